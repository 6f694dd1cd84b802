"""The leader's outer level of a hierarchical round (a mixin of :class:`HierarchicalSync`).

OUTER_QUORUM -> OUTER_REDUCE -> OUTER_COMMIT on the leader's cluster Manager, blocking
(on the round's tracker) or overlapped (overlap.py: launched at an outer round, collected
``sync.outer.delay`` inner rounds later), and the broadcast of its result to the cluster.
Failure semantics are the round's (hier.py): a failed outer level rolls back the outer
stage only; inner work is never discarded for it.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Optional

import torch

from hier_localsgd.core import guard
from hier_localsgd.core.addresses import LighthouseUnreachable
from hier_localsgd.core.comm import LevelComm
from hier_localsgd.core.device import host_copy, host_state
from hier_localsgd.core.flat import checksum
from hier_localsgd.core.fragments import gather, scatter_
from hier_localsgd.core.level import Level
from hier_localsgd.core.link import CONTROL, PAYLOAD, LinkProcessGroup
from hier_localsgd.core.managers import LevelManager, QuorumFailed, QuorumView
from hier_localsgd.core.outage import LighthouseOutage
from hier_localsgd.core.peers import QuorumWatch, fetch_status, parse_status
from hier_localsgd.core.phases import Phase, PhaseTracker
from hier_localsgd.sync.common import FatalSyncError, OuterResult, Status, outer_progress
from hier_localsgd.sync.compression import OuterCompression
from hier_localsgd.sync.overlap import merge_keep_local

logger = logging.getLogger("hier_localsgd.sync.hier")  # one logger name for the whole round


class OuterRound:
    """The outer level's methods; state lives on :class:`HierarchicalSync`."""

    def _outer_round(
        self, cluster_model: torch.Tensor, contribute: bool, inner_ok: bool,
        tr: Optional[PhaseTracker] = None, lvl: Optional[Level] = None, view: Optional[tuple[int, int]] = None,
        comp: Optional[OuterCompression] = None, norm: Optional[float] = None,
    ) -> OuterResult:
        """The leader's outer level: OUTER_QUORUM, OUTER_REDUCE, OUTER_COMMIT.

        Blocking (defaults): on the round's tracker, the outer level and the current
        counters. Overlapped (overlap.py): on the stage's tracker, a copy of the outer
        level (``lvl``, committed here, adopted at the apply round), of the compression
        state (``comp``), the counters at the launch (``view``) and the poison screen's
        norm of the contribution (``norm``, taken at the launch: it needs the group's own
        process group, which only the training thread uses); it then touches no state
        the training thread uses."""
        c = self.counters
        tr = self.tracker if tr is None else tr
        lvl = self.outer if lvl is None else lvl
        comp = self.comp if comp is None else comp
        cur_round, cur_step = view or (c.outer_round, c.step)
        fallback = OuterResult(Status.INNER_ONLY if inner_ok else Status.ABORT, cluster_model, cur_round, cur_step)
        if tr is not self.tracker and not self._leader:
            return fallback  # a stage whose leader was demoted before it began: no cluster Manager for it
        joined = self._outer_quorum(tr, cur_round, cur_step)
        if tr is self.tracker and self.vote.active:  # a blocking round: the group's ranks agree (group_vote.py)
            v = self.vote.agree("outer quorum", joined=joined is not None, none_joined=joined is None,
                                no_heal=joined is None or not joined[2].healed)
            if not v["joined"] and not v["no_heal"]:  # as for the inner quorum (hier.py _group_quorum)
                raise FatalSyncError("an outer heal reached only some ranks of this replica group: the group restarts to heal whole")
            if not v["joined"]:
                self._outer_quorum_split(joined, v["none_joined"], tr)
                return fallback
        if joined is None:
            return fallback
        mgr, comm, q = joined

        tr.enter(Phase.OUTER_REDUCE)
        self._fault_point(Phase.OUTER_REDUCE, cur_step)
        view_round, view_step = self._outer_healed or (cur_round, cur_step)
        # A cluster that just healed to a newer global model measured its work from an
        # older one: within sync.outer.max_staleness rounds it contributes that work
        # measured from its old base (a stale update), else weight 0 this round.
        moved = self._outer_healed is not None and view_round != cur_round
        weight = 1.0 if contribute and (not moved or self._stale(cur_round)) and mgr.errored() is None else 0.0
        if norm is None:  # blocking: every rank of the leader's group is here (it voted)
            norm = self._screen_norm(lvl, cluster_model, None, 1.0 if contribute else 0.0)
        plan = self._consistency(
            comm, q, "outer",
            guard.Fingerprint(lvl.fingerprint(), view_round, 0, view_step, weight, norm=norm if weight > 0 else 0.0,
                              ref=lvl.norm_ref, who=guard.member_code(self.id.cluster, 0)),
            tensors=lvl.state_tensors(),
        )
        view_round, view_step = self._outer_healed or (view_round, view_step)
        moved = self._outer_healed is not None and view_round != cur_round  # the guard may have resynced it
        stale = self._stale(cur_round)
        # Streaming fragments: the round syncs fragment (outer round mod F), the same in
        # every cluster (the guard has brought every member to the quorum's outer round),
        # except the run's last round, which syncs the whole model so the run ends on one.
        # A cluster that healed to a newer global model adopts all of it (fragment None).
        last = self.s.final_step > 0 and view_step >= self.s.final_step
        fragment = self.fragments.fragment_for_sync(view_round) if self.s.outer_fragments and not last else None
        sent = plan.total_weight > 0 and plan.weights[q.rank] > 0
        staged = self._reduce(lvl, comm, cluster_model, plan, q.rank, comp, self.fragment_ranges(fragment),
                              base=self._outer_base if stale else None)

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
                self._outer_sent_round = cur_round
            self.events("rollback", level="outer", reason="outer commit vote failed", step=cur_step)
            return OuterResult(fallback.status, cluster_model, view_round, view_step)
        lvl.commit(staged)
        lvl.norm_ref = guard.accepted_median(plan.fingerprints, plan.weights) or lvl.norm_ref
        self._outer_fresh, self._outer_sent_round = False, None
        if comp is not None:
            comp.commit()
        if stale and plan.weights[q.rank] > 0:
            self.events("stale_update", level="outer", behind=view_round - cur_round, step=cur_step)
        new_round = view_round + (1 if plan.total_weight > 0 else 0)
        self.tracker.mark_commit("outer", new_round)
        self.events(
            "commit", level="outer", outer_round=new_round, step=view_step, fragment=fragment,
            participants=q.size, total_weight=plan.total_weight, checksum=checksum(lvl.backup),
        )
        return OuterResult(Status.OUTER_COMMITTED, lvl.backup.clone(), new_round, view_step, plan.weights[q.rank],
                           fragment=None if moved else fragment)

    def _outer_quorum(self, tr: PhaseTracker, cur_round: int, cur_step: int) -> Optional[tuple[LevelManager, LevelComm, QuorumView]]:
        """OUTER_QUORUM: the leader's cluster Manager joins the outer quorum. Returns its
        Manager, comm and quorum, or None when the quorum failed or the global lighthouse is
        out (the event and the rollback are recorded here; the round stays inner-only)."""
        tr.enter(Phase.OUTER_QUORUM)
        self._fault_point(Phase.OUTER_QUORUM, cur_step)
        self._outer_healed, self._outer_base = None, None
        health = self.health["outer"]
        try:
            if self.outer_mgr is None:
                health.before_quorum()
                if not health.probe():  # a new Manager would wait timeouts.connect for it
                    raise LighthouseOutage(health.message("no cluster Manager yet"))
            mgr, comm = self._ensure_outer(tr)
            comm.use_tracker(tr)  # overlapped: the stage's phases; blocking: the round's
            q = mgr.start_quorum(tr.remaining(), health, self.s.quorum_slice, progress=outer_progress(cur_round, cur_step, self._outer_fresh))
        except LighthouseOutage as e:
            # The clusters train and sync inside themselves until the global lighthouse returns.
            self._outage("outer", e)
            self.events("rollback", level="outer", reason=str(e), step=cur_step)
            return None
        except (QuorumFailed, LighthouseUnreachable) as e:
            self._quorum_failed("outer", e)
            self.events("rollback", level="outer", reason=str(e), step=cur_step)
            return None
        self._lighthouse_ok("outer")
        self._quorum_failures["outer"] = 0
        self.tracker.set_extra(outer=mgr.describe(q.size))
        if q.healed:
            self._outer_fresh = False
            self.events("heal", level="outer", step=cur_step, outer_round=self._outer_healed[0] if self._outer_healed else None)
        return mgr, comm, q

    def _outer_quorum_split(self, joined: Optional[tuple], none_joined: bool, tr: PhaseTracker) -> None:
        """Not every rank of the leader's group joined the outer quorum: none goes on. If
        some did, every rank casts the outer commit vote (false), so the group's cluster
        Manager calls stay matched (as for the inner quorum, hier.py ``_group_quorum``).
        A rank whose quorum failed has a cluster Manager all the same: its sibling's quorum
        formed only after every rank of the group had asked."""
        if none_joined or self.outer_mgr is None:
            return
        if joined is not None:
            self.outer_mgr.report_error(RuntimeError("another rank of this replica group is not in the outer quorum"))
        try:
            self.outer_mgr.should_commit(tr.remaining())
        except RuntimeError as e:
            raise FatalSyncError(f"outer commits keep failing: {e}") from e
        self.events("rollback", level="outer", reason="another rank of this replica group is not in the outer quorum",
                    step=self.counters.step)

    def _stale(self, cur_round: int) -> bool:
        """Whether this cluster, healed or resynced to a newer global model this round,
        still contributes its work (sync.outer.max_staleness), measured from the global
        model it started from. Not when this leader's pseudo-gradient of that same round
        went out and only its commit failed (the others' commit may hold it already: it
        would count twice), nor with streaming fragments (a cluster that moved adopts the
        whole global model). A leader that died after its payload went out cannot tell its
        successor; then one round of its cluster's work can count twice."""
        if self._outer_healed is None or self._outer_base is None or self.s.outer_fragments:
            return False
        if self._outer_sent_round == cur_round:
            return False
        return 0 < self._outer_healed[0] - cur_round <= self.s.outer_max_staleness

    def _launch_outer(self, contribute: bool) -> None:
        """After the inner commit of an outer round (overlap.py): every member keeps the
        committed model as the snapshot; the leader starts the outer round behind training."""
        assert self._snap is not None and self.stage is not None
        c = self.counters
        self._snap.copy_(self.inner.backup)
        self._snap_step = c.step
        self._snap_since_outer = self._since_outer
        if not self._leader:
            return
        self._drop_stage("a new outer round")  # one never applied (its apply round was skipped)
        lvl = Level("outer", self.s.outer, self.outer.backup)
        lvl.load_state_dict(self.outer.state_dict())
        view = (c.outer_round, c.step)
        self._stage_outer, self._outer_target, self._outer_view = lvl, lvl, view
        comp = self._stage_comp = None if self.comp is None else self.comp.copy()
        model = self._snap.clone()
        norm = self._screen_norm(lvl, model, None, 1.0 if contribute else 0.0)  # here: the training thread
        self.stage.launch(lambda tr: self._outer_round(model, contribute, contribute, tr=tr, lvl=lvl, view=view, comp=comp, norm=norm))
        self.events("outer_launch", step=c.step, outer_round=c.outer_round, delay=self.s.outer_delay)

    def _collect_outer(self) -> OuterResult:
        """The leader, at the apply round: the stage's result, waiting at most while the
        stage is inside its deadlines (and the round's BROADCAST budget lasts)."""
        assert self.stage is not None
        c, st = self.counters, self.stage
        none = OuterResult(Status.INNER_ONLY, None, c.outer_round, c.step)
        if not st.busy:
            return none
        end = self.tracker.deadline() or (time.time() + self.t.broadcast_wait.total_seconds())
        end -= self.t.broadcast.total_seconds()  # leave the broadcast its own time
        res: Optional[OuterResult] = None
        while True:
            finished, res = st.collect(min(timedelta(seconds=0.5), st.wait_budget()))
            if finished:
                break
            dl = st.tracker.deadline()
            now = time.time()
            if now >= end or (dl is not None and now > dl + 1.0):
                self.events("timeout", level="outer", op="stage", phase=st.tracker.phase.value, deadline=dl, step=c.step)
                self._drop_stage("the outer stage ran past its deadline", abort=True)
                return none
        lvl = self._stage_outer
        self._outer_target, self._outer_view = self.outer, None
        if res is None or res.status != Status.OUTER_COMMITTED or res.params is None:
            self._stage_outer, self._stage_comp = None, None
            return none
        # Keep the stage's level until _apply adopts it (its momentum, with the global model).
        self._stage_outer = lvl
        step = c.step + (res.step - self._snap_step)  # a healed-to newer view moves the step as well
        return OuterResult(Status.OUTER_COMMITTED, res.params, res.outer_round, step, res.cluster_weight, merge=True, fragment=res.fragment)

    def _await_stage(self) -> None:
        """The final partial round (a run whose length is off the outer schedule) is
        blocking while an overlapped round may still be in flight on the same Manager:
        wait for it (within its deadlines, as at an apply round) and forget its result.
        Nothing is lost: the blocking round measures the cluster's pseudo-gradient from the
        last applied global model, so it carries that round's work too. Every cluster
        does the same at the same step, so the stage's collectives stay matched."""
        if self.stage is None or not self.stage.busy:
            return
        running, t0 = self.stage.running, time.time()
        res = self._collect_outer()
        self._stage_outer, self._stage_comp = None, None
        self._outer_target, self._outer_view = self.outer, None
        # Not a rollback: its work rides the final round (the dashboard shows it neutral).
        self.events("outer_folded", step=self.counters.step, committed=res.status == Status.OUTER_COMMITTED,
                    was_running=running, waited_s=round(time.time() - t0, 3))

    def _drop_stage(self, why: str, abort: bool = False) -> None:
        """Forgets an outer stage in flight or never applied; ``abort``: shut the cluster
        Manager down first (its process group aborts, so the stage's waits end)."""
        if self.stage is None or not self.stage.busy:
            return
        if abort and self.outer_mgr is not None:
            self.outer_mgr.shutdown()
            self.outer_mgr, self.outer_comm = None, None
            self.tracker.set_extra(outer=None)
        logger.warning("%s dropping the outer stage: %s", self.id, why)
        self.stage.abandon()
        self._stage_outer, self._outer_target, self._outer_view = None, self.outer, None
        self._stage_comp = None
        self.events("rollback", level="outer", reason=f"outer stage dropped: {why}", step=self.counters.step)

    def _broadcast_global(self, result: Optional[OuterResult], prior: torch.Tensor) -> OuterResult:
        """BROADCAST at an apply round: a header, then the global model only if the
        header says the outer round committed (every member reads the header first)."""
        c = self.counters
        header = OuterResult.empty_header()
        if self._leader:
            assert result is not None
            header[:] = result.header()
        header_ok = self.inner_comm.broadcast(header, 0, CONTROL)
        if not header_ok:  # the group is broken: the commit vote fails
            return OuterResult(Status.ABORT, None, c.outer_round, c.step)
        status = Status(int(header[0]))
        if status != Status.OUTER_COMMITTED:
            return OuterResult(status, None, c.outer_round, c.step)
        params = result.params if self._leader and result is not None else prior.clone()
        assert params is not None
        params_ok = self.inner_comm.broadcast(params, 0, PAYLOAD)
        residual = self._broadcast_residual(self._stage_comp)  # issued even if the model's failed (matched collectives)
        if not params_ok or (self.comp is not None and residual is None):
            return OuterResult(Status.ABORT, None, c.outer_round, c.step)
        return OuterResult.from_header(header, params, merge=True, residual=residual)

    def _broadcast_residual(self, stage: Optional[OuterCompression] = None) -> Optional[torch.Tensor]:
        """Compressed outer reduce: the leader sends the cluster's committed residual
        (``stage``'s at an overlapped apply round) after the model, as reliable control
        traffic, so every member holds it (compression.py). Returns what this member
        received (the leader: its own), or None if there is none or the broadcast failed."""
        if self.comp is None:
            return None
        if self._leader:
            buf = (stage or self.comp).residual.clone()
        else:
            buf = torch.empty_like(self.comp.residual)
        return buf if self.inner_comm.broadcast(buf, 0, CONTROL) else None

    def _outer_join_wanted(self, join: bool, q: QuorumView, plan: guard.GuardPlan) -> bool:
        """Whether this join round also takes the global model: a cluster restarted whole.

        A cluster whose every group restarted has no peer to heal from inside, so it used to
        train from step 0 until its first outer round, heal there from the other clusters and
        count all those steps at weight 0 (in a 12-minute chaos run, 56 % of the lost work).
        Instead its last join round (the whole cluster in the quorum, all at step 0, nobody
        contributing) becomes an outer round of weight 0 in which the leader heals from the
        global level, and BROADCAST hands the global model to the cluster before its first step.

        Only when the job has moved on: the leader reads the global lighthouse's status page
        (its last quorum announced a step > 0), so a fresh job starts as before. Every member
        evaluates the same condition after the consistency guard (same counters, same
        quorum); the leader's answer reaches them in one small all-reduce, so all of them
        take the BROADCAST phase or none does. Blocking rounds and one rank per group only
        (the ranks of a group could read the page differently). If the outer quorum does
        not form within its phase, the round stays inner-only and the cluster trains from
        step 0 as before.
        """
        c = self.counters
        if not (join and not self._overlap and self.s.group_world_size == 1 and q.size >= self.s.replicas_per_cluster
                and c.step == 0 and c.outer_round == 0 and plan.total_weight == 0):
            return False
        ask = 0.0
        if self._leader:
            html = fetch_status(self.s.global_lighthouse, self.s.quorum_slice)
            step = parse_status(html).max_step if html is not None else None
            ask = 1.0 if step is not None and step > 0 else 0.0
        v = torch.tensor([ask], dtype=torch.float32)
        if not self.inner_comm.allreduce_sum(v, CONTROL):
            return False  # the round is lost anyway (its commit fails): no outer join
        return float(v[0]) > 0

    def _outer_without_cluster(self) -> None:
        """The leader's outer round while its cluster lighthouse is out (one rank per group).

        The other clusters must not wait at their outer quorum for a cluster that cannot
        sync inside: the leader contributes its own model as the cluster's (its local
        progress since the last inner commit) and adopts the global result. Its cluster
        peers, who cannot hear a broadcast, are brought along by the consistency guard when
        their lighthouse returns: they are behind the leader's outer round, so they carry
        weight 0 in that round and are resynced from it (guard.py). With several ranks per
        group the ranks could see the outage at different rounds, so they skip instead.
        """
        c = self.counters
        if self.stage is not None and self.stage.busy:
            return  # the cluster's own outer round is still in flight
        result = self._outer_round(host_copy(self.flat.data[self.part]), contribute=True, inner_ok=True)
        if result.status != Status.OUTER_COMMITTED or result.params is None:
            return
        self._adopt_into_inner(result.params, result.fragment, base=host_copy(self.flat.data[self.part]))
        c.outer_round, c.step = result.outer_round, result.step
        # The leader's steps since its last inner commit reached the global model.
        self.work["steps_since_commit"] = 0
        self._kept_sent = False
        self._since_outer = 0
        self.tracker.set_extra(**self.work_counters())
        self._publish_committed()  # the model becomes the new global model
        self._opt_backup = host_state(self.opt.state_dict())
        self.tracker.set_counters(step=c.step, outer_round=c.outer_round)

    def _adopt_outer(self, result: OuterResult, now: torch.Tensor) -> None:
        """A committed outer result becomes the cluster's model: the global model itself, or
        (overlapped) merged with the progress since the snapshot; the outer backup is the
        global model, and a leader takes its stage's outer level (momentum) along."""
        assert result.params is not None
        c = self.counters
        if result.merge:
            assert self._snap is not None
            self._adopt_into_inner(merge_keep_local(result.params, self._snap, now), result.fragment, base=now)
            if self._leader and self._stage_outer is not None:
                self.outer.load_state_dict(self._stage_outer.state_dict())
            if self._leader and self._stage_comp is not None and self.comp is not None:
                self.comp.load(self._stage_comp.residual)
            self._stage_outer, self._stage_comp = None, None
        else:
            self._adopt_into_inner(result.params, result.fragment, base=now)
        self.outer.set_backup(result.params)  # the whole global model: other fragments' entries are unchanged in it
        c.outer_round, c.step = result.outer_round, result.step

    @torch.no_grad()
    def _adopt_into_inner(self, value: torch.Tensor, fragment: Optional[int], base: torch.Tensor) -> None:
        """The cluster model becomes ``value`` — only in ``fragment``'s ranges with streaming
        fragments (the other fragments keep ``base``, their local progress: Streaming
        DiLoCo syncs one fragment at a time)."""
        ranges = self.fragment_ranges(fragment)
        if ranges is None:
            self.inner.set_backup(value)
            return
        new = base.clone() if base is not self.inner.backup else base
        scatter_(new, ranges, gather(value, ranges))
        if new is not self.inner.backup:
            self.inner.set_backup(new)

    def _ensure_outer(self, tracker: Optional[PhaseTracker] = None) -> tuple[LevelManager, LevelComm]:
        if self.outer_mgr is None or self.outer_comm is None:
            t = self.t
            link = LinkProcessGroup("outer", t.outer_pg, distinct_clusters=True, emulation=self.s.outer_link, backend=self.s.outer_backend)
            link.share_stats(self.outer_stats)  # one account (and loss streams) across leadership changes
            self.outer_link = link
            self.outer_mgr = self._manager("outer", link, f"store/outer/{self._outer_epoch}")  # one store per leadership term
            self._outer_epoch += 1
            self.outer_comm = LevelComm(self.outer_mgr, link, tracker or self.tracker, self._gate, self.events,
                                        watch=QuorumWatch(self.s.global_lighthouse, self.s.quorum_slice))
        return self.outer_mgr, self.outer_comm
