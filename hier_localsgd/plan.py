"""``hier-localsgd plan``: what a model costs to train on a hierarchy, before booking it.

From a model (a torchtitan Llama3 flavor, the Llama-7B preset, or explicit dims) and a
topology with its networks (C clusters x R replica groups x G ranks, LAN inside a
cluster, WAN between clusters), this module computes, with closed formulas only (no
torch, nothing is instantiated):

1. **Parameters by part** for torchtitan's Llama3 ``Transformer`` (``model.py`` of
   torchtitan 0.2.2), with d = dim, L = layers, h = heads, k = kv heads,
   hd = d / h, F = FFN hidden size, V = vocabulary:

   * embeddings ``V d``; output ``V d`` (untied in torchtitan; 0 when tied);
   * attention per layer ``d (h hd) + 2 d (k hd) + (h hd) d`` (wq, wk, wv, wo, no bias);
   * MLP per layer ``3 d F`` (SwiGLU: w1, w2, w3, no bias);
   * norms ``(2 L + 1) d`` (RMSNorm weights: two per block and the final one).

   F follows torchtitan's rule: ``F = int(2 * 4d / 3)``, then ``int(multiplier * F)``
   if a multiplier is set, then rounded up to a multiple of ``multiple_of``.

2. **Training FLOPs per token**, torchtitan's MFU convention
   (``get_dense_model_nparams_and_flops``): ``6 (N - N_emb) + 12 L h hd T``: 6 FLOPs
   per weight for forward and backward (the embedding is a lookup, not a matmul), plus
   the attention score and value matmuls over the T positions of the sequence (no
   causal discount, no recomputation counted). A step is this times the tokens of the
   step (``batch_size x seq_len`` per rank).

3. **Peak memory per rank** (bytes): parameters, gradients, AdamW state (2 tensors),
   the copies the sync algorithm keeps (per level: a backup, plus a momentum buffer for
   ``diloco``; this project also snapshots the inner optimizer for rollback), the sync
   scratch (pseudo-gradient and staged state, sync.py) and activations, with and
   without per-block activation checkpointing. With ``sharding=fsdp`` the model-sized
   terms are divided by G. Activations per token per block (elements):
   ``6d + 2 k hd + 4F`` (norm inputs/outputs, q/k/v and the attention output saved by
   SDPA, the SwiGLU intermediates); with checkpointing only the block input ``d`` per
   block is kept plus one block's full set during its recomputation. The head keeps
   ``2d`` elements and the logits in float32 (``2 V`` float32 for logits and their
   softmax). Activations and the sync scratch are never alive together (syncs happen
   between steps), so the peak is the persistent part plus the larger of the two.

4. **Sync time per level** with the ring lower bound: an all-reduce of S bytes over n
   ranks on a link of bandwidth B and one-way latency a takes at least
   ``2(n-1)/n * S/B + 2(n-1) a`` (``link.ring_allreduce_bytes`` is the first factor);
   a broadcast from a root to n-1 peers ``(n-1) S/B + a`` (the root sends every copy,
   as Gloo's broadcast does). Per mode:

   * ``hier``: an inner all-reduce over R on the LAN every H_inner steps; every
     H_inner x H_outer steps an outer all-reduce over C leaders on the WAN and a
     broadcast from each leader to its R-1 peers on the LAN;
   * ``flat`` (torchft DiLoCo over every replica group): an all-reduce over C R every
     H_flat steps; the ring crosses clusters, so each of its steps waits for the WAN;
   * ``ddp``: the gradient all-reduce over C R every step, WAN-bound likewise.

   Each of a replica group's G ranks syncs its own part in parallel over its own share
   of the links: S/G bytes with ``sharding=fsdp``, S with ``replicate``. Syncs block
   training in this project, so they are fully exposed; ``hardware.ddp_overlap`` hides
   a fraction of the ddp all-reduce behind the backward pass.

5. **Communication fraction** ``sync / (compute + sync)`` per step for each mode, and a
   recommendation of (H_inner, H_outer) for a target fraction f: the per-step sync
   budget is ``b = f/(1-f) t_step``; H_inner is the smallest value whose inner syncs use
   at most ``inner_share`` of b, then H_outer the smallest that brings the total under b.

6. **Compute-optimal N and D** for a FLOPs budget C under the Chinchilla parametric fit
   ``L(N, D) = E + A/N^alpha + B/D^beta`` with ``C = 6 N D`` (Hoffmann et al. 2022,
   approach 3: E 1.69, A 406.4, B 410.7, alpha 0.34, beta 0.28, all configurable):
   ``N_opt = G (C/6)^(beta/(alpha+beta))``, ``D_opt = (C/6) / N_opt``,
   ``G = (alpha A / (beta B))^(1/(alpha+beta))``.

``run_plan`` prints the tables and writes ``plan.json``. docs/planner.md has the
commands, examples and what was validated.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Optional, Sequence

DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "fp16": 2,
    "float8": 1, "fp8": 1,
}
SHARDINGS = ("replicate", "fsdp")
ALGORITHMS = ("localsgd", "diloco")
MODES = ("ddp", "flat", "hier")

# Models that are not torchtitan Llama3 flavors. Llama-7B (Llama 1 and Llama 2 7B share
# the shapes): published count 6,738,415,616 parameters.
PRESETS: Dict[str, Dict[str, Any]] = {
    "llama_7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000),
}

HEADER = "hier-localsgd plan"


# ----------------------------------------------------------------------------- config
@dataclass
class PlanModelConfig:
    """The model. ``flavor`` names a torchtitan Llama3 flavor (``debugmodel``, ``8B``,
    ``70B``, ``405B``; a ``llama3_`` prefix is accepted) or a preset (``llama_7b``);
    "" means explicit dims only. Any non-zero field overrides the flavor's value."""

    flavor: str = "debugmodel"
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0  # 0: the flavor's, else n_heads
    ffn_dim: int = 0  # 0: torchtitan's rule from dim, ffn_dim_multiplier and multiple_of
    multiple_of: int = 0  # 0: the flavor's, else 256
    ffn_dim_multiplier: float = 0.0  # 0: the flavor's (none for most)
    vocab_size: int = 0
    tied_embeddings: bool = False


