"""``hier-localsgd simulate``: a discrete-event simulation of a large deployment with failures.

What it predicts, for C clusters x R replica groups running ``hier`` (or the ``flat`` and
``ddp`` baselines) with given step time, networks, H values, failure rates, restart and
heal times and timeouts:

* **goodput**: compute that ends in committed outer rounds (``flat``/``ddp``: committed
  rounds) / compute time available, ``C R T`` replica-group-seconds over the run. With no
  failures it equals ``1 - sync / (compute + sync)``, the communication fraction of
  :mod:`hier_localsgd.tools.plan.planner` (tests/test_simulate.py checks the equality);
* where the rest went: sync, waits (quorums, the global barrier, heals), downtime, and
  compute that was computed but lost (rolled back, or discarded at weight 0);
* **time lost per failure, by role** (non-leader, leader, whole cluster), attributed to
  the failure that caused it;
* **slow-link traffic** (bytes crossing clusters: outer all-reduces and heals from another
  cluster; for ``flat``/``ddp`` the C cluster-crossing edges of their ring);
* the chaos command's own figure, ``efficiency`` = steps kept / steps run, counted as
  sync/hier.py and chaos.py count it, for validation against ``hier-localsgd chaos``;
* the **sensitivity** of goodput to the failure rate (the rates scaled by each factor of
  ``sensitivity``).

Model (docs/architecture.md, "Failure semantics" and "Recovery order"). Time advances
through a heap of timestamped events (``heapq``, ties broken by insertion order); random
draws come from one seeded ``random.Random`` in event order, so a seed reproduces a run
exactly. The replica groups of a cluster run in lockstep: an inner round is
``H_inner`` local steps of ``step_s`` each (times ``1 + N(0, step_jitter)`` per cluster
and round, from its own seeded stream), then

1. INNER_QUORUM at the cluster lighthouse, with torchft's rule
   (:func:`lighthouse_forms_at`): at once if every member of the last quorum joined
   ("fast quorum"); otherwise once more than half of the heartbeating participants joined
   and either all of them did or ``join_s`` passed since the first one. A crashed member
   heartbeats for ``heartbeat_s`` after its death; a hung one until its watchdog ends it.
   Restarted replica groups waiting at the lighthouse join here. Past ``inner_quorum_s``
   the round fails (rollback);
2. the round's collectives: heals of the joiners (``heal_s``, everyone waits),
   ``reconfigure_s`` if the membership changed, the inner all-reduce (ring bound on the
   LAN, tools/plan/planner.py);
3. every ``H_inner x H_outer`` steps, the leader (lowest live replica group) joins the
   global lighthouse with its cluster Manager (one Manager id per leader incarnation, as
   torchft appends a uuid). The same rule forms the outer quorum; a leader that waits
   more than ``outer_quorum_s`` gives up the outer round (INNER_ONLY: its cluster commits
   the inner round and goes on). Then: heals over the WAN of new or stale cluster
   Managers (``outer_heal_s``), the outer all-reduce over the WAN, the broadcast inside
   each cluster (LAN), and the inner commit.

A cluster whose model derives from an older global model than the current one (it missed
a committed outer round, or it restarted from scratch) contributes weight 0 at its next
outer round and adopts the global model and step: its work since its last outer commit is
discarded (sync/hier.py ``moved``). A leader change alone costs a heal of the new cluster
manager over the WAN, and the work only if the global model moved meanwhile.

Failures:

* a replica group that crashes loses its steps since its last inner commit; if it dies
  while its cluster's collectives run, the round fails for the survivors at once (Gloo
  connections close) and they roll back; it restarts after ``restart_s`` and joins at
  its cluster's next quorum (healing, weight 0 there), contributing from the next round;
* a leader that crashes during the outer round fails that outer round for every cluster
  (the others' inner rounds commit: their work is kept for the next outer round); a
  non-leader that crashes while its leader is in the outer round breaks its cluster's
  round, but the outer result (which holds the cluster's work) stands;
* a whole cluster lost: its uncommitted work is lost; the others continue (with
  ``min_clusters``); its replica groups restart together (start-up barrier, at most
  ``startup_s``) from scratch and train until their first outer round, where they heal
  from another cluster at weight 0;
* a hang (``hang_fraction`` of failures): the replica group stops but keeps heartbeating:
  a collective it is part of fails at the phase timeout (``inner_reduce_s``,
  ``outer_reduce_s``), quorums give up on it after ``join_s``; its watchdog ends it
  ``local_step_s + watchdog_grace_s`` after it hung, then it restarts as after a crash.

Failure processes: ``independent`` (per replica group, exponential with mean ``mtbf_s``;
whole clusters with ``cluster_mtbf_s``), ``chaos`` (the chaos command's schedule: one
job-wide exponential clock with mean ``kill_every_s``, the role drawn as chaos.py draws
it, no kills after ``stop_kills_at``), and an explicit ``kills`` list to replay a run:
``"t:c"`` kills cluster c at t seconds, ``"t:c:r"`` replica group r of cluster c;
``"sK:c"`` / ``"sK:c:r"`` kill while cluster c runs its local step K+1 (K steps done, as
the chaos report gives the step of each kill).

``flat`` and ``ddp`` run as one level over all C R replica groups (one "cluster" whose
ring is WAN-bound when C > 1); a total loss there resumes from the last commit.

A run ends at the first commit that closes an outer round after ``duration_s`` (or when
every replica group has done ``steps``). A run that cannot get there (the outer level
stopped committing: docs/planner.md, "out of step") is stopped at three times its length
and reported as truncated.

Not modelled: jitter inside a round (only between rounds and clusters), the lighthouse's
quorum tick, link loss, concurrent heals competing for bandwidth, a restarted replica
group's start-up join rounds, and ``max_quorum_failures`` exits.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from hier_localsgd.tools.plan.planner import (
    HardwareConfig,
    NetworkLink,
    NetworkConfig,
    PlanModelConfig,
    PlanTopologyConfig,
    PlanTrainConfig,
    comm_fraction,
    dtype_bytes,
    flops_per_token,
    fmt_bytes,
    fmt_time,
    param_counts,
    resolve_model,
    table,
)
from hier_localsgd import costs
from hier_localsgd.core.faults import ROLES
from hier_localsgd.core.timeouts import Timeouts
from hier_localsgd.launch.lighthouse import LighthouseConfig
from hier_localsgd.sync.types import MODES

FAILURE_MODELS = ("independent", "chaos", "none")
INF = math.inf


# ----------------------------------------------------------------------------- config
@dataclass
class SimSyncConfig:
    mode: str = "hier"  # hier | flat | ddp
    h_inner: int = 100  # the defaults suit the default deployment (plan's recommendation for ~5 %)
    h_outer: int = 20
    h_flat: int = 0  # flat: steps per sync; 0 = h_inner * h_outer. ddp always syncs every step.
    dtype: str = "bfloat16"  # of the synced tensors
    min_replicas: int = 1
    min_clusters: int = 1


@dataclass
class FailureConfig:
    model: str = "independent"  # independent | chaos | none (the kills list applies with any)
    mtbf_s: float = 2.28e7  # per replica group (independent); default: one 8-GPU node in Llama 3's 54-day run (~6,300 h)
    cluster_mtbf_s: float = 0.0  # per cluster, whole-cluster outages (independent); 0 = none
    kill_every_s: float = 30.0  # chaos: mean seconds between kills, whole job
    roles: List[str] = field(default_factory=lambda: ["non_leader", "leader", "cluster"])  # chaos
    stop_kills_at: float = 1.0  # chaos/independent: no failures after this fraction of the run
    kills: List[str] = field(default_factory=list)  # explicit: "t:c" (cluster c), "t:c:r"; "sK:c[:r]" at local step K
    hang_fraction: float = 0.0  # share of failures that are hangs instead of crashes
    restart_s: float = 60.0  # failure -> process back (scheduler restart delay + start-up)
    heal_s: float = -1.0  # a restarted replica group's heal from a peer; <0: its state bytes over the LAN
    outer_heal_s: float = -1.0  # a new or stale cluster manager's heal from another cluster; <0: over the WAN
    reconfigure_s: float = 0.0  # process-group reconfiguration when a quorum's membership changes


_DEFAULT_TIMEOUTS = Timeouts()

@dataclass
class SimTimeoutsConfig:
    """Seconds; the project's defaults (phase timeouts from :class:`Timeouts`, the lighthouse's from its section)."""

    heartbeat_s: float = LighthouseConfig.heartbeat_timeout_ms / 1000  # lighthouse.heartbeat_timeout_ms
    join_s: float = LighthouseConfig.join_timeout_ms / 1000  # lighthouse.join_timeout_ms
    inner_quorum_s: float = _DEFAULT_TIMEOUTS.inner_quorum.total_seconds()
    outer_quorum_s: float = _DEFAULT_TIMEOUTS.outer_quorum.total_seconds()
    inner_reduce_s: float = _DEFAULT_TIMEOUTS.inner_reduce.total_seconds()
    outer_reduce_s: float = _DEFAULT_TIMEOUTS.outer_reduce.total_seconds()
    local_step_s: float = _DEFAULT_TIMEOUTS.local_step.total_seconds()
    watchdog_grace_s: float = _DEFAULT_TIMEOUTS.watchdog_grace.total_seconds()
    startup_s: float = _DEFAULT_TIMEOUTS.startup.total_seconds()


@dataclass
class SimulateConfig:
    topology: PlanTopologyConfig = field(default_factory=lambda: PlanTopologyConfig(clusters=64, replicas_per_cluster=16, ranks_per_replica=8, sharding="fsdp"))
    model: PlanModelConfig = field(default_factory=lambda: PlanModelConfig(flavor="8B"))
    params: int = 0  # >0: the model's parameter count (model is then ignored; needs hardware.step_time_s)
    step_jitter: float = 0.0  # relative standard deviation of a round's compute time, per cluster and round
    train: PlanTrainConfig = field(default_factory=lambda: PlanTrainConfig(batch_size=1, seq_len=8192, param_dtype="float32"))
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    sync: SimSyncConfig = field(default_factory=SimSyncConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    timeouts: SimTimeoutsConfig = field(default_factory=SimTimeoutsConfig)
    duration_s: float = 24 * 3600.0  # simulated wall time (the run ends at the first outer commit after it)
    steps: int = 0  # >0: instead, run until every replica group has done this many steps
    seed: int = 0
    runs: int = 1  # seeds seed .. seed+runs-1; figures are means over runs
    sensitivity: List[float] = field(default_factory=lambda: [0.0, 1.0, 10.0, 100.0, 1000.0])  # failure-rate factors
    plot: bool = True
    json_name: str = "simulate.json"
    plot_name: str = "simulate.png"


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


# ----------------------------------------------------------------------------- the lighthouse rule
def lighthouse_forms_at(now: float, first_joined: float, joined: int, waiting_for: Sequence[float], join_s: float, fast: bool, min_joined: int = 1) -> float:
    """When torchft's lighthouse forms a quorum (``quorum_compute``), if nobody else joins.

    ``waiting_for``: for each healthy participant that has not joined, the time its
    heartbeat stops counting (``inf`` for a live one). The lighthouse forms at once if
    every member of the previous quorum has joined (``fast``, "Fast quorum found");
    otherwise once ``joined > healthy // 2`` (no split brain) and either every healthy
    participant has joined or ``join_s`` has passed since the first joined. Returns
    ``inf`` if only a new join (or nothing) can form it.
    """
    if joined < min_joined:
        return INF
    if fast:
        return now
    deadline = first_joined + join_s
    cands = sorted({now, *[g for g in waiting_for if now < g < INF], *([deadline] if deadline > now else [])})
    for tc in cands:
        b = sum(1 for g in waiting_for if g > tc)
        if joined > (joined + b) // 2 and (b == 0 or tc >= deadline):
            return tc
    return INF


# ----------------------------------------------------------------------------- state
# Event kinds, in the heap as (time, seq, kind, a, b, token).
COMPUTE_DONE, QUORUM, SYNC_DONE, COMMIT, OUTER_DONE, BARRIER, FAIL, CLUSTER_FAIL, KILL, RESTART, WATCHDOG, ABORT, CLUSTER_START, OUTER_TIMEOUT = range(14)

# Cluster states.
S_COMPUTE, S_QUORUM, S_SYNC, S_OUTER, S_COMMIT, S_DOWN, S_DONE = "compute", "quorum", "sync", "outer", "commit", "down", "done"


class Member:
    """One replica group."""

    __slots__ = ("r", "alive", "hung", "joining", "fid", "down_at", "back_at", "acc0", "gen")

    def __init__(self, r: int) -> None:
        self.r = r
        self.alive = True
        self.hung = False
        self.joining = False  # restarted, waiting at its cluster's lighthouse
        self.fid = -1  # the failure that took it down
        self.down_at = 0.0
        self.back_at = 0.0
        self.acc0 = 0  # cluster.outer_acc when it joined (its since-outer steps = outer_acc - acc0)
        self.gen = 0  # invalidates its scheduled failure after a restart


class Cluster:
    """A cluster's replica groups, which run in lockstep, and its level state."""

    def __init__(self, idx: int, replicas: int) -> None:
        self.idx = idx
        self.members = [Member(r) for r in range(replicas)]
        self.active: Set[int] = set(range(replicas))  # the last quorum's live members (they compute)
        self.blockers: Dict[int, Tuple[float, int]] = {}  # r -> (until when the lighthouse waits for it, fid)
        self.joiners: List[int] = []
        self.state = S_COMPUTE
        self.epoch = 0
        self.round_start = 0.0
        self.round_step_s = 0.0
        self.phase_start = 0.0
        self.step = 0
        self.leader = 0
        self.inner_rounds = 0
        # outer level
        self.base = 0  # the global outer round its model derives from
        self.mgr_id = idx  # its leader's cluster Manager at the global lighthouse (-1: none)
        self.mgr_new = False  # that Manager has not been in a global quorum yet (it heals there)
        self.mgr_cause = -1  # the failure that made the leader change
        self.stale_cause = -1
        self.delay_cause = -1
        self.broken = False  # a non-leader died during the outer phase
        self.outer_weight = 0.0  # this cluster's weight in the outer round in flight
        self.outer_outcome: Optional[str] = None  # "committed" | "inner_only" for the pending commit
        # work (compute replica-seconds)
        self.pending = 0.0  # inner-committed since the last outer commit
        self.round_compute = 0.0  # the current round's, once computed
        self.round_joiners = 0
        # time categories
        self.cat = "compute"
        self.cat_since = 0.0
        # chaos-style step accounting
        self.outer_acc = 0
        self.acc0_sum = 0
        # restart of a lost cluster
        self.restart_cause = -1
        self.first_back = INF


