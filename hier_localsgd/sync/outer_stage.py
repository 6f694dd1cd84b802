"""The leader's outer stage (:class:`LeaderStage`, owned by
:class:`~hier_localsgd.sync.outer_round.OuterLevel`): an overlapped outer round
(``sync.outer.delay > 0``, overlap.py) launched on the stage thread, collected at its
apply round, waited for by the run's final round, or dropped.

It is separate from outer_round.py because it owns the state only an outer round in
flight has: the stage thread, the stage's copies of the outer level and of the
compression state, the counters at the launch, and where an outer heal loads meanwhile.
OuterLevel runs the round itself (its ``run`` is what the stage thread calls) and reads
that state through the public names here: ``level``, ``comp`` (the copies, until the
apply round adopts them), ``target``/``view`` (what an outer heal loads and serves).
Without the overlap there is no stage (``stage`` None): ``busy``, ``await_stage`` and
``drop`` do nothing, ``launch`` and ``collect`` are not called (they assert a stage), and
``target`` is the outer level itself.

Failure semantics (overlap.py): a stage that fails or runs past its deadline costs only
the outer stage: :meth:`LeaderStage.collect` returns an INNER_ONLY result and, for a stage
still running, shuts the cluster Manager down (its process group aborts, so the stage's
waits end) before abandoning it. An exception the stage must end the process with
(``FatalSyncError``) is re-raised by :meth:`LeaderStage.collect` on the training thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from datetime import timedelta
from typing import Callable, Optional

import torch

from hier_localsgd.core.runtime.phases import Phase
from hier_localsgd.core.tensors.level import Level
from hier_localsgd.sync.async_outer import AsyncOuter
from hier_localsgd.sync.common import OuterResult, Status
from hier_localsgd.sync.compression import OuterCompression
from hier_localsgd.sync.overlap import OuterStage, merge_keep_local
from hier_localsgd.sync.state import SyncState, screen_norm

logger = logging.getLogger("hier_localsgd.sync.hier")  # one logger name for the whole round

# What dropping a stage still in flight may take after its wait ends: collect's last poll
# (0.5 s), the cluster Manager's shutdown (2.5 s seen) and abandon's join of the stage
# thread (at most 5 s). The final round's wait for a stage ends this much before its
# OUTER_QUORUM deadline, so the members' final_broadcast_wait covers the leader's worst case.
STAGE_DROP_S = 10.0


class LeaderStage:
    """The leader's outer stage (module doc). ``shutdown_manager``: shuts the cluster
    Manager down (OuterLevel's), for a stage that ran past its deadline."""

    def __init__(self, st: SyncState, overlap: bool, asynchronous: Optional[AsyncOuter],
                 shutdown_manager: Callable[[], None]) -> None:
        self.st = st
        self.asynchronous = asynchronous
        self.shutdown_manager = shutdown_manager
        self.stage: Optional[OuterStage] = (
            OuterStage(str(st.id), listener=lambda phase: st.tracker.set_extra(outer_stage=phase)) if overlap else None
        )
        if self.stage is not None:
            self.stage.tracker.budgets = st.timeouts
        self.level: Optional[Level] = None  # the stage's copy of the outer level
        self.comp: Optional[OuterCompression] = None  # and of the compression state
        self.target = st.outer  # where an outer heal loads and what a donor serves
        self.view: Optional[tuple[int, int]] = None  # the stage's (outer_round, step)

    @property
    def busy(self) -> bool:
        """An outer round is in flight on the stage, or done and not yet collected."""
        return self.stage is not None and self.stage.busy

    def launch(self, contribute: bool, run: Callable[..., OuterResult]) -> None:
        """The leader starts the launched outer round (asynchronous: the push) on its stage
        thread; ``run``: OuterLevel's round, called there with the stage's copies."""
        st = self.st
        c = st.counters
        assert st.snap is not None and self.stage is not None
        self.drop("a new outer round")  # one never applied (its apply round was skipped)
        if self.asynchronous is not None:
            asy, model = self.asynchronous, st.snap.clone()
            comp = self.comp = None if st.comp is None else st.comp.copy()
            req = asy.request(model, contribute, comp, overlap=True)  # here: the counters and tokens of the push round
            base, built = st.outer.backup.clone(), time.time()
            self.stage.launch(lambda tr: asy.exchange(req, base, model, contribute, comp, tr, built=built, adopts=False))
            st.events("outer_launch", step=c.step, outer_round=c.outer_round, delay=1, asynchronous=True)
            return
        lvl = Level("outer", st.settings.outer, st.outer.backup)
        lvl.load_state_dict(st.outer.state_dict())
        view = (c.outer_round, c.step)
        self.level, self.target, self.view = lvl, lvl, view
        comp = self.comp = None if st.comp is None else st.comp.copy()
        model = st.snap.clone()
        norm = screen_norm(st, lvl, model, None, 1.0 if contribute else 0.0)  # here: the training thread
        self.stage.launch(lambda tr: run(model, contribute, contribute, tr=tr, lvl=lvl, view=view, comp=comp, norm=norm))
        st.events("outer_launch", step=c.step, outer_round=c.outer_round, delay=st.settings.outer_delay)

    def collect(self, end: Optional[float] = None) -> OuterResult:
        """The leader, at the apply round: the stage's result, waiting at most while the
        stage is inside its deadlines and until ``end`` (epoch seconds; by default what
        the round's BROADCAST budget leaves once the broadcast has its own time). A stage
        still running then is dropped, its cluster Manager shut down."""
        assert self.stage is not None
        st = self.st
        c, stage = st.counters, self.stage
        none = OuterResult(Status.INNER_ONLY, None, c.outer_round, c.step)
        if not stage.busy:
            asy = self.asynchronous  # a push in flight that another leader sent: the server knows
            return (asy.recover(st.outer.backup, st.tracker) or none) \
                if asy is not None and asy.launched >= 0 else none
        if end is None:
            end = st.tracker.deadline() or (time.time() + st.timeouts.broadcast_wait.total_seconds())
            end -= st.timeouts.broadcast.total_seconds()  # leave the broadcast its own time
        res: Optional[OuterResult] = None
        while True:
            finished, res = stage.collect(min(timedelta(seconds=0.5), stage.wait_budget()))
            if finished:
                break
            dl = stage.tracker.deadline()
            now = time.time()
            if now >= end or (dl is not None and now > dl + 1.0):
                st.events("timeout", level="outer", op="stage", phase=stage.tracker.phase.value, deadline=dl, step=c.step)
                self.drop("the outer stage ran past its deadline", abort=True)
                return none
        lvl = self.level
        self.target, self.view = st.outer, None
        if res is None or res.status != Status.OUTER_COMMITTED or res.params is None:
            self.level, self.comp = None, None
            return none
        # Keep the stage's level until adopt() takes it (its momentum, with the global model).
        self.level = lvl
        step = c.step + (res.step - st.snap_step)  # a healed-to newer view moves the step as well
        return OuterResult(Status.OUTER_COMMITTED, res.params, res.outer_round, step, res.cluster_weight, merge=True, fragment=res.fragment,
                           push_in=res.push_in, checksum=res.checksum)

    def last_push(self, cluster_model: torch.Tensor, contribute: bool, inner_ok: bool) -> OuterResult:
        """The run's last round with an overlapped push in flight (asynchronous): take its
        answer ``θ_v`` first (within the round's budget), then push the steps since it
        (``θ_s − θ_now``) from version ``v``, blocking. The answer in flight unanswered or
        dropped: the blocking push carries everything since the last applied version (the
        server merges a base at most once). The last push unanswered: the cluster merges
        ``θ_v`` as at an apply round (a ``merge`` header)."""
        st = self.st
        asy = self.asynchronous
        assert asy is not None and st.snap is not None
        tr = st.tracker
        tr.enter(Phase.OUTER_QUORUM, st.timeouts.outer_level, reason="asynchronous: the push in flight first")
        deadline = tr.deadline() or time.time() + st.timeouts.outer_level.total_seconds()
        res = self.collect(end=deadline - STAGE_DROP_S)
        if res.status != Status.OUTER_COMMITTED or res.params is None:
            return asy.run(cluster_model, contribute, inner_ok, tr)
        if self.comp is not None and st.comp is not None:
            st.comp.load(self.comp.residual)  # what the push in flight left; the last push stages on it
        self.level, self.comp = None, None
        merged = merge_keep_local(res.params, st.snap, cluster_model)
        req = asy.request(merged, contribute, st.comp, base=res.params, version=res.outer_round)
        last = asy.exchange(req, res.params, cluster_model, inner_ok, st.comp, tr)
        if last.status == Status.OUTER_COMMITTED or not inner_ok:
            return last  # (not inner_ok: ABORT, the cluster rolls back as for any failed round)
        st.events("outer_unavailable", level="outer", step=st.counters.step, detail="the last push: merging the answer in flight")
        return replace(res, step=st.counters.step)

    def await_stage(self, end: float) -> None:
        """The final partial round (a run whose length is off the outer schedule) is
        blocking while an overlapped round may still be in flight on the same Manager:
        wait for it (within its deadlines and until ``end``) and forget its result.
        Nothing is lost: the blocking round measures the cluster's pseudo-gradient from the
        last applied global model, so it carries that round's work too. Every cluster
        does the same at the same step, so the stage's collectives stay matched.

        It waits for the stage to end on its own rather than dropping it: a leader that
        shut its Manager down while another cluster's stage was still in its commit
        vote left the clusters' outer levels in different states (the final round's
        quorum then met one old and one new Manager); a CI run under load ended two
        clusters on different models. Its caller's phase budget covers the wait
        (``Timeouts.outer_level``, and the members' ``final_broadcast_wait``)."""
        if self.stage is None or not self.stage.busy:
            return
        running, t0 = self.stage.running, time.time()
        res = self.collect(end)
        self.level, self.comp = None, None
        self.target, self.view = self.st.outer, None
        # Not a rollback: its work rides the final round (the dashboard shows it neutral).
        self.st.events("outer_folded", step=self.st.counters.step, committed=res.status == Status.OUTER_COMMITTED,
                       was_running=running, waited_s=round(time.time() - t0, 3))

    def drop(self, why: str, abort: bool = False) -> None:
        """Forgets an outer stage in flight or never applied; ``abort``: shut the cluster
        Manager down first (its process group aborts, so the stage's waits end)."""
        if self.stage is None or not self.stage.busy:
            return
        st = self.st
        if abort:
            self.shutdown_manager()
        logger.warning("%s dropping the outer stage: %s", st.id, why)
        self.stage.abandon()
        self.level, self.target, self.view = None, st.outer, None
        self.comp = None
        st.events("rollback", level="outer", reason=f"outer stage dropped: {why}", step=st.counters.step)