@dataclass
class PlanTopologyConfig:
    clusters: int = 2
    replicas_per_cluster: int = 2
    ranks_per_replica: int = 1  # G
    sharding: str = "replicate"  # replicate: every rank holds and syncs the whole model; fsdp: 1/G each


@dataclass
class LinkConfig:
    bandwidth_gbps: float = 10.0  # Gbit/s available to one rank
    latency_ms: float = 0.1  # one way


@dataclass
class NetworkConfig:
    """Default figures of issue #6: LAN 10 Gbit/s, 0.1 ms; WAN 1 Gbit/s, 20 ms."""

    lan: LinkConfig = field(default_factory=lambda: LinkConfig(10.0, 0.1))
    wan: LinkConfig = field(default_factory=lambda: LinkConfig(1.0, 20.0))
    round_overhead_s: float = 0.0  # fixed cost per sync round and level (quorum, commit vote); calibrate from a benchmark


@dataclass
class PlanTrainConfig:
    batch_size: int = 4  # sequences per rank per step
    seq_len: int = 64
    param_dtype: str = "float32"
    grad_dtype: str = "float32"
    optimizer_dtype: str = "float32"
    optimizer_states: int = 2  # AdamW: exp_avg, exp_avg_sq
    activation_dtype: str = "float32"
    rollback_snapshot: bool = True  # this project keeps a copy of the inner optimizer state for rollback


@dataclass
class PlanSyncConfig:
    h_inner: int = 10
    h_outer: int = 3
    h_flat: int = 0  # 0: h_inner * h_outer (the flat baseline syncs as often as the outer level)
    inner_algorithm: str = "localsgd"
    outer_algorithm: str = "diloco"
    flat_algorithm: str = "diloco"
    dtype: str = "float32"  # of the synced tensors (pseudo-gradients, gradients, broadcast model)
    target_comm_fraction: float = 0.05
    inner_share: float = 0.5  # share of the sync budget given to the inner level in the recommendation


@dataclass
class HardwareConfig:
    """Per rank. Default: an H100 SXM (989 dense bf16 TFLOP/s) at 40 % MFU, 80 GiB."""

    peak_tflops: float = 989.0
    mfu: float = 0.4
    memory_gib: float = 80.0
    step_time_s: float = 0.0  # >0: use this measured compute time per step instead of FLOPs / (peak x MFU)
    ddp_overlap: float = 0.0  # fraction of the ddp all-reduce hidden behind the backward pass


