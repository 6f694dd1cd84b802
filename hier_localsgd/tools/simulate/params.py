"""The simulator's resolved parameters: a config turned into the figures one run needs (:func:`resolve`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence, Tuple

from hier_localsgd import costs
from hier_localsgd.core.tensors.fragments import outer_period
from hier_localsgd.core.runtime.faults import ROLES
from hier_localsgd.core.links.lossy import LinkSpec
from hier_localsgd.tools.deployment import check_shared, links
from hier_localsgd.tools.plan.network import OuterVariant, async_down_bytes, async_leg_s, async_push_bytes, hier_sync_per_step, outer_round_s
from hier_localsgd.tools.plan.model import dtype_bytes, flops_per_token, param_counts, resolve_model, shard_factor
from hier_localsgd.tools.plan.planner import check_plan_section, step_time, sync_bytes
from hier_localsgd.tools.simulate.config import FAILURE_MODELS, SimulateConfig

if TYPE_CHECKING:
    from hier_localsgd.config import Config


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
    inner_link: LinkSpec  # links.inner (flat/ddp across clusters: links.outer)
    outer_link: LinkSpec  # links.outer
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
    kills: Tuple[Tuple[float, int, int, int, str], ...]  # (t or -1, cluster, replica or -1, step or -1, phase)
    early_quorum: bool  # sync.inner.early_quorum: a round's quorum is formed before its sync point
    hang_fraction: float
    duration_s: float
    steps: int
    # Per cluster, its compute speed (topology.cluster_speed): a step lasts step_s / speed.
    speeds: Tuple[float, ...] = ()
    # sync.async_outer: each leader pushes to the global model server and goes on (engine.py)
    asynchronous: bool = False
    max_staleness: int = 0  # sync.async_outer.max_staleness (versions)
    match_pace: bool = False  # sync.async_outer.match_pace: the server sets each cluster's push schedule
    # sync.outer.delay > 0 with the asynchronous level: a push goes out behind training and its
    # answer is merged at the cluster's next round (engine.py launch). The synchronous
    # level's overlap is not simulated (its rounds run blocking).
    overlap: bool = False
    # sync.async_outer.grace_s, .min_clusters: the server's batch window (batches.py)
    grace_s: float = 0.0
    async_min_clusters: int = 1
    # sync.outer.compression (its format and block; the synchronous level's collective and
    # the pushes): what crosses the WAN per outer round. Fragments and delay are not
    # simulated here (the synchronous level's rounds run whole and blocking).
    compression: OuterVariant = OuterVariant()
    compress_down: bool = True  # sync.async_outer.compress_down: an answer's steps come down quantized
    # simulate.target_rounds: the synchronous rounds' worth of merged work at which the
    # global model reaches the target (target.py; a calibration); 0: not modelled
    target_rounds: float = 0.0

    def speed(self, cluster: int) -> float:
        return self.speeds[cluster] if self.speeds else 1.0

    @property
    def slowest_step_s(self) -> float:
        return self.step_s / min(self.speeds, default=1.0)

    def inner_time(self, n: int) -> float:
        return self.inner_link.allreduce_time(self.sync_bytes, n) + self.round_overhead_s

    def outer_time(self, n: int) -> float:
        """The synchronous outer round's collective among ``n`` leaders, compressed as
        configured (tools/plan/network.py outer_round_s)."""
        return outer_round_s(self.sync_bytes, n, self.outer_link, self.compression, self.round_overhead_s)

    @property
    def push_bytes(self) -> float:
        """What one asynchronous push sends up (tools/plan/network.py async_push_bytes)."""
        return async_push_bytes(self.sync_bytes, self.compression)

    @property
    def answer_bytes(self) -> float:
        """What its answer brings down: one version's quantized step with compress_down, or
        the model (tools/plan/network.py async_down_bytes; a cluster on schedule is one
        version behind)."""
        return async_down_bytes(self.sync_bytes, self.compression, self.compress_down)

    @property
    def upload_s(self) -> float:
        """A push's way up (tools/plan/network.py async_leg_s)."""
        return async_leg_s(self.push_bytes, self.outer_link, self.round_overhead_s)

    @property
    def download_s(self) -> float:
        """Its answer's way down."""
        return async_leg_s(self.answer_bytes, self.outer_link, self.round_overhead_s)

    def push_time(self) -> float:
        """The asynchronous outer level's exchange, up and down (network.py async_push_s)."""
        return self.upload_s + self.download_s

    def broadcast_time(self, n: int) -> float:
        return self.inner_link.broadcast_time(self.sync_bytes, n)

    @property
    def period(self) -> int:
        """Local steps per commit that ends work (outer period; one round for flat/ddp)."""
        return outer_period(self.h_inner, self.h_outer) if self.mode == "hier" else self.h_inner

    def no_failure_sync_per_step(self) -> float:
        """Exposed sync seconds per step without failures (the planner's formula, tools/plan/network.py)."""
        if self.mode == "hier":
            outer = self.push_time() if self.asynchronous else self.outer_time(self.clusters)
            if self.overlap:  # behind the next inner round's compute (the fastest cluster's)
                outer = max(0.0, outer - self.h_inner * self.step_s - self.inner_time(self.replicas))
            return hier_sync_per_step(self.inner_time(self.replicas), outer, self.broadcast_time(self.replicas), self.h_inner, self.h_outer)
        return self.inner_time(self.replicas) / self.h_inner  # one level (flat, ddp: H_inner = 1)