@dataclass
class RunResult:
    """One simulation's figures (JSON-ready through :func:`dataclasses.asdict`)."""

    seed: int
    end_s: float
    capacity: float  # replica-group-seconds
    goodput: float
    expected_no_failure_goodput: float
    committed: float
    compute: float
    lost: Dict[str, float]
    uncommitted_at_end: float
    sync: float
    wait: float
    down: float
    balance_error: float
    failures: List[Dict[str, Any]]
    by_role: Dict[str, Dict[str, float]]
    unattributed_stall: float
    slow_link_bytes: float
    steps_run: int
    steps_discarded: int
    efficiency: Optional[float]
    outer_rounds: int
    failed_outer_rounds: int
    inner_rounds: int
    final_step: int
    truncated: bool = False  # stopped by the safety net (the configuration cannot finish)


class Simulation:
    """One run. ``run()`` returns a :class:`RunResult`."""

    def __init__(self, p: SimParams, seed: int) -> None:
        self.p = p
        self.seed = seed
        self.rng = random.Random(seed)
        self.jitter_rng = random.Random(seed * 1_000_003 + 7)  # its own stream: jitter does not change the failure draws
        self.heap: List[Tuple[float, int, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.hier = p.mode == "hier"
        self.clusters = [Cluster(c, p.replicas) for c in range(p.clusters)]
        # global barrier (hier)
        self.arrived: Dict[int, float] = {}
        self.prev_quorum: Set[int] = set(range(p.clusters))  # cluster Manager ids of the last outer quorum
        self.next_mgr_id = p.clusters
        self.lingering: Dict[int, Tuple[float, int]] = {}  # dead or replaced Manager id -> (heartbeat stops counting, fid)
        self.round_no = 0
        self.global_step = 0
        self.in_flight: Optional[Dict[str, Any]] = None
        self.barrier_gen = 0
        self.first_arrival = INF
        self.outstanding: Set[int] = set()  # clusters whose commit closes the last global round
        self.stop_pending = False
        self.end: Optional[float] = None
        # accounting
        self.totals: Dict[str, float] = defaultdict(float)
        self.lost: Dict[str, float] = defaultdict(float)
        self.committed = 0.0
        self.ledger: Dict[int, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.failures: List[Dict[str, Any]] = []
        self.unattributed_stall = 0.0
        self.slow_bytes = 0.0
        self.steps_run = 0
        self.steps_discarded = 0
        self.outer_rounds = 0
        self.failed_outer = 0
        self.kills_stopped = False
        self.truncated = False
        self.step_kills: Dict[int, List[Tuple[int, int]]] = defaultdict(list)  # cluster -> [(step, replica)]

    # ------------------------------------------------------------------ events
    def push(self, t: float, kind: int, a: int = 0, b: int = 0, token: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b, token))

    def run(self) -> RunResult:
        p = self.p
        for c in self.clusters:
            self.start_round(c, 0.0)
        self.schedule_failures()
        handlers: Dict[int, Callable[[float, int, int, int], None]] = {
            COMPUTE_DONE: self.on_compute_done, QUORUM: self.on_quorum, SYNC_DONE: self.on_sync_done,
            COMMIT: self.on_commit, OUTER_DONE: self.on_outer_done, BARRIER: self.on_barrier,
            FAIL: self.on_fail, CLUSTER_FAIL: self.on_cluster_fail, KILL: self.on_kill,
            RESTART: self.on_restart, WATCHDOG: self.on_watchdog, ABORT: self.on_abort,
            CLUSTER_START: self.on_cluster_start, OUTER_TIMEOUT: self.on_outer_timeout,
        }
        # A safety net for runs that cannot finish: the outer level stopped committing (see
        # docs/planner.md, "out of step"), or kills come faster than a restarted cluster
        # reaches its first outer round. Stop and flag the result as truncated.
        nominal = p.duration_s if p.steps == 0 else p.steps * (p.step_s + p.no_failure_sync_per_step())
        limit = 3 * nominal + 3600.0
        while self.heap and self.end is None:
            t, _, kind, a, b, token = heapq.heappop(self.heap)
            self.now = t
            if t > limit:
                self.end = t
                self.truncated = True
                break
            handlers[kind](t, a, b, token)
        if self.end is None:
            self.end = self.now
        return self.finish()

    def failures_active(self, t: float) -> bool:
        """No failures after ``stop_kills_at`` of the run (steps: of the slowest live cluster's steps)."""
        p = self.p
        if p.steps > 0:
            if self.kills_stopped:
                return False
            live = [c.step for c in self.clusters if c.state not in (S_DOWN, S_DONE)]
            return not live or min(live) < int(p.steps * p.stop_kills_at)
        return t < p.stop_kills_at * p.duration_s

    def schedule_failures(self) -> None:
        p = self.p
        if p.failure_model == "independent":
            if p.mtbf_s > 0:
                for c in self.clusters:
                    for m in c.members:
                        self.push(self.rng.expovariate(1.0 / p.mtbf_s), FAIL, c.idx, m.r, m.gen)
            if p.cluster_mtbf_s > 0:
                for c in self.clusters:
                    self.push(self.rng.expovariate(1.0 / p.cluster_mtbf_s), CLUSTER_FAIL, c.idx, 0, 0)
        elif p.failure_model == "chaos":
            self.push(self.rng.expovariate(1.0 / p.kill_every_s), KILL, 0, 0, 0)
        for t, c, r, step in p.kills:
            if step >= 0:
                self.step_kills[c].append((step, r))
                continue
            if r < 0:
                self.push(t, CLUSTER_FAIL, c, 0, -1)  # token -1: explicit, not rescheduled
            else:
                self.push(t, FAIL, c, r, -1)

    # ------------------------------------------------------------------ time categories
    def book(self, c: Cluster, t: float) -> None:
        """Books the active members' time since the last booking in the current category."""
        dt = t - c.cat_since
        if dt > 0 and c.active:
            self.totals[c.cat] += dt * len(c.active)
        c.cat_since = max(c.cat_since, t)

    def enter(self, c: Cluster, t: float, cat: str) -> None:
        self.book(c, t)
        c.cat = cat

    # ------------------------------------------------------------------ the round
    def start_round(self, c: Cluster, t: float) -> None:
        p = self.p
        if p.steps and c.step >= p.steps:
            self.cluster_done(c, t)
            return
        c.epoch += 1
        c.state = S_COMPUTE
        c.round_start = t
        c.round_compute = 0.0
        c.round_joiners = 0
        c.broken = False
        c.outer_outcome = None
        self.enter(c, t, "compute")
        c.round_step_s = p.step_s
        if p.step_jitter > 0:
            c.round_step_s = p.step_s * max(0.05, 1.0 + self.jitter_rng.gauss(0.0, p.step_jitter))
        self.push(t + p.h_inner * c.round_step_s, COMPUTE_DONE, c.idx, 0, c.epoch)
        kills = self.step_kills.get(c.idx)
        if kills:
            for k, r in [x for x in kills if c.step <= x[0] < c.step + p.h_inner]:
                kills.remove((k, r))
                at = t + (k - c.step + 0.5) * c.round_step_s  # half-way through local step k+1
                self.push(at, CLUSTER_FAIL if r < 0 else FAIL, c.idx, max(r, 0), -1)

    def on_compute_done(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_COMPUTE:
            return
        p = self.p
        n = len(c.active)
        c.step += p.h_inner
        c.round_compute = n * (t - c.round_start)
        self.steps_run += n * p.h_inner
        c.state = S_QUORUM
        c.phase_start = t
        self.enter(c, t, "wait")
        self.schedule_quorum(c, t)

    def quorum_time(self, c: Cluster, now: float) -> Tuple[float, int]:
        """When the cluster lighthouse forms the quorum the members requested at
        ``c.phase_start`` (the last quorum's live members, plus waiting joiners), and which
        failure decides it (-1: none). Blockers: the last quorum's dead or hung members."""
        joiners = [c.members[r] for r in c.joiners if c.members[r].alive and not c.members[r].hung]
        first = min([c.phase_start] + [m.back_at for m in joiners])
        waiting = [g for g, _ in c.blockers.values()]
        tq = lighthouse_forms_at(max(now, c.phase_start), first, len(c.active) + len(joiners), waiting,
                                 self.p.join_s, fast=not c.blockers, min_joined=self.p.min_replicas)
        cause = -1
        if c.blockers and tq > c.phase_start:
            # the blocker whose expiry formed it, else (join timeout) the latest one
            expired = [(g, fid) for g, fid in c.blockers.values() if g <= tq]
            cause = max(expired)[1] if expired else max(c.blockers.values())[1]
        return tq, cause

    def schedule_quorum(self, c: Cluster, t: float) -> None:
        c.epoch += 1
        tq, _ = self.quorum_time(c, t)
        self.push(max(t, min(tq, c.phase_start + self.p.inner_quorum_s)), QUORUM, c.idx, 0, c.epoch)

    def on_quorum(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_QUORUM:
            return
        p = self.p
        tq, cause = self.quorum_time(c, t)
        deadline = c.phase_start + p.inner_quorum_s
        if tq > deadline + 1e-12 and t >= deadline - 1e-12:
            # INNER_QUORUM timed out: the round fails (rollback), the next one starts
            self.book(c, t)
            if cause >= 0:
                self.ledger[cause]["stall"] += (t - c.phase_start) * len(c.active)
            self.abort(c, t, cause)
            return
        if tq > t + 1e-12:  # not yet (a blocker was added meanwhile)
            self.push(min(tq, deadline), QUORUM, c.idx, 0, c.epoch)
            return
        joiners = [r for r in c.joiners if c.members[r].alive and not c.members[r].hung]
        self.book(c, t)
        stall = t - c.phase_start
        if stall > 1e-12 and cause >= 0:
            self.ledger[cause]["stall"] += stall * len(c.active)
            c.delay_cause = cause
        changed = bool(c.blockers) or bool(joiners)
        c.blockers.clear()
        for r in joiners:
            m = c.members[r]
            m.joining = False
            self.totals["wait"] += t - m.back_at
            self.ledger[m.fid]["down"] += t - m.down_at
            m.acc0 = c.outer_acc + p.h_inner  # it computed nothing this round (weight 0)
            c.acc0_sum += m.acc0
            c.active.add(r)
        c.joiners = [r for r in c.joiners if r not in joiners and c.members[r].alive]
        c.round_joiners = len(joiners)
        if self.hier:
            leader = min(c.active)
            if leader != c.leader or c.mgr_id < 0:
                # A new leader starts a cluster Manager. A demoted one shuts its own down;
                # the global lighthouse counts it for one more heartbeat timeout.
                old = c.members[c.leader]
                why = old.fid if (not old.alive or old.hung) else c.members[leader].fid
                self.drop_manager(c, t + p.heartbeat_s, why)
                self.new_manager(c, why)
                c.leader = leader
        c.state = S_SYNC
        c.phase_start = t
        self.enter(c, t, "sync")
        heal = p.heal_s if joiners else 0.0
        reconf = p.reconfigure_s if changed else 0.0
        if heal + reconf > 0:
            fid = c.members[joiners[0]].fid if joiners else cause
            if fid >= 0:
                self.ledger[fid]["stall"] += (heal + reconf) * len(c.active)
                c.delay_cause = fid
            else:
                self.unattributed_stall += (heal + reconf) * len(c.active)
        if not self.hier and p.wide_clusters > 1:
            # the ring over every replica group crosses each cluster boundary once
            self.slow_bytes += p.ranks * (p.wide_clusters * costs.ring_factor(len(c.active)) * p.sync_bytes + len(joiners) * p.heal_bytes)
        self.push(t + heal + reconf + p.inner_time(len(c.active)), SYNC_DONE, c.idx, 0, c.epoch)

    def is_outer_round(self, c: Cluster) -> bool:
        return self.hier and c.step % self.p.period == 0

    def on_sync_done(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_SYNC:
            return
        if self.is_outer_round(c):
            c.state = S_OUTER
            c.phase_start = t
            self.enter(c, t, "wait")
            self.arrive(c, t)
        else:
            self.commit(c, t)

    def commit(self, c: Cluster, t: float) -> None:
        """INNER_COMMIT: adopt the round (and the outer outcome, if any); next round."""
        p = self.p
        n = len(c.active)
        outcome = c.outer_outcome
        if c.broken:
            # The cluster's inner round failed; an outer commit holding its work stands.
            self.steps_discarded += (n - c.round_joiners) * p.h_inner
            if outcome == "committed" and c.outer_weight > 0:
                self.committed += c.pending + c.round_compute
            elif outcome == "committed":
                self.lose("discarded", c.pending + c.round_compute, c.stale_cause)
            else:
                self.lose("rollback", c.round_compute, c.delay_cause)
            if outcome == "committed":
                c.pending = 0.0
                self.adopt(c)
        else:
            c.pending += c.round_compute
            c.outer_acc += p.h_inner
            c.inner_rounds += 1
            if not self.hier:
                self.committed += c.pending
                c.pending = 0.0
            elif outcome == "committed":
                if c.outer_weight > 0:
                    self.committed += c.pending
                else:
                    self.lose("discarded", c.pending, c.stale_cause)
                    self.steps_discarded += n * c.outer_acc - c.acc0_sum
                c.pending = 0.0
                self.adopt(c)
        c.round_compute = 0.0
        if c.idx in self.outstanding:
            self.outstanding.discard(c.idx)
        if not self.hier and self.stop_pending_check(t):
            return
        self.start_round(c, t)
        if self.hier and self.stop_pending and not self.outstanding:
            self.end = t

    def adopt(self, c: Cluster) -> None:
        """The cluster now holds the current global model and step."""
        c.base = self.round_no
        c.step = max(c.step, self.global_step)
        c.outer_acc = 0
        c.acc0_sum = 0
        for r in c.active:
            c.members[r].acc0 = 0
        c.stale_cause = -1

    def stop_pending_check(self, t: float) -> bool:
        """flat/ddp: end at the first commit after the horizon."""
        if self.p.steps == 0 and t >= self.p.duration_s:
            self.end = t
            return True
        return False

    def lose(self, reason: str, amount: float, cause: int) -> None:
        if amount <= 0:
            return
        self.lost[reason] += amount
        if cause >= 0:
            self.ledger[cause][reason] += amount

    # ------------------------------------------------------------------ global barrier (hier)
    def arrive(self, c: Cluster, t: float) -> None:
        self.arrived[c.idx] = t
        self.first_arrival = min(self.first_arrival, t)
        self.push(t + self.p.outer_quorum_s, OUTER_TIMEOUT, c.idx, 0, c.epoch)
        self.evaluate_barrier(t)

    def on_outer_timeout(self, t: float, ci: int, _b: int, epoch: int) -> None:
        """OUTER_QUORUM timed out: the leader gives up this outer round (INNER_ONLY); the
        cluster commits its inner round and goes on. It is stale if the others committed one."""
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_OUTER or ci not in self.arrived:
            return
        del self.arrived[ci]
        if not self.arrived:
            self.first_arrival = INF
        c.outer_outcome = "inner_only"
        c.state = S_COMMIT
        self.push(t + self.p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)
        self.evaluate_barrier(t)

    def new_manager(self, c: Cluster, cause: int) -> None:
        c.mgr_id = self.next_mgr_id
        self.next_mgr_id += 1
        c.mgr_new = True
        c.mgr_cause = cause

    def drop_manager(self, c: Cluster, gone_at: float, cause: int) -> None:
        """The cluster's Manager stops (dies, or is shut down): it counts until ``gone_at``."""
        if c.mgr_id >= 0:
            self.lingering[c.mgr_id] = (gone_at, cause)
            c.mgr_id = -1

    def evaluate_barrier(self, t: float) -> None:
        """The global lighthouse: form the outer quorum of the arrived leaders now, or
        schedule the next look (a heartbeat running out, the join timeout)."""
        if self.in_flight is not None or not self.arrived:
            return
        p = self.p
        for k in [k for k, (g, _) in self.lingering.items() if g <= t]:
            del self.lingering[k]
        joined = {self.clusters[ci].mgr_id for ci in self.arrived}
        waiting = [INF for c in self.clusters if c.mgr_id >= 0 and c.idx not in self.arrived]
        waiting += [g for g, _ in self.lingering.values()]
        at = lighthouse_forms_at(t, self.first_arrival, len(joined), waiting, p.join_s,
                                 fast=self.prev_quorum <= joined, min_joined=p.min_clusters)
        if at <= t:
            self.form_outer(t)
        elif at < INF:
            self.barrier_gen += 1
            self.push(at, BARRIER, 0, 0, self.barrier_gen)

    def on_barrier(self, t: float, _a: int, _b: int, gen: int) -> None:
        if gen == self.barrier_gen:
            self.evaluate_barrier(t)

    def form_outer(self, t: float) -> None:
        p = self.p
        parts = sorted(self.arrived)
        # who made the early arrivals wait: the last to arrive, or a Manager whose heartbeat ran out
        last = max(parts, key=lambda ci: self.arrived[ci])
        cause = self.clusters[last].delay_cause
        if self.arrived[last] < t - 1e-12:
            gone = [(g, fid) for g, fid in self.lingering.values() if g <= t + 1e-12]
            cause = max(gone)[1] if gone else -1
        for ci in parts:
            c = self.clusters[ci]
            wait = t - self.arrived[ci]
            if wait > 1e-12:
                # a cluster out of step because it restarted waits for the others' schedule: its own failure's cost
                k = c.stale_cause if (c.base != self.round_no and c.stale_cause >= 0) else cause
                if k >= 0:
                    self.ledger[k]["stall"] += wait * len(c.active)
                else:
                    self.unattributed_stall += wait * len(c.active)
        heal_needed = [ci for ci in parts if self.clusters[ci].mgr_new or self.clusters[ci].base != self.round_no]
        for ci in parts:
            c = self.clusters[ci]
            c.outer_weight = 1.0 if c.base == self.round_no else 0.0
            if c.outer_weight == 0 and c.stale_cause < 0:
                c.stale_cause = c.delay_cause
            self.enter(c, t, "sync")
            c.phase_start = t
            c.delay_cause = -1  # accounted for up to this barrier
        ids = {self.clusters[ci].mgr_id for ci in parts}
        changed = ids != self.prev_quorum
        for ci in parts:
            self.clusters[ci].mgr_new = False
        heal = p.outer_heal_s if heal_needed else 0.0
        reconf = p.reconfigure_s if changed else 0.0
        if heal + reconf > 0:
            hc = self.clusters[heal_needed[0]] if heal_needed else None
            fid = (hc.stale_cause if hc.stale_cause >= 0 else hc.mgr_cause) if hc else -1
            members = sum(len(self.clusters[ci].active) for ci in parts)
            if fid >= 0:
                self.ledger[fid]["stall"] += (heal + reconf) * members
            else:
                self.unattributed_stall += (heal + reconf) * members
        self.slow_bytes += p.ranks * (len(heal_needed) * p.outer_heal_bytes + len(parts) * costs.ring_factor(len(parts)) * p.sync_bytes)
        self.prev_quorum = ids
        self.arrived.clear()
        self.first_arrival = INF
        self.barrier_gen += 1
        self.in_flight = {"parts": parts, "ids": ids, "start": t, "gen": self.barrier_gen}
        self.push(t + heal + reconf + p.outer_time(len(parts)), OUTER_DONE, 0, 0, self.barrier_gen)

    def on_outer_done(self, t: float, _a: int, _b: int, gen: int) -> None:
        fl = self.in_flight
        if fl is None or fl["gen"] != gen or fl.get("hung"):
            return
        self.in_flight = None
        parts = [ci for ci in fl["parts"] if self.clusters[ci].state == S_OUTER]
        weight = sum(self.clusters[ci].outer_weight for ci in parts)
        self.global_step = max([self.clusters[ci].step for ci in parts if self.clusters[ci].outer_weight > 0] + [self.global_step])
        if weight > 0:
            self.round_no += 1
        self.outer_rounds += 1
        horizon = self.p.steps == 0 and t >= self.p.duration_s
        for ci in parts:
            c = self.clusters[ci]
            c.outer_outcome = "committed"
            c.state = S_COMMIT
            self.outstanding.add(ci)
            self.push(t + self.p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)
        if horizon:
            self.stop_pending = True
        self.evaluate_barrier(t)

    def fail_outer(self, t: float, dead: int, fid: int) -> None:
        """The outer round in flight failed (a participant's leader is gone): the others'
        inner rounds commit (INNER_ONLY); their work waits for the next outer round."""
        fl = self.in_flight
        assert fl is not None
        self.in_flight = None
        self.failed_outer += 1
        self.prev_quorum = set(fl["ids"])
        for ci in fl["parts"]:
            c = self.clusters[ci]
            if ci == dead or c.state != S_OUTER:
                continue
            self.ledger[fid]["stall"] += (t - fl["start"]) * len(c.active)
            c.outer_outcome = "inner_only"
            c.state = S_COMMIT
            c.delay_cause = fid
            self.push(t + self.p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)
        self.evaluate_barrier(t)

    def on_commit(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_COMMIT:
            return
        self.commit(c, t)

    # ------------------------------------------------------------------ failures
    def new_failure(self, t: float, role: str, c: int, r: int, kind: str) -> int:
        fid = len(self.failures)
        self.failures.append({"id": fid, "t": t, "role": role, "cluster": c, "replica": r, "kind": kind})
        return fid

    def role_of(self, c: Cluster, r: int) -> str:
        return "leader" if self.hier and r == c.leader and r in c.active else "non_leader"

    def on_fail(self, t: float, ci: int, r: int, token: int) -> None:
        c = self.clusters[ci]
        m = c.members[r]
        p = self.p
        if token >= 0 and (token != m.gen or p.failure_model != "independent"):
            return
        if token >= 0 and not self.failures_active(t):
            return
        if not m.alive or m.hung or c.state in (S_DONE,):
            return
        hang = p.hang_fraction > 0 and self.rng.random() < p.hang_fraction
        fid = self.new_failure(t, self.role_of(c, r), ci, r, "hang" if hang else "crash")
        self.fail_member(c, r, t, fid, hang)

    def on_cluster_fail(self, t: float, ci: int, _b: int, token: int) -> None:
        c = self.clusters[ci]
        p = self.p
        if token >= 0:
            if p.cluster_mtbf_s > 0:
                self.push(t + self.rng.expovariate(1.0 / p.cluster_mtbf_s), CLUSTER_FAIL, ci, 0, 0)
            if not self.failures_active(t):
                return
        live = [r for r in range(p.replicas) if c.members[r].alive]
        if c.state in (S_DOWN, S_DONE) or not live:
            return
        fid = self.new_failure(t, "cluster", ci, -1, "crash")
        for r in live:
            self.fail_member(c, r, t, fid, hang=False)

    def on_kill(self, t: float, _a: int, _b: int, _t: int) -> None:
        """The chaos command's schedule (chaos.py ChaosMonkey)."""
        p = self.p
        if not self.failures_active(t):
            return
        running = [(c, m) for c in self.clusters for m in c.members if m.alive and not m.hung and c.state not in (S_DOWN, S_DONE)]
        if p.steps and running and min(c.step for c, _ in running) >= int(p.steps * p.stop_kills_at):
            self.kills_stopped = True
            return
        roles = list(p.roles)
        self.rng.shuffle(roles)
        for role in roles:
            cands = self.chaos_candidates(role, running)
            if cands:
                break
        else:
            self.push(t + 1.0, KILL)  # nothing eligible right now (restarting)
            return
        ci, r = self.rng.choice(cands)
        c = self.clusters[ci]
        if role == "cluster":
            fid = self.new_failure(t, "cluster", ci, -1, "crash")
            for rr in range(p.replicas):
                if c.members[rr].alive:
                    self.fail_member(c, rr, t, fid, hang=False)
        else:
            hang = p.hang_fraction > 0 and self.rng.random() < p.hang_fraction
            fid = self.new_failure(t, role, ci, r, "hang" if hang else "crash")
            self.fail_member(c, r, t, fid, hang)
        self.push(t + self.rng.expovariate(1.0 / p.kill_every_s), KILL)

    def chaos_candidates(self, role: str, running: List[Tuple[Cluster, Member]]) -> List[Tuple[int, int]]:
        if role == "leader":
            return [(c.idx, m.r) for c, m in running if self.hier and m.r == c.leader and m.r in c.active]
        if role == "non_leader":
            return [(c.idx, m.r) for c, m in running if not (self.hier and m.r == c.leader and m.r in c.active)]
        whole = [c.idx for c in self.clusters if c.state not in (S_DOWN, S_DONE) and all(m.alive and not m.hung for m in c.members)]
        return [(ci, -1) for ci in whole] if self.hier and len(whole) >= 2 else []

    def fail_member(self, c: Cluster, r: int, t: float, fid: int, hang: bool) -> None:
        """Replica group r of cluster c crashes (or hangs) at t."""
        p = self.p
        m = c.members[r]
        self.book(c, t)
        m.gen += 1
        was_active = r in c.active
        if m.joining or not was_active:
            # Waiting to rejoin, or hung (a cluster outage takes it too): nothing of the cluster's is lost.
            if m.hung:
                self.totals["down"] += t - m.down_at
                self.ledger[m.fid]["down"] += t - m.down_at
                m.hung = False
            if m.joining:
                self.totals["wait"] += t - m.back_at
                self.ledger[m.fid]["down"] += t - m.down_at
                m.joining = False
                if r in c.joiners:
                    c.joiners.remove(r)
            self.take_down(c, m, t, fid, hang=False)
            return
        # its own steps since the last inner commit
        if c.state == S_COMPUTE:
            k = int((t - c.round_start) / c.round_step_s + 1e-9)
            partial = t - c.round_start
            self.steps_run += k
            self.steps_discarded += k
            self.lose("own_work", partial, fid)
        else:
            # it finished computing the round; that round is not committed yet
            share = c.round_compute / len(c.active) if c.active else 0.0
            if not (c.state == S_COMMIT and c.outer_outcome == "committed"):
                self.steps_discarded += p.h_inner
                c.round_compute -= share
                self.lose("own_work", share, fid)
        c.active.discard(r)
        c.acc0_sum -= m.acc0
        leader = self.hier and r == c.leader
        if leader:  # its cluster Manager goes with it (a hung one heartbeats until the watchdog)
            self.drop_manager(c, t + (p.hang_watchdog_s if hang else 0.0) + p.heartbeat_s, fid)
        gone_at = t + p.hang_watchdog_s + p.heartbeat_s if hang else t + p.heartbeat_s
        c.blockers[r] = (gone_at, fid)
        self.take_down(c, m, t, fid, hang)
        if not c.active:
            self.cluster_lost(c, t, fid)
            return
        self.disrupt(c, t, fid, hang, leader)

    def take_down(self, c: Cluster, m: Member, t: float, fid: int, hang: bool) -> None:
        m.fid = fid
        m.down_at = t
        if hang:
            m.hung = True
            self.push(t + self.p.hang_watchdog_s, WATCHDOG, c.idx, m.r, m.gen)
        else:
            m.alive = False
            self.push(t + self.p.restart_s, RESTART, c.idx, m.r, m.gen)

    def disrupt(self, c: Cluster, t: float, fid: int, hang: bool, leader: bool) -> None:
        """What a member's failure does to its surviving peers, by the cluster's phase."""
        p = self.p
        if c.state == S_QUORUM:
            self.schedule_quorum(c, t)  # waits for the lighthouse to drop it
        elif c.state == S_SYNC:
            if hang:  # the collective waits for it until the phase timeout
                c.epoch += 1
                self.push(max(t, c.phase_start + p.inner_reduce_s), ABORT, c.idx, fid, c.epoch)
            else:  # its connections close: the others fail at once
                self.abort(c, t, fid)
        elif c.state == S_OUTER:
            fl = self.in_flight
            if leader:
                if fl is not None and c.idx in fl["parts"]:
                    if hang:
                        fl["hung"] = True  # the outer all-reduce cannot complete
                        self.push(max(t, fl["start"] + p.outer_reduce_s), ABORT, c.idx, fid, c.epoch)
                    else:
                        self.fail_outer(t, c.idx, fid)
                        self.abort(c, t, fid)
                else:
                    self.arrived.pop(c.idx, None)
                    if not self.arrived:
                        self.first_arrival = INF
                    self.abort(c, t, fid)
                    self.evaluate_barrier(t)
            else:
                c.broken = True
                c.delay_cause = fid

    def on_abort(self, t: float, ci: int, fid: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch:
            return
        if c.state == S_OUTER and self.in_flight is not None and ci in self.in_flight["parts"]:
            self.fail_outer(t, ci, fid)
        if c.state in (S_SYNC, S_OUTER):
            self.abort(c, t, fid)

    def abort(self, c: Cluster, t: float, fid: int) -> None:
        """The round failed for the cluster: roll back to the last commit, next round."""
        self.book(c, t)
        self.steps_discarded += (len(c.active) - c.round_joiners) * self.p.h_inner
        self.lose("rollback", c.round_compute, fid)
        c.round_compute = 0.0
        c.delay_cause = fid
        self.outstanding.discard(c.idx)
        self.start_round(c, t)
        if self.stop_pending and not self.outstanding:
            self.end = t

    def cluster_lost(self, c: Cluster, t: float, fid: int) -> None:
        """Every replica group of the cluster is down: its uncommitted work is gone."""
        self.lose("discarded", c.pending + c.round_compute, fid)
        c.pending = 0.0
        c.round_compute = 0.0
        c.epoch += 1
        c.blockers.clear()
        if self.hier:
            self.drop_manager(c, t + self.p.heartbeat_s, fid)
            if self.in_flight is not None and c.idx in self.in_flight["parts"] and c.state == S_OUTER:
                self.fail_outer(t, c.idx, fid)
            elif c.idx in self.arrived:
                del self.arrived[c.idx]
                if not self.arrived:
                    self.first_arrival = INF
            self.outstanding.discard(c.idx)
        c.state = S_DOWN
        c.restart_cause = fid
        c.first_back = INF
        back = [c.members[r].back_at for r in c.joiners if c.members[r].alive]
        if back:  # restarted replica groups already waiting start the cluster afresh
            c.first_back = min(back)
            self.push(max(t, c.first_back + self.p.startup_s), CLUSTER_START, c.idx, 0, c.epoch)
        if self.hier:
            self.evaluate_barrier(t)
        if self.stop_pending and not self.outstanding:
            self.end = t

    def on_watchdog(self, t: float, ci: int, r: int, gen: int) -> None:
        c = self.clusters[ci]
        m = c.members[r]
        if gen != m.gen or not m.hung:
            return
        m.hung = False
        m.alive = False
        self.push(t + self.p.restart_s, RESTART, ci, r, m.gen)

    def on_restart(self, t: float, ci: int, r: int, gen: int) -> None:
        c = self.clusters[ci]
        m = c.members[r]
        p = self.p
        if gen != m.gen or m.alive:
            return
        m.alive = True
        m.back_at = t
        m.gen += 1
        self.totals["down"] += t - m.down_at
        if p.failure_model == "independent" and p.mtbf_s > 0:
            self.push(t + self.rng.expovariate(1.0 / p.mtbf_s), FAIL, ci, r, m.gen)
        if c.state == S_DONE:
            self.book(c, t)
            c.active.add(r)  # idles (booked as wait) until the run ends
            return
        if c.state == S_DOWN:
            # Start-up barrier: the cluster starts when all are back, or startup_s after the first.
            m.joining = True
            c.joiners.append(r)
            if c.first_back == INF:
                c.first_back = t
                self.push(t + p.startup_s, CLUSTER_START, ci, 0, c.epoch)
            if all(mm.alive for mm in c.members):
                self.push(t, CLUSTER_START, ci, 0, c.epoch)
            return
        m.joining = True
        c.joiners.append(r)
        if c.state == S_QUORUM:
            self.schedule_quorum(c, t)

    def on_cluster_start(self, t: float, ci: int, _b: int, epoch: int) -> None:
        """A lost cluster restarts from scratch: step 0, initial weights, a new cluster Manager.
    (flat/ddp, where the one "cluster" is the whole job: from its last commit.)"""
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_DOWN:
            return
        back = [r for r in c.joiners if c.members[r].alive]
        if not back:  # they failed again meanwhile: the next one back starts the clock again
            c.first_back = INF
            return
        for r in back:
            m = c.members[r]
            m.joining = False
            self.totals["wait"] += t - m.back_at
            self.ledger[m.fid]["down"] += t - m.down_at
            m.acc0 = 0
        c.joiners = [r for r in c.joiners if r not in back]
        c.active = set(back)
        c.cat_since = t
        if self.hier:
            c.step = 0  # flat/ddp: a total loss resumes from the last commit (as from a checkpoint)
        c.pending = 0.0
        c.outer_acc = 0
        c.acc0_sum = 0
        c.base = -1  # derives from the initial weights: weight 0 at its first outer round
        c.stale_cause = c.restart_cause
        c.leader = min(back)
        self.new_manager(c, c.restart_cause)
        c.delay_cause = c.restart_cause
        self.start_round(c, t)

    def cluster_done(self, c: Cluster, t: float) -> None:
        self.book(c, t)
        c.state = S_DONE
        c.epoch += 1
        c.cat = "wait"  # finished replica groups idle until the run ends
        if all(cc.state == S_DONE for cc in self.clusters):
            self.end = t
        elif self.hier:
            if c.mgr_id >= 0:  # a clean exit: its Manager leaves at once
                self.prev_quorum.discard(c.mgr_id)
                c.mgr_id = -1
            self.evaluate_barrier(t)

    # ------------------------------------------------------------------ results
    def finish(self) -> RunResult:
        p = self.p
        end = self.end if self.end is not None else self.now
        uncommitted = 0.0
        for c in self.clusters:
            if c.state != S_DOWN:
                self.book(c, end)
                if c.state == S_COMPUTE:
                    # the round in progress: computed so far, not committed
                    uncommitted += len(c.active) * max(0.0, end - c.round_start)
                else:
                    uncommitted += c.round_compute
                uncommitted += c.pending
            for m in c.members:
                if not m.alive:
                    self.totals["down"] += end - m.down_at
                    self.ledger[m.fid]["down"] += end - m.down_at
                elif m.hung:
                    self.totals["down"] += end - m.down_at
                    self.ledger[m.fid]["down"] += end - m.down_at
                elif m.joining:
                    self.totals["wait"] += end - m.back_at
                    self.ledger[m.fid]["down"] += end - m.down_at
        capacity = p.clusters * p.replicas * end
        compute = self.totals["compute"]
        balance = capacity - (compute + self.totals["sync"] + self.totals["wait"] + self.totals["down"])
        balance_compute = compute - (self.committed + sum(self.lost.values()) + uncommitted)
        by_role: Dict[str, Dict[str, float]] = {}
        for f in self.failures:
            lg = self.ledger.get(f["id"], {})
            f["lost_replica_s"] = {k: v for k, v in lg.items()}
            f["lost_replica_s_total"] = sum(lg.values())
            agg = by_role.setdefault(f["role"], defaultdict(float))
            agg["count"] += 1
            for k, v in lg.items():
                agg[k] += v
            agg["total"] += sum(lg.values())
        for role, agg in by_role.items():
            n = agg["count"]
            by_role[role] = {"count": n, **{k: v / n for k, v in agg.items() if k != "count"}}
        sync = p.no_failure_sync_per_step()
        slow = self.slow_bytes
        return RunResult(
            seed=self.seed, end_s=end, capacity=capacity,
            goodput=self.committed / capacity if capacity else 0.0,
            expected_no_failure_goodput=1.0 - comm_fraction(p.step_s, sync),
            committed=self.committed, compute=compute, lost=dict(self.lost), uncommitted_at_end=uncommitted,
            sync=self.totals["sync"], wait=self.totals["wait"], down=self.totals["down"],
            balance_error=max(abs(balance), abs(balance_compute)) / capacity if capacity else 0.0,
            failures=self.failures, by_role=by_role, unattributed_stall=self.unattributed_stall,
            slow_link_bytes=slow, steps_run=self.steps_run, steps_discarded=self.steps_discarded,
            efficiency=(self.steps_run - self.steps_discarded) / self.steps_run if self.steps_run else None,
            outer_rounds=self.outer_rounds, failed_outer_rounds=self.failed_outer,
            inner_rounds=sum(c.inner_rounds for c in self.clusters), final_step=max(c.step for c in self.clusters),
            truncated=self.truncated,
        )


def simulate_once(p: SimParams, seed: int) -> RunResult:
    """One simulation of ``p`` with ``seed`` (reproducible)."""
    return Simulation(p, seed).run()


# ----------------------------------------------------------------------------- runs and report
def summarize_runs(results: Sequence[RunResult]) -> Dict[str, Any]:
    """Means (and min/max) over runs of the headline figures."""

    def stats(xs: Sequence[float]) -> Dict[str, float]:
        return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "stdev": statistics.pstdev(xs) if len(xs) > 1 else 0.0}

    cap = [r.capacity for r in results]
    out: Dict[str, Any] = {
        "runs": len(results),
        "goodput": stats([r.goodput for r in results]),
        "expected_no_failure_goodput": results[0].expected_no_failure_goodput,
        "failures": stats([len(r.failures) for r in results]),
        "end_s": stats([r.end_s for r in results]),
        "shares": {
            "committed": statistics.fmean(r.committed / c for r, c in zip(results, cap)),
            "lost_compute": statistics.fmean(sum(r.lost.values()) / c for r, c in zip(results, cap)),
            "uncommitted_at_end": statistics.fmean(r.uncommitted_at_end / c for r, c in zip(results, cap)),
            "sync": statistics.fmean(r.sync / c for r, c in zip(results, cap)),
            "wait": statistics.fmean(r.wait / c for r, c in zip(results, cap)),
            "down": statistics.fmean(r.down / c for r, c in zip(results, cap)),
        },
        "lost_by_reason": {k: statistics.fmean(r.lost.get(k, 0.0) / c for r, c in zip(results, cap)) for k in ("own_work", "rollback", "discarded")},
        "slow_link_bytes_per_hour": statistics.fmean(r.slow_link_bytes / r.end_s * 3600 for r in results if r.end_s > 0),
        "slow_link_bytes": statistics.fmean(r.slow_link_bytes for r in results),
        "balance_error": max(r.balance_error for r in results),
        "outer_rounds": statistics.fmean(r.outer_rounds for r in results),
        "truncated": sum(1 for r in results if r.truncated),
        "failed_outer_rounds": statistics.fmean(r.failed_outer_rounds for r in results),
    }
    effs = [r.efficiency for r in results if r.efficiency is not None]
    if effs:
        out["efficiency"] = stats(effs)
        out["steps_run"] = statistics.fmean(r.steps_run for r in results)
        out["steps_discarded"] = statistics.fmean(r.steps_discarded for r in results)
    roles: Dict[str, Dict[str, float]] = {}
    for role in ROLES:
        agg: Dict[str, float] = defaultdict(float)
        for r in results:
            for f in r.failures:
                if f["role"] != role:
                    continue
                agg["count"] += 1
                for k, v in f["lost_replica_s"].items():
                    agg[k] += v
                agg["total"] += f["lost_replica_s_total"]
        if agg["count"]:
            n = agg["count"]
            roles[role] = {"failures": n / len(results), **{k: v / n for k, v in agg.items() if k != "count"}}
    out["lost_per_failure_by_role"] = roles
    return out


def simulate_many(p: SimParams, seed: int, runs: int) -> List[RunResult]:
    return [simulate_once(p, seed + i) for i in range(runs)]


def job_failure_interval(p: SimParams) -> Optional[float]:
    """Mean seconds between failures over the whole job (for the tables)."""
    if p.failure_model == "chaos":
        return p.kill_every_s
    if p.failure_model != "independent":
        return None
    rate = 0.0
    n = p.clusters * p.replicas
    if p.mtbf_s > 0:
        rate += n / p.mtbf_s
    if p.cluster_mtbf_s > 0:
        rate += p.clusters / p.cluster_mtbf_s
    return 1.0 / rate if rate > 0 else None


def _fmt_s(x: Optional[float]) -> str:
    return "-" if x is None else fmt_time(x)


def human(report: Dict[str, Any]) -> str:
    par, s = report["params"], report["summary"]
    topo = report["config"]["topology"]
    lines = [
        f"hier-localsgd simulate: {par['mode']} on {topo['clusters']} clusters x {topo['replicas_per_cluster']} replica groups "
        f"x {topo['ranks_per_replica']} ranks; step {fmt_time(par['step_s'])}, H_inner {report['config']['sync']['h_inner']}, "
        f"H_outer {report['config']['sync']['h_outer']}; {s['runs']} run(s) of "
        + (f"{report['config']['steps']} steps" if report["config"]["steps"] else f"{fmt_time(report['config']['duration_s'])}"),
        f"  failures: {par['failure_model']}" + (f", one every {fmt_time(report['job_failure_interval_s'])} over the job" if report["job_failure_interval_s"] else "")
        + f"; restart {fmt_time(par['restart_s'])}, heal {fmt_time(par['heal_s'])}"
        + (f", outer heal {fmt_time(par['outer_heal_s'])}" if par["mode"] == "hier" else "")
        + f", heartbeat {fmt_time(par['heartbeat_s'])}",
        "",
        f"goodput {s['goodput']['mean']:.4f} (min {s['goodput']['min']:.4f}, max {s['goodput']['max']:.4f}); "
        f"without failures {s['expected_no_failure_goodput']:.4f} (1 - sync overhead)",
    ]
    if "efficiency" in s:
        lines.append(
            f"steps kept / steps run (chaos.py's efficiency) {s['efficiency']['mean']:.4f} (min {s['efficiency']['min']:.4f}, max {s['efficiency']['max']:.4f}); "
            f"steps run {s['steps_run']:.0f}, discarded {s['steps_discarded']:.0f}"
        )
    if s["truncated"]:
        lines.append(
            f"WARNING: {s['truncated']} of {s['runs']} run(s) never reached an outer commit after the horizon and were "
            "stopped at 3x its length: the outer level stopped committing (docs/planner.md, 'out of step')"
        )
    lines += ["", "Where the replica groups' time went (share of C R T)"]
    sh, lr = s["shares"], s["lost_by_reason"]
    rows = [
        ["compute, committed", f"{sh['committed']:.2%}"],
        ["compute, lost: own steps of failed groups", f"{lr['own_work']:.2%}"],
        ["compute, lost: rolled-back rounds", f"{lr['rollback']:.2%}"],
        ["compute, lost: discarded at weight 0 / lost clusters", f"{lr['discarded']:.2%}"],
        ["compute, not yet committed at the end", f"{sh['uncommitted_at_end']:.2%}"],
        ["sync (collectives, heals)", f"{sh['sync']:.2%}"],
        ["waiting (quorums, global barrier, rejoin)", f"{sh['wait']:.2%}"],
        ["down (restarting)", f"{sh['down']:.2%}"],
    ]
    lines.append(table(["", "share"], rows))
    roles = s["lost_per_failure_by_role"]
    if roles:
        lines += ["", "Time lost per failure, by role (replica-group-seconds; job-seconds = / C R)"]
        n = topo["clusters"] * topo["replicas_per_cluster"]
        rows = []
        for role, v in roles.items():
            rows.append([
                role, f"{v['failures']:.1f}", f"{v.get('total', 0):.1f}", f"{v.get('total', 0) / n:.2f}",
                f"{v.get('own_work', 0):.1f}", f"{v.get('rollback', 0):.1f}", f"{v.get('discarded', 0):.1f}",
                f"{v.get('stall', 0):.1f}", f"{v.get('down', 0):.1f}",
            ])
        lines.append(table(["role", "failures/run", "total", "job-s", "own work", "rollback", "discarded", "stall", "down"], rows))
    lines += [
        "",
        f"slow-link traffic: {fmt_bytes(s['slow_link_bytes'])} per run, {fmt_bytes(s['slow_link_bytes_per_hour'])}/h; "
        f"outer rounds {s['outer_rounds']:.1f} (failed {s['failed_outer_rounds']:.1f})",
    ]
    if report.get("sensitivity"):
        lines += ["", "Sensitivity to the failure rate"]
        rows = []
        for row in report["sensitivity"]:
            rows.append([
                f"x{row['factor']:g}", _fmt_s(row["job_failure_interval_s"]), f"{row['failures']:.1f}",
                f"{row['goodput']:.4f}", f"{row['goodput_min']:.4f}-{row['goodput_max']:.4f}",
                "-" if row.get("efficiency") is None else f"{row['efficiency']:.4f}",
                str(row["truncated"]),
            ])
        lines.append(table(["rate", "one failure every", "failures/run", "goodput", "range", "steps kept/run", "truncated"], rows))
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: str) -> bool:
    """Goodput against the failure rate, and where the time went at each rate. False
    if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    sens = report.get("sensitivity", [])
    rated = [r for r in sens if r["job_failure_interval_s"]]
    ax = axes[0]
    if rated:
        xs = [3600.0 / r["job_failure_interval_s"] for r in rated]
        ax.plot(xs, [r["goodput"] for r in rated], "o-", label="goodput")
        ax.fill_between(xs, [r["goodput_min"] for r in rated], [r["goodput_max"] for r in rated], alpha=0.2)
        if any(r.get("efficiency") is not None for r in rated):
            ax.plot(xs, [r["efficiency"] for r in rated], "s--", label="steps kept / steps run")
        ax.set_xscale("log")
    ax.axhline(report["summary"]["expected_no_failure_goodput"], ls=":", c="gray", label="no failures")
    ax.set_xlabel("failures per hour (whole job)")
    ax.set_ylabel("share")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower left")
    ax.set_title("Goodput vs failure rate")

    ax = axes[1]
    rows = sens or [{"factor": 1.0, "shares": report["summary"]["shares"], "lost_by_reason": report["summary"]["lost_by_reason"]}]
    parts = [
        ("committed", lambda r: r["shares"]["committed"]),
        ("lost: own steps", lambda r: r["lost_by_reason"]["own_work"]),
        ("lost: rollback", lambda r: r["lost_by_reason"]["rollback"]),
        ("lost: discarded", lambda r: r["lost_by_reason"]["discarded"]),
        ("not committed at end", lambda r: r["shares"]["uncommitted_at_end"]),
        ("sync", lambda r: r["shares"]["sync"]),
        ("waiting", lambda r: r["shares"]["wait"]),
        ("down", lambda r: r["shares"]["down"]),
    ]
    labels = [f"x{r['factor']:g}" for r in rows]
    bottom = [0.0] * len(rows)
    for name, get in parts:
        vals = [get(r) for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("failure rate (x configured)")
    ax.set_ylabel("share of replica-group time")
    ax.set_ylim(0, 1.0)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title("Where the time went")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def make_report(cfg: SimulateConfig) -> Dict[str, Any]:
    """Runs the configured simulations (and the sensitivity sweep) and gathers the figures."""
    p = resolve(cfg)
    results = simulate_many(p, cfg.seed, cfg.runs)
    summary = summarize_runs(results)
    sens = []
    for factor in cfg.sensitivity:
        if factor == 1.0:
            rs, pf = results, p
        else:
            pf = scale_failures(p, factor)
            rs = simulate_many(pf, cfg.seed, cfg.runs)
        sm = summarize_runs(rs)
        sens.append({
            "factor": factor,
            "job_failure_interval_s": job_failure_interval(pf) if factor else None,
            "failures": sm["failures"]["mean"],
            "goodput": sm["goodput"]["mean"], "goodput_min": sm["goodput"]["min"], "goodput_max": sm["goodput"]["max"],
            "efficiency": sm.get("efficiency", {}).get("mean"),
            "truncated": sm["truncated"],
            "shares": sm["shares"],
            "lost_by_reason": sm["lost_by_reason"],
        })
    params = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in asdict(p).items()}
    return {
        "config": asdict(cfg),
        "params": params,
        "job_failure_interval_s": job_failure_interval(p),
        "summary": summary,
        "sensitivity": sens,
        "runs": [{k: v for k, v in asdict(r).items() if k != "failures"} | {"failures": r.failures[:200]} for r in results],
    }


def run_simulate(cfg: SimulateConfig, out_dir: str) -> int:
    """Prints the simulation report, writes ``<out_dir>/<json_name>`` and, if matplotlib is
    importable, ``<out_dir>/<plot_name>``. Returns 0.

    Raises:
        ValueError: a bad field; the message starts with its path (``simulate.sync.h_inner: ...``).
    """
    report = make_report(cfg)
    print(human(report))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, cfg.json_name)
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    print(f"\nreport written to {path}")
    if cfg.plot:
        png = os.path.join(out_dir, cfg.plot_name)
        if plot(report, png):
            print(f"plot written to {png}")
        else:
            print("plot skipped: matplotlib is not installed")
    return 0


# ----------------------------------------------------------------------------- validation set-ups
def chaos_validation_config(**overrides: Any) -> SimulateConfig:
    """The chaos command's measured run (docs/benchmarks.md) as a simulation.

    ``hier-localsgd chaos train.steps=600 sync.min_clusters=1 chaos.kill_every_s=30``:
    2 clusters x 2 replica groups, debugmodel, 600 steps, H_inner 10, H_outer 3, kills of
    any role every 30 s on average over the first 80 % of the steps, restart after 2 s
    plus ~4 s process start, heartbeat timeout 5 s. The step time (0.34 s compute plus the
    default networks' syncs) reproduces the ~0.35 s wall per step measured.
    """
    cfg = SimulateConfig(
        topology=PlanTopologyConfig(clusters=2, replicas_per_cluster=2, ranks_per_replica=1, sharding="replicate"),
        params=6_163_712,  # torchtitan's Llama3 debugmodel
        train=PlanTrainConfig(batch_size=4, seq_len=64),
        hardware=HardwareConfig(step_time_s=0.34),
        sync=SimSyncConfig(mode="hier", h_inner=10, h_outer=3, dtype="float32", min_clusters=1),
        failures=FailureConfig(model="chaos", kill_every_s=30.0, stop_kills_at=0.8, restart_s=6.0),
        steps=600, runs=200, sensitivity=[],
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def torchft_per_step_config(failure_every_s: float = 60.0, **overrides: Any) -> SimulateConfig:
    """torchft's per-step (HSDP, ddp-like) fault-tolerance run as a simulation.

    30 replica groups (one cluster: a single level, so ``mode=ddp``, H = 1), one failure
    every ``failure_every_s`` over the job (per-group MTBF = 30 x that), torchft's default
    heartbeat timeout (5 s). The step time, restart, heal and reconfiguration figures of
    that run are not published; the values here are assumptions (docs/planner.md).
    """
    cfg = SimulateConfig(
        topology=PlanTopologyConfig(clusters=1, replicas_per_cluster=30, ranks_per_replica=1, sharding="replicate"),
        params=1_500_000_000,
        hardware=HardwareConfig(step_time_s=1.0),
        sync=SimSyncConfig(mode="ddp", h_inner=1, h_outer=1, dtype="bfloat16"),
        network=NetworkConfig(lan=NetworkLink(400.0, 0.01), wan=NetworkLink(400.0, 0.01)),
        failures=FailureConfig(model="independent", mtbf_s=30 * failure_every_s, restart_s=30.0, heal_s=2.0, reconfigure_s=3.0),
        duration_s=3600.0, runs=5, sensitivity=[],
    )
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg
