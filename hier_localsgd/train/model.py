"""Models: torchtitan's Llama3 flavors, or a tiny bigram LM for fast tests.

``llama3_<flavor>`` builds ``torchtitan.models.llama3.Transformer`` from
``llama3_args[flavor]`` (``llama3_debugmodel``: dim 256, 6 layers, 16 heads,
vocab 2048, 6,163,712 parameters) with sdpa attention, which trains on CPU with
torchtitan 0.2.2. torchtitan is imported only when such a model is asked for
(its import alone takes seconds).

``tiny``: an embedding, one hidden layer and an output projection applied to
each position — a bigram model. It cannot use more than the previous token, which
is exactly what the first-order Markov corpus needs to reach its entropy floor,
so tests converge in seconds.

Every replica builds the same initial weights from ``train.seed``.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

from hier_localsgd.train.sections import LLAMA3_PREFIX, TINY

class TinyLM(nn.Module):
    """Bigram LM: logits for position t depend on token t only."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.hidden(self.embed(tokens))))


# Flavors torchtitan 0.2.2 lacks (its smallest above debugmodel is 8B): ``1B`` has the
# shape of Llama 3.2 1B with untied embeddings, 1.50 B parameters (fits one 80 GB GPU per
# process in fp32 with AdamW; benchmarks/gpu_check.sh). Derived from 8B's arguments.
EXTRA_LLAMA3 = {"1B": dict(base="8B", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, multiple_of=256, ffn_dim_multiplier=1.5)}


def llama3_flavors() -> list[str]:
    from torchtitan.models.llama3 import llama3_args

    return sorted(set(llama3_args) | set(EXTRA_LLAMA3))


def llama3_flavor_args(flavor: str, field: str = "model.name"):  # type: ignore[no-untyped-def]
    """A copy of the flavor's torchtitan ``TransformerModelArgs`` (torchtitan's or :data:`EXTRA_LLAMA3`).

    Raises:
        ValueError: naming ``field`` for an unknown flavor."""
    from torchtitan.models.llama3 import llama3_args

    if flavor in EXTRA_LLAMA3:
        extra = dict(EXTRA_LLAMA3[flavor])
        args = copy.deepcopy(llama3_args[extra.pop("base")])
        for k, v in extra.items():
            setattr(args, k, v)
        return args
    if flavor not in llama3_args:
        raise ValueError(f"{field}={LLAMA3_PREFIX}{flavor}: unknown llama3 flavor (known: {llama3_flavors()})")
    return copy.deepcopy(llama3_args[flavor])


def param_dtype(name: str) -> torch.dtype:
    """``train.param_dtype`` as a torch dtype (core/runtime/device.py's table)."""
    from hier_localsgd.core.runtime.device import DTYPES

    return DTYPES[name]


def build_model(name: str, vocab_size: int, seq_len: int, dim: int, seed: int) -> nn.Module:
    """Builds the model with weights that depend only on ``seed``.

    Args:
        name: ``tiny`` or ``llama3_<flavor>``.
        vocab_size: vocabulary (tiny; for llama3 flavors the flavor's own is kept
            unless it is smaller than the data's).
        seq_len: longest sequence (llama3 rotary tables).
        dim: hidden size (tiny only).
    """
    torch.manual_seed(seed)
    if name == TINY:
        return TinyLM(vocab_size, dim)
    if name.startswith(LLAMA3_PREFIX):
        from torchtitan.models.llama3 import Transformer

        args = llama3_flavor_args(name[len(LLAMA3_PREFIX) :])
        if args.attn_type != "sdpa":
            raise ValueError(f"model.name={name!r}: attention {args.attn_type!r} has no CPU backward; use an sdpa flavor")
        args.max_seq_len = seq_len
        args.vocab_size = max(args.vocab_size, vocab_size)
        model = Transformer(args)
        with torch.no_grad():
            model.init_weights()
        return model
    raise ValueError(f"model.name={name!r}: expected {TINY!r} or {LLAMA3_PREFIX}<flavor>")


def precision_context(device: torch.device, precision: str) -> ContextManager[object]:
    """``train.precision``: ``bf16`` autocasts forward (and so backward) to bfloat16 on
    ``device`` (CPU autocast included), the parameters keeping their own dtype (fp32
    master weights by default); ``fp32`` changes nothing."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str = "fp32") -> torch.Tensor:
    """Next-token cross-entropy (computed in fp32 whatever the autocast)."""
    with precision_context(x.device, precision):
        logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], precision: str = "fp32") -> float:
    was_training = model.training
    model.eval()
    total = 0.0
    for x, y in batches:
        total += float(lm_loss(model, x, y, precision))
    model.train(was_training)
    return total / len(batches)


def shard_model(model: nn.Module, pg: Any, device: torch.device) -> nn.Module:
    """Applies FSDP2 to ``model`` over the group ``pg``: each transformer block (a llama3
    model's ``layers``) is its own unit, then the root. Returns the model (sharded in place)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(pg, device.type)
    layers = getattr(model, "layers", None)
    if layers is not None:
        for block in (layers.values() if isinstance(layers, nn.ModuleDict) else layers):
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
