"""What the parts of one hierarchical round share.

hier.py runs the round and owns the parts: :class:`~hier_localsgd.sync.committed.CommittedState`
(the committed model, heals, rollback), :class:`~hier_localsgd.sync.outer_round.OuterLevel`
(the leader's outer level) and :class:`~hier_localsgd.sync.final.FinalWait` (the end of a run
after an outage). Each part owns its own state; what all of them read is one public
:class:`SyncState`, built once and handed to each part, plus the pieces every level's round
runs alike, as functions of it: the consistency guard and the reduce (failure semantics:
hier.py), planned faults, lighthouse outages, a level's Manager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.optim import Optimizer

from hier_localsgd.core.tensors import guard
from hier_localsgd.core.ft.comm import LevelComm
from hier_localsgd.core.runtime.faults import ACTIONS, FaultPlan, fire
from hier_localsgd.core.tensors.flat_params import FlatParams
from hier_localsgd.core.tensors.fragments import Ranges
from hier_localsgd.core.runtime.invariants import CollectiveGate
from hier_localsgd.core.tensors.level import Level, LevelAlgorithm, Staged
from hier_localsgd.core.links.stats import CONTROL, PAYLOAD
from hier_localsgd.core.links.link import LinkProcessGroup
from hier_localsgd.core.ft.managers import LevelManager, QuorumView
from hier_localsgd.core.ft.outage import LighthouseHealth, LighthouseOutage, OutageLimitExceeded
from hier_localsgd.core.runtime.phases import Phase, PhaseTracker
from hier_localsgd.core.runtime.timeouts import Timeouts
from hier_localsgd.core.security.secret import Key
from hier_localsgd.core.links.lossy import LinkSpec
from hier_localsgd.sync.common import Counters, EventSink, FatalSyncError, Identity
from hier_localsgd.sync.compression import OuterCompression
from hier_localsgd.sync.group_vote import GroupVote
from hier_localsgd.sync.poison import PoisonRecord
from hier_localsgd.sync.sections import PoisonConfig
from hier_localsgd.sync.user_state import UserState

logger = logging.getLogger("hier_localsgd.sync.hier")  # one logger name for the whole round


@dataclass(frozen=True)
class HierSettings:
    """The hierarchy's settings. Built from the config by one function,
    :func:`hier_localsgd.sync.build.hier_settings`; no field has a default here (each
    default has its one home in the config's sections)."""

    h_inner: int
    h_outer: int
    inner: LevelAlgorithm
    outer: LevelAlgorithm
    cluster_lighthouse: str
    cluster_lighthouse_field: str
    global_lighthouse: str
    global_lighthouse_field: str
    min_replicas: int
    min_clusters: int
    max_quorum_failures: int
    max_commit_failures: Optional[int]
    hostname: str
    replicas_per_cluster: int
    inner_link: Optional[LinkSpec]
    outer_link: Optional[LinkSpec]
    group_rank: int
    group_world_size: int
    # group.parallel=tp: every rank holds its own shard of the model (tp.py) and syncs all
    # of it with the same rank of the other groups; no slicing, no group all-gather.
    group_shards: bool
    # Process-group backend of each level (core/runtime/device.py; link.py stages tensors to it).
    inner_backend: str
    outer_backend: str
    # Lighthouse outages (outage.py): each quorum request waits at most quorum_slice (the
    # lighthouse heartbeat timeout) before the lighthouse is probed; a level whose
    # lighthouse has not answered for outage_limit ends the process.
    quorum_slice: timedelta
    outage_limit: timedelta
    # A final round skipped for a cluster lighthouse outage: how long finish() waits for
    # the lighthouse and the cluster's quorum to reconcile the groups' models (final.py).
    final_wait: timedelta
    # Overlapped outer sync (overlap.py): inner rounds between an outer round's launch and
    # the application of its result; 0 = blocking. The outer round at final_step (the run's
    # last step, 0 = unknown) always blocks, so a run ends on a synced model.
    outer_delay: int
    # Eager updates (overlap.py): the local outer step stands in until the global one arrives.
    outer_eager: bool
    final_step: int
    # Compressed outer reduce (compression.py): none | int8 | fp8, elements per block.
    outer_compression: str
    outer_compression_block: int
    outer_topk: int  # elements kept per chunk with topk2 (core/tensors/sparse.py)
    # Streaming fragments (core/tensors/fragments.py): each fragment's ranges of the flat vector
    # (of this rank's shard with group_shards); one fragment per outer round, every
    # h_inner·h_outer/F steps.
    # Empty: one fragment, the whole model (every h_inner·h_outer steps).
    outer_fragments: Tuple[Ranges, ...]
    # Ask for each inner round's quorum during its last local step (early.py).
    early_quorum: bool
    # A cluster behind the outer quorum by 1..this many outer rounds contributes a stale
    # update (outer_round.py, ``OuterLevel.run``); 0: weight 0.
    outer_max_staleness: int
    # A member that healed from a peer whose state is at most this many inner rounds of
    # steps ahead of the member's last commit contributes its local steps since then,
    # measured from that commit, to the round it healed in (a stale update at the inner
    # level, committed.py ``stale_inner``); 0: weight 0. One rank per group.
    inner_max_staleness: int
    # A failed inner round keeps the local steps when nothing committed moved
    # (sync.failed_round=keep_local; committed.py). Needs group_world_size == 1.
    keep_local: bool
    # The screen of contributions at both levels (core/tensors/guard.py) and when a group gives up.
    poison: PoisonConfig
    # Heals are authenticated with this key (core/security/secret.py); None: no job secret.
    heal_key: Optional[Key]
    bind: str  # run.bind: "" = hostname's address

    @property
    def num_fragments(self) -> int:
        return max(1, len(self.outer_fragments))


@dataclass
class SyncState:
    """What every part of the round reads (and some write): public fields only.

    Built by :class:`~hier_localsgd.sync.hier.HierarchicalSync`, which fills the inner
    level's link, Manager and collectives, the group vote and the poison record right after
    (the inner Manager serves the committed state, which needs this object first)."""

    settings: HierSettings
    id: Identity
    timeouts: Timeouts
    flat: FlatParams
    opt: Optimizer
    tracker: PhaseTracker
    events: EventSink
    faults: FaultPlan
    user: UserState
    # This rank's slice of the flat vector (all of it with one rank per group) and the
    # slice length every rank pads to for the group's all-gather.
    part: slice
    slice_len: int
    group: Optional[object]  # the replica group's own process group and store (torchrun's)
    group_store: Optional[object]
    job_done: Optional[Callable[[], Optional[str]]]
    # Three optimizers, three owners (I2): the inner optimizer owns the model's
    # parameters; each level owns its backup and its momentum buffer.
    inner: Level
    outer: Level
    # The cluster's error-feedback residual of a compressed outer reduce (compression.py):
    # replicated in the cluster like the outer backup; the overlapped stage works on a copy.
    comp: Optional[OuterCompression]
    # Every member, overlapped (overlap.py): the committed model the last launched outer
    # round started from (θ_s), and its step.
    snap: Optional[torch.Tensor]
    # Every member, eager updates (overlap.py): the stand-in step ``U = θ_s − θ_e`` the
    # cluster model holds since the launch (zero when none is pending), and the outer
    # momentum every member keeps in step with its leader's to compute it.
    stand_in: Optional[torch.Tensor]
    gate: CollectiveGate
    health: Dict[str, LighthouseHealth]
    # HierarchicalSync's handlers, which the outer level's quorum and outages share.
    quorum_failed: Callable[[str, Exception], None]
    check_job_done: Callable[[], None]
    counters: Counters = field(default_factory=Counters)
    snap_step: int = 0
    # Work accounting: local steps run, and those discarded by a rollback (or
    # contributed with weight 0) — what chaos.py's goodput starts from.
    work: Dict[str, int] = field(default_factory=lambda: {"steps_run": 0, "steps_discarded": 0, "steps_since_commit": 0})
    since_outer: int = 0  # steps committed at the inner level since the last outer commit
    # A leader's seconds waiting for other clusters at the outer level (the dashboard's
    # waiting time): the global quorum's forming (quorums that healed and quorums that
    # failed are left out; a new quorum's process group setup is in), or an asynchronous
    # push's batch at the server. Off the training thread for an overlapped round.
    outer_wait_s: float = 0.0
    leader: bool = False  # rank 0 of the last inner quorum
    quorum_failures: Dict[str, int] = field(default_factory=lambda: {"inner": 0, "outer": 0})
    published_outage: Dict[str, bool] = field(default_factory=lambda: {"inner": False, "outer": False})
    # Filled by HierarchicalSync right after construction.
    inner_link: LinkProcessGroup = field(init=False)
    inner_mgr: LevelManager = field(init=False)
    inner_comm: LevelComm = field(init=False)
    vote: GroupVote = field(init=False)
    poison: PoisonRecord = field(init=False)

    def work_counters(self) -> Dict[str, int]:
        """``work`` plus ``steps_since_outer``: steps committed at the inner level since the last outer commit."""
        return {**self.work, "steps_since_outer": self.since_outer}

    def waited_for_clusters(self, seconds: float) -> None:
        """Adds to :attr:`outer_wait_s` and publishes it (any thread: the overlapped stage's too)."""
        self.outer_wait_s += max(0.0, seconds)
        self.tracker.set_extra(outer_wait_s=round(self.outer_wait_s, 3))


# ------------------------------------------------------------------ pieces every level runs
def consistency(
    st: SyncState,
    comm: LevelComm,
    q: QuorumView,
    level: str,
    mine: guard.Fingerprint,
    tensors: List[torch.Tensor],
    on_resync: Callable[[guard.Fingerprint], None],
) -> guard.GuardPlan:
    """Exchanges fingerprints; if members disagree, resyncs from the newest one
    (``on_resync(source)``: a resynced member's level, before its tensors are replaced)."""
    v = guard.encode(q.rank, q.size, mine)
    if not comm.allreduce_sum(v, CONTROL):
        # The round is lost (commit will fail); keep collectives matched: weight 0.
        return guard.GuardPlan([mine] * q.size, None, [0.0] * q.size, failed=True)
    fps = guard.decode(v, q.size)
    p = guard.plan(fps, max_behind=st.settings.outer_max_staleness if level == "outer" else 0, ratio=st.settings.poison.norm_ratio)
    for i in p.excluded_ranks():
        st.poison.excluded(level, guard.member_name(fps[i].who, level), p.excluded[i], fps[i].norm,
                           mine=i == q.rank, step=st.counters.step)
        if i == q.rank:
            st.tracker.set_extra(excluded=st.poison.count)  # the dashboard's count
    if p.source is None:
        return p
    src = fps[p.source]
    logger.warning("%s %s level diverged: resync from rank %d (%s)", st.id, level, p.source, src)
    buf = guard.pack(tensors) if q.rank == p.source else torch.empty(sum(t.numel() for t in tensors))
    if comm.broadcast(buf, p.source, CONTROL) and q.rank != p.source:
        on_resync(src)
        guard.unpack_into(buf, tensors)
    st.events("resync", level=level, source=p.source, diverged=p.diverged(q.rank), step=st.counters.step)
    return p


def reduce(
    level: Level, comm: LevelComm, live: torch.Tensor, plan: guard.GuardPlan, rank: int,
    comp: Optional[OuterCompression] = None, ranges: Optional[Ranges] = None, base: Optional[torch.Tensor] = None,
) -> Staged:
    """All-reduces the weighted pseudo-gradient and stages the level's update
    (``comp``: compressed, staging the residual too; ``ranges``: one outer fragment's
    elements only, the rest of the level unchanged; ``base``: the pseudo-gradient is
    measured from it instead of the level's backup, a stale outer contribution)."""
    if ranges == () or (plan.total_weight == 0 and not plan.failed):
        # Every member knows either from the guard or the fragment (a fragment with no
        # element in this rank's slice is empty on this rank of every cluster): no reduce.
        return level.unchanged()
    grad = level.pseudo_grad(live, ranges, base=base)
    if plan.failed:  # zeros into the reduce the others may be running (guard.GuardPlan.failed)
        grad.zero_()
        if comp is not None:
            comp.reduce(comm, grad, 0.0, 1.0, ranges)
        else:
            comm.allreduce_sum(grad, PAYLOAD)
        return level.unchanged()
    w = plan.weights[rank]
    if comp is not None:
        if w not in (0.0, 1.0):
            grad.mul_(w)
        comp.reduce(comm, grad, w, plan.total_weight, ranges)  # weight 0: sends zeros, encodes nothing
    else:
        if w == 0.0:
            grad.zero_()  # not mul_(0): a NaN times 0 is NaN (an excluded contribution, guard.screen)
        elif w != 1.0:
            grad.mul_(w)
        comm.allreduce_sum(grad, PAYLOAD)
    grad.div_(plan.total_weight)
    return level.stage(grad, ranges)


def screen_norm(st: SyncState, level: Level, live: torch.Tensor, base: Optional[torch.Tensor], weight: float, rounds: float = 1.0) -> float:
    """The norm this member's contribution shows the poison screen (guard.py): of the
    whole group's pseudo-gradient (every rank's slice, one sum on the group's own
    process group, so every ring judges the group alike), divided by ``rounds`` of
    work; guard.NONFINITE; 0 at weight 0. Every rank of a group calls it."""
    ss = level.sum_of_squares(live, base) if weight > 0 else 0.0
    n = guard.contribution_norm(st.vote.total(ss))
    return n / rounds if n > 0 else n


def fault_point(st: SyncState, phase: Phase, step: Optional[int] = None, outer_link: Optional[LinkProcessGroup] = None,
                arm_failure: Optional[Callable[[Exception, str], None]] = None) -> None:
    """Fires a planned fault for this step (default: the current one) and phase (tests,
    experiments); a ``fail`` at OUTER_REDUCE arms the outer link, at every other phase the
    inner one; ``arm_failure`` instead where the phase's exchange is not a link's (the
    asynchronous level's push)."""
    step = st.counters.step if step is None else step
    st.faults.from_phase_inbox()  # a stop for a phase handed over meanwhile (the chaos command's phase kill)
    f = st.faults.take(step, phase.value, ACTIONS)
    if f is None:
        return
    st.events("fault", action=f.action, phase=phase.value, step=step)
    logger.warning("%s injecting fault %s", st.id, f)
    link = outer_link if phase == Phase.OUTER_REDUCE else st.inner_link
    fire(f, f"{phase.value} at step {step}", arm_failure or (None if link is None else link.arm_failure))


def outage(st: SyncState, level: str, e: LighthouseOutage) -> None:
    """A round skipped because the level's lighthouse does not answer (outage.py)."""
    health = st.health[level]
    if not st.published_outage[level]:
        st.published_outage[level] = True
        st.events("outage", level=level, state="start", lighthouse=health.addr, detail=str(e)[:200], step=st.counters.step)
    publish_outages(st)
    try:
        health.check_limit()
    except OutageLimitExceeded as limit:
        st.check_job_done()
        raise FatalSyncError(str(limit)) from limit


def lighthouse_ok(st: SyncState, level: str) -> None:
    health = st.health[level]
    was = st.published_outage[level]
    health.mark_up()
    if was:
        st.published_outage[level] = False
        st.events("outage", level=level, state="end", lighthouse=health.addr, step=st.counters.step)
        publish_outages(st)


def publish_outages(st: SyncState) -> None:
    st.tracker.set_extra(outage={lv: h.describe() for lv, h in st.health.items() if h.describe() is not None} or None)


def manager(
    st: SyncState, level: str, pg: LinkProcessGroup, store_key: str,
    state_dict: Callable[[], Dict[str, object]], load_state_dict: Callable[[Dict[str, object]], None],
) -> LevelManager:
    """The Manager of one level (inner: the cluster's lighthouse; outer: the global one),
    serving and loading heals with the level owner's ``state_dict``/``load_state_dict``."""
    s, inner = st.settings, level == "inner"
    return LevelManager(
        level=level,
        replica_id=st.id.inner_replica_id if inner else st.id.outer_replica_id,
        lighthouse_addr=s.cluster_lighthouse if inner else s.global_lighthouse,
        lighthouse_field=s.cluster_lighthouse_field if inner else s.global_lighthouse_field,
        pg=pg,
        state_dict=state_dict,
        load_state_dict=load_state_dict,
        min_replicas=s.min_replicas if inner else s.min_clusters,
        timeouts=st.timeouts,
        hostname=s.hostname,
        group_rank=s.group_rank,
        group_world_size=s.group_world_size,
        max_commit_failures=s.max_commit_failures,
        group_store=st.group_store,
        store_key=store_key,
        presence_timeout=s.quorum_slice,  # a left-over quorum request costs this, not a phase
        heal_key=s.heal_key,
        bind=s.bind,
    )