@dataclass
class ScalingConfig:
    """Chinchilla parametric fit (Hoffmann et al. 2022, approach 3); C = flops_per_param_token x N x D."""

    budget_flops: float = 1.23e22
    E: float = 1.69
    A: float = 406.4
    B: float = 410.7
    alpha: float = 0.34
    beta: float = 0.28
    flops_per_param_token: float = 6.0


@dataclass
class PlanConfig:
    model: PlanModelConfig = field(default_factory=PlanModelConfig)
    topology: PlanTopologyConfig = field(default_factory=PlanTopologyConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    train: PlanTrainConfig = field(default_factory=PlanTrainConfig)
    sync: PlanSyncConfig = field(default_factory=PlanSyncConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    json_name: str = "plan.json"


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
        from torchtitan.models.llama3 import llama3_args
    except Exception as e:  # pragma: no cover - torchtitan is a dependency
        raise ValueError(f"{path}: {flavor!r} needs torchtitan to resolve ({e}); give explicit dims with flavor=''") from e
    if name not in llama3_args:
        known = sorted(set(llama3_args) | set(PRESETS))
        raise ValueError(f"{path}: unknown flavor {flavor!r} (known: {known}, or '' with explicit dims)")
    a = llama3_args[name]
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


def sync_state_copies(mode: str, sync: PlanSyncConfig, optimizer_states: int, rollback_snapshot: bool) -> Dict[str, int]:
    """Model-sized copies the sync keeps: persistent (backups, momenta, rollback snapshot)
    and transient (pseudo-gradient and staged state during a round; sync.py)."""

    def level(alg: str) -> int:
        return 1 + (1 if alg == "diloco" else 0)  # backup (+ momentum)

    if mode == "ddp":
        return {"persistent": 0, "transient": 0}
    if mode == "flat":  # torchft DiLoCo: original parameters + outer momentum; pseudo-gradient
        return {"persistent": level(sync.flat_algorithm), "transient": 1}
    persistent = level(sync.inner_algorithm) + level(sync.outer_algorithm) + (optimizer_states if rollback_snapshot else 0)
    # inner round: pseudo-gradient + staged backup (+ staged momentum);
    # outer round on the leader, on top: pseudo-gradient, staged backup (+ momentum), result clone.
    transient = level(sync.inner_algorithm) + 1 + level(sync.outer_algorithm) + 2
    return {"persistent": persistent, "transient": transient}


def memory_per_rank(cfg: PlanConfig, d: ModelDims, mode: str) -> Dict[str, float]:
    """Peak bytes per rank (see the module docstring), with and without checkpointing."""
    t, tp = cfg.train, cfg.topology
    n = param_counts(d)["total"]
    shard = tp.ranks_per_replica if tp.sharding == "fsdp" else 1
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
    snapshot = t.optimizer_states if (mode == "hier" and t.rollback_snapshot) else 0
    out["sync_backups"] = (copies["persistent"] - snapshot) * n * pb / shard
    out["rollback_snapshot"] = snapshot * n * ob / shard
    out["sync_scratch"] = copies["transient"] * n * pb / shard
    tokens = t.batch_size * t.seq_len
    act = activation_elements_per_token(d)
    head = tokens * (act["head"] * ab + act["logits_fp32"] * 4)
    out["activations"] = tokens * act["block"] * d.n_layers * ab + head
    out["activations_checkpointed"] = tokens * (d.dim * d.n_layers + act["block"]) * ab + head
    persistent = out["parameters"] + out["gradients"] + out["optimizer"] + out["sync_backups"] + out["rollback_snapshot"]
    out["persistent"] = persistent
    out["peak"] = persistent + max(out["activations"], out["sync_scratch"])
    out["peak_checkpointed"] = persistent + max(out["activations_checkpointed"], out["sync_scratch"])
    return out


# ----------------------------------------------------------------------------- network
def ring_factor(n: int) -> float:
    """Bytes one rank sends per byte in a ring all-reduce over n: ``2(n-1)/n``
    (the factor of ``link.ring_allreduce_bytes``)."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n


def ring_allreduce_time(nbytes: float, n: int, link: LinkConfig) -> float:
    """Ring lower bound: ``2(n-1)/n S/B + 2(n-1) a`` seconds (0 for n <= 1)."""
    if n <= 1:
        return 0.0
    return ring_factor(n) * nbytes * 8 / (link.bandwidth_gbps * 1e9) + 2 * (n - 1) * link.latency_ms / 1e3


def broadcast_time(nbytes: float, n: int, link: LinkConfig) -> float:
    """Root to n-1 peers, the root sending every copy: ``(n-1) S/B + a`` (0 for n <= 1)."""
    if n <= 1:
        return 0.0
    return (n - 1) * nbytes * 8 / (link.bandwidth_gbps * 1e9) + link.latency_ms / 1e3


def transfer_time(nbytes: float, link: LinkConfig) -> float:
    """One point-to-point transfer (a heal): ``S/B + a``."""
    return nbytes * 8 / (link.bandwidth_gbps * 1e9) + link.latency_ms / 1e3


@dataclass(frozen=True)
class SyncTimes:
    """Seconds per sync of each kind, and the bytes one rank puts on the wire for it."""

    sync_bytes: float  # S per rank (model bytes in the sync dtype, /G with fsdp)
    inner_s: float
    outer_allreduce_s: float
    broadcast_s: float
    flat_s: float
    ddp_s: float
    inner_bytes: float
    outer_bytes: float
    broadcast_bytes: float  # sent by the leader
    flat_bytes: float
    ddp_bytes: float
    wide_link: str  # which link bounds flat/ddp ("wan", or "lan" with one cluster)


def sync_times(n_params: int, topo: PlanTopologyConfig, net: NetworkConfig, dtype: str, prefix: str = "plan") -> SyncTimes:
    """Per-sync times of every level and mode (ring bound + ``round_overhead_s``)."""
    s = n_params * dtype_bytes(dtype, f"{prefix}.sync.dtype")
    if topo.sharding == "fsdp":
        s /= topo.ranks_per_replica
    c, r = topo.clusters, topo.replicas_per_cluster
    n = c * r
    wide = net.wan if c > 1 else net.lan
    o = net.round_overhead_s
    return SyncTimes(
        sync_bytes=s,
        inner_s=ring_allreduce_time(s, r, net.lan) + o,
        outer_allreduce_s=ring_allreduce_time(s, c, net.wan) + o,
        broadcast_s=broadcast_time(s, r, net.lan),
        flat_s=ring_allreduce_time(s, n, wide) + o,
        ddp_s=ring_allreduce_time(s, n, wide) + o,
        inner_bytes=ring_factor(r) * s,
        outer_bytes=ring_factor(c) * s,
        broadcast_bytes=(r - 1) * s,
        flat_bytes=ring_factor(n) * s,
        ddp_bytes=ring_factor(n) * s,
        wide_link="wan" if c > 1 else "lan",
    )


def h_flat(sync: PlanSyncConfig) -> int:
    return sync.h_flat or sync.h_inner * sync.h_outer


def sync_per_step(st: SyncTimes, mode: str, h_inner: int, h_outer: int, h_flat_: int, ddp_overlap: float = 0.0) -> float:
    """Average exposed sync seconds per local step of one mode."""
    if mode == "ddp":
        return st.ddp_s * (1.0 - ddp_overlap)
    if mode == "flat":
        return st.flat_s / h_flat_
    return st.inner_s / h_inner + (st.outer_allreduce_s + st.broadcast_s) / (h_inner * h_outer)


def comm_fraction(step_s: float, sync_s: float) -> float:
    """Share of wall time spent communicating: ``sync / (compute + sync)``."""
    return sync_s / (step_s + sync_s) if step_s + sync_s > 0 else 0.0


def recommend_h(st: SyncTimes, step_s: float, target: float, inner_share: float) -> Dict[str, Any]:
    """Smallest H values that keep the communication fraction at or below ``target``.

    Per-step budget ``b = target/(1-target) step_s``. hier: H_inner is the smallest with
    ``inner_s/H_inner <= inner_share b``; H_outer the smallest with
    ``inner_s/H_inner + (outer_s + bcast_s)/(H_inner H_outer) <= b``. flat: the smallest
    H with ``flat_s/H <= b``. ddp has no H: reported as reachable or not.
    """
    b = target / (1.0 - target) * step_s
    out: Dict[str, Any] = {"budget_per_step_s": b}
    if b <= 0:
        return {**out, "h_inner": None, "h_outer": None, "h_flat": None, "ddp_meets_target": False}
    h_in = max(1, math.ceil(st.inner_s / (inner_share * b) - 1e-12)) if st.inner_s > 0 else 1
    left = b - st.inner_s / h_in
    outer = st.outer_allreduce_s + st.broadcast_s
    h_out = max(1, math.ceil(outer / (h_in * left) - 1e-12)) if outer > 0 else 1
    hf = max(1, math.ceil(st.flat_s / b - 1e-12)) if st.flat_s > 0 else 1
    frac = comm_fraction(step_s, sync_per_step(st, "hier", h_in, h_out, hf))
    return {
        **out,
        "h_inner": h_in,
        "h_outer": h_out,
        "outer_period_steps": h_in * h_out,
        "hier_fraction": frac,
        "h_flat": hf,
        "flat_fraction": comm_fraction(step_s, st.flat_s / hf),
        "ddp_meets_target": comm_fraction(step_s, st.ddp_s) <= target,
    }


# ----------------------------------------------------------------------------- scaling law
def chinchilla_optimum(s: ScalingConfig) -> Dict[str, float]:
    """Closed-form minimum of ``E + A/N^alpha + B/D^beta`` subject to ``k N D = C``."""
    a, b = s.alpha, s.beta
    g = (a * s.A / (b * s.B)) ** (1.0 / (a + b))
    nd = s.budget_flops / s.flops_per_param_token
    n = g * nd ** (b / (a + b))
    d = nd / n
    loss = s.E + s.A / n**a + s.B / d**b
    return {"budget_flops": s.budget_flops, "G": g, "N_opt": n, "D_opt": d, "tokens_per_param": d / n, "loss": loss}


def chinchilla_loss(s: ScalingConfig, n: float, d: float) -> float:
    return s.E + s.A / n**s.alpha + s.B / d**s.beta


# ----------------------------------------------------------------------------- the plan
def validate_plan(cfg: PlanConfig) -> ModelDims:
    """Checks every field; raises ValueError whose message starts with the field path."""

    def err(path: str, msg: str) -> None:
        raise ValueError(f"plan.{path}: {msg}")

    d = resolve_model(cfg.model)
    tp = cfg.topology
    for k in ("clusters", "replicas_per_cluster", "ranks_per_replica"):
        if getattr(tp, k) < 1:
            err(f"topology.{k}", f"must be positive (got {getattr(tp, k)})")
    if tp.sharding not in SHARDINGS:
        err("topology.sharding", f"unknown sharding {tp.sharding!r} (expected one of {SHARDINGS})")
    for lk in ("lan", "wan"):
        link: LinkConfig = getattr(cfg.network, lk)
        if link.bandwidth_gbps <= 0:
            err(f"network.{lk}.bandwidth_gbps", f"must be positive (got {link.bandwidth_gbps})")
        if link.latency_ms < 0:
            err(f"network.{lk}.latency_ms", f"must be at least 0 (got {link.latency_ms})")
    if cfg.network.round_overhead_s < 0:
        err("network.round_overhead_s", f"must be at least 0 (got {cfg.network.round_overhead_s})")
    t = cfg.train
    for k in ("batch_size", "seq_len"):
        if getattr(t, k) < 1:
            err(f"train.{k}", f"must be positive (got {getattr(t, k)})")
    if t.optimizer_states < 0:
        err("train.optimizer_states", f"must be at least 0 (got {t.optimizer_states})")
    for k in ("param_dtype", "grad_dtype", "optimizer_dtype", "activation_dtype"):
        dtype_bytes(getattr(t, k), f"plan.train.{k}")
    s = cfg.sync
    for k in ("h_inner", "h_outer"):
        if getattr(s, k) < 1:
            err(f"sync.{k}", f"must be at least 1 (got {getattr(s, k)})")
    if s.h_flat < 0:
        err("sync.h_flat", f"must be at least 1, or 0 for h_inner*h_outer (got {s.h_flat})")
    for k in ("inner_algorithm", "outer_algorithm", "flat_algorithm"):
        if getattr(s, k) not in ALGORITHMS:
            err(f"sync.{k}", f"unknown algorithm {getattr(s, k)!r} (expected one of {ALGORITHMS})")
    dtype_bytes(s.dtype, "plan.sync.dtype")
    if not 0 < s.target_comm_fraction < 1:
        err("sync.target_comm_fraction", f"must be in (0, 1) (got {s.target_comm_fraction})")
    if not 0 < s.inner_share < 1:
        err("sync.inner_share", f"must be in (0, 1) (got {s.inner_share})")
    h = cfg.hardware
    if h.step_time_s < 0:
        err("hardware.step_time_s", f"must be at least 0 (got {h.step_time_s})")
    if h.step_time_s == 0:
        if h.peak_tflops <= 0:
            err("hardware.peak_tflops", f"must be positive (got {h.peak_tflops})")
        if not 0 < h.mfu <= 1:
            err("hardware.mfu", f"must be in (0, 1] (got {h.mfu})")
    if h.memory_gib <= 0:
        err("hardware.memory_gib", f"must be positive (got {h.memory_gib})")
    if not 0 <= h.ddp_overlap < 1:
        err("hardware.ddp_overlap", f"must be in [0, 1) (got {h.ddp_overlap})")
    sc = cfg.scaling
    for k in ("budget_flops", "A", "B", "alpha", "beta", "flops_per_param_token"):
        if getattr(sc, k) <= 0:
            err(f"scaling.{k}", f"must be positive (got {getattr(sc, k)})")
    if not cfg.json_name:
        err("json_name", "must not be empty")
    return d


def step_time(cfg: PlanConfig, flops_per_step_rank: float) -> float:
    """Compute seconds per local step: the measured figure if given, else FLOPs / (peak x MFU)."""
    h = cfg.hardware
    if h.step_time_s > 0:
        return h.step_time_s
    return flops_per_step_rank / (h.peak_tflops * 1e12 * h.mfu)


def make_plan(cfg: PlanConfig) -> Dict[str, Any]:
    """Every figure of the plan, as a JSON-ready dict."""
    d = validate_plan(cfg)
    params = param_counts(d)
    n = params["total"]
    t, tp, s = cfg.train, cfg.topology, cfg.sync
    fpt = flops_per_token(d, t.seq_len)
    tokens_rank = t.batch_size * t.seq_len
    flops_rank = fpt["total"] * tokens_rank
    step_s = step_time(cfg, flops_rank)
    st = sync_times(n, tp, cfg.network, s.dtype)
    hf = h_flat(s)

    modes: Dict[str, Any] = {}
    for mode in MODES:
        per_step = sync_per_step(st, mode, s.h_inner, s.h_outer, hf, cfg.hardware.ddp_overlap)
        frac = comm_fraction(step_s, per_step)
        modes[mode] = {
            "sync_per_step_s": per_step,
            "comm_fraction": frac,
            "step_wall_s": step_s + per_step,
            "tokens_per_s": tokens_rank * tp.ranks_per_replica * tp.clusters * tp.replicas_per_cluster / (step_s + per_step),
            "memory": memory_per_rank(cfg, d, mode),
        }
    c = tp.clusters
    outer_period = s.h_inner * s.h_outer
    slow = {
        # bytes on the slow (cross-cluster) links per local step, all ranks together
        "hier": c * tp.ranks_per_replica * st.outer_bytes / outer_period if c > 1 else 0.0,
        # a ring over C*R ordered by cluster crosses C cluster boundaries
        "flat": c * tp.ranks_per_replica * st.flat_bytes / hf if c > 1 else 0.0,
        "ddp": c * tp.ranks_per_replica * st.ddp_bytes if c > 1 else 0.0,
    }
    for mode in MODES:
        modes[mode]["slow_link_bytes_per_step"] = slow[mode]
    mem_limit = cfg.hardware.memory_gib * 2**30
    return {
        "model": {**asdict(d), "head_dim": d.head_dim},
        "parameters": params,
        "flops": {
            "per_token": fpt,
            "tokens_per_rank_step": tokens_rank,
            "per_rank_step": flops_rank,
            "per_replica_group_step": flops_rank * tp.ranks_per_replica,
            "six_n_per_token": 6.0 * n,
        },
        "step_time_s": step_s,
        "step_time_source": "measured (hardware.step_time_s)" if cfg.hardware.step_time_s > 0 else "FLOPs / (peak x MFU)",
        "sync": asdict(st),
        "h": {"inner": s.h_inner, "outer": s.h_outer, "flat": hf},
        "modes": modes,
        "fits_memory": {m: {"no_checkpointing": modes[m]["memory"]["peak"] <= mem_limit, "checkpointing": modes[m]["memory"]["peak_checkpointed"] <= mem_limit} for m in MODES},
        "recommendation": {"target_comm_fraction": s.target_comm_fraction, **recommend_h(st, step_s, s.target_comm_fraction, s.inner_share)},
        "scaling": {**chinchilla_optimum(cfg.scaling), "constants": asdict(cfg.scaling)},
        # if the G ranks of a group split the model by tensors instead (group.parallel=tp, tp.py)
        "tensor_parallel": tp_volumes(d, tokens_rank, tp.ranks_per_replica),
        "config": asdict(cfg),
    }


def tp_volumes(d: ModelDims, tokens: int, g: int) -> Dict[str, Any]:
    """TP bytes per rank, per layer and step, for both layouts (tp.tp_comm_volume); {} for G = 1."""
    if g < 2:
        return {}
    from hier_localsgd.tp import VARIANTS, tp_comm_volume

    return {v: tp_comm_volume(d, tokens, g, v) for v in VARIANTS}


# ----------------------------------------------------------------------------- report
def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table, columns right-aligned except the first."""
    cells = [[str(h) for h in headers]] + [[str(x) for x in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for j, row in enumerate(cells):
        lines.append("  ".join(row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]) for i in range(len(row))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt_count(x: float) -> str:
    for unit, k in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= k:
            return f"{x / k:.3f} {unit}"
    return f"{x:.0f}"


def fmt_bytes(x: float) -> str:
    for unit, k in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= k:
            return f"{x / k:.2f} {unit}"
    return f"{x:.0f} B"


def fmt_time(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.2f} ms"
    return f"{x * 1e6:.1f} us"


def human(p: Dict[str, Any]) -> str:
    m, cfg = p["model"], p["config"]
    tp, s = cfg["topology"], cfg["sync"]
    out = [
        f"{HEADER}: {m['name']} (dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads, {m['n_kv_heads']} kv heads, "
        f"FFN {m['ffn_dim']}, vocab {m['vocab_size']}) on {tp['clusters']} clusters x {tp['replicas_per_cluster']} replica groups "
        f"x {tp['ranks_per_replica']} ranks ({tp['sharding']})",
        "",
        "Parameters",
    ]
    par = p["parameters"]
    out.append(table(["part", "parameters", "share"], [[k, f"{v:,}", f"{v / par['total']:.1%}"] for k, v in par.items()]))
    f = p["flops"]
    out += [
        "",
        f"FLOPs (training, per token, seq_len {cfg['train']['seq_len']}): {fmt_count(f['per_token']['total'])} "
        f"= 6(N-N_emb) {fmt_count(f['per_token']['dense'])} + attention {fmt_count(f['per_token']['attention'])}   (6N = {fmt_count(f['six_n_per_token'])})",
        f"per rank step ({f['tokens_per_rank_step']} tokens): {fmt_count(f['per_rank_step'])}FLOP; "
        f"compute time per step {fmt_time(p['step_time_s'])} ({p['step_time_source']})",
        "",
        "Peak memory per rank",
    ]
    rows = []
    keys = ["parameters", "gradients", "optimizer", "sync_backups", "rollback_snapshot", "sync_scratch", "activations", "activations_checkpointed", "peak", "peak_checkpointed"]
    for k in keys:
        rows.append([k] + [fmt_bytes(p["modes"][mode]["memory"][k]) for mode in MODES])
    out.append(table(["", *MODES], rows))
    fits = p["fits_memory"]
    out.append(
        f"fits in hardware.memory_gib={cfg['hardware']['memory_gib']:g} GiB: "
        + ", ".join(f"{m} {'yes' if fits[m]['no_checkpointing'] else ('with checkpointing' if fits[m]['checkpointing'] else 'no')}" for m in MODES)
    )
    st = p["sync"]
    lan, wan = cfg["network"]["lan"], cfg["network"]["wan"]
    out += [
        "",
        f"Syncs (ring bound; LAN {lan['bandwidth_gbps']} Gbit/s {lan['latency_ms']} ms, WAN {wan['bandwidth_gbps']} Gbit/s {wan['latency_ms']} ms; "
        f"{fmt_bytes(st['sync_bytes'])} per rank in {s['dtype']})",
        table(
            ["sync", "ranks", "link", "bytes sent per rank", "time", "every (steps)"],
            [
                ["inner all-reduce", tp["replicas_per_cluster"], "lan", fmt_bytes(st["inner_bytes"]), fmt_time(st["inner_s"]), p["h"]["inner"]],
                ["outer all-reduce", tp["clusters"], "wan", fmt_bytes(st["outer_bytes"]), fmt_time(st["outer_allreduce_s"]), p["h"]["inner"] * p["h"]["outer"]],
                ["broadcast in cluster", tp["replicas_per_cluster"], "lan", fmt_bytes(st["broadcast_bytes"]), fmt_time(st["broadcast_s"]), p["h"]["inner"] * p["h"]["outer"]],
                ["flat all-reduce", tp["clusters"] * tp["replicas_per_cluster"], st["wide_link"], fmt_bytes(st["flat_bytes"]), fmt_time(st["flat_s"]), p["h"]["flat"]],
                ["ddp all-reduce", tp["clusters"] * tp["replicas_per_cluster"], st["wide_link"], fmt_bytes(st["ddp_bytes"]), fmt_time(st["ddp_s"]), 1],
            ],
        ),
        "",
        "Time per step",
        table(
            ["mode", "compute", "sync (avg)", "comm fraction", "tokens/s (all)", "slow-link bytes/step"],
            [
                [mode, fmt_time(p["step_time_s"]), fmt_time(v["sync_per_step_s"]), f"{v['comm_fraction']:.1%}", fmt_count(v["tokens_per_s"]), fmt_bytes(v["slow_link_bytes_per_step"])]
                for mode, v in p["modes"].items()
            ],
        ),
    ]
    for variant, vol in p.get("tensor_parallel", {}).items():
        out.append(f"tensor parallel over the group's {tp['ranks_per_replica']} ranks ({variant}): {fmt_bytes(vol['per_step']['total'])} per rank "
                   f"and step, {fmt_bytes(sum(vol['per_layer'].values()))} per layer ("
                   + ", ".join(f"{op} {fmt_bytes(b)}" for op, b in vol["per_layer"].items()) + ")")
    rec = p["recommendation"]
    if rec.get("h_inner"):
        out += [
            "",
            f"For a communication fraction <= {rec['target_comm_fraction']:.1%}: hier H_inner={rec['h_inner']}, H_outer={rec['h_outer']} "
            f"(outer every {rec['outer_period_steps']} steps, {rec['hier_fraction']:.2%}); flat H={rec['h_flat']} ({rec['flat_fraction']:.2%}); "
            f"ddp {'meets' if rec['ddp_meets_target'] else 'cannot meet'} it ({p['modes']['ddp']['comm_fraction']:.1%})",
        ]
    sc = p["scaling"]
    k = sc["constants"]
    out += [
        "",
        f"Compute-optimal (L = {k['E']} + {k['A']}/N^{k['alpha']} + {k['B']}/D^{k['beta']}, C = {k['flops_per_param_token']:g} N D) "
        f"for C = {sc['budget_flops']:.3g} FLOPs:",
        f"  N_opt = {fmt_count(sc['N_opt'])} parameters, D_opt = {fmt_count(sc['D_opt'])} tokens, "
        f"{sc['tokens_per_param']:.1f} tokens/parameter, loss {sc['loss']:.4f}",
    ]
    return "\n".join(out)


def run_plan(cfg: PlanConfig, out_dir: str) -> int:
    """Prints the plan and writes ``<out_dir>/<json_name>``. Returns 0.

    Raises:
        ValueError: a bad field; the message starts with its path (``plan.model.dim: ...``).
    """
    p = make_plan(cfg)
    print(human(p))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, cfg.json_name)
    with open(path, "w") as fh:
        json.dump(p, fh, indent=2)
    print(f"\nplan written to {path}")
    return 0
