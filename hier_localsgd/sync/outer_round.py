"""The leader's outer level of a hierarchical round (:class:`OuterLevel`, owned by
:class:`~hier_localsgd.sync.hier.HierarchicalSync`).

OUTER_QUORUM -> OUTER_REDUCE -> OUTER_COMMIT on the leader's cluster Manager, blocking
(on the round's tracker) or overlapped (overlap.py: launched at an outer round, collected
``sync.outer.delay`` inner rounds later), and the broadcast of its result to the cluster.
It owns the cluster Manager (which exists only while this group leads), the fragments,
what an outer heal or resync replaced, and the leader's outer stage (outer_stage.py's
LeaderStage: an overlapped round in flight, its launch, collection and drop).
Failure semantics are the round's (hier.py): a failed outer level rolls back the outer
stage only; inner work is never discarded for it.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional

import torch

from hier_localsgd.core.tensors import guard
from hier_localsgd.core.runtime.addresses import LighthouseUnreachable
from hier_localsgd.core.ft.comm import LevelComm
from hier_localsgd.core.runtime.device import host_copy
from hier_localsgd.core.tensors.flat_params import checksum
from hier_localsgd.core.tensors.fragments import FragmentSchedule, Ranges, gather, localize, scatter_
from hier_localsgd.core.tensors.level import Level
from hier_localsgd.core.links.stats import CONTROL, LinkStats
from hier_localsgd.core.links.link import LinkProcessGroup
from hier_localsgd.core.ft.managers import LevelManager, QuorumFailed, QuorumView
from hier_localsgd.core.ft.outage import LighthouseOutage
from hier_localsgd.core.ft.peers import QuorumWatch, fetch_status, parse_status
from hier_localsgd.core.runtime.phases import Phase, PhaseTracker
from hier_localsgd.sync import outer_broadcast
from hier_localsgd.sync.async_outer import AsyncOuter, AsyncOuterSettings
from hier_localsgd.sync.committed import CommittedState
from hier_localsgd.sync.common import FatalSyncError, OuterResult, Status, outer_progress
from hier_localsgd.sync.compression import OuterCompression
from hier_localsgd.sync.outer_stage import STAGE_DROP_S, LeaderStage
from hier_localsgd.sync.overlap import eager_stand_in, merge_keep_local
from hier_localsgd.sync.state import SyncState, consistency, fault_point, lighthouse_ok, manager, outage, reduce, screen_norm

logger = logging.getLogger("hier_localsgd.sync.hier")  # one logger name for the whole round


class OuterLevel:
    """The leader's outer level and the broadcast of its result (module doc).

    Public state the round reads: ``mgr``/``comm``/``link`` (the cluster Manager, None
    while this group does not lead), ``stats`` (the outer link's account across leadership
    changes), ``leader_stage`` (:class:`LeaderStage`: an overlapped round in flight),
    ``snap_since_outer`` (inner-committed steps the launched outer round carries),
    ``schedule`` (streaming fragments)."""

    def __init__(self, st: SyncState, committed: CommittedState, asynchronous: Optional[AsyncOuterSettings] = None) -> None:
        self.st = st
        self.committed = committed  # the leader's lone outer round (without_cluster) commits into it
        s = st.settings
        # Streaming fragments, in offsets of this rank's slice (core/tensors/fragments.py).
        self._fragments = [localize(r, st.part) for r in s.outer_fragments]
        self.schedule = FragmentSchedule(s.h_outer, s.num_fragments)  # keyed by committed outer rounds
        # The cluster Manager exists only while this replica group leads its cluster:
        # a Manager that heartbeats without joining would stall the global lighthouse.
        self.stats = LinkStats()
        # sync.async_outer: pushes to the global model server instead of a global quorum.
        self.asynchronous: Optional[AsyncOuter] = None if asynchronous is None else AsyncOuter(st, asynchronous, self.stats)
        if self.asynchronous is not None:
            committed.carry("async_outer", self.asynchronous)
        self.link: Optional[LinkProcessGroup] = None
        self.mgr: Optional[LevelManager] = None
        self.comm: Optional[LevelComm] = None
        self._epoch = 0
        # Overlapped outer sync (overlap.py), when sync.outer.delay > 0: its stage (outer_stage.py).
        self.overlap = s.outer_delay > 0
        self.leader_stage = LeaderStage(st, self.overlap, self.asynchronous, self.shutdown_manager)
        self.snap_since_outer = 0  # inner-committed steps the launched outer round carries
        self._healed: Optional[tuple[int, int]] = None
        # The global model this cluster's work started from, kept when an outer heal or
        # resync replaced it in this round (a stale contribution is measured from it).
        self._base: Optional[torch.Tensor] = None
        # The cluster Manager has not yet committed or healed an outer round: its outer
        # momentum may be stale (kept while this group was not the leader).
        self._fresh = True
        # The outer round whose pseudo-gradient this leader sent but whose commit failed.
        self._sent_round: Optional[int] = None

    def fragment_ranges(self, fragment: Optional[int]) -> Optional[Ranges]:
        """The ranges of this rank's slice an outer round of ``fragment`` syncs (None: all of it)."""
        return None if fragment is None or not self._fragments else self._fragments[fragment]

    # ------------------------------------------------------------------ the outer round
    def run(
        self, cluster_model: torch.Tensor, contribute: bool, inner_ok: bool,
        tr: Optional[PhaseTracker] = None, lvl: Optional[Level] = None, view: Optional[tuple[int, int]] = None,
        comp: Optional[OuterCompression] = None, norm: Optional[float] = None, after_stage: bool = False,
    ) -> OuterResult:
        """The leader's outer level: OUTER_QUORUM, OUTER_REDUCE, OUTER_COMMIT.

        Blocking (defaults): on the round's tracker, the outer level and the current
        counters. Overlapped (overlap.py): on the stage's tracker, a copy of the outer
        level (``lvl``, committed here, adopted at the apply round), of the compression
        state (``comp``), the counters at the launch (``view``) and the poison screen's
        norm of the contribution (``norm``, taken at the launch: it needs the group's own
        process group, which only the training thread uses); it then touches no state
        the training thread uses. ``after_stage``: the final partial round, which first waits
        for an overlapped round still in flight (:meth:`LeaderStage.await_stage`)."""
        st = self.st
        if self.asynchronous is not None:  # overlapped pushes run on the stage (LeaderStage.launch)
            if after_stage and self.leader_stage.busy:
                return self.leader_stage.last_push(cluster_model, contribute, inner_ok)
            return self.asynchronous.run(cluster_model, contribute, inner_ok, st.tracker)
        c = st.counters
        tr = st.tracker if tr is None else tr
        lvl = st.outer if lvl is None else lvl
        comp = st.comp if comp is None else comp
        cur_round, cur_step = view or (c.outer_round, c.step)
        fallback = OuterResult(Status.INNER_ONLY if inner_ok else Status.ABORT, cluster_model, cur_round, cur_step)
        if tr is not st.tracker and not st.leader:
            return fallback  # a stage whose leader was demoted before it began: no cluster Manager for it
        if after_stage:
            # The final partial round: the Manager is free once an overlapped round still in
            # flight on it has ended (LeaderStage.await_stage); OUTER_QUORUM is then re-armed for the
            # quorum itself.
            tr.enter(Phase.OUTER_QUORUM, st.timeouts.outer_level)
            deadline = tr.deadline() or time.time() + st.timeouts.outer_level.total_seconds()
            self.leader_stage.await_stage(end=deadline - STAGE_DROP_S)  # a drop, if any, also ends inside the budget
        joined = self.quorum(tr, cur_round, cur_step)
        if tr is st.tracker and st.vote.active:  # a blocking round: the group's ranks agree (group_vote.py)
            v = st.vote.agree("outer quorum", joined=joined is not None, none_joined=joined is None,
                              no_heal=joined is None or not joined[2].healed)
            if not v["joined"] and not v["no_heal"]:  # as for the inner quorum (inner_quorum.py for_group)
                raise FatalSyncError("an outer heal reached only some ranks of this replica group: the group restarts to heal whole")
            if not v["joined"]:
                self._quorum_split(joined, v["none_joined"], tr)
                return fallback
        if joined is None:
            return fallback
        mgr, comm, q = joined

        tr.enter(Phase.OUTER_REDUCE)
        fault_point(st, Phase.OUTER_REDUCE, cur_step, self.link)
        view_round, view_step = self._healed or (cur_round, cur_step)
        # A cluster that just healed to a newer global model measured its work from an
        # older one: within sync.outer.max_staleness rounds it contributes that work
        # measured from its old base (a stale update), else weight 0 this round.
        moved = self._healed is not None and view_round != cur_round
        weight = 1.0 if contribute and (not moved or self._stale(cur_round)) and mgr.errored() is None else 0.0
        if norm is None:  # blocking: every rank of the leader's group is here (it voted)
            norm = screen_norm(st, lvl, cluster_model, None, 1.0 if contribute else 0.0)
        mine = guard.Fingerprint(lvl.fingerprint(), view_round, 0, view_step, weight, norm=norm if weight > 0 else 0.0,
                                 ref=lvl.norm_ref, who=guard.member_code(st.id.cluster, 0))
        tensors = lvl.state_tensors()
        plan = consistency(st, comm, q, "outer", mine, tensors, on_resync=lambda src: self._resynced(src, mine, tensors))
        view_round, view_step = self._healed or (view_round, view_step)
        moved = self._healed is not None and view_round != cur_round  # the guard may have resynced it
        stale = self._stale(cur_round)
        # Streaming fragments: the round syncs fragment (outer round mod F), the same in
        # every cluster (the guard has brought every member to the quorum's outer round),
        # except the run's last round, which syncs the whole model so the run ends on one.
        # A cluster that healed to a newer global model adopts all of it (fragment None).
        last = st.settings.final_step > 0 and view_step >= st.settings.final_step
        fragment = self.schedule.fragment_for_sync(view_round) if st.settings.outer_fragments and not last else None
        sent = plan.total_weight > 0 and plan.weights[q.rank] > 0
        staged = reduce(lvl, comm, cluster_model, plan, q.rank, comp, self.fragment_ranges(fragment),
                        base=self._base if stale else None)

        tr.enter(Phase.OUTER_COMMIT)
        try:
            ok = mgr.should_commit(tr.remaining())
        except RuntimeError as e:
            if comp is not None:
                comp.rollback()
            raise FatalSyncError(f"outer commits keep failing: {e}") from e
        if not ok:
            if comp is not None:
                comp.rollback()
            if sent:
                # Its pseudo-gradient may have reached the others' commit: never again as a stale update.
                self._sent_round = cur_round
            st.events("rollback", level="outer", reason="outer commit vote failed", step=cur_step)
            return OuterResult(fallback.status, cluster_model, view_round, view_step)
        lvl.commit(staged)
        lvl.norm_ref = guard.accepted_median(plan.fingerprints, plan.weights) or lvl.norm_ref
        self._fresh, self._sent_round = False, None
        if comp is not None:
            comp.commit()
        if stale and plan.weights[q.rank] > 0:
            st.events("stale_update", level="outer", behind=view_round - cur_round, step=cur_step)
        new_round = view_round + (1 if plan.total_weight > 0 else 0)
        st.tracker.mark_commit("outer", new_round)
        st.events(
            "commit", level="outer", outer_round=new_round, step=view_step, fragment=fragment,
            participants=q.size, total_weight=plan.total_weight, checksum=checksum(lvl.backup),
        )
        return OuterResult(Status.OUTER_COMMITTED, lvl.backup.clone(), new_round, view_step, plan.weights[q.rank],
                           fragment=None if moved else fragment)

    def _resynced(self, src: guard.Fingerprint, mine: guard.Fingerprint, tensors: List[torch.Tensor]) -> None:
        """The outer guard resyncs this leader's level from ``src`` (before its tensors change)."""
        if src.outer_round > mine.outer_round and self._base is None:
            self._base = tensors[0].clone()  # the global model its work started from (a stale update)
        self._healed = (src.outer_round, src.step)

    def quorum(self, tr: PhaseTracker, cur_round: int, cur_step: int) -> Optional[tuple[LevelManager, LevelComm, QuorumView]]:
        """OUTER_QUORUM: the leader's cluster Manager joins the outer quorum. Returns its
        Manager, comm and quorum, or None when the quorum failed or the global lighthouse is
        out (the event and the rollback are recorded here; the round stays inner-only)."""
        st = self.st
        tr.enter(Phase.OUTER_QUORUM)
        fault_point(st, Phase.OUTER_QUORUM, cur_step, self.link)
        self._healed, self._base = None, None
        health = st.health["outer"]
        try:
            not_ready: Optional[Exception] = None
            try:
                if self.mgr is None:
                    health.before_quorum()
                    if not health.probe():  # a new Manager would wait timeouts.connect for it
                        raise LighthouseOutage(health.message("no cluster Manager yet"))
                mgr, comm = self.ensure(tr)
            except (LighthouseOutage, LighthouseUnreachable) as e:
                not_ready = e
            agree = None
            if tr is st.tracker:  # blocking, on the training thread: a group's ranks vote (LevelManager.start_quorum)
                ready, agree = st.vote.slices("outer quorum", ready=not_ready is None)
                if not ready and not_ready is None:
                    not_ready = LighthouseOutage(health.message("another rank of this replica group cannot ask the global lighthouse"))
            if not_ready is not None:
                raise not_ready
            comm.use_tracker(tr)  # overlapped: the stage's phases; blocking: the round's
            asked = time.monotonic()
            q = mgr.start_quorum(tr.remaining(), health, st.settings.quorum_slice,
                                 progress=outer_progress(cur_round, cur_step, self._fresh), agree=agree)
            if not q.healed:  # formed once every live leader asked: the wait for the slowest (a heal is a transfer)
                st.waited_for_clusters(time.monotonic() - asked)
        except LighthouseOutage as e:
            # The clusters train and sync inside themselves until the global lighthouse returns.
            outage(st, "outer", e)
            st.events("rollback", level="outer", reason=str(e), step=cur_step)
            return None
        except (QuorumFailed, LighthouseUnreachable) as e:
            st.quorum_failed("outer", e)
            st.events("rollback", level="outer", reason=str(e), step=cur_step)
            return None
        lighthouse_ok(st, "outer")
        st.quorum_failures["outer"] = 0
        st.tracker.set_extra(outer=mgr.describe(q.size))
        if q.healed:
            self._fresh = False
            st.events("heal", level="outer", step=cur_step, outer_round=self._healed[0] if self._healed else None)
        return mgr, comm, q

    def _quorum_split(self, joined: Optional[tuple], none_joined: bool, tr: PhaseTracker) -> None:
        """Not every rank of the leader's group joined the outer quorum: none goes on. If
        some did, every rank casts the outer commit vote (false), so the group's cluster
        Manager calls stay matched (as for the inner quorum, inner_quorum.py ``InnerQuorum.for_group``).
        A rank whose quorum failed has a cluster Manager all the same: its sibling's quorum
        formed only after every rank of the group had asked."""
        if none_joined or self.mgr is None:
            return
        if joined is not None:
            self.mgr.report_error(RuntimeError("another rank of this replica group is not in the outer quorum"))
        try:
            self.mgr.should_commit(tr.remaining())
        except RuntimeError as e:
            raise FatalSyncError(f"outer commits keep failing: {e}") from e
        self.st.events("rollback", level="outer", reason="another rank of this replica group is not in the outer quorum",
                       step=self.st.counters.step)

    def _stale(self, cur_round: int) -> bool:
        """Whether this cluster, healed or resynced to a newer global model this round,
        still contributes its work (sync.outer.max_staleness), measured from the global
        model it started from. Not when this leader's pseudo-gradient of that same round
        went out and only its commit failed (the others' commit may hold it already: it
        would count twice), nor with streaming fragments (a cluster that moved adopts the
        whole global model). A leader that died after its payload went out cannot tell its
        successor; then one round of its cluster's work can count twice."""
        if self._healed is None or self._base is None or self.st.settings.outer_fragments:
            return False
        if self._sent_round == cur_round:
            return False
        return 0 < self._healed[0] - cur_round <= self.st.settings.outer_max_staleness

    # ------------------------------------------------------------------ overlapped outer sync
    def launch(self, contribute: bool) -> None:
        """After the inner commit of an outer round (overlap.py): every member keeps the
        committed model as the snapshot; the leader starts the outer round behind training."""
        st = self.st
        assert st.snap is not None and self.leader_stage.stage is not None
        c = st.counters
        if contribute:  # one never resolved (its apply round's commit failed); this launch's eager step publishes
            self.committed.take_out_stand_in()
        else:
            self.committed.take_out_stand_in_live()
        st.snap.copy_(st.inner.backup)
        st.snap_step = c.step
        self.snap_since_outer = st.since_outer
        if st.leader:
            self.leader_stage.launch(contribute, self.run)
        if self.asynchronous is not None:
            self.asynchronous.launch(c.step)  # every member: the next round applies it
        if st.stand_in is not None and contribute:  # the same condition on every rank of the group (publish)
            # Eager updates (overlap.py): every member steps with its cluster's own
            # pseudo-gradient (identical inputs on every member: identical results).
            fragment = self.schedule.fragment_for_sync(c.outer_round) if st.settings.outer_fragments else None
            st.stand_in.copy_(eager_stand_in(st.outer, st.snap, self.fragment_ranges(fragment)))
            st.inner.set_backup(st.snap - st.stand_in)
            self.committed.publish()
            st.events("eager_step", step=c.step, outer_round=c.outer_round, fragment=fragment)

    # ------------------------------------------------------------------ BROADCAST
    def broadcast(self, result: Optional[OuterResult], prior: torch.Tensor) -> OuterResult:
        """BROADCAST of a blocking round's result to the cluster (outer_broadcast.py)."""
        return outer_broadcast.broadcast(self.st, result, prior)

    def broadcast_global(self, result: Optional[OuterResult], prior: torch.Tensor) -> OuterResult:
        """BROADCAST at an apply round, with the stage's residual and momentum (outer_broadcast.py)."""
        return outer_broadcast.broadcast_global(self.st, result, prior, self.leader_stage.comp, self.leader_stage.level)

    def join_wanted(self, join: bool, q: QuorumView, plan: guard.GuardPlan) -> bool:
        """Whether this join round also takes the global model: a cluster restarted whole.

        A cluster whose every group restarted has no peer to heal from inside, so it used to
        train from step 0 until its first outer round, heal there from the other clusters and
        count all those steps at weight 0 (in a 12-minute chaos run, 56 % of the lost work).
        Instead its last join round (the whole cluster in the quorum, all at step 0, nobody
        contributing) becomes an outer round of weight 0 in which the leader heals from the
        global level, and BROADCAST hands the global model to the cluster before its first step.

        Only when the job has moved on: the leader reads the global lighthouse's status page
        (its last quorum announced a step > 0), so a fresh job starts as before; with the
        asynchronous level it asks the global model server (:meth:`AsyncOuter.moved_on`: a
        version past 0), and the round is a push of no work whose answer, the newest version,
        the cluster adopts, resuming its step count at its furthest push (async_outer.py).
        Every member evaluates the same condition after the consistency guard (same
        counters, same quorum); the leader's answer reaches them in one small all-reduce,
        so all of them take the BROADCAST phase or none does. Blocking rounds (asynchronous
        ones: every round's push is blocking at step 0, nothing is in flight yet) and one
        rank per group only (the ranks of a group could read the page differently). If the
        outer quorum does not form within its phase, or the server does not answer, the
        round stays inner-only and the cluster trains from step 0 as before.
        """
        st = self.st
        c = st.counters
        if not (join and (not self.overlap or self.asynchronous is not None) and st.settings.group_world_size == 1
                and q.size >= st.settings.replicas_per_cluster and c.step == 0 and c.outer_round == 0 and plan.total_weight == 0):
            return False
        ask = 0.0
        if st.leader and self.asynchronous is not None:
            ask = 1.0 if self.asynchronous.moved_on() else 0.0
        elif st.leader:
            html = fetch_status(st.settings.global_lighthouse, st.settings.quorum_slice)
            step = parse_status(html).max_step if html is not None else None
            ask = 1.0 if step is not None and step > 0 else 0.0
        v = torch.tensor([ask], dtype=torch.float32)
        if not st.inner_comm.allreduce_sum(v, CONTROL):
            return False  # the round is lost anyway (its commit fails): no outer join
        return float(v[0]) > 0

    def without_cluster(self) -> None:
        """The leader's outer round while its cluster lighthouse is out (one rank per group).

        The other clusters must not wait at their outer quorum for a cluster that cannot
        sync inside: the leader contributes its own model as the cluster's (its local
        progress since the last inner commit) and adopts the global result. Its cluster
        peers, who cannot hear a broadcast, are brought along by the consistency guard when
        their lighthouse returns: they are behind the leader's outer round, so they carry
        weight 0 in that round and are resynced from it (guard.py). With several ranks per
        group the ranks could see the outage at different rounds, so they skip instead.
        """
        st = self.st
        c = st.counters
        if self.leader_stage.busy:
            return  # the cluster's own outer round is still in flight
        live = self.committed.without_stand_in(host_copy(st.flat.data[st.part]))
        if self.asynchronous is not None:  # its own steps since its last commit are in `live`
            self.asynchronous.note_work(1.0, c.step)  # its own steps since the cluster's last round
        result = self.run(live, contribute=True, inner_ok=True)
        if self.asynchronous is not None:  # not a cluster round: its members' count stays theirs
            self.asynchronous.round_ended(committed=False, step=None)
        if result.status != Status.OUTER_COMMITTED or result.params is None:
            return
        if st.stand_in is not None:
            st.stand_in.zero_()  # taken out of `live`, which the global model now replaces
        self.adopt_into_inner(result.params, result.fragment, base=live)
        if self.asynchronous is not None:  # its peers hear nothing: the push schedule stays theirs
            self.asynchronous.adopted(step=result.step)
        c.outer_round, c.step = result.outer_round, result.step
        # The leader's steps since its last inner commit reached the global model.
        st.work["steps_since_commit"] = 0
        self.committed.kept_sent = False
        st.since_outer = 0
        st.tracker.set_extra(**st.work_counters())
        self.committed.publish()  # the model becomes the new global model
        self.committed.keep_optimizer()
        st.tracker.set_counters(step=c.step, outer_round=c.outer_round)

    # ------------------------------------------------------------------ adopting a result
    def adopt(self, result: OuterResult, now: torch.Tensor) -> None:
        """A committed outer result becomes the cluster's model: the global model itself, or
        (overlapped) merged with the progress since the snapshot; the outer backup is the
        global model, and a leader takes its stage's outer level (momentum) along."""
        assert result.params is not None
        st = self.st
        c = st.counters
        if result.merge:
            assert st.snap is not None
            self.adopt_into_inner(merge_keep_local(result.params, st.snap, now), result.fragment, base=now)
            ls = self.leader_stage
            if st.leader and ls.level is not None:
                st.outer.load_state_dict(ls.level.state_dict())
            if st.leader and ls.comp is not None and st.comp is not None:
                st.comp.load(ls.comp.residual)
            ls.level, ls.comp = None, None
        else:
            self.adopt_into_inner(result.params, result.fragment, base=now)
        if self.asynchronous is not None:  # every member, from the header: one schedule per cluster
            self.asynchronous.adopted(step=result.step, push_in=result.push_in, merge=result.merge)
            if result.merge and result.checksum is not None:  # the leader: the version is held now (chaos heal evidence)
                st.events("adopt", level="outer", outer_round=result.outer_round, step=result.step, asynchronous=True,
                          checksum=result.checksum)
        if result.momentum is not None and not st.leader:
            st.outer.set_momentum(result.momentum)  # eager updates: in step with the leader's
        st.outer.set_backup(result.params)  # the whole global model: other fragments' entries are unchanged in it
        c.outer_round, c.step = result.outer_round, result.step

    @torch.no_grad()
    def adopt_into_inner(self, value: torch.Tensor, fragment: Optional[int], base: torch.Tensor) -> None:
        """The cluster model becomes ``value`` — only in ``fragment``'s ranges with streaming
        fragments (the other fragments keep ``base``, their local progress: Streaming
        DiLoCo syncs one fragment at a time)."""
        inner = self.st.inner
        ranges = self.fragment_ranges(fragment)
        if ranges is None:
            inner.set_backup(value)
            return
        new = base.clone() if base is not inner.backup else base
        scatter_(new, ranges, gather(value, ranges))
        if new is not inner.backup:
            inner.set_backup(new)

    # ------------------------------------------------------------------ the cluster Manager
    def ensure(self, tracker: Optional[PhaseTracker] = None) -> tuple[LevelManager, LevelComm]:
        if self.mgr is None or self.comm is None:
            st = self.st
            t = st.timeouts
            link = LinkProcessGroup("outer", t.outer_pg, distinct_clusters=True, emulation=st.settings.outer_link, backend=st.settings.outer_backend)
            link.share_stats(self.stats)  # one account (and loss streams) across leadership changes
            self.link = link
            self.mgr = manager(st, "outer", link, f"store/outer/{self._epoch}",  # one store per leadership term
                               self.state_dict, self.load_state_dict)
            self._epoch += 1
            self.comm = LevelComm(self.mgr, link, tracker or st.tracker, st.gate, st.events,
                                  watch=QuorumWatch(st.settings.global_lighthouse, st.settings.quorum_slice))
        return self.mgr, self.comm

    def demote(self) -> None:
        """This group no longer leads: a member does not keep the outer momentum up to date,
        holds no cluster Manager and no stage."""
        self._fresh = True
        self.shutdown_manager()
        self.leader_stage.drop("no longer the leader")

    def shutdown_manager(self) -> None:
        """Shuts the cluster Manager down, if any (it aborts a stage's process group too)."""
        if self.mgr is not None:
            self.mgr.shutdown()
            self.mgr, self.comm = None, None
            self.st.tracker.set_extra(outer=None)

    def promote(self) -> None:
        """This group leads: join the global lighthouse early so the first outer quorum waits for us."""
        st = self.st
        if self.asynchronous is not None:
            # no cluster Manager: the global model server is asked at each outer round; a
            # cluster new to it sends the model meanwhile (async_outer.py register_early)
            self.asynchronous.register_early()
            return
        if self.mgr is None and not st.health["outer"].down and st.health["outer"].probe():
            try:
                self.ensure()
            except LighthouseUnreachable as e:
                st.health["outer"].mark_down()
                logger.error("%s cannot reach the global lighthouse yet: %s", st.id, e)

    def close(self) -> None:
        if self.mgr is not None:
            self.mgr.shutdown()  # aborts a stage's process group: its waits end
            self.mgr = None
        self.leader_stage.drop("closing")

    # ------------------------------------------------------------------ outer heals
    def state_dict(self) -> Dict[str, object]:
        """What a leader serves another cluster's healing leader (overlapped: the stage's
        outer level and launch counters, the state its outer round runs on)."""
        outer_round, step = self.leader_stage.view or (self.st.counters.outer_round, self.st.counters.step)
        return {
            "outer": self.leader_stage.target.state_dict(),
            "counters": {"outer_round": outer_round, "step": step},
        }

    def load_state_dict(self, sd: Dict[str, object]) -> None:
        target = self.leader_stage.target
        base = target.backup.clone()  # the global model this cluster's work started from
        target.load_state_dict(sd["outer"])  # type: ignore[arg-type]
        counters = sd["counters"]
        assert isinstance(counters, dict)
        self._healed = (int(counters["outer_round"]), int(counters["step"]))
        self._base = base
        logger.info("%s healed its outer level from another cluster: %s", self.st.id, counters)