# The phases a replayed kill can name (``"sK:c[:r]@PHASE"``): where in the round ending at
# step K the process was (the chaos report's ``phase``). LOCAL: during local step K+1.
KILL_PHASES = ("LOCAL", "INNER_QUORUM", "INNER_REDUCE", "OUTER_QUORUM", "OUTER_REDUCE", "OUTER_COMMIT", "BROADCAST", "INNER_COMMIT")


def _parse_kills(kills: Sequence[str], clusters: int, replicas: int) -> Tuple[Tuple[float, int, int, int, str], ...]:
    """``"t:c[:r]"`` (at t seconds) or ``"sK:c[:r][@PHASE]"`` (during cluster c's local step
    K+1, or in PHASE of the round that ends at step K): (t or -1, c, r or -1, K or -1, PHASE)."""
    out = []
    for i, k in enumerate(kills):
        path = f"simulate.failures.kills[{i}]"
        text, _, phase = str(k).partition("@")
        phase = phase or "LOCAL"
        if phase not in KILL_PHASES or (phase != "LOCAL" and not text.startswith("s")):
            raise ValueError(f"{path}: {k!r} — a phase goes with a step kill 'sK:c[:r]@PHASE', PHASE one of {KILL_PHASES}")
        parts = text.split(":")
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
        out.append((t, c, r, step, phase))
    return tuple(out)


def check_simulate(cfg: SimulateConfig) -> None:
    """``simulate.*`` (the kills list: :func:`_parse_kills`); ValueError naming ``simulate.<field>``."""

    def err(path: str, msg: str) -> None:
        raise ValueError(f"simulate.{path}: {msg}")

    f = cfg.failures
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
    if cfg.duration_s < 0:
        err("duration_s", f"must be positive, or 0 to run train.steps steps (got {cfg.duration_s})")
    if cfg.runs < 1:
        err("runs", f"must be at least 1 (got {cfg.runs})")
    for i, x in enumerate(cfg.sensitivity):
        if x < 0:
            err(f"sensitivity[{i}]", f"must be at least 0 (got {x})")
    if not 0 <= cfg.step_jitter < 0.5:
        err("step_jitter", f"must be in [0, 0.5) (got {cfg.step_jitter})")
    if cfg.params < 0:
        err("params", f"must be positive, or 0 to count the model's (got {cfg.params})")
    if not (cfg.target_rounds >= 0 and math.isfinite(cfg.target_rounds)):
        err("target_rounds", f"must be a finite number of rounds, or 0 for no target (got {cfg.target_rounds})")


def model_figures(cfg: "Config") -> Tuple[int, float]:
    """(parameters, compute seconds per step): ``simulate.params`` with the measured
    ``plan.hardware.step_time_s``, or ``plan.model`` and FLOPs / (peak x MFU) as the planner counts them."""
    hw = cfg.plan.hardware
    if cfg.simulate.params > 0:
        if hw.step_time_s <= 0:
            raise ValueError("plan.hardware.step_time_s: must be given with simulate.params (no model to count FLOPs from)")
        return cfg.simulate.params, hw.step_time_s
    dims = resolve_model(cfg.plan.model)
    fl = flops_per_token(dims, cfg.train.seq_len)["total"] * cfg.train.batch_size * cfg.train.seq_len
    return param_counts(dims)["total"], step_time(cfg.plan, fl)


