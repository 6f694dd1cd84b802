"""FSDP2 inside a replica group (``group.sharding=fsdp``): the torchft HSDP pattern.

The G ranks of a replica group shard the model with ``torch.distributed.fsdp.fully_shard``
(FSDP2) over the group's own process group (``train.backends.group``: NCCL on CUDA, Gloo
on CPU); every rank holds 1/G of each parameter (dim-0 shards), gradients are
reduce-scattered inside the group every step, and each rank syncs *its own shard* across
replica groups with the same rank k of the other groups (``HierSettings.group_shards``, as
tensor parallelism does: no slicing, no group all-gather), so the slow links still carry
one model per cluster per outer round.

The built-in trainer shards with :func:`hier_localsgd.train.model.shard_model`; a user's
program applies ``fully_shard`` itself, and the API syncs the shards through
:class:`ShardedParams`.

Checked on torch 2.13.0 (CPU build): ``fully_shard`` trains on CPU tensors over Gloo
(all-gather and reduce-scatter run through Gloo), which is what tests/test_device.py uses.

:class:`ShardedParams` gives the sync the :class:`hier_localsgd.core.tensors.flat_params.FlatParams`
interface it uses (``data``, ``numel``, ``nbytes``, ``load_``, ``check_in_place``) over the
rank's local shards. Unlike FlatParams it cannot make the shards views of one buffer (FSDP2
owns their storage and may re-create it at lazy initialisation), so ``data`` is a fresh
concatenation on every read and :meth:`ShardedParams.load_` copies into each local shard in
place under ``no_grad``: the Parameter objects the optimizer holds are never replaced (I4).
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import nn

from hier_localsgd.core.runtime.invariants import PARAMETERS_WRITTEN_IN_PLACE, InvariantViolation



def _local(p: torch.Tensor) -> torch.Tensor:
    """The rank's shard of ``p`` (the DTensor's local tensor: FSDP2's own storage)."""
    return p._local_tensor if hasattr(p, "_local_tensor") else p.data  # type: ignore[attr-defined]


class ShardedParams:
    """FlatParams' interface over this rank's FSDP2 shards (see the module docstring)."""

    grad: Optional[torch.Tensor] = None  # gradients stay FSDP's (no flat gradient buffer)

    def __init__(self, model: nn.Module) -> None:
        self.params: List[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model has no trainable parameters")
        self._ids = [id(p) for p in self.params]
        self.numel = sum(_local(p).numel() for p in self.params)
        self.dtype = _local(self.params[0]).dtype

    @property
    def data(self) -> torch.Tensor:
        """The rank's shards, concatenated (a fresh tensor: read, never written through)."""
        with torch.no_grad():
            return torch.cat([_local(p).reshape(-1) for p in self.params])

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()

    @torch.no_grad()
    def load_(self, src: torch.Tensor) -> None:
        """Copies ``src`` into the local shards, in place (I4)."""
        off = 0
        for p in self.params:
            t = _local(p)
            n = t.numel()
            t.copy_(src[off : off + n].view_as(t))
            off += n

    def zero_grad(self) -> None:
        raise RuntimeError("ShardedParams has no flat gradients (the ddp baseline does not shard)")

    def check_in_place(self) -> None:
        """I4: the optimizer's Parameter objects are still the model's."""
        if [id(p) for p in self.params] != self._ids:
            raise InvariantViolation(PARAMETERS_WRITTEN_IN_PLACE, "a sharded parameter was replaced")
