"""The planner's model arithmetic: resolved dimensions, parameters, FLOPs and memory per rank (formulas: planner.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional

from hier_localsgd.sync.sections import SyncConfig
from hier_localsgd.tools.plan.config import DTYPE_BYTES, PRESETS, PlanModelConfig

if TYPE_CHECKING:
    from hier_localsgd.config import Config


# ----------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelDims:
    """A resolved Llama-style decoder."""

    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    tied_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def llama_ffn_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """torchtitan's FeedForward hidden size for ``hidden_dim = 4 dim``."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _flavor_args(flavor: str, path: str) -> Dict[str, Any]:
    """The flavor's dims: a preset, or torchtitan's ``llama3_args`` (imported lazily)."""
    name = flavor[len("llama3_"):] if flavor.startswith("llama3_") else flavor
    if name.lower() in PRESETS:
        return dict(PRESETS[name.lower()], multiple_of=256, ffn_dim_multiplier=None)
    try:
        from hier_localsgd.train.model import llama3_flavor_args, llama3_flavors

        known = sorted(set(llama3_flavors()) | set(PRESETS))
    except Exception as e:  # pragma: no cover - torchtitan is a dependency
        raise ValueError(f"{path}: {flavor!r} needs torchtitan to resolve ({e}); give explicit dims with flavor=''") from e
    if name not in known:
        raise ValueError(f"{path}: unknown flavor {flavor!r} (known: {known}, or '' with explicit dims)")
    a = llama3_flavor_args(name)
    return dict(
        dim=a.dim, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads or a.n_heads,
        ffn_dim=0, vocab_size=a.vocab_size, multiple_of=a.multiple_of, ffn_dim_multiplier=a.ffn_dim_multiplier,
    )


def resolve_model(m: PlanModelConfig, prefix: str = "plan.model") -> ModelDims:
    """Flavor (if any) overridden by the non-zero explicit fields; validated."""
    base: Dict[str, Any] = dict(dim=0, n_layers=0, n_heads=0, n_kv_heads=0, ffn_dim=0, vocab_size=0, multiple_of=256, ffn_dim_multiplier=None)
    if m.flavor:
        base.update(_flavor_args(m.flavor, f"{prefix}.flavor"))
    for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "multiple_of"):
        v = getattr(m, k)
        if v < 0:
            raise ValueError(f"{prefix}.{k}: must be positive (got {v})")
        if v:
            base[k] = v
    if m.ffn_dim_multiplier < 0:
        raise ValueError(f"{prefix}.ffn_dim_multiplier: must be positive or 0 (got {m.ffn_dim_multiplier})")
    if m.ffn_dim_multiplier:
        base["ffn_dim_multiplier"] = m.ffn_dim_multiplier
    for k in ("dim", "n_layers", "n_heads", "vocab_size"):
        if base[k] <= 0:
            raise ValueError(f"{prefix}.{k}: must be positive (no flavor gives it)")
    if not base["n_kv_heads"]:
        base["n_kv_heads"] = base["n_heads"]
    if base["dim"] % base["n_heads"]:
        raise ValueError(f"{prefix}.n_heads: {base['n_heads']} does not divide dim={base['dim']}")
    if base["n_heads"] % base["n_kv_heads"]:
        raise ValueError(f"{prefix}.n_kv_heads: {base['n_kv_heads']} does not divide n_heads={base['n_heads']}")
    ffn = base["ffn_dim"] or llama_ffn_dim(base["dim"], base["multiple_of"], base["ffn_dim_multiplier"])
    return ModelDims(
        name=m.flavor or "custom", dim=base["dim"], n_layers=base["n_layers"], n_heads=base["n_heads"],
        n_kv_heads=base["n_kv_heads"], ffn_dim=ffn, vocab_size=base["vocab_size"], tied_embeddings=m.tied_embeddings,
    )


def param_counts(d: ModelDims) -> Dict[str, int]:
    """Parameters by part (see the module docstring); ``total`` is their sum."""
    hd = d.head_dim
    attention = d.n_layers * (d.dim * d.n_heads * hd + 2 * d.dim * d.n_kv_heads * hd + d.n_heads * hd * d.dim)
    mlp = d.n_layers * 3 * d.dim * d.ffn_dim
    norms = (2 * d.n_layers + 1) * d.dim
    embeddings = d.vocab_size * d.dim
    output = 0 if d.tied_embeddings else d.vocab_size * d.dim
    parts = {"embeddings": embeddings, "attention": attention, "mlp": mlp, "norms": norms, "output": output}
    parts["total"] = sum(parts.values())
    return parts


def flops_per_token(d: ModelDims, seq_len: int) -> Dict[str, float]:
    """Training FLOPs per token: ``6 (N - N_emb) + 12 L h hd T`` (torchtitan's count)."""
    p = param_counts(d)
    dense = 6.0 * (p["total"] - p["embeddings"])
    attention = 12.0 * d.n_layers * d.n_heads * d.head_dim * seq_len
    return {"dense": dense, "attention": attention, "total": dense + attention, "forward": (dense + attention) / 3.0}


def dtype_bytes(name: str, path: str) -> int:
    if name not in DTYPE_BYTES:
        raise ValueError(f"{path}: unknown dtype {name!r} (expected one of {sorted(DTYPE_BYTES)})")
    return DTYPE_BYTES[name]


