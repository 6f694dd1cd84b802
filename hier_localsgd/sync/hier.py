"""Hierarchical LocalSGD/DiLoCo: one sync round of one replica group, top to bottom.

Every ``h_inner`` local steps the replica groups of a cluster run an inner round
through the cluster's lighthouse; every ``h_outer`` inner rounds (``step`` a
multiple of ``h_inner * h_outer``) the round also carries the outer level: the
cluster's leader (rank 0 of the inner quorum) syncs across clusters through the
global lighthouse and broadcasts the result to its cluster, inside the same inner
quorum. Only leaders touch the slow links; slow-link traffic per outer round is
one model per cluster whatever the number of replica groups. With streaming
fragments (``sync.outer.fragments = F``, core/tensors/fragments.py) an outer round comes every
``h_inner * h_outer / F`` steps and carries one fragment (the run's last round the
whole model); with the early inner quorum (early.py) INNER_QUORUM collects a request
made during the round's last local step. With the asynchronous outer level each cluster
pushes on its own schedule (async_outer.py ``is_push_step``; with ``match_pace`` its push
steps need not be on the ``h_inner`` grid, and it runs an inner round there).

One round (the phases are in :mod:`hier_localsgd.core.runtime.phases`)::

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

(The round's phases stay in this file, in order; each part owns its state: the
committed state, heals, rollback and the inner stale update are committed.py's
CommittedState, INNER_QUORUM (the early request, the group's vote on it)
inner_quorum.py's InnerQuorum, the leader's outer level (blocking and overlapped, fragments,
compression, outer heals) and the broadcast outer_round.py's OuterLevel (its round in flight
outer_stage.py's LeaderStage), the end of a run after an outage final.py's FinalWait; what
they all read is state.py's SyncState, with the settings and the pieces every level runs:
the guard, the reduce, faults, outages.)
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Callable, Dict, Optional, Tuple

import torch
from torch.optim import Optimizer

from hier_localsgd.core.tensors import guard
from hier_localsgd.core.ft.comm import LevelComm, is_timeout
from hier_localsgd.core.runtime.device import host_copy
from hier_localsgd.core.runtime.faults import FaultPlan
from hier_localsgd.core.tensors.flat_params import FlatParams
from hier_localsgd.core.tensors.fragments import Ranges
from hier_localsgd.core.runtime.invariants import CollectiveGate, check_disjoint_tensors
from hier_localsgd.core.tensors.level import Level
from hier_localsgd.core.links.link import LinkProcessGroup
from hier_localsgd.core.ft.managers import QuorumFailed
from hier_localsgd.core.ft.outage import LighthouseHealth, LighthouseOutage
from hier_localsgd.core.ft.peers import QuorumWatch
from hier_localsgd.core.runtime.phases import Phase, PhaseTracker
from hier_localsgd.core.runtime.timeouts import Timeouts
from hier_localsgd.sync.async_outer import AsyncOuterSettings
from hier_localsgd.sync.committed import CommittedState
from hier_localsgd.sync.common import EventSink, FatalSyncError, Identity, JobFinished, OuterResult, Status
from hier_localsgd.sync.compression import build as build_compression
from hier_localsgd.sync.final import FinalWait
from hier_localsgd.sync.group_vote import GroupVote
from hier_localsgd.sync.inner_quorum import InnerQuorum
from hier_localsgd.sync.outer_round import OuterLevel
from hier_localsgd.sync.overlap import is_apply_round, is_launch_round
from hier_localsgd.sync.poison import PoisonRecord
from hier_localsgd.sync.state import HierSettings, SyncState, consistency, fault_point, lighthouse_ok, manager, outage, reduce, screen_norm
from hier_localsgd.sync.user_state import UserState

logger = logging.getLogger(__name__)

__all__ = ["HierSettings", "HierarchicalSync", "Identity"]


def _shared(name: str) -> property:
    """An attribute of the round's :class:`SyncState`, read and set through the sync
    (tests and the training loop reach ``sync.counters``, ``sync.settings``, ...)."""
    return property(lambda self: getattr(self.st, name), lambda self, v: setattr(self.st, name, v))


def _outer(name: str) -> property:
    """An attribute of the :class:`OuterLevel` (the cluster Manager, the outer link's stats)."""
    return property(lambda self: getattr(self.outer_level, name), lambda self, v: setattr(self.outer_level, name, v))


class HierarchicalSync:
    """Runs the hierarchical sync for one replica group (see the module docstring).

    The training loop calls :meth:`start` once, then :meth:`after_optimizer_step`
    after every local step (having advanced ``counters.step`` itself).

    It owns the parts of the round (module doc): ``committed`` (:class:`CommittedState`),
    ``outer_level`` (:class:`OuterLevel`), ``inner_quorum`` (:class:`InnerQuorum`) and
    ``final`` (:class:`FinalWait`), built on one shared :class:`SyncState` ``st``.
    """

    settings = _shared("settings")
    id = _shared("id")
    flat = _shared("flat")
    tracker = _shared("tracker")
    events = _shared("events")
    counters = _shared("counters")
    job_done = _shared("job_done")
    part = _shared("part")
    inner = _shared("inner")
    outer = _shared("outer")
    comp = _shared("comp")
    health = _shared("health")
    work = _shared("work")
    outer_mgr = _outer("mgr")
    outer_comm = _outer("comm")
    outer_stats = _outer("stats")
    fragments = _outer("schedule")

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
        async_outer: Optional[AsyncOuterSettings] = None,
    ) -> None:
        """``group``/``group_store``: the replica group's own torch.distributed process
        group and store (torchrun's), when it has several ranks. ``job_done``: returns a
        message once the job has finished without this group (status.py), asked before
        a failing quorum ends the process. ``user_state``: the user's objects that heal and
        checkpoint with the model (user_state.py). ``async_outer``: the asynchronous outer
        level's server (async_outer.py); None: synchronous outer rounds."""
        tracker.budgets = timeouts  # every phase's deadline, named once (Timeouts.phase)
        # This rank's slice of the flat vector (all of it with one rank per group).
        g, k = settings.group_world_size, settings.group_rank
        if settings.group_shards:
            g, k = 1, 0  # the flat vector already is this rank's shard
        slice_len = (flat.numel + g - 1) // g
        part = slice(min(flat.numel, k * slice_len), min(flat.numel, (k + 1) * slice_len))
        if g > 1 and (group is None or group_store is None):
            raise ValueError("a replica group of several ranks needs its process group and store")
        overlap = settings.outer_delay > 0
        probe = min(timedelta(seconds=1), settings.quorum_slice)
        self.st = SyncState(
            settings=settings, id=identity, timeouts=timeouts, flat=flat, opt=inner_optimizer, tracker=tracker, events=events,
            faults=faults or FaultPlan([], identity.cluster, identity.replica), user=user_state or UserState(),
            part=part, slice_len=slice_len,
            group=group, group_store=group_store,  # group_store is already per attempt (job.py)
            job_done=job_done,
            inner=Level("inner", settings.inner, flat.data[part]),
            outer=Level("outer", settings.outer, flat.data[part]),
            comp=build_compression(settings.outer_compression, settings.outer_compression_block, part.stop - part.start,
                                   settings.outer_topk),
            snap=host_copy(flat.data[part]) if overlap else None,
            stand_in=torch.zeros_like(host_copy(flat.data[part])) if settings.outer_eager else None,
            # Overlapped outer sync (overlap.py): the leader's inner and outer groups may each
            # have a collective in flight (they share no pair of processes, I1).
            gate=CollectiveGate(concurrent=[("inner", "outer")] if overlap else ()),
            health={
                "inner": LighthouseHealth("inner", settings.cluster_lighthouse_field, settings.cluster_lighthouse, probe, settings.quorum_slice, settings.outage_limit),
                "outer": LighthouseHealth("outer", settings.global_lighthouse_field, settings.global_lighthouse, probe, settings.quorum_slice, settings.outage_limit),
            },
            quorum_failed=self._quorum_failed, check_job_done=self._check_job_done,
        )
        st = self.st
        self._quorum_failures = st.quorum_failures  # one dict: _quorum_failed counts, the levels reset
        self.committed = CommittedState(st)
        self.outer_level = OuterLevel(st, self.committed, async_outer)
        self.inner_quorum = InnerQuorum(st, self.committed)  # INNER_QUORUM, the early request too
        self.final = FinalWait(st, self._final_join_round)
        check_disjoint_tensors(
            [
                ("model parameters (inner optimizer)", [flat.data]),
                ("inner level backup and outer optimizer", st.inner.state_tensors()),
                ("outer level backup and outer optimizer", st.outer.state_tensors()),
                ("committed model", [self.committed.model]),
                ("outer compression residual", [] if st.comp is None else [st.comp.residual]),
            ]
        )
        if st.snap is not None:
            check_disjoint_tensors([("model parameters (inner optimizer)", [flat.data]), ("outer stage snapshot", [st.snap]),
                                    ("eager stand-in", [] if st.stand_in is None else [st.stand_in])])
        self._last_quorum_size = 0
        self._last_rank = 0
        self._last_healed = False
        self._weight0_why = ""
        tracker.set_extra(**st.work_counters())

        st.inner_link = LinkProcessGroup("inner", timeouts.inner_pg, emulation=settings.inner_link, backend=settings.inner_backend)
        st.inner_mgr = manager(st, "inner", st.inner_link, "store/inner", self.committed.state_dict, self.committed.load_state_dict)
        st.inner_comm = LevelComm(st.inner_mgr, st.inner_link, tracker, st.gate, events,
                                  watch=QuorumWatch(settings.cluster_lighthouse, settings.quorum_slice))
        # Several ranks per group: they agree before every branch (group_vote.py).
        vote_dev = torch.device("cpu")
        if group is not None and g > 1:
            import torch.distributed as dist

            if dist.get_backend(group) == "nccl":  # type: ignore[arg-type]
                vote_dev = flat.data.device
        st.vote = GroupVote(group, settings.group_world_size, vote_dev, events)
        st.poison = PoisonRecord(str(identity), settings.poison, events)

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
        try:
            self._start()
        finally:
            if self.outer_level.asynchronous is not None:
                self.outer_level.asynchronous.started(self.st.counters.step)  # its first period starts with training

    def _start(self) -> None:
        st = self.st
        deadline = time.time() + st.timeouts.startup.total_seconds()
        while True:
            st.tracker.set_counters(step=st.counters.step)
            self.round(join=True)
            if self._last_healed or self._last_quorum_size >= st.settings.replicas_per_cluster:
                return
            if time.time() > deadline:
                logger.warning("%s starting with %d of %d replica groups after %s", st.id, self._last_quorum_size, st.settings.replicas_per_cluster, st.timeouts.startup)
                return
            # A restart that comes up just after the last group finished would otherwise wait
            # out the start-up and three outer quorums alone (seen: 150 s in test_overlap).
            self._check_job_done()
            time.sleep(0.2)

    def before_forward(self) -> None:
        """With ``early_quorum``: the last local step of a round asks for the round's
        quorum meanwhile (early.py). Otherwise nothing: syncs happen at round boundaries."""
        st = self.st
        c = st.counters
        if st.settings.early_quorum and self.inner_quorum.early is None and self.is_sync_step(c.step + 1):
            self.inner_quorum.ask_early()

    def before_optimizer_step(self) -> bool:
        """Local steps always apply; a failed round rolls them back later."""
        return True

    def after_optimizer_step(self) -> bool:
        """Runs a round at round boundaries; returns whether one ran."""
        st = self.st
        st.work["steps_run"] += 1
        st.work["steps_since_commit"] += 1
        st.tracker.set_extra(**st.work_counters())  # a status written mid-round must not be stale
        st.tracker.set_counters(step=st.counters.step)
        if self.is_sync_step(st.counters.step):
            self.round()
            return True
        st.tracker.enter(Phase.LOCAL)
        return False

    def finish(self) -> None:
        """After the last step: reconciles a cluster whose final round met a cluster
        lighthouse outage (final.py); with the asynchronous outer level, join rounds until
        the cluster holds the job's final version (async_outer.py). Never raises."""
        self.final.finish()
        if self.outer_level.asynchronous is not None:
            self.final.await_version(self.outer_level.asynchronous)

    def work_counters(self) -> Dict[str, int]:
        """``work`` plus ``steps_since_outer``: steps committed at the inner level since the last outer commit."""
        return self.st.work_counters()

    def is_sync_step(self, step: int) -> bool:
        """A round ends at ``step``: every ``h_inner`` steps, and at the run's last step
        (``final_step``), which need not be a multiple of anything: a final partial round;
        with the asynchronous level, also at its cluster's push steps (async_outer.py)."""
        asy = self.outer_level.asynchronous
        if asy is None:
            return step % self.st.settings.h_inner == 0 or self._is_final(step)
        return (step % self.st.settings.h_inner == 0 and not asy.skips_round(step)) or self._is_final(step) or asy.is_push_step(step)

    def _is_final(self, step: int) -> bool:
        return self.st.settings.final_step > 0 and step == self.st.settings.final_step

    def is_outer_round(self) -> bool:
        """The round at the current step carries the outer level: on the schedule every
        cluster computes alike (overlap.is_launch_round), and at the run's last step, so the
        run ends on one synced model whatever ``train.steps`` is."""
        s, step = self.st.settings, self.st.counters.step
        asy = self.outer_level.asynchronous
        if asy is not None:  # each cluster's own push schedule (async_outer.py)
            return asy.is_push_step(step) or self._is_final(step)
        return is_launch_round(step, s.h_inner, s.h_outer, s.num_fragments) or self._is_final(step)

    def is_apply_round(self) -> bool:
        """The round applies an overlapped outer round's result: ``sync.outer.delay`` rounds
        after its launch on the schedule; asynchronous, the round after its push (async_outer.py)."""
        s = self.st.settings
        asy = self.outer_level.asynchronous
        if asy is not None:
            return asy.is_apply_round(self.st.counters.step)
        return is_apply_round(self.st.counters.step, s.h_inner, s.h_outer, s.outer_delay, s.num_fragments)

    def fragment_ranges(self, fragment: Optional[int]) -> Optional[Ranges]:
        """The ranges of this rank's slice an outer round of ``fragment`` syncs (None: all of it)."""
        return self.outer_level.fragment_ranges(fragment)

    @property
    def leader(self) -> bool:
        return self.st.leader

    def link_stats(self) -> Dict[str, Dict[str, object]]:
        return {"inner": self.st.inner_link.stats.as_dict(), "outer": self.outer_level.stats.as_dict()}

    def global_model(self) -> Optional[torch.Tensor]:
        """The global model as this process last applied it: the outer level's backup (the
        result of the last outer round it adopted, without its cluster's progress since;
        with ``sync.outer.delay`` the round applied at the last merge). None where this rank
        holds only its slice of it (a replica group of several ranks, not sharded)."""
        return self.outer.backup if (self.part.start, self.part.stop) == (0, self.flat.numel) else None

    def snapshot(self) -> Dict[str, object]:
        """The committed state for a durable checkpoint (clones; call right after a commit)."""
        return self.committed.snapshot()

    def restore(self, sd: Dict[str, object]) -> None:
        """Loads a checkpoint's state (before the join round of a resumed job)."""
        self.committed.restore(sd)

    def close(self) -> None:
        self.outer_level.close()
        self.st.inner_mgr.shutdown()

    # ------------------------------------------------------------------ one round
    def round(self, join: bool = False) -> bool:
        """Runs one sync round; returns whether this replica committed it."""
        st, cs, ol = self.st, self.committed, self.outer_level
        tr, c = st.tracker, st.counters
        # keep_local may keep this round's local steps only if what it committed has not
        # moved when the round fails (a heal, a resync or an outer commit moves it).
        cs.round_start_hash = cs.inner_hash() if st.settings.keep_local and not join else None
        cs.inner_stale = None  # a heal in this round's quorum keeps what it replaced here
        st.poison.begin_round()
        tr.enter(Phase.INNER_QUORUM, reason="join" if join else "")
        fault_point(st, Phase.INNER_QUORUM)
        try:
            q = self.inner_quorum.for_group(join)
        except LighthouseOutage as e:
            # Nothing was exchanged: keep the local progress and train on (outage.py).
            outage(st, "inner", e)
            if not join and st.settings.final_step > 0 and c.step >= st.settings.final_step:
                self.final.outage = True  # finish() reconciles the cluster (final.py)
            if st.leader and self.is_outer_round() and st.settings.group_world_size == 1 and not join:
                ol.without_cluster()
            tr.enter(Phase.LOCAL, reason="cluster lighthouse not answering: round skipped")
            return False
        except QuorumFailed as e:
            self._quorum_failed("inner", e)
            cs.rollback(f"inner quorum failed: {e}")
            return False
        lighthouse_ok(st, "inner")
        st.quorum_failures["inner"] = 0
        self._last_quorum_size, self._last_rank, self._last_healed = q.size, q.rank, q.healed
        tr.set_extra(inner=st.inner_mgr.describe(q.size))
        if q.healed:
            st.events("heal", level="inner", step=c.step, inner_round=c.inner_round, outer_round=c.outer_round)
        self._set_leader(q.rank == 0)

        tr.enter(Phase.INNER_REDUCE)
        fault_point(st, Phase.INNER_REDUCE)
        # Why this member's steps would carry weight 0 ("" = they count, unless the guard resyncs it).
        # A member that healed keeps its weight when its work is a stale update within bounds.
        stale = cs.stale_inner(join)
        healed = q.healed or cs.inner_stale is not None  # (a heal in an earlier slice of the request too)
        errored = st.inner_mgr.errored() is not None
        self._weight0_why = "join" if join else "heal" if healed and stale is None else "errored" if errored else ""
        weight = 0.0 if self._weight0_why else 1.0
        live, base, behind = stale if stale is not None else (st.flat.data[st.part], None, 0)
        # The screen's norm, per round of this member's work (a stale update spans several).
        rounds = max(1.0, st.work["steps_since_commit"] / st.settings.h_inner)
        plan = consistency(
            st, st.inner_comm, q, "inner",
            guard.Fingerprint(cs.inner_hash(), c.outer_round, c.inner_round, c.step, weight,
                              norm=screen_norm(st, st.inner, live, base, weight, rounds), ref=st.inner.norm_ref,
                              who=guard.member_code(st.id.cluster, st.id.replica)),
            tensors=cs.inner_tensors(), on_resync=self._resynced,
        )
        if plan.excluded and plan.excluded[q.rank]:
            self._weight0_why = "excluded"
            cs.round_start_hash = None  # keep_local never keeps an excluded member's steps
        staged = reduce(st.inner, st.inner_comm, live, plan, q.rank, base=base)
        sent = plan.total_weight > 0 and plan.weights[q.rank] > 0
        asy = ol.asynchronous
        if asy is not None:
            asy.note_work(plan.total_weight, c.step)  # the tokens the next push carries
        stale_steps = st.work["steps_since_commit"] if stale is not None and sent else 0
        # Each rank saw its own ring: the group takes one path (group_vote.py). A rank whose
        # inner level failed fails the group's round; a rank whose consistency exchange
        # failed (its plan has no weight) still follows its siblings into the outer round.
        # "idle": nobody contributed and nobody was excluded (everyone joining). A cluster
        # whose only contributions were excluded still carries its earlier rounds' work and
        # must meet the other clusters at the outer level.
        idle = plan.total_weight == 0 and not plan.excluded_ranks()
        v = st.vote.agree("inner round", inner_ok=st.inner_mgr.errored() is None, idle=idle)
        inner_ok = v["inner_ok"]
        if not inner_ok and st.inner_mgr.errored() is None:
            st.inner_mgr.report_error(RuntimeError("the inner round failed on another rank of this replica group"))

        result: Optional[OuterResult] = None
        # A round nobody contributed to (everyone joining: a fresh or resumed start) is a
        # no-op at both levels; stepping the outer optimizer on a zero pseudo-gradient
        # would still move the model by its momentum. Every member knows the total.
        outer_now = self.is_outer_round() and not v["idle"]
        outer_join = not outer_now and ol.join_wanted(join, q, plan)  # a cluster restarted whole
        final = st.settings.final_step > 0 and c.step >= st.settings.final_step
        async_pull = asy is not None and asy.pulling  # finish(): the job's final version
        if outer_join or async_pull or (outer_now and (not ol.overlap or final)):
            # The final round waits for an overlapped round still in flight (one outer
            # round at a time on the Manager); its members wait that much longer.
            after_stage = final and ol.overlap
            if st.leader and async_pull:
                assert asy is not None
                tr.enter(Phase.OUTER_QUORUM, reason="asynchronous: asking for the job's final version")
                result = asy.pull_final(cs.without_stand_in(staged.backup))
            elif st.leader:
                if not after_stage:
                    ol.leader_stage.drop("a blocking outer round")  # a result never applied (its apply round was skipped)
                # The cluster model carries the whole cluster's work since the last outer
                # commit, so it contributes whenever its inner round is valid (a join: nothing).
                result = ol.run(cs.without_stand_in(staged.backup), contribute=inner_ok and not outer_join, inner_ok=inner_ok,
                                after_stage=after_stage)
            if after_stage and not st.leader:
                tr.enter(Phase.BROADCAST, st.timeouts.final_broadcast_wait, leader=False)
            else:
                tr.enter(Phase.BROADCAST, leader=st.leader)
            fault_point(st, Phase.BROADCAST)
            result = ol.broadcast(result, prior=cs.without_stand_in(staged.backup))  # a lost packet's fill: as the leader's
            if async_pull:
                asy.answered(result.status, result.cluster_weight > 0)  # type: ignore[union-attr]
        elif ol.overlap and self.is_apply_round():
            # Every member knows this round by its step: the header tells whether a global
            # model follows (overlap.py).
            tr.enter(Phase.BROADCAST, leader=False)
            fault_point(st, Phase.BROADCAST)
            result = ol.leader_stage.collect() if st.leader else None
            result = ol.broadcast_global(result, prior=staged.backup)

        tr.enter(Phase.INNER_COMMIT)
        fault_point(st, Phase.INNER_COMMIT)
        try:
            ok = st.inner_mgr.should_commit(tr.remaining())
        except RuntimeError as e:  # torchft raises after max_retries consecutive failures
            raise FatalSyncError(f"inner commits keep failing: {e}") from e
        committed = cs.apply(ok, staged, result, plan, self._last_rank, self._weight0_why,
                             adopt=ol.adopt, carried_at_launch=ol.snap_since_outer)
        cs.inner_stale = None
        if asy is not None:
            asy.round_ended(committed, c.step)
        if async_pull and committed and result is not None and result.status == Status.OUTER_COMMITTED:
            asy.final = True  # type: ignore[union-attr]  # every member: the job's final version
        if not committed and sent and st.work["steps_since_commit"] > 0:
            cs.kept_sent = True  # keep_local kept them (CommittedState.stale_inner)
        if committed and stale_steps:
            st.events("stale_update", level="inner", steps=stale_steps, behind=behind, step=c.step)
        # Asynchronous: an answer merged in this round set a new schedule (from its push's
        # step, async_outer.py adopted); a push the old one put here waits for the new one.
        if outer_now and ol.overlap and not final and (asy is None or asy.is_push_step(c.step)):
            ol.launch(contribute=committed)
        st.poison.end_round()  # a group that keeps poisoning gives up here, between rounds
        return committed

    def _resynced(self, src: guard.Fingerprint) -> None:
        """The inner guard resyncs this member from ``src``: its counters too."""
        c = self.st.counters
        c.outer_round, c.inner_round = src.outer_round, src.inner_round
        c.step = src.step

    def _final_join_round(self) -> Tuple[bool, int]:
        """One join round for finish() (final.py): (committed, the size of its quorum)."""
        self._last_quorum_size = 0  # a round that fails before its quorum leaves no stale size
        committed = self.round(join=True)
        return committed, self._last_quorum_size

    def _quorum_failed(self, level: str, e: Exception) -> None:
        self._quorum_failures[level] += 1
        n = self._quorum_failures[level]
        self.events("timeout" if is_timeout(e) else "quorum_failed", level=level, op="quorum", phase=self.tracker.phase.value, detail=str(e)[:200])
        logger.warning("%s %s quorum failed (%d in a row): %s", self.id, level, n, e)
        # At every failure, not only the last: a group behind a job that has finished waits
        # out one quorum timeout, not max_quorum_failures of them (seen: a lagging cluster's
        # leader 3 x 120 s, then its successor as long again).
        self._check_job_done()
        if n >= self.settings.max_quorum_failures:
            raise FatalSyncError(f"{level} quorum failed {n} times in a row (last: {e})") from e

    def _check_job_done(self) -> None:
        """Raises :class:`JobFinished` if the job ended without this group (a late or lone
        group must not exit non-zero, or its launcher would restart it for nothing)."""
        done = self.job_done() if self.job_done is not None else None
        if done:
            raise JobFinished(done)

    # ------------------------------------------------------------------ leadership
    def _set_leader(self, leader: bool) -> None:
        st = self.st
        if leader != st.leader:
            st.leader = leader
            st.tracker.set_counters(leader=leader)
            st.events("leader", leader=leader, step=st.counters.step)
            logger.info("%s %s its cluster's leader", st.id, "is now" if leader else "is no longer")
        if not leader:
            self.outer_level.demote()
        else:
            self.outer_level.promote()
