"""Hierarchical LocalSGD/DiLoCo: one sync round of one replica group, top to bottom.

Every ``h_inner`` local steps the replica groups of a cluster run an inner round
through the cluster's lighthouse; every ``h_outer`` inner rounds (``step`` a
multiple of ``h_inner * h_outer``) the round also carries the outer level: the
cluster's leader (rank 0 of the inner quorum) syncs across clusters through the
global lighthouse and broadcasts the result to its cluster, inside the same inner
quorum. Only leaders touch the slow links; slow-link traffic per outer round is
one model per cluster whatever the number of replica groups. With streaming
fragments (``sync.outer.fragments = F``, core/fragments.py) an outer round comes every
``h_inner * h_outer / F`` steps and carries one fragment (the run's last round the
whole model); with the early inner quorum (early.py) INNER_QUORUM collects a request
made during the round's last local step.

One round (the phases are in :mod:`hier_localsgd.core.phases`)::

    INNER_QUORUM   join the cluster quorum; heal from a live peer if behind
                   (torchft checkpoint transport); rank 0 is the leader
    INNER_REDUCE   consistency guard (guard.py), then all-reduce the weighted
                   pseudo-gradient ``backup - live``; stage the level's update
    [outer round, leader only]
      OUTER_QUORUM   join the global quorum with the cluster Manager; heal from
                     another cluster if behind
      OUTER_REDUCE   guard, then all-reduce ``global_backup - cluster_model``
      OUTER_COMMIT   cluster Managers vote; on success the outer update is final
    [outer round, every member]
      BROADCAST      the leader sends a header (status, outer round, step, cluster
                     weight, fragment) and the
                     resulting model over the inner process group
    INNER_COMMIT   inner Managers vote; on success adopt the staged state,
                   otherwise roll back to the last commit

Why the broadcast comes before the inner commit: the non-leaders wait for the
leader inside an already formed quorum, on a process group with a bounded
timeout, instead of at the lighthouse where a slow outer sync would let a quorum
form without the leader. The inner commit then makes the cluster adopt the outer
result atomically with its own round.

Several ranks per replica group (``group_world_size`` G > 1, launched by torchrun):
every rank holds the whole model (data parallel inside the group), but each rank
synchronises only its slice k of the flat parameter vector, over its own Managers'
process groups (rank k of every replica group forms ring k, as torchft arranges), so the
slow links still carry one model per cluster per outer round. Both levels' state is
per slice; after every commit or rollback the group all-gathers the committed slices
into the full committed model (the rollback target). With G = 1 the slice is the whole
vector and the gather is a copy. With tensor-parallel groups (``group_shards``, tp.py) rank
k's flat vector is its own shard of the model: it syncs all of it over ring k, and the
gather is a copy too.

Failure semantics. Once a quorum has formed every member runs every collective of
the round, in order, even after an error (errors only decide the commit vote), so
a failure costs one round, not a timeout. A quorum that does not form rolls back at
once. A replica whose commit failed restores its last commit: model, inner
optimizer, the levels' backups and momenta (staged updates are simply dropped) —
or, with ``sync.failed_round=keep_local``, keeps its local steps for the next round
when nothing it committed moved (committed.py). An outer commit is final: a leader
whose outer commit succeeded adopts the new global model even if its cluster's
inner commit then fails; the guard or torchft's healing brings the cluster along
next round. ``max_quorum_failures`` consecutive
quorum failures of one level end the process (:class:`FatalSyncError`), as does any
invariant violation inside a process. A quorum whose outer group would break I1 (two
members of one cluster: for a moment while leadership moves) is refused before any
collective runs in it and counts as a failed quorum (managers.GroupRefused): it ends
the process only if it persists.

(About 770 lines, a third of them this docstring, the settings and their comments: the
round's phases stay in one file, in order; the outer level is outer_round.py, overlap
overlap.py, the committed state, heals and the inner stale update committed.py.)
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch.optim import Optimizer

from hier_localsgd.core import guard
from hier_localsgd.core.comm import LevelComm, is_timeout
from hier_localsgd.core.device import host_copy, host_state, host_state_finite
from hier_localsgd.core.faults import ACTIONS, FaultPlan, fire
from hier_localsgd.core.flat import FlatParams, checksum
from hier_localsgd.core.fragments import FragmentSchedule, Ranges, localize
from hier_localsgd.core.invariants import CollectiveGate, check_disjoint_tensors
from hier_localsgd.core.level import Level, LevelAlgorithm, Staged
from hier_localsgd.core.link import CONTROL, PAYLOAD, LinkProcessGroup, LinkStats
from hier_localsgd.emulation.lossy import LinkSpec
from hier_localsgd.core.addresses import LighthouseUnreachable
from hier_localsgd.core.managers import LevelManager, QuorumFailed, QuorumView
from hier_localsgd.core.outage import LighthouseHealth, LighthouseOutage, OutageLimitExceeded
from hier_localsgd.core.peers import QuorumWatch
from hier_localsgd.sync.compression import DEFAULT_BLOCK, NONE as NO_COMPRESSION, OuterCompression, build as build_compression
from hier_localsgd.sync.early import EarlyQuorum, EarlyQuorumStuck
from hier_localsgd.sync.overlap import OuterStage, is_apply_round, is_launch_round
from hier_localsgd.core.phases import Phase, PhaseTracker
from hier_localsgd.sync.committed import CommittedState
from hier_localsgd.sync.common import Counters, EventSink, FatalSyncError, Identity, JobFinished, OuterResult, Status, training_progress
from hier_localsgd.sync.final import FinalWait
from hier_localsgd.sync.group_vote import GroupVote
from hier_localsgd.sync.poison import PoisonRecord
from hier_localsgd.sync.types import PoisonConfig
from hier_localsgd.sync.user_state import UserState
from hier_localsgd.sync.outer_round import OuterRound
from hier_localsgd.core.timeouts import Timeouts

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class HierSettings:
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
    replicas_per_cluster: int = 1
    inner_link: Optional[LinkSpec] = None  # emulated lossy/slow link per level (lossy.py)
    outer_link: Optional[LinkSpec] = None
    group_rank: int = 0
    group_world_size: int = 1
    # group.parallel=tp: every rank holds its own shard of the model (tp.py) and syncs all
    # of it with the same rank of the other groups; no slicing, no group all-gather.
    group_shards: bool = False
    # Process-group backend of each level (core/device.py; link.py stages tensors to it).
    inner_backend: str = "gloo"
    outer_backend: str = "gloo"
    # Lighthouse outages (outage.py): each quorum request waits at most quorum_slice (the
    # lighthouse heartbeat timeout) before the lighthouse is probed; a level whose
    # lighthouse has not answered for outage_limit ends the process.
    quorum_slice: timedelta = timedelta(seconds=5)
    outage_limit: timedelta = timedelta(seconds=600)
    # A final round skipped for a cluster lighthouse outage: how long finish() waits for
    # the lighthouse and the cluster's quorum to reconcile the groups' models (final.py).
    final_wait: timedelta = timedelta(seconds=60)
    # Overlapped outer sync (overlap.py): inner rounds between an outer round's launch and
    # the application of its result; 0 = blocking. The outer round at final_step (the run's
    # last step, 0 = unknown) always blocks, so a run ends on a synced model.
    outer_delay: int = 0
    final_step: int = 0
    # Compressed outer reduce (compression.py): none | int8 | fp8, elements per block.
    outer_compression: str = NO_COMPRESSION
    outer_compression_block: int = DEFAULT_BLOCK
    # Streaming fragments (core/fragments.py): each fragment's ranges of the flat vector
    # (of this rank's shard with group_shards); one fragment per outer round, every
    # h_inner·h_outer/F steps.
    # Empty: one fragment, the whole model (every h_inner·h_outer steps).
    outer_fragments: Tuple[Ranges, ...] = ()
    # Ask for each inner round's quorum during its last local step (early.py).
    early_quorum: bool = False
    # A cluster behind the outer quorum by 1..this many outer rounds contributes a stale
    # update (outer_round.py, ``_outer_round``); 0: weight 0.
    outer_max_staleness: int = 0
    # A member that healed from a peer whose state is at most this many inner rounds of
    # steps ahead of the member's last commit contributes its local steps since then,
    # measured from that commit, to the round it healed in (a stale update at the inner
    # level, committed.py _stale_inner); 0: weight 0. One rank per group.
    inner_max_staleness: int = 0
    # A failed inner round keeps the local steps when nothing committed moved
    # (sync.failed_round=keep_local; committed.py). Needs group_world_size == 1.
    keep_local: bool = False
    # The screen of contributions at both levels (core/guard.py) and when a group gives up.
    poison: PoisonConfig = field(default_factory=PoisonConfig)

    @property
    def num_fragments(self) -> int:
        return max(1, len(self.outer_fragments))


class HierarchicalSync(OuterRound, CommittedState, FinalWait):
    """Runs the hierarchical sync for one replica group (see the module docstring).

    The training loop calls :meth:`start` once, then :meth:`after_optimizer_step`
    after every local step (having advanced ``counters.step`` itself).
    """

    def __init__(
        self,
        settings: HierSettings,
        identity: Identity,
        timeouts: Timeouts,
        flat: FlatParams,
        inner_optimizer: Optimizer,
        tracker: PhaseTracker,
        events: EventSink,
        faults: Optional[FaultPlan] = None,
        group: Optional[object] = None,
        group_store: Optional[object] = None,
        job_done: Optional[Callable[[], Optional[str]]] = None,
        user_state: Optional[UserState] = None,
    ) -> None:
        """``group``/``group_store``: the replica group's own torch.distributed process
        group and store (torchrun's), when it has several ranks. ``job_done``: returns a
        message once the job has finished without this group (status.py), asked before
        a failing quorum ends the process. ``user_state``: the user's objects that heal and
        checkpoint with the model (user_state.py)."""
        self.s = settings
        self.id = identity
        self.t = timeouts
        self.flat = flat
        self.opt = inner_optimizer
        self.tracker = tracker
        tracker.budgets = timeouts  # every phase's deadline, named once (Timeouts.phase)
        self.events = events
        self.faults = faults or FaultPlan([], identity.cluster, identity.replica)
        self.counters = Counters()
        self.job_done = job_done
        self.user = user_state or UserState()

        # This rank's slice of the flat vector (all of it with one rank per group).
        g, k = settings.group_world_size, settings.group_rank
        if settings.group_shards:
            g, k = 1, 0  # the flat vector already is this rank's shard
        self._slice_len = (flat.numel + g - 1) // g
        self.part = slice(min(flat.numel, k * self._slice_len), min(flat.numel, (k + 1) * self._slice_len))
        # Streaming fragments, in offsets of this rank's slice (core/fragments.py).
        self._fragments = [localize(r, self.part) for r in settings.outer_fragments]
        self.fragments = FragmentSchedule(settings.h_outer, settings.num_fragments)  # keyed by committed outer rounds
        self.group, self.group_store = group, group_store  # group_store is already per attempt (trainer.py)
        if g > 1 and (group is None or group_store is None):
            raise ValueError("a replica group of several ranks needs its process group and store")
        self._init_state(settings, flat, inner_optimizer)
        self._init_overlap(settings, identity, timeouts, tracker, flat)
        self._leader = False
        self._quorum_failures = {"inner": 0, "outer": 0}
        self._outer_healed: Optional[tuple[int, int]] = None
        # The global model this cluster's work started from, kept when an outer heal or
        # resync replaced it in this round (a stale contribution is measured from it).
        self._outer_base: Optional[torch.Tensor] = None
        # The cluster Manager has not yet committed or healed an outer round: its outer
        # momentum may be stale (kept while this group was not the leader).
        self._outer_fresh = True
        # The outer round whose pseudo-gradient this leader sent but whose commit failed.
        self._outer_sent_round: Optional[int] = None
        self._last_quorum_size = 0
        self._last_rank = 0
        self._last_healed = False
        self._weight0_why = ""
        self._outer_epoch = 0
        # The early inner quorum (early.py) and the heal it received, applied at the sync point.
        self._early: Optional[EarlyQuorum] = None
        self._defer_heal = False
        self._pending_heal: Optional[Dict[str, object]] = None
        # (its last committed inner backup, its live model, the steps between that commit and
        # the donor's state) just before this round's heal replaced them: an inner stale
        # update's base, work and age (committed.py, _stale_inner)
        self._inner_stale: Optional[Tuple[torch.Tensor, torch.Tensor, int]] = None
        # The step an early quorum announced while it is in flight: what a heal serves (committed.py)
        self._serve_step: Optional[int] = None
        # keep_local kept steps whose pseudo-gradient a failed round had already sent: never a
        # stale update (the leader's final outer commit may hold them already)
        self._kept_sent = False
        # keep_local: the committed state's checksum when the round began (committed.py)
        self._round_start_hash: Optional[int] = None
        # Work accounting: local steps run, and those discarded by a rollback (or
        # contributed with weight 0) — what chaos.py's goodput starts from.
        self.work = {"steps_run": 0, "steps_discarded": 0, "steps_since_commit": 0}
        self._since_outer = 0  # steps committed at the inner level since the last outer commit
        tracker.set_extra(**self.work_counters())

        self._init_levels_comm(settings, timeouts, tracker, events)
        # Several ranks per group: they agree before every branch (group_vote.py).
        vote_dev = torch.device("cpu")
        if group is not None and g > 1:
            import torch.distributed as dist

            if dist.get_backend(group) == "nccl":  # type: ignore[arg-type]
                vote_dev = flat.data.device
        self.vote = GroupVote(group, settings.group_world_size, vote_dev, events)
        self.poison = PoisonRecord(str(identity), settings.poison, events)

    def _init_state(self, settings: HierSettings, flat: FlatParams, inner_optimizer: Optimizer) -> None:
        """The levels, the committed model, the compression residual, the optimizer snapshot."""
        # Three optimizers, three owners (I2): the inner optimizer owns the model's
        # parameters; each level owns its backup and its momentum buffer.
        self.inner = Level("inner", settings.inner, flat.data[self.part])
        self.outer = Level("outer", settings.outer, flat.data[self.part])
        # Host state (core/device.py): pinned host memory when the model is on CUDA.
        self._committed = host_copy(flat.data)  # the full model at the last commit
        # The cluster's error-feedback residual of a compressed outer reduce (compression.py):
        # replicated in the cluster like the outer backup; the overlapped stage works on a copy.
        self.comp: Optional[OuterCompression] = build_compression(
            settings.outer_compression, settings.outer_compression_block, self.part.stop - self.part.start)
        self._stage_comp: Optional[OuterCompression] = None
        check_disjoint_tensors(
            [
                ("model parameters (inner optimizer)", [flat.data]),
                ("inner level backup and outer optimizer", self.inner.state_tensors()),
                ("outer level backup and outer optimizer", self.outer.state_tensors()),
                ("committed model", [self._committed]),
                ("outer compression residual", [] if self.comp is None else [self.comp.residual]),
            ]
        )
        self._opt_backup = host_state(inner_optimizer.state_dict())

    def _init_overlap(self, settings: HierSettings, identity: Identity, timeouts: Timeouts, tracker: PhaseTracker, flat: FlatParams) -> None:
        """The overlapped outer stage and its snapshot (overlap.py), when sync.outer.delay > 0."""
        # Overlapped outer sync (overlap.py): the leader's inner and outer groups may each
        # have a collective in flight (they share no pair of processes, I1).
        self._overlap = settings.outer_delay > 0
        self._gate = CollectiveGate(concurrent=[("inner", "outer")] if self._overlap else ())
        self.stage: Optional[OuterStage] = (
            OuterStage(str(identity), listener=lambda phase: tracker.set_extra(outer_stage=phase)) if self._overlap else None
        )
        if self.stage is not None:
            self.stage.tracker.budgets = timeouts
        # Every member: the committed model the last launched outer round started from (θ_s).
        self._snap: Optional[torch.Tensor] = host_copy(flat.data[self.part]) if self._overlap else None
        self._snap_step = 0
        self._snap_since_outer = 0  # inner-committed steps the launched outer round carries
        self._stage_outer: Optional[Level] = None  # the stage's copy of the outer level
        self._outer_target = self.outer  # where an outer heal loads and what a donor serves
        self._outer_view: Optional[tuple[int, int]] = None  # the stage's (outer_round, step)
        if self._snap is not None:
            check_disjoint_tensors([("model parameters (inner optimizer)", [flat.data]), ("outer stage snapshot", [self._snap])])

    def _init_levels_comm(self, settings: HierSettings, timeouts: Timeouts, tracker: PhaseTracker, events: EventSink) -> None:
        """Lighthouse health, the inner level's link, Manager and collectives; the outer
        level's are made while this group leads (_ensure_outer)."""
        probe = min(timedelta(seconds=1), settings.quorum_slice)
        self.health = {
            "inner": LighthouseHealth("inner", settings.cluster_lighthouse_field, settings.cluster_lighthouse, probe, settings.quorum_slice, settings.outage_limit),
            "outer": LighthouseHealth("outer", settings.global_lighthouse_field, settings.global_lighthouse, probe, settings.quorum_slice, settings.outage_limit),
        }
        self._published_outage: Dict[str, bool] = {"inner": False, "outer": False}
        self.inner_link = LinkProcessGroup("inner", timeouts.inner_pg, emulation=settings.inner_link, backend=settings.inner_backend)
        self.inner_mgr = self._manager("inner", self.inner_link, "store/inner")
        self.inner_comm = LevelComm(self.inner_mgr, self.inner_link, tracker, self._gate, events,
                                    watch=QuorumWatch(settings.cluster_lighthouse, settings.quorum_slice))
        # The cluster Manager exists only while this replica group leads its cluster:
        # a Manager that heartbeats without joining would stall the global lighthouse.
        self.outer_stats = LinkStats()
        self.outer_link: Optional[LinkProcessGroup] = None
        self.outer_mgr: Optional[LevelManager] = None
        self.outer_comm: Optional[LevelComm] = None

    # ------------------------------------------------------------------ loop API
    def start(self) -> None:
        """The join round: sync once before the first local step.

        A restarted replica group heals from a live peer here, before it spends
        compute on local steps, and starts at once. A cluster starting together
        (a fresh job, or one resumed from checkpoints) repeats no-op join rounds
        (every weight is 0) until every replica group of the cluster is in the
        quorum or ``timeouts.startup`` passes, so it starts together and its
        leader is the lowest replica group from the first round. A group that finds
        the job finished meanwhile raises :class:`JobFinished` (it exits 0).
        """
        deadline = time.time() + self.t.startup.total_seconds()
        while True:
            self.tracker.set_counters(step=self.counters.step)
            self.round(join=True)
            if self._last_healed or self._last_quorum_size >= self.s.replicas_per_cluster:
                return
            if time.time() > deadline:
                logger.warning("%s starting with %d of %d replica groups after %s", self.id, self._last_quorum_size, self.s.replicas_per_cluster, self.t.startup)
                return
            # A restart that comes up just after the last group finished would otherwise wait
            # out the start-up and three outer quorums alone (seen: 150 s in test_overlap).
            self._check_job_done()
            time.sleep(0.2)

    def before_forward(self) -> None:
        """With ``early_quorum``: the last local step of a round asks for the round's
        quorum meanwhile (early.py). Otherwise nothing: syncs happen at round boundaries."""
        c = self.counters
        if self.s.early_quorum and self._early is None and self.is_sync_step(c.step + 1):
            progress = training_progress(c.outer_round, c.step + 1, c.inner_round)  # as the sync point would announce
            # The call may run a little past its budget (a last slice of >= 0.1 s, a lighthouse
            # probe, the group's configuration): it gets the phase's budget less a heartbeat
            # timeout, so it has ended by the time the sync point's own budget runs out.
            full = self.t.phase(Phase.INNER_QUORUM)
            budget = max(full - self.s.quorum_slice, full / 2)
            self._defer_heal = True  # a heal it decides is applied at the sync point (committed.py)
            self._serve_step = c.step + 1  # set before its thread starts: a donor may serve at once
            self._early = EarlyQuorum(
                lambda: self.inner_mgr.start_quorum(budget, self.health["inner"], self.s.quorum_slice, progress=progress), c.step + 1)

    def before_optimizer_step(self) -> bool:
        """Local steps always apply; a failed round rolls them back later."""
        return True

    def after_optimizer_step(self) -> bool:
        """Runs a round at round boundaries; returns whether one ran."""
        self.work["steps_run"] += 1
        self.work["steps_since_commit"] += 1
        self.tracker.set_extra(**self.work_counters())  # a status written mid-round must not be stale
        self.tracker.set_counters(step=self.counters.step)
        if self.is_sync_step(self.counters.step):
            self.round()
            return True
        self.tracker.enter(Phase.LOCAL)
        return False

    def work_counters(self) -> Dict[str, int]:
        """``work`` plus ``steps_since_outer``: steps committed at the inner level since the last outer commit."""
        return {**self.work, "steps_since_outer": self._since_outer}

    def is_sync_step(self, step: int) -> bool:
        """A round ends at ``step``: every ``h_inner`` steps, and at the run's last step
        (``final_step``), which need not be a multiple of anything: a final partial round."""
        return step % self.s.h_inner == 0 or self._is_final(step)

    def _is_final(self, step: int) -> bool:
        return self.s.final_step > 0 and step == self.s.final_step

    def is_outer_round(self) -> bool:
        """The round at the current step carries the outer level: on the schedule every
        cluster computes alike (overlap.is_launch_round), and at the run's last step, so the
        run ends on one synced model whatever ``train.steps`` is."""
        step = self.counters.step
        return is_launch_round(step, self.s.h_inner, self.s.h_outer, self.s.num_fragments) or self._is_final(step)

    def fragment_ranges(self, fragment: Optional[int]) -> Optional[Ranges]:
        """The ranges of this rank's slice an outer round of ``fragment`` syncs (None: all of it)."""
        return None if fragment is None or not self._fragments else self._fragments[fragment]

    @property
    def leader(self) -> bool:
        return self._leader

    def link_stats(self) -> Dict[str, Dict[str, object]]:
        return {"inner": self.inner_link.stats.as_dict(), "outer": self.outer_stats.as_dict()}

    def close(self) -> None:
        if self.outer_mgr is not None:
            self.outer_mgr.shutdown()  # aborts a stage's process group: its waits end
            self.outer_mgr = None
        self._drop_stage("closing")
        self.inner_mgr.shutdown()

    # ------------------------------------------------------------------ one round
    def round(self, join: bool = False) -> bool:
        """Runs one sync round; returns whether this replica committed it."""
        tr, c = self.tracker, self.counters
        # keep_local may keep this round's local steps only if what it committed has not
        # moved when the round fails (a heal, a resync or an outer commit moves it).
        self._round_start_hash = self._inner_hash() if self.s.keep_local and not join else None
        self._inner_stale = None  # a heal in this round's quorum keeps what it replaced here
        self.poison.begin_round()
        tr.enter(Phase.INNER_QUORUM, reason="join" if join else "")
        self._fault_point(Phase.INNER_QUORUM)
        try:
            q = self._group_quorum(join)
        except LighthouseOutage as e:
            # Nothing was exchanged: keep the local progress and train on (outage.py).
            self._outage("inner", e)
            if not join and self.s.final_step > 0 and c.step >= self.s.final_step:
                self._final_outage = True  # finish() reconciles the cluster (final.py)
            if self._leader and self.is_outer_round() and self.s.group_world_size == 1 and not join:
                self._outer_without_cluster()
            tr.enter(Phase.LOCAL, reason="cluster lighthouse not answering: round skipped")
            return False
        except QuorumFailed as e:
            self._quorum_failed("inner", e)
            self._rollback(f"inner quorum failed: {e}")
            return False
        self._lighthouse_ok("inner")
        self._quorum_failures["inner"] = 0
        self._last_quorum_size, self._last_rank, self._last_healed = q.size, q.rank, q.healed
        self.tracker.set_extra(inner=self.inner_mgr.describe(q.size))
        if q.healed:
            self.events("heal", level="inner", step=c.step, inner_round=c.inner_round, outer_round=c.outer_round)
        self._set_leader(q.rank == 0)

        tr.enter(Phase.INNER_REDUCE)
        self._fault_point(Phase.INNER_REDUCE)
        # Why this member's steps would carry weight 0 ("" = they count, unless the guard resyncs it).
        # A member that healed keeps its weight when its work is a stale update within bounds.
        stale = self._stale_inner(join)
        healed = q.healed or self._inner_stale is not None  # (a heal in an earlier slice of the request too)
        errored = self.inner_mgr.errored() is not None
        self._weight0_why = "join" if join else "heal" if healed and stale is None else "errored" if errored else ""
        weight = 0.0 if self._weight0_why else 1.0
        live, base, behind = stale if stale is not None else (self.flat.data[self.part], None, 0)
        # The screen's norm, per round of this member's work (a stale update spans several).
        rounds = max(1.0, self.work["steps_since_commit"] / self.s.h_inner)
        plan = self._consistency(
            self.inner_comm, q, "inner",
            guard.Fingerprint(self._inner_hash(), c.outer_round, c.inner_round, c.step, weight,
                              norm=self._screen_norm(self.inner, live, base, weight, rounds), ref=self.inner.norm_ref,
                              who=guard.member_code(self.id.cluster, self.id.replica)),
            tensors=self._inner_tensors(),
        )
        if plan.excluded and plan.excluded[q.rank]:
            self._weight0_why = "excluded"
            self._round_start_hash = None  # keep_local never keeps an excluded member's steps
        staged = self._reduce(self.inner, self.inner_comm, live, plan, q.rank, base=base)
        sent = plan.total_weight > 0 and plan.weights[q.rank] > 0
        stale_steps = self.work["steps_since_commit"] if stale is not None and sent else 0
        # Each rank saw its own ring: the group takes one path (group_vote.py). A rank whose
        # inner level failed fails the group's round; a rank whose consistency exchange
        # failed (its plan has no weight) still follows its siblings into the outer round.
        # "idle": nobody contributed and nobody was excluded (everyone joining). A cluster
        # whose only contributions were excluded still carries its earlier rounds' work and
        # must meet the other clusters at the outer level.
        idle = plan.total_weight == 0 and not plan.excluded_ranks()
        v = self.vote.agree("inner round", inner_ok=self.inner_mgr.errored() is None, idle=idle)
        inner_ok = v["inner_ok"]
        if not inner_ok and self.inner_mgr.errored() is None:
            self.inner_mgr.report_error(RuntimeError("the inner round failed on another rank of this replica group"))

        result: Optional[OuterResult] = None
        # A round nobody contributed to (everyone joining: a fresh or resumed start) is a
        # no-op at both levels; stepping the outer optimizer on a zero pseudo-gradient
        # would still move the model by its momentum. Every member knows the total.
        outer_now = self.is_outer_round() and not v["idle"]
        outer_join = not outer_now and self._outer_join_wanted(join, q, plan)  # a cluster restarted whole
        final = self.s.final_step > 0 and c.step >= self.s.final_step
        if outer_join or (outer_now and (not self._overlap or final)):
            if self._leader:
                if final:
                    self._await_stage()  # the last overlapped round may still be in flight
                self._drop_stage("a blocking outer round")  # a result never applied (its apply round was skipped)
                # The cluster model carries the whole cluster's work since the last outer
                # commit, so it contributes whenever its inner round is valid (a join: nothing).
                result = self._outer_round(staged.backup, contribute=inner_ok and not outer_join, inner_ok=inner_ok)
            tr.enter(Phase.BROADCAST, leader=self._leader)
            self._fault_point(Phase.BROADCAST)
            result = self._broadcast(result, prior=staged.backup)
        elif self._overlap and self.is_apply_round():
            # Every member knows this round by its step: the header tells whether a global
            # model follows (overlap.py).
            tr.enter(Phase.BROADCAST, leader=False)
            self._fault_point(Phase.BROADCAST)
            result = self._collect_outer() if self._leader else None
            result = self._broadcast_global(result, prior=staged.backup)

        tr.enter(Phase.INNER_COMMIT)
        try:
            ok = self.inner_mgr.should_commit(tr.remaining())
        except RuntimeError as e:  # torchft raises after max_retries consecutive failures
            raise FatalSyncError(f"inner commits keep failing: {e}") from e
        committed = self._apply(ok, staged, result, plan)
        self._inner_stale = None
        if not committed and sent and self.work["steps_since_commit"] > 0:
            self._kept_sent = True  # keep_local kept them (_stale_inner)
        if committed and stale_steps:
            self.events("stale_update", level="inner", steps=stale_steps, behind=behind, step=c.step)
        if outer_now and self._overlap and not final:
            self._launch_outer(contribute=committed)
        self.poison.end_round()  # a group that keeps poisoning gives up here, between rounds
        return committed

    def _group_quorum(self, join: bool) -> QuorumView:
        """INNER_QUORUM for the whole replica group: every rank joined, or every rank takes
        the same failure (group_vote.py). A failed quorum on any rank fails the round on all
        (a rollback); otherwise an outage on any rank is an outage on all (local progress
        kept). When some ranks joined and some did not, every rank casts the round's commit
        vote (false) so the group's Manager calls stay matched; the joined ranks run no
        collective, and their peers' collectives in that quorum fail at their deadline.
        A heal that reached only some ranks cannot be undone: FatalSyncError on every rank
        (the launcher restarts the group, which heals as one).
        One rank per group: :meth:`_inner_quorum`. Raises what that raises."""
        if not self.vote.active:
            return self._inner_quorum(join)
        q: Optional[QuorumView] = None
        err: Optional[Exception] = None
        try:
            q = self._inner_quorum(join)
        except (LighthouseOutage, QuorumFailed) as e:
            err = e
        v = self.vote.agree("inner quorum", joined=q is not None, none_joined=q is None,
                            no_failure=not isinstance(err, QuorumFailed), no_heal=q is None or not q.healed)
        if v["joined"]:
            assert q is not None
            return q
        if not v["no_heal"]:  # a rank that healed holds the donor's model and counters, its sibling not
            raise FatalSyncError("a heal reached only some ranks of this replica group: the group restarts to heal whole")
        if not v["none_joined"]:  # a sibling is in the quorum: its commit vote waits for ours
            if q is not None:
                self.inner_mgr.report_error(RuntimeError("another rank of this replica group is not in the quorum"))
            try:
                self.inner_mgr.should_commit(self.tracker.remaining())
            except RuntimeError as e:  # torchft raises after max_retries consecutive failures
                raise FatalSyncError(f"inner commits keep failing: {e}") from e
        if not v["no_failure"]:
            raise err if isinstance(err, QuorumFailed) else QuorumFailed("inner quorum failed on another rank of this replica group")
        if isinstance(err, LighthouseOutage):
            raise err
        raise LighthouseOutage(self.health["inner"].message("another rank of this replica group found the lighthouse not answering"))

    def _inner_quorum(self, join: bool) -> QuorumView:
        """INNER_QUORUM: the early quorum's result when one was asked for this round
        (early.py; a heal it received is applied here, on the training thread), else a
        quorum request now. Raises what the quorum call raises."""
        tr, c = self.tracker, self.counters
        early, self._early = self._early, None
        self._serve_step = None  # the sync point's step is c.step now
        if early is not None and not join and early.step == c.step:
            try:
                q = early.result(tr.remaining())
            except EarlyQuorumStuck as e:
                raise FatalSyncError(str(e)) from e  # the heal flags stay: a late heal is never applied off-thread
            finally:
                heal = None
                if early.done():  # a quorum call that raised drops its heal; the next round heals again
                    heal, self._pending_heal, self._defer_heal = self._pending_heal, None, False
            if heal is not None:
                self._load_inner_state(heal)
            tr.set_extra(early_quorum_s=round(early.seconds or 0.0, 4))
            return q
        if early is not None:  # one request at a time per Manager: let the unused one end
            early.settle(tr.remaining())
            if not early.done():
                raise FatalSyncError(f"an unused early inner quorum for step {early.step} did not end within its phase")
            self._pending_heal, self._defer_heal = None, False
        return self.inner_mgr.start_quorum(tr.remaining(), self.health["inner"], self.s.quorum_slice, progress=training_progress(c.outer_round, c.step, c.inner_round))

    def is_apply_round(self) -> bool:
        return is_apply_round(self.counters.step, self.s.h_inner, self.s.h_outer, self.s.outer_delay, self.s.num_fragments)

    # ------------------------------------------------------------------ pieces
    def _consistency(
        self,
        comm: LevelComm,
        q: QuorumView,
        level: str,
        mine: guard.Fingerprint,
        tensors: List[torch.Tensor],
    ) -> guard.GuardPlan:
        """Exchanges fingerprints; if members disagree, resyncs from the newest one."""
        v = guard.encode(q.rank, q.size, mine)
        if not comm.allreduce_sum(v, CONTROL):
            # The round is lost (commit will fail); keep collectives matched: weight 0.
            return guard.GuardPlan([mine] * q.size, None, [0.0] * q.size, failed=True)
        fps = guard.decode(v, q.size)
        p = guard.plan(fps, max_behind=self.s.outer_max_staleness if level == "outer" else 0, ratio=self.s.poison.norm_ratio)
        for i in p.excluded_ranks():
            self.poison.excluded(level, guard.member_name(fps[i].who, level), p.excluded[i], fps[i].norm,
                                 mine=i == q.rank, step=self.counters.step)
            if i == q.rank:
                self.tracker.set_extra(excluded=self.poison.count)  # the dashboard's count
        if p.source is None:
            return p
        src = fps[p.source]
        logger.warning("%s %s level diverged: resync from rank %d (%s)", self.id, level, p.source, src)
        buf = guard.pack(tensors) if q.rank == p.source else torch.empty(sum(t.numel() for t in tensors))
        if comm.broadcast(buf, p.source, CONTROL) and q.rank != p.source:
            if level == "outer" and src.outer_round > mine.outer_round and self._outer_base is None:
                self._outer_base = tensors[0].clone()  # the global model its work started from (a stale update)
            guard.unpack_into(buf, tensors)
            if level == "inner":
                self.counters.outer_round, self.counters.inner_round = src.outer_round, src.inner_round
                self.counters.step = src.step
            else:
                self._outer_healed = (src.outer_round, src.step)
        self.events("resync", level=level, source=p.source, diverged=p.diverged(q.rank), step=self.counters.step)
        return p

    def _reduce(
        self, level: Level, comm: LevelComm, live: torch.Tensor, plan: guard.GuardPlan, rank: int,
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


    def _screen_norm(self, level: Level, live: torch.Tensor, base: Optional[torch.Tensor], weight: float, rounds: float = 1.0) -> float:
        """The norm this member's contribution shows the poison screen (guard.py): of the
        whole group's pseudo-gradient (every rank's slice, one sum on the group's own
        process group, so every ring judges the group alike), divided by ``rounds`` of
        work; guard.NONFINITE; 0 at weight 0. Every rank of a group calls it."""
        ss = level.sum_of_squares(live, base) if weight > 0 else 0.0
        n = guard.contribution_norm(self.vote.total(ss))
        return n / rounds if n > 0 else n

    def _restore_optimizer(self) -> None:
        """An excluded member's inner optimizer goes back to its state at the last commit
        (before the poisoned steps), or starts afresh if that state is not finite either."""
        if host_state_finite(self._opt_backup):
            self.opt.load_state_dict(copy.deepcopy(self._opt_backup))
            self.events("optimizer_restored", step=self.counters.step, how="last commit")
        else:
            self.opt.state.clear()
            self.events("optimizer_restored", step=self.counters.step, how="reset")

    # ------------------------------------------------------------------ overlapped outer sync


    def _broadcast(self, result: Optional[OuterResult], prior: torch.Tensor) -> OuterResult:
        """BROADCAST: the leader (inner rank 0) sends status + model to its cluster.

        Both broadcasts run on every member unless the header *says* ABORT: a
        receiver that lost the header still joins the model broadcast (its result
        is discarded), so the leader never waits for a peer that bailed out.
        """
        header = OuterResult.empty_header()
        if self._leader:
            assert result is not None
            header[:] = result.header()
        header_ok = self.inner_comm.broadcast(header, 0, CONTROL)
        if self._leader:
            assert result is not None
            status: Optional[Status] = result.status
        else:
            status = Status(int(header[0])) if header_ok else None  # None: unknown
        if status == Status.ABORT:
            self.inner_mgr.report_error(RuntimeError("the leader aborted this round"))
            return OuterResult(Status.ABORT, None, self.counters.outer_round, self.counters.step)
        # A receiver starts from its own cluster model: what a lossy link's stale fill keeps.
        params = result.params if self._leader and result is not None else prior.clone()
        assert params is not None
        params_ok = self.inner_comm.broadcast(params, 0, PAYLOAD)
        residual = self._broadcast_residual()  # issued whenever the model broadcast is
        if not (header_ok and params_ok) or status is None or (self.comp is not None and residual is None):
            return OuterResult(Status.ABORT, None, self.counters.outer_round, self.counters.step)
        return OuterResult.from_header(header, params, residual=residual)

    def _apply(self, ok: bool, staged: Staged, result: Optional[OuterResult], plan: guard.GuardPlan) -> bool:
        """INNER_COMMIT's outcome: adopt the staged state, or roll back."""
        c = self.counters
        outer_final = self._leader and result is not None and result.status == Status.OUTER_COMMITTED
        if not ok:
            if outer_final:
                # The outer commit is final even though our cluster's round failed.
                assert result is not None and result.params is not None
                self._adopt_outer(result, self.inner.backup)
            self._rollback("inner commit vote failed")
            return False

        self.inner.commit(staged)
        self.inner.norm_ref = guard.accepted_median(plan.fingerprints, plan.weights) or self.inner.norm_ref
        self._kept_sent = False
        if plan.weights and plan.weights[min(self._last_rank, len(plan.weights) - 1)] == 0:
            # committed, but our steps carried weight 0
            self._discard_local_work(self._weight0_why or ("resync" if plan.source is not None else "guard_failed"))
        self._since_outer += self.work["steps_since_commit"]
        self.work["steps_since_commit"] = 0
        adopted = result is not None and result.status != Status.ABORT and result.params is not None
        if adopted and result is not None and result.status == Status.OUTER_COMMITTED:
            # What the outer round carried: all inner-committed work since the last outer
            # commit, or (overlapped) what there was at its launch; the rest rides on the next.
            carried = min(self._snap_since_outer, self._since_outer) if result.merge else self._since_outer
            if result.cluster_weight == 0:
                # The global model moved without this cluster's work (it had just
                # healed to a newer one): the work it carried is lost.
                self._count_discarded(carried, "outer", "cluster_weight0")
            self._since_outer -= carried
        self.tracker.set_extra(**self.work_counters())
        if adopted:
            assert result is not None and result.params is not None
            if result.status == Status.OUTER_COMMITTED:
                self._adopt_outer(result, self.inner.backup)
            else:
                self.inner.set_backup(result.params)
                c.outer_round, c.step = result.outer_round, result.step
            if self.comp is not None and result.residual is not None and not self._leader:
                self.comp.load(result.residual)  # the leader's committed residual (compression.py)
        if plan.total_weight > 0 or adopted:
            c.inner_round += 1
        self._publish_committed()
        if self._weight0_why == "excluded":  # its optimizer took the poisoned steps: back to the last commit's
            self._restore_optimizer()
        self._opt_backup = host_state(self.opt.state_dict())
        self.tracker.set_counters(step=c.step, inner_round=c.inner_round, outer_round=c.outer_round)
        self.tracker.mark_commit("inner", c.inner_round)
        self.events(
            "commit", level="inner", inner_round=c.inner_round, outer_round=c.outer_round, step=c.step,
            outer=bool(result is not None and result.status == Status.OUTER_COMMITTED),
            cluster_weight=result.cluster_weight if result is not None and result.status == Status.OUTER_COMMITTED else None,
            total_weight=plan.total_weight, participants=len(plan.weights), checksum=checksum(self._committed),
        )
        self.tracker.enter(Phase.LOCAL)
        return True


    def _quorum_failed(self, level: str, e: Exception) -> None:
        self._quorum_failures[level] += 1
        n = self._quorum_failures[level]
        self.events("timeout" if is_timeout(e) else "quorum_failed", level=level, op="quorum", phase=self.tracker.phase.value, detail=str(e)[:200])
        logger.warning("%s %s quorum failed (%d in a row): %s", self.id, level, n, e)
        # At every failure, not only the last: a group behind a job that has finished waits
        # out one quorum timeout, not max_quorum_failures of them (seen: a lagging cluster's
        # leader 3 x 120 s, then its successor as long again).
        self._check_job_done()
        if n >= self.s.max_quorum_failures:
            raise FatalSyncError(f"{level} quorum failed {n} times in a row (last: {e})") from e

    def _check_job_done(self) -> None:
        """Raises :class:`JobFinished` if the job ended without this group (a late or lone
        group must not exit non-zero, or its launcher would restart it for nothing)."""
        done = self.job_done() if self.job_done is not None else None
        if done:
            raise JobFinished(done)

    def _outage(self, level: str, e: LighthouseOutage) -> None:
        """A round skipped because the level's lighthouse does not answer (outage.py)."""
        health = self.health[level]
        if not self._published_outage[level]:
            self._published_outage[level] = True
            self.events("outage", level=level, state="start", lighthouse=health.addr, detail=str(e)[:200], step=self.counters.step)
        self._publish_outages()
        try:
            health.check_limit()
        except OutageLimitExceeded as limit:
            self._check_job_done()
            raise FatalSyncError(str(limit)) from limit

    def _lighthouse_ok(self, level: str) -> None:
        health = self.health[level]
        was = self._published_outage[level]
        health.mark_up()
        if was:
            self._published_outage[level] = False
            self.events("outage", level=level, state="end", lighthouse=health.addr, step=self.counters.step)
            self._publish_outages()

    def _publish_outages(self) -> None:
        self.tracker.set_extra(outage={lv: h.describe() for lv, h in self.health.items() if h.describe() is not None} or None)

    # ------------------------------------------------------------------ leadership
    def _set_leader(self, leader: bool) -> None:
        if leader != self._leader:
            self._leader = leader
            self.tracker.set_counters(leader=leader)
            self.events("leader", leader=leader, step=self.counters.step)
            logger.info("%s %s its cluster's leader", self.id, "is now" if leader else "is no longer")
        if not leader:
            self._outer_fresh = True  # a member does not keep the outer momentum up to date
        if not leader and self.outer_mgr is not None:
            self.outer_mgr.shutdown()  # aborts a stage's process group too
            self.outer_mgr, self.outer_comm = None, None
            self.tracker.set_extra(outer=None)
        if not leader:
            self._drop_stage("no longer the leader")
        if leader and self.outer_mgr is None and not self.health["outer"].down and self.health["outer"].probe():
            # Join the global lighthouse early so the first outer quorum waits for us.
            try:
                self._ensure_outer()
            except LighthouseUnreachable as e:
                self.health["outer"].mark_down()
                logger.error("%s cannot reach the global lighthouse yet: %s", self.id, e)

    def _manager(self, level: str, pg: LinkProcessGroup, store_key: str) -> LevelManager:
        """The Manager of one level (inner: the cluster's lighthouse; outer: the global one)."""
        s, inner = self.s, level == "inner"
        return LevelManager(
            level=level,
            replica_id=self.id.inner_replica_id if inner else self.id.outer_replica_id,
            lighthouse_addr=s.cluster_lighthouse if inner else s.global_lighthouse,
            lighthouse_field=s.cluster_lighthouse_field if inner else s.global_lighthouse_field,
            pg=pg,
            state_dict=self._inner_state_dict if inner else self._outer_state_dict,
            load_state_dict=self._load_inner_state if inner else self._load_outer_state,
            min_replicas=s.min_replicas if inner else s.min_clusters,
            timeouts=self.t,
            hostname=s.hostname,
            group_rank=s.group_rank,
            group_world_size=s.group_world_size,
            max_commit_failures=s.max_commit_failures,
            group_store=self.group_store,
            store_key=store_key,
            presence_timeout=s.quorum_slice,  # a left-over quorum request costs this, not a phase
        )

    # ------------------------------------------------------------------ faults
    def _fault_point(self, phase: Phase, step: Optional[int] = None) -> None:
        """Fires a planned fault for this step (default: the current one) and phase (tests, experiments)."""
        step = self.counters.step if step is None else step
        f = self.faults.take(step, phase.value, ACTIONS)
        if f is None:
            return
        self.events("fault", action=f.action, phase=phase.value, step=step)
        logger.warning("%s injecting fault %s", self.id, f)
        link = self.outer_link if phase == Phase.OUTER_REDUCE else self.inner_link
        fire(f, f"{phase.value} at step {step}", link.arm_failure)
