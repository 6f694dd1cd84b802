"""A model's parameters as views of one flat buffer.

Sync works on whole-model vectors (pseudo-gradients, backups, broadcasts). Making
every parameter a view into one contiguous buffer lets each level reduce the model
with one collective and copy it with one ``copy_`` — and it settles seed 004's
``p`` vs ``p.data`` bug by construction (invariant I4): sync code only ever writes
``FlatParams.data`` in place under ``no_grad``; the Parameter objects the optimizer
holds are never replaced.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import xxhash
from torch import nn

from hier_localsgd.core.runtime.invariants import PARAMETERS_WRITTEN_IN_PLACE, InvariantViolation


class FlatParams:
    """Rebinds ``model``'s parameters as views of one flat fp32 buffer.

    Args:
        model: the model; its parameters must share one dtype and device.
        flat_grads: also make every ``.grad`` a view of one flat buffer (used by
            the ddp baseline, which all-reduces gradients every step). Callers then
            clear gradients with :meth:`zero_grad`, not ``optimizer.zero_grad()``.
    """

    def __init__(self, model: nn.Module, flat_grads: bool = False) -> None:
        self.params: List[nn.Parameter] = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("model has no trainable parameters")
        dtypes = {p.dtype for p in self.params}
        devices = {p.device for p in self.params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"parameters must share one dtype and device, got {dtypes} {devices}")
        self.numel = sum(p.numel() for p in self.params)
        dtype, device = dtypes.pop(), devices.pop()
        self.data = torch.empty(self.numel, dtype=dtype, device=device)
        self.grad: Optional[torch.Tensor] = (
            torch.zeros(self.numel, dtype=dtype, device=device) if flat_grads else None
        )
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                view = self.data[offset : offset + n].view_as(p)
                view.copy_(p)
                p.data = view  # rebinding storage once, at construction, is the point
                if self.grad is not None:
                    p.grad = self.grad[offset : offset + n].view_as(p)
                offset += n
        self._ids = [id(p) for p in self.params]
        self._offsets = [0]
        for p in self.params:
            self._offsets.append(self._offsets[-1] + p.numel())

    @property
    def nbytes(self) -> int:
        return self.numel * self.data.element_size()

    @torch.no_grad()
    def load_(self, src: torch.Tensor) -> None:
        """Copies ``src`` into the parameters (in place, I4)."""
        self.data.copy_(src)

    def zero_grad(self) -> None:
        if self.grad is None:
            raise RuntimeError("FlatParams was built without flat_grads")
        self.grad.zero_()

    @torch.no_grad()
    def gather_grads(self) -> None:
        """Makes every ``.grad`` a view of the flat gradient again (``flat_grads``): a gradient
        that ``optimizer.zero_grad()`` set to None and backward re-allocated is copied in (a
        missing one counts as zero). A no-op for gradients that still are the views."""
        if self.grad is None:
            raise RuntimeError("FlatParams was built without flat_grads")
        for p, a, b in zip(self.params, self._offsets, self._offsets[1:]):
            view = self.grad[a:b].view_as(p)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            else:
                continue
            p.grad = view

    def check_in_place(self) -> None:
        """I4: parameters are still the same objects and still views of ``data``."""
        for p, pid in zip(self.params, self._ids):
            if id(p) != pid or p.data.untyped_storage().data_ptr() != self.data.untyped_storage().data_ptr():
                raise InvariantViolation(
                    PARAMETERS_WRITTEN_IN_PLACE,
                    "a parameter was replaced or re-allocated outside FlatParams",
                )


def checksum(*tensors: torch.Tensor) -> str:
    """xxh3-64 of the tensors' bytes, hex. Equal checksums mean bitwise-equal tensors."""
    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(memoryview(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()))
    return h.hexdigest()


def checksum_int(*tensors: torch.Tensor) -> int:
    """Like :func:`checksum` but as an unsigned 64-bit integer."""
    return int(checksum(*tensors), 16)
