"""``hier-localsgd plan``: what a model costs to train on a hierarchy, before booking it.

From a model (``plan.model``: a torchtitan Llama3 flavor, the Llama-7B preset, or explicit
dims) and the deployment every command reads (tools/deployment.py: ``topology`` C clusters
x R replica groups x G ranks, ``sync`` H values and algorithms, ``links.inner`` the LAN
inside a cluster and ``links.outer`` the WAN between clusters, ``train`` batch and
sequence length), this module computes, with closed formulas only (no torch, nothing is
instantiated):

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

3. **Peak memory per rank** (bytes) on the device: parameters, gradients, AdamW state
   (2 tensors), the sync copies kept on the device and the sync scratch
   (model.sync_state_copies: hier keeps its backups, momenta, rollback snapshot and staged
   state on the host, as core/runtime/device.py places them; torchft's flat DiLoCo its outer
   momentum on the device), reported apart as ``host_*``, and activations, with and
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
   ``2(n-1)/n * S/B + 2(n-1) a`` (one model for every use: hier_localsgd/costs.py);
   a broadcast from a root to n-1 peers ``(n-1) S/B + a`` (the root sends every copy,
   as Gloo's broadcast does). Per mode:

   * ``hier``: an inner all-reduce over R on the LAN every H_inner steps; every
     H_inner x H_outer steps an outer all-reduce over C leaders on the WAN and a
     broadcast from each leader to its R-1 peers on the LAN;
   * ``flat`` (torchft DiLoCo over every replica group): an all-reduce over C R every
     H_flat steps; the ring crosses clusters, so each of its steps waits for the WAN;
   * ``ddp``: the gradient all-reduce over C R every step, WAN-bound likewise.

   Each of a replica group's G ranks syncs its own part in parallel over its own share
   of the links: S/G bytes with ``plan.sharding=fsdp``, S with ``replicate``. Syncs block
   training in this project, so they are fully exposed; ``plan.hardware.ddp_overlap``
   hides a fraction of the ddp all-reduce behind the backward pass. A link whose
   ``bandwidth_gbps`` is 0 (the default: not emulated) is costed as unlimited, and the
   report says so.

5. **Communication fraction** ``sync / (compute + sync)`` per step for each mode, and a
   recommendation of (H_inner, H_outer) for a target fraction f: the per-step sync
   budget is ``b = f/(1-f) t_step``; H_inner is the smallest value whose inner syncs use
   at most ``plan.inner_share`` of b, then H_outer the smallest that brings the total under b.

6. **Compute-optimal N and D** for a FLOPs budget C under the Chinchilla parametric fit
   ``L(N, D) = E + A/N^alpha + B/D^beta`` with ``C = 6 N D`` (Hoffmann et al. 2022,
   approach 3: E 1.69, A 406.4, B 410.7, alpha 0.34, beta 0.28, all configurable):
   ``N_opt = G (C/6)^(beta/(alpha+beta))``, ``D_opt = (C/6) / N_opt``,
   ``G = (alpha A / (beta B))^(1/(alpha+beta))``.

``run_plan`` prints the tables and writes ``plan.json``. docs/planner.md has the
commands, examples and what was validated.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Dict

from hier_localsgd.core.links.lossy import LinkSpec
from hier_localsgd.tools.deployment import check_shared, links, unlimited
from hier_localsgd.tools.plan.config import PlanConfig, REPORT_ORDER, SHARDINGS, ScalingConfig
from hier_localsgd.tools.plan.model import ModelDims, dtype_bytes, flops_per_token, memory_per_rank, param_counts, resolve_model, shard_factor
from hier_localsgd.tools.plan.pick import pick_outer
from hier_localsgd.tools.plan.network import (
    OuterVariant, SyncTimes, async_down_bytes, async_push_bytes, async_push_s, cluster_paces, comm_fraction, h_values, hier_variant_sync_per_step, outer_round_bytes,
    outer_round_s, paced_shares, recommend_h, sync_per_step, sync_times,
)

if TYPE_CHECKING:
    from hier_localsgd.config import Config


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
def validate_plan(cfg: "Config") -> ModelDims:
    """Checks the shared sections plan reads (tools/deployment.py) and every ``plan.*``
    field; raises ValueError whose message starts with the field path."""
    check_shared(cfg)
    check_plan_section(cfg.plan)
    return resolve_model(cfg.plan.model)


def check_plan_section(p: PlanConfig, prefix: str = "plan") -> None:
    """``plan.*`` without the model (:func:`resolve_model` checks it); ValueError naming the field."""

    def err(path: str, msg: str) -> None:
        raise ValueError(f"{prefix}.{path}: {msg}")

    if p.sharding not in SHARDINGS:
        err("sharding", f"unknown sharding {p.sharding!r} (expected one of {SHARDINGS})")
    if p.round_overhead_s < 0:
        err("round_overhead_s", f"must be at least 0 (got {p.round_overhead_s})")
    t = p.train
    if t.optimizer_states < 0:
        err("train.optimizer_states", f"must be at least 0 (got {t.optimizer_states})")
    for k in ("param_dtype", "grad_dtype", "optimizer_dtype", "activation_dtype", "sync_dtype"):
        dtype_bytes(getattr(t, k), f"{prefix}.train.{k}")
    if not 0 < p.target_comm_fraction < 1:
        err("target_comm_fraction", f"must be in (0, 1) (got {p.target_comm_fraction})")
    if not 0 < p.inner_share < 1:
        err("inner_share", f"must be in (0, 1) (got {p.inner_share})")
    if not p.topk2_step_cost > 0:
        err("topk2_step_cost", f"the steps topk2 needs as a multiple of fp32's: must be above 0 (got {p.topk2_step_cost})")
    h = p.hardware
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
    sc = p.scaling
    for k in ("budget_flops", "A", "B", "alpha", "beta", "flops_per_param_token"):
        if getattr(sc, k) <= 0:
            err(f"scaling.{k}", f"must be positive (got {getattr(sc, k)})")
    if not p.json_name:
        err("json_name", "must not be empty")


def sync_bytes(cfg: "Config", n_params: float, prefix: str = "plan") -> float:
    """S: the bytes one rank syncs, the model in ``plan.train.sync_dtype``, /G with fsdp."""
    return n_params * dtype_bytes(cfg.plan.train.sync_dtype, f"{prefix}.train.sync_dtype") / shard_factor(cfg)


def step_time(cfg: PlanConfig, flops_per_step_rank: float) -> float:
    """Compute seconds per local step: the measured figure if given, else FLOPs / (peak x MFU)."""
    h = cfg.hardware
    if h.step_time_s > 0:
        return h.step_time_s
    return flops_per_step_rank / (h.peak_tflops * 1e12 * h.mfu)


def tp_volumes(d: ModelDims, tokens: int, g: int) -> Dict[str, Any]:
    """TP bytes per rank, per layer and step, for both layouts (train/tp.tp_comm_volume); {} for G = 1."""
    if g < 2:
        return {}
    from hier_localsgd.train.sections import VARIANTS
    from hier_localsgd.train.tp import tp_comm_volume

    return {v: tp_comm_volume(d, tokens, g, v) for v in VARIANTS}


def deployment_of(cfg: "Config") -> Dict[str, Any]:
    """The shared sections' fields the plan read (its JSON's ``config``, beside ``plan``)."""
    lan, wan = cfg.links.inner, cfg.links.outer
    return {
        "topology": asdict(cfg.topology),
        "sync": {"inner": asdict(cfg.sync.inner), "outer": asdict(cfg.sync.outer), "flat": asdict(cfg.sync.flat)},
        "links": {k: {"bandwidth_gbps": v.bandwidth_gbps, "latency_ms": v.latency_ms} for k, v in (("inner", lan), ("outer", wan))},
        "train": {"batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len, "steps": cfg.train.steps},
        "plan": asdict(cfg.plan),
    }


def async_exchange(cfg: "Config", st: SyncTimes, variant: OuterVariant, wan: LinkSpec) -> Dict[str, float]:
    """One asynchronous push: its bytes up and down (``sync.outer.compression``,
    ``sync.async_outer.compress_down``) and its seconds (network.py ``async_push_s``)."""
    up = async_push_bytes(st.sync_bytes, variant)
    down = async_down_bytes(st.sync_bytes, variant, cfg.sync.async_outer.compress_down)
    return {"up": up, "down": down, "s": async_push_s(up, down, wan, cfg.plan.round_overhead_s)}


def cluster_rates(cfg: "Config", st: SyncTimes, step_s: float, wan: LinkSpec, variant: OuterVariant, h: Dict[str, int]) -> Dict[str, Any]:
    """``topology.cluster_speed`` (hier): each cluster's steps per second with the synchronous
    outer level (every cluster at the slowest's pace) and the asynchronous one (its own pace,
    a push per outer period: :func:`~hier_localsgd.tools.plan.network.async_push_s`), as a
    share of its own rate with an outer level that costs nothing, and the goodput without
    failures (its compute over its wall time, averaged over clusters; the asynchronous one
    over a fixed duration: over a fixed number of steps the faster clusters finish first
    and idle, as the simulator counts it). Modelled, steady
    state: no grace window (the server's wait for a slower cluster's push, at most
    ``sync.async_outer.grace_s`` a push), no matched paces, no failures; the simulator models
    them (``hier-localsgd simulate``)."""
    tp, pc = cfg.topology, cfg.plan
    speeds = [tp.speed(k) for k in range(tp.clusters)]
    outer_sync = outer_round_s(st.sync_bytes, tp.clusters, wan, variant, pc.round_overhead_s)
    outer_async = async_exchange(cfg, st, variant, wan)["s"]
    levels = {}
    for name, outer_s, asynchronous in (("synchronous", outer_sync, False), ("asynchronous", outer_async, True)):
        per_step = hier_variant_sync_per_step(st, outer_s, step_s, h["inner"], h["outer"], variant)
        paces = cluster_paces(step_s, speeds, per_step, asynchronous)
        shares = paced_shares(step_s, speeds, paces)  # its compute's share of its wall time
        levels[name] = {"sync_per_step_s": per_step, "steps_per_s": [1.0 / x for x in paces], "of_own_rate": shares,
                        "goodput_no_failures": sum(shares) / len(speeds)}
    return {"speeds": speeds, "compute_s": [step_s / sp for sp in speeds], "configured": "asynchronous" if cfg.sync.async_outer.enabled else "synchronous",
            **levels}


def make_plan(cfg: "Config") -> Dict[str, Any]:
    """Every figure of the plan, as a JSON-ready dict.

    Raises:
        ValueError: a bad field (shared sections or ``plan.*``), its path first.
    """
    d = validate_plan(cfg)
    params = param_counts(d)
    n = params["total"]
    tp, pc = cfg.topology, cfg.plan
    fpt = flops_per_token(d, cfg.train.seq_len)
    tokens_rank = cfg.train.batch_size * cfg.train.seq_len
    flops_rank = fpt["total"] * tokens_rank
    step_s = step_time(pc, flops_rank)
    lan, wan = links(cfg)
    st = sync_times(sync_bytes(cfg, n), tp.clusters, tp.replicas_per_cluster, lan, wan, pc.round_overhead_s)
    h = h_values(cfg.sync)
    variant = OuterVariant.of(cfg.sync, int(dtype_bytes(cfg.plan.train.sync_dtype, "plan.train.sync_dtype")))

    # hier's outer round as configured (compression, fragments): what one leader sends, and its time
    outer_round = {"compression": variant.compression, "fragments": variant.fragments,
                   "bytes": outer_round_bytes(st.sync_bytes, tp.clusters, variant),
                   "s": outer_round_s(st.sync_bytes, tp.clusters, wan, variant, pc.round_overhead_s)}
    if cfg.sync.async_outer.enabled and tp.clusters > 1:  # a push and the model back, nobody waited for
        ex = async_exchange(cfg, st, variant, wan)
        outer_round.update(asynchronous=True, bytes=ex["up"] + ex["down"], s=ex["s"])
    modes: Dict[str, Any] = {}
    for mode in REPORT_ORDER:
        per_step = sync_per_step(st, mode, h["inner"], h["outer"], h["flat"], pc.hardware.ddp_overlap)
        if mode == "hier":  # overlap, compression and fragments of sync.outer (network.OuterVariant)
            per_step = hier_variant_sync_per_step(st, outer_round["s"], step_s, h["inner"], h["outer"], variant)
        modes[mode] = {
            "sync_per_step_s": per_step,
            "comm_fraction": comm_fraction(step_s, per_step),
            "step_wall_s": step_s + per_step,
            "tokens_per_s": tokens_rank * tp.ranks_per_replica * tp.clusters * tp.replicas_per_cluster / (step_s + per_step),
            "memory": memory_per_rank(cfg, d, mode),
        }
    c = tp.clusters
    clusters = cluster_rates(cfg, st, step_s, wan, variant, h) if tp.cluster_speed and cfg.sync.mode == "hier" else None
    slow = {
        # bytes on the slow (cross-cluster) links per local step, all ranks together
        "hier": c * tp.ranks_per_replica * variant.fragments * outer_round["bytes"] / (h["inner"] * h["outer"]) if c > 1 else 0.0,
        # a ring over C*R ordered by cluster crosses C cluster boundaries
        "flat": c * tp.ranks_per_replica * st.flat_bytes / h["flat"] if c > 1 else 0.0,
        "ddp": c * tp.ranks_per_replica * st.ddp_bytes if c > 1 else 0.0,
    }
    for mode in REPORT_ORDER:
        modes[mode]["slow_link_bytes_per_step"] = slow[mode]
    mem_limit = pc.hardware.memory_gib * 2**30
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
        "step_time_source": "measured (plan.hardware.step_time_s)" if pc.hardware.step_time_s > 0 else "FLOPs / (peak x MFU)",
        "sync": asdict(st),
        "outer_round": outer_round,
        "clusters": clusters,
        "outer_pick": pick_outer(st, step_s, tp.clusters, wan, pc.round_overhead_s, h["inner"], h["outer"], variant,
                                 steps=cfg.train.steps, topk2_step_cost=pc.topk2_step_cost),
        "unlimited_links": [k for k, spec in (("links.inner", lan), ("links.outer", wan)) if unlimited(spec)],
        "h": h,
        "modes": modes,
        "fits_memory": {m: {"no_checkpointing": modes[m]["memory"]["peak"] <= mem_limit, "checkpointing": modes[m]["memory"]["peak_checkpointed"] <= mem_limit} for m in REPORT_ORDER},
        "recommendation": {"target_comm_fraction": pc.target_comm_fraction, **recommend_h(st, step_s, pc.target_comm_fraction, pc.inner_share)},
        "scaling": {**chinchilla_optimum(pc.scaling), "constants": asdict(pc.scaling)},
        # if the G ranks of a group split the model by tensors instead (group.parallel=tp, train/tp.py)
        "tensor_parallel": tp_volumes(d, tokens_rank, tp.ranks_per_replica),
        "config": deployment_of(cfg),
    }
