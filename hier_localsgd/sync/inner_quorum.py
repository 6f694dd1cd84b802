"""INNER_QUORUM of one replica group (:class:`InnerQuorum`, owned by
:class:`~hier_localsgd.sync.hier.HierarchicalSync`).

How a round's inner quorum is asked for and agreed on: the early request made during the
round's last local step (early.py) and collected at the sync point, or a request there;
with several ranks per group, the group's vote on the outcome (group_vote.py), so every
rank joins or every rank takes the same failure. It is separate from hier.py because it
owns state no other phase touches (the early request in flight) and its failure rules are
its own; the round (hier.py ``round``) only asks it for a quorum and handles what it raises.

Failure semantics: :meth:`InnerQuorum.for_group` raises ``LighthouseOutage`` (keep the
local progress) or ``QuorumFailed`` (roll back) on every rank of the group alike, and
``FatalSyncError`` when a heal reached only some ranks, when the group's commit vote keeps
failing, or when an early request is stuck past its phase (the launcher restarts the group).
"""

from __future__ import annotations

from typing import Optional

from hier_localsgd.core.ft.managers import QuorumFailed, QuorumView
from hier_localsgd.core.ft.outage import LighthouseOutage
from hier_localsgd.core.runtime.phases import Phase
from hier_localsgd.sync.committed import CommittedState
from hier_localsgd.sync.common import FatalSyncError, training_progress
from hier_localsgd.sync.early import EarlyQuorum, EarlyQuorumStuck
from hier_localsgd.sync.state import SyncState


class InnerQuorum:
    """The replica group's INNER_QUORUM (module doc). ``early``: the early request in
    flight (early.py), None when none was asked; the heal it receives waits in committed.py."""

    def __init__(self, st: SyncState, committed: CommittedState) -> None:
        self.st = st
        self.committed = committed
        self.early: Optional[EarlyQuorum] = None

    def ask_early(self) -> None:
        """The round's last local step asks for the quorum of the sync point at the next step
        (``sync.inner.early_quorum``; the caller checks that the next step ends a round)."""
        st = self.st
        c = st.counters
        progress = training_progress(c.outer_round, c.step + 1, c.inner_round)  # as the sync point would announce
        # The call may run a little past its budget (a last slice of >= 0.1 s, a lighthouse
        # probe, the group's configuration): it gets the phase's budget less a heartbeat
        # timeout, so it has ended by the time the sync point's own budget runs out.
        full = st.timeouts.phase(Phase.INNER_QUORUM)
        budget = max(full - st.settings.quorum_slice, full / 2)
        self.committed.defer_heal = True  # a heal it decides is applied at the sync point (committed.py)
        self.committed.serve_step = c.step + 1  # set before its thread starts: a donor may serve at once
        self.early = EarlyQuorum(
            lambda: st.inner_mgr.start_quorum(budget, st.health["inner"], st.settings.quorum_slice, progress=progress), c.step + 1)

    def for_group(self, join: bool) -> QuorumView:
        """INNER_QUORUM for the whole replica group: every rank joined, or every rank takes
        the same failure (group_vote.py). A failed quorum on any rank fails the round on all
        (a rollback); otherwise an outage on any rank is an outage on all (local progress
        kept). When some ranks joined and some did not, every rank casts the round's commit
        vote (false) so the group's Manager calls stay matched; the joined ranks run no
        collective, and their peers' collectives in that quorum fail at their deadline.
        A heal that reached only some ranks cannot be undone: FatalSyncError on every rank
        (the launcher restarts the group, which heals as one).
        One rank per group: :meth:`for_rank`. Raises what that raises."""
        st = self.st
        if not st.vote.active:
            return self.for_rank(join)
        q: Optional[QuorumView] = None
        err: Optional[Exception] = None
        try:
            q = self.for_rank(join)
        except (LighthouseOutage, QuorumFailed) as e:
            err = e
        v = st.vote.agree("inner quorum", joined=q is not None, none_joined=q is None,
                          no_failure=not isinstance(err, QuorumFailed), no_heal=q is None or not q.healed)
        if v["joined"]:
            assert q is not None
            return q
        if not v["no_heal"]:  # a rank that healed holds the donor's model and counters, its sibling not
            raise FatalSyncError("a heal reached only some ranks of this replica group: the group restarts to heal whole")
        if not v["none_joined"]:  # a sibling is in the quorum: its commit vote waits for ours
            if q is not None:
                st.inner_mgr.report_error(RuntimeError("another rank of this replica group is not in the quorum"))
            try:
                st.inner_mgr.should_commit(st.tracker.remaining())
            except RuntimeError as e:  # torchft raises after max_retries consecutive failures
                raise FatalSyncError(f"inner commits keep failing: {e}") from e
        if not v["no_failure"]:
            raise err if isinstance(err, QuorumFailed) else QuorumFailed("inner quorum failed on another rank of this replica group")
        if isinstance(err, LighthouseOutage):
            raise err
        raise LighthouseOutage(st.health["inner"].message("another rank of this replica group found the lighthouse not answering"))

    def for_rank(self, join: bool) -> QuorumView:
        """INNER_QUORUM of this rank: the early quorum's result when one was asked for this
        round (early.py; a heal it received is applied here, on the training thread), else a
        quorum request now. Raises what the quorum call raises."""
        st, cs = self.st, self.committed
        tr, c = st.tracker, st.counters
        early, self.early = self.early, None
        cs.serve_step = None  # the sync point's step is c.step now
        if early is not None and not join and early.step == c.step:
            try:
                q = early.result(tr.remaining())
            except EarlyQuorumStuck as e:
                raise FatalSyncError(str(e)) from e  # the heal flags stay: a late heal is never applied off-thread
            finally:
                heal = None
                if early.done():  # a quorum call that raised drops its heal; the next round heals again
                    heal, cs.pending_heal, cs.defer_heal = cs.pending_heal, None, False
            if heal is not None:
                cs.load_state_dict(heal)
            tr.set_extra(early_quorum_s=round(early.seconds or 0.0, 4))
            return q
        if early is not None:  # one request at a time per Manager: let the unused one end
            early.settle(tr.remaining())
            if not early.done():
                raise FatalSyncError(f"an unused early inner quorum for step {early.step} did not end within its phase")
            cs.pending_heal, cs.defer_heal = None, False
        _, agree = st.vote.slices("inner quorum")  # a group of several ranks: no early quorum (build.py)
        return st.inner_mgr.start_quorum(tr.remaining(), st.health["inner"], st.settings.quorum_slice,
                                         progress=training_progress(c.outer_round, c.step, c.inner_round), agree=agree)