def resolve(cfg: "Config") -> SimParams:
    """Validates what the simulation reads (the shared sections, ``plan.*``, ``simulate.*``;
    ValueError naming the field) and resolves it into one run's figures.

    flat and ddp become one level over every replica group (one "cluster" of C R), whose
    ring crosses clusters (``links.outer``) when C > 1.
    """
    check_shared(cfg)
    check_plan_section(cfg.plan)
    check_simulate(cfg.simulate)
    to = cfg.timeouts_obj()
    cfg.lighthouse.check(cfg.topology.clusters, count_addresses=False, serving=False)
    tp, s, f, sim = cfg.topology, cfg.sync, cfg.simulate.failures, cfg.simulate
    lan, wan = links(cfg)
    n_params, step_s = model_figures(cfg)
    pt = cfg.plan.train
    shard = shard_factor(cfg)
    param_b = dtype_bytes(pt.param_dtype, "plan.train.param_dtype")
    state_bytes = n_params / shard * (
        param_b * 4  # model, inner backup, outer backup + momentum
        + dtype_bytes(pt.optimizer_dtype, "plan.train.optimizer_dtype") * pt.optimizer_states
    )
    outer_state_bytes = n_params / shard * param_b * 2  # outer backup + momentum

    hier = s.mode == "hier"
    if hier:
        clusters, replicas = tp.clusters, tp.replicas_per_cluster
        h_inner, h_outer = s.inner.every, s.outer.every
        inner_link = lan
    else:
        # One level over every replica group; the ring crosses clusters (WAN-bound if C > 1).
        clusters, replicas = 1, tp.clusters * tp.replicas_per_cluster
        h_inner, h_outer = (1 if s.mode == "ddp" else s.flat.every), 1
        inner_link = wan if tp.clusters > 1 else lan
    heal_s = f.heal_s if f.heal_s >= 0 else costs.transfer_time(state_bytes, inner_link.latency_s, inner_link.bandwidth_Bps)
    outer_heal_s = f.outer_heal_s if f.outer_heal_s >= 0 else costs.transfer_time(outer_state_bytes, wan.latency_s, wan.bandwidth_Bps)
    kills = _parse_kills(f.kills, tp.clusters, tp.replicas_per_cluster)
    if not hier and kills:
        # flat/ddp simulate one group of C*R: replica r of cluster c is member c*R + r.
        kills = tuple((t, 0, (c * tp.replicas_per_cluster + r) if r >= 0 else -1, k, ph) for t, c, r, k, ph in kills)
        if any(r < 0 for _, _, r, _, _ in kills):
            raise ValueError("simulate.failures.kills: whole-cluster kills need sync.mode=hier")
    secs = lambda td: td.total_seconds()  # noqa: E731
    p = SimParams(
        mode=s.mode, clusters=clusters, replicas=replicas, ranks=tp.ranks_per_replica,
        h_inner=h_inner, h_outer=h_outer, step_s=step_s, step_jitter=sim.step_jitter, sync_bytes=sync_bytes(cfg, n_params),
        inner_link=inner_link, outer_link=wan, round_overhead_s=cfg.plan.round_overhead_s,
        min_replicas=s.min_replicas if hier else 1, min_clusters=s.min_clusters,
        heartbeat_s=cfg.lighthouse.heartbeat_timeout_ms / 1000, join_s=cfg.lighthouse.join_timeout_ms / 1000,
        inner_quorum_s=secs(to.inner_quorum), outer_quorum_s=secs(to.outer_quorum), inner_reduce_s=secs(to.inner_reduce),
        outer_reduce_s=secs(to.outer_reduce), hang_watchdog_s=secs(to.local_step) + secs(to.watchdog_grace),
        startup_s=secs(to.startup), restart_s=f.restart_s, heal_s=heal_s, outer_heal_s=outer_heal_s,
        outer_heal_bytes=outer_state_bytes, heal_bytes=state_bytes, wide_clusters=tp.clusters,
        reconfigure_s=f.reconfigure_s,
        failure_model=f.model, mtbf_s=f.mtbf_s, cluster_mtbf_s=f.cluster_mtbf_s if hier else 0.0,
        kill_every_s=f.kill_every_s, roles=tuple(f.roles), stop_kills_at=f.stop_kills_at,
        kills=kills, early_quorum=hier and s.inner.early_quorum, hang_fraction=f.hang_fraction, duration_s=sim.duration_s, steps=0 if sim.duration_s > 0 else cfg.train.steps,
        speeds=tuple(tp.speed(c) for c in range(tp.clusters)) if hier else (),
        asynchronous=hier and s.async_outer.enabled, max_staleness=s.async_outer.max_staleness,
        match_pace=hier and s.async_outer.enabled and s.async_outer.match_pace,
        overlap=hier and s.async_outer.enabled and s.outer.delay > 0,
        grace_s=s.async_outer.grace_s, async_min_clusters=s.async_outer.min_clusters,
        compression=replace(OuterVariant.of(s, int(dtype_bytes(pt.sync_dtype, "plan.train.sync_dtype"))), delay=0, fragments=1) if hier else OuterVariant(),
        compress_down=s.async_outer.compress_down, target_rounds=sim.target_rounds,
    )
    check_size(p)
    return p


# An event loop in Python handles some 10^5 rounds per second; past this many it would run for minutes.
MAX_ROUNDS = 10_000_000


def check_size(p: SimParams) -> None:
    """Refuses a run too long to simulate (ValueError naming the horizon): every cluster's
    inner rounds are events, so the horizon over ``H_inner`` steps bounds the work."""
    steps = p.steps if p.steps > 0 else p.duration_s / p.step_s
    rounds = p.clusters * steps / p.h_inner
    if rounds > MAX_ROUNDS:
        field = "train.steps" if p.steps > 0 else "simulate.duration_s"
        raise ValueError(f"{field}: about {rounds:.3g} inner rounds to simulate (step {p.step_s:.3g} s, H_inner {p.h_inner}, "
                         f"{p.clusters} cluster(s)); at most {MAX_ROUNDS:.0e}: shorten the run or give a real step time (plan.hardware.step_time_s)")


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