def activation_elements_per_token(d: ModelDims) -> Dict[str, float]:
    """Activation elements kept for backward, per token (see the module docstring)."""
    block = 6 * d.dim + 2 * d.n_kv_heads * d.head_dim + 4 * d.ffn_dim
    return {"block": float(block), "head": float(2 * d.dim), "logits_fp32": float(2 * d.vocab_size)}


def sync_state_copies(mode: str, sync: SyncConfig, optimizer_states: int, rollback_snapshot: bool) -> Dict[str, int]:
    """Model-sized copies the sync keeps, by where they are allocated (core/runtime/device.py):

    * ``device``: persistent on the accelerator. hier: none — its level backups, momenta,
      committed model and optimizer snapshot are host tensors. flat (torchft DiLoCo): the
      outer optimizer's momentum (an SGD over the model's own parameters, on the device);
      its backup is on the host (``backup_device=cpu``).
    * ``device_transient``: during a round, on the device. hier: the backup's device copy
      and the pseudo-gradient ``backup - live`` (core/tensors/level.py); the all-reduce runs in
      place (NCCL) or through a pinned host buffer (Gloo). flat: the pseudo-gradients and
      the all-reduce bucket (torchft's ``use_bucketization``).
    * ``host``: persistent host memory (pinned where the model is on CUDA). hier: the
      committed model, a backup per level plus a momentum for a ``diloco`` level, and the
      pinned staging buffer of the Gloo outer link (core/links/link.py); flat: the backup.
    * ``host_snapshot``: hier's rollback copy of the inner optimizer (``optimizer_states``
      model-sized tensors, host).
    * ``host_transient``: hier's staged update of each level (backup, + momentum).
    """

    def level(alg: str) -> int:
        return 1 + (1 if alg == "diloco" else 0)  # backup (+ momentum)

    if mode == "ddp":
        return {"device": 0, "device_transient": 0, "host": 0, "host_snapshot": 0, "host_transient": 0}
    if mode == "flat":
        momentum = 1 if sync.flat.algorithm == "diloco" else 0
        return {"device": momentum, "device_transient": 2, "host": 1, "host_snapshot": 0, "host_transient": 0}
    return {
        "device": 0,
        "device_transient": 2,
        "host": 1 + level(sync.inner.algorithm) + level(sync.outer.algorithm) + 1,
        "host_snapshot": optimizer_states if rollback_snapshot else 0,
        "host_transient": level(sync.inner.algorithm) + level(sync.outer.algorithm),
    }



def shard_factor(cfg: "Config") -> int:
    """By how much ``plan.sharding`` divides a rank's model-sized state: G with fsdp, else 1."""
    return cfg.topology.ranks_per_replica if cfg.plan.sharding == "fsdp" else 1


def memory_per_rank(cfg: "Config", d: ModelDims, mode: str) -> Dict[str, float]:
    """Peak bytes per rank on the device (see the module docstring), with and without
    checkpointing, and the host memory the sync holds (``host_*``, :func:`sync_state_copies`)."""
    t = cfg.plan.train
    n = param_counts(d)["total"]
    shard = shard_factor(cfg)
    pb = dtype_bytes(t.param_dtype, "plan.train.param_dtype")
    gb = dtype_bytes(t.grad_dtype, "plan.train.grad_dtype")
    ob = dtype_bytes(t.optimizer_dtype, "plan.train.optimizer_dtype")
    ab = dtype_bytes(t.activation_dtype, "plan.train.activation_dtype")
    copies = sync_state_copies(mode, cfg.sync, t.optimizer_states, t.rollback_snapshot)
    out: Dict[str, float] = {
        "parameters": n * pb / shard,
        "gradients": n * gb / shard,
        "optimizer": n * ob * t.optimizer_states / shard,
    }
    out["sync_backups"] = copies["device"] * n * pb / shard  # on the device (flat's outer momentum)
    out["rollback_snapshot"] = 0.0  # hier keeps it on the host (host_rollback_snapshot)
    out["sync_scratch"] = copies["device_transient"] * n * pb / shard
    out["host_sync_state"] = copies["host"] * n * pb / shard
    out["host_rollback_snapshot"] = copies["host_snapshot"] * n * ob / shard
    out["host_scratch"] = copies["host_transient"] * n * pb / shard
    out["host_peak"] = out["host_sync_state"] + out["host_rollback_snapshot"] + out["host_scratch"]
    tokens = cfg.train.batch_size * cfg.train.seq_len
    act = activation_elements_per_token(d)
    head = tokens * (act["head"] * ab + act["logits_fp32"] * 4)
    out["activations"] = tokens * act["block"] * d.n_layers * ab + head
    out["activations_checkpointed"] = tokens * (d.dim * d.n_layers + act["block"]) * ab + head
    persistent = out["parameters"] + out["gradients"] + out["optimizer"] + out["sync_backups"] + out["rollback_snapshot"]
    out["persistent"] = persistent
    out["peak"] = persistent + max(out["activations"], out["sync_scratch"])
    out["peak_checkpointed"] = persistent + max(out["activations_checkpointed"], out["sync_scratch"])
    return out


