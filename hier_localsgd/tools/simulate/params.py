"""The simulator's resolved parameters: a config turned into the figures one run needs (:func:`resolve`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Sequence, Tuple

from hier_localsgd import costs
from hier_localsgd.core.faults import ROLES
from hier_localsgd.sync.types import MODES
from hier_localsgd.tools.plan.config import NetworkLink
from hier_localsgd.tools.plan.model import dtype_bytes, flops_per_token, param_counts, resolve_model
from hier_localsgd.tools.simulate.config import FAILURE_MODELS, SimulateConfig


# ----------------------------------------------------------------------------- resolved parameters
@dataclass(frozen=True)
class SimParams:
    """Everything one simulation needs, resolved from a :class:`SimulateConfig`."""

    mode: str
    clusters: int
    replicas: int  # per cluster
    ranks: int  # per replica group (G)
    h_inner: int
    h_outer: int
    step_s: float
    step_jitter: float
    sync_bytes: float  # per rank
    inner_link: NetworkLink
    outer_link: NetworkLink
    round_overhead_s: float
    min_replicas: int
    min_clusters: int
    heartbeat_s: float
    join_s: float
    inner_quorum_s: float
    outer_quorum_s: float
    inner_reduce_s: float
    outer_reduce_s: float
    hang_watchdog_s: float
    startup_s: float
    restart_s: float
    heal_s: float
    outer_heal_s: float
    outer_heal_bytes: float  # per rank, crossing clusters
    heal_bytes: float  # per rank, a restarted replica group's heal
    wide_clusters: int  # clusters the deployment spans (flat/ddp: their ring crosses this many cluster boundaries)
    reconfigure_s: float
    failure_model: str
    mtbf_s: float
    cluster_mtbf_s: float
    kill_every_s: float
    roles: Tuple[str, ...]
    stop_kills_at: float
    kills: Tuple[Tuple[float, int, int, int], ...]  # (t or -1, cluster, replica or -1, step or -1)
    hang_fraction: float
    duration_s: float
    steps: int

    def inner_time(self, n: int) -> float:
        return costs.allreduce_time(self.sync_bytes, n, *self.inner_link.alpha_beta()) + self.round_overhead_s

    def outer_time(self, n: int) -> float:
        return costs.allreduce_time(self.sync_bytes, n, *self.outer_link.alpha_beta()) + self.round_overhead_s

    def broadcast_time(self, n: int) -> float:
        return costs.broadcast_time(self.sync_bytes, n, *self.inner_link.alpha_beta())

    @property
    def period(self) -> int:
        """Local steps per commit that ends work (outer period; one round for flat/ddp)."""
        return self.h_inner * self.h_outer if self.mode == "hier" else self.h_inner

    def no_failure_sync_per_step(self) -> float:
        """Exposed sync seconds per step without failures (tools/plan/planner.py's formula)."""
        if self.mode == "hier":
            return self.inner_time(self.replicas) / self.h_inner + (self.outer_time(self.clusters) + self.broadcast_time(self.replicas)) / self.period
        return self.inner_time(self.replicas) / self.h_inner


def _parse_kills(kills: Sequence[str], clusters: int, replicas: int) -> Tuple[Tuple[float, int, int, int], ...]:
    """``"t:c[:r]"`` (at t seconds) or ``"sK:c[:r]"`` (during cluster c's local step K+1)."""
    out = []
    for i, k in enumerate(kills):
        path = f"simulate.failures.kills[{i}]"
        parts = str(k).split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            if parts[0].startswith("s"):
                t, step = -1.0, int(parts[0][1:])
                bad = step < 0
            else:
                t, step = float(parts[0]), -1
                bad = t < 0
            c = int(parts[1])
            r = int(parts[2]) if len(parts) == 3 else -1
        except ValueError:
            raise ValueError(f"{path}: {k!r} — expected 't:c' (whole cluster) or 't:c:r' (t in seconds), or 'sK:c[:r]' (at local step K)") from None
        if bad or not 0 <= c < clusters or not -1 <= r < replicas or (len(parts) == 3 and r < 0):
            raise ValueError(f"{path}: {k!r} — time and step must be >= 0, cluster in [0, {clusters}), replica in [0, {replicas})")
        out.append((t, c, r, step))
    return tuple(out)


def resolve(cfg: SimulateConfig) -> SimParams:
    """Validates ``cfg`` (ValueError naming ``simulate.<field>``) and resolves it."""

    def err(path: str, msg: str) -> None:
        raise ValueError(f"simulate.{path}: {msg}")

    tp, s, f, to, hw, net = cfg.topology, cfg.sync, cfg.failures, cfg.timeouts, cfg.hardware, cfg.network
    for k in ("clusters", "replicas_per_cluster", "ranks_per_replica"):
        if getattr(tp, k) < 1:
            err(f"topology.{k}", f"must be positive (got {getattr(tp, k)})")
    if tp.sharding not in ("replicate", "fsdp"):
        err("topology.sharding", f"unknown sharding {tp.sharding!r} (expected replicate or fsdp)")
    if s.mode not in MODES:
        err("sync.mode", f"unknown mode {s.mode!r} (expected one of {MODES})")
    for k in ("h_inner", "h_outer"):
        if getattr(s, k) < 1:
            err(f"sync.{k}", f"must be at least 1 (got {getattr(s, k)})")
    if s.h_flat < 0:
        err("sync.h_flat", f"must be at least 1, or 0 for h_inner*h_outer (got {s.h_flat})")
    if not 1 <= s.min_replicas <= tp.replicas_per_cluster:
        err("sync.min_replicas", f"must be in [1, topology.replicas_per_cluster={tp.replicas_per_cluster}] (got {s.min_replicas})")
    if not 1 <= s.min_clusters <= tp.clusters:
        err("sync.min_clusters", f"must be in [1, topology.clusters={tp.clusters}] (got {s.min_clusters})")
    dbytes = dtype_bytes(s.dtype, "simulate.sync.dtype")
    for lk in ("lan", "wan"):
        link: NetworkLink = getattr(net, lk)
        if link.bandwidth_gbps <= 0:
            err(f"network.{lk}.bandwidth_gbps", f"must be positive (got {link.bandwidth_gbps})")
        if link.latency_ms < 0:
            err(f"network.{lk}.latency_ms", f"must be at least 0 (got {link.latency_ms})")
    if net.round_overhead_s < 0:
        err("network.round_overhead_s", f"must be at least 0 (got {net.round_overhead_s})")
    if f.model not in FAILURE_MODELS:
        err("failures.model", f"unknown failure model {f.model!r} (expected one of {FAILURE_MODELS})")
    if f.mtbf_s < 0:
        err("failures.mtbf_s", f"must be positive, or 0 for none (got {f.mtbf_s})")
    if f.cluster_mtbf_s < 0:
        err("failures.cluster_mtbf_s", f"must be positive, or 0 for none (got {f.cluster_mtbf_s})")
    if f.kill_every_s <= 0:
        err("failures.kill_every_s", f"must be positive (got {f.kill_every_s})")
    for i, role in enumerate(f.roles):
        if role not in ROLES:
            err(f"failures.roles[{i}]", f"unknown role {role!r} (expected one of {ROLES})")
    if f.model == "chaos" and not f.roles:
        err("failures.roles", "needs at least one role")
    if not 0 < f.stop_kills_at <= 1:
        err("failures.stop_kills_at", f"must be in (0, 1] (got {f.stop_kills_at})")
    if not 0 <= f.hang_fraction <= 1:
        err("failures.hang_fraction", f"must be in [0, 1] (got {f.hang_fraction})")
    for k in ("restart_s", "reconfigure_s"):
        if getattr(f, k) < 0:
            err(f"failures.{k}", f"must be at least 0 (got {getattr(f, k)})")
    for k, v in asdict(to).items():
        if v <= 0:
            err(f"timeouts.{k}", f"must be positive (got {v})")
    if hw.step_time_s < 0:
        err("hardware.step_time_s", f"must be at least 0 (got {hw.step_time_s})")
    if cfg.duration_s <= 0 and cfg.steps <= 0:
        err("duration_s", f"must be positive, or give steps (got {cfg.duration_s})")
    if cfg.steps < 0:
        err("steps", f"must be at least 0 (got {cfg.steps})")
    if cfg.runs < 1:
        err("runs", f"must be at least 1 (got {cfg.runs})")
    for i, x in enumerate(cfg.sensitivity):
        if x < 0:
            err(f"sensitivity[{i}]", f"must be at least 0 (got {x})")
    if not 0 <= cfg.step_jitter < 0.5:
        err("step_jitter", f"must be in [0, 0.5) (got {cfg.step_jitter})")
    if cfg.params < 0:
        err("params", f"must be positive, or 0 to count the model's (got {cfg.params})")

    # model size and step time
    if cfg.params > 0:
        n_params = cfg.params
        if hw.step_time_s <= 0:
            err("hardware.step_time_s", "must be given with simulate.params (no model to count FLOPs from)")
        step_s = hw.step_time_s
    else:
        dims = resolve_model(cfg.model, prefix="simulate.model")
        n_params = param_counts(dims)["total"]
        if cfg.train.batch_size < 1 or cfg.train.seq_len < 1:
            err("train.batch_size" if cfg.train.batch_size < 1 else "train.seq_len", "must be positive")
        if hw.step_time_s > 0:
            step_s = hw.step_time_s
        else:
            if hw.peak_tflops <= 0 or not 0 < hw.mfu <= 1:
                err("hardware.mfu" if hw.peak_tflops > 0 else "hardware.peak_tflops", "must be positive (mfu in (0, 1])")
            fl = flops_per_token(dims, cfg.train.seq_len)["total"] * cfg.train.batch_size * cfg.train.seq_len
            step_s = fl / (hw.peak_tflops * 1e12 * hw.mfu)
    shard = tp.ranks_per_replica if tp.sharding == "fsdp" else 1
    sync_bytes = n_params * dbytes / shard
    state_bytes = n_params / shard * (
        dtype_bytes(cfg.train.param_dtype, "simulate.train.param_dtype") * 4  # model, inner backup, outer backup + momentum
        + dtype_bytes(cfg.train.optimizer_dtype, "simulate.train.optimizer_dtype") * cfg.train.optimizer_states
    )
    outer_state_bytes = n_params / shard * dtype_bytes(cfg.train.param_dtype, "simulate.train.param_dtype") * 2  # outer backup + momentum

    hier = s.mode == "hier"
    flat_h = s.h_flat or s.h_inner * s.h_outer
    if hier:
        clusters, replicas = tp.clusters, tp.replicas_per_cluster
        h_inner, h_outer = s.h_inner, s.h_outer
        inner_link = net.lan
    else:
        # One level over every replica group; the ring crosses clusters (WAN-bound if C > 1).
        clusters, replicas = 1, tp.clusters * tp.replicas_per_cluster
        h_inner, h_outer = (1 if s.mode == "ddp" else flat_h), 1
        inner_link = net.wan if tp.clusters > 1 else net.lan
    heal_s = f.heal_s if f.heal_s >= 0 else costs.transfer_time(state_bytes, *inner_link.alpha_beta())
    outer_heal_s = f.outer_heal_s if f.outer_heal_s >= 0 else costs.transfer_time(outer_state_bytes, *net.wan.alpha_beta())
    kills = _parse_kills(f.kills, tp.clusters, tp.replicas_per_cluster)
    if not hier and kills:
        # flat/ddp simulate one group of C*R: replica r of cluster c is member c*R + r.
        kills = tuple((t, 0, (c * tp.replicas_per_cluster + r) if r >= 0 else -1, k) for t, c, r, k in kills)
        if any(r < 0 for _, _, r, _ in kills):
            err("failures.kills", "whole-cluster kills need sync.mode=hier")
    return SimParams(
        mode=s.mode, clusters=clusters, replicas=replicas, ranks=tp.ranks_per_replica,
        h_inner=h_inner, h_outer=h_outer, step_s=step_s, step_jitter=cfg.step_jitter, sync_bytes=sync_bytes,
        inner_link=inner_link, outer_link=net.wan, round_overhead_s=net.round_overhead_s,
        min_replicas=s.min_replicas if hier else 1, min_clusters=s.min_clusters,
        heartbeat_s=to.heartbeat_s, join_s=to.join_s, inner_quorum_s=to.inner_quorum_s,
        outer_quorum_s=to.outer_quorum_s, inner_reduce_s=to.inner_reduce_s,
        outer_reduce_s=to.outer_reduce_s, hang_watchdog_s=to.local_step_s + to.watchdog_grace_s,
        startup_s=to.startup_s, restart_s=f.restart_s, heal_s=heal_s, outer_heal_s=outer_heal_s,
        outer_heal_bytes=outer_state_bytes, heal_bytes=state_bytes, wide_clusters=tp.clusters,
        reconfigure_s=f.reconfigure_s,
        failure_model=f.model, mtbf_s=f.mtbf_s, cluster_mtbf_s=f.cluster_mtbf_s if hier else 0.0,
        kill_every_s=f.kill_every_s, roles=tuple(f.roles), stop_kills_at=f.stop_kills_at,
        kills=kills, hang_fraction=f.hang_fraction, duration_s=cfg.duration_s, steps=cfg.steps,
    )


def scale_failures(p: SimParams, factor: float) -> SimParams:
    """The same deployment with every failure rate multiplied by ``factor`` (0: none)."""
    if factor == 0:
        return replace(p, failure_model="none", kills=())
    return replace(
        p,
        mtbf_s=p.mtbf_s / factor if p.mtbf_s else 0.0,
        cluster_mtbf_s=p.cluster_mtbf_s / factor if p.cluster_mtbf_s else 0.0,
        kill_every_s=p.kill_every_s / factor,
    )


