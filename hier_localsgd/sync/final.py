"""The end of a run whose last round met a cluster lighthouse outage (:class:`FinalWait`,
owned by :class:`~hier_localsgd.sync.hier.HierarchicalSync`).

Why: a round whose cluster lighthouse does not answer is skipped (outage.py): the members
keep their own progress, the leader syncs across clusters alone (``OuterLevel.without_cluster``),
and the consistency guard brings the members to the leader's model at the first round after
the lighthouse is back. At the run's last step there is no such round: the cluster ended on
different models (seen in a chaos run, docs/benchmarks.md: a 10 s outage of cluster 1's
lighthouse 10 s before the end).

What: a group whose final round was skipped for that reason waits, at most
``sync.final_wait_s``, for its cluster lighthouse to answer, then runs join rounds (every
weight 0: nothing new is merged, no outer round) until its whole cluster is in one quorum.
In that quorum a member behind the leader's outer round heals or is resynced from it
(guard.py), as in any round after an outage: the cluster ends on the leader's model (the
global model when the leader's lone outer round committed, else its last inner commit). A
member's steps since its last commit are lost (weight 0: they are in no model the other
clusters hold). A group whose final round ran does nothing.

Timeouts: the lighthouse is probed until ``sync.final_wait_s`` has passed; a join round is
started only before then, and runs within its own phase timeouts, so ``finish()`` returns
at most one round's timeouts after the bound.

Failure semantics: never raises. Past the bound (the lighthouse still out, or the cluster
never whole again: a peer that had finished normally does not come back), or when a join
round fails fatally, it logs, records ``final_wait`` ``gave_up`` and ends with the model it
has (a partial join round may already have rolled it back to its last commit); the job's
consistency check reports it. While it waits, a failed quorum does not end the group as
"job finished without it" (it trained every step: its result must be written). Replica
groups of one rank only (as ``OuterLevel.without_cluster``): the ranks of a larger group could
see the outage at different rounds.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Tuple

from hier_localsgd.sync.common import FatalSyncError, JobFinished
from hier_localsgd.sync.state import SyncState

from hier_localsgd.sync.async_outer import POLL_S

if TYPE_CHECKING:
    from hier_localsgd.sync.async_outer import AsyncOuter

logger = logging.getLogger(__name__)


class FinalWait:
    """``finish()``: the reconciliation after a final round skipped for an outage.

    Args:
        st: the round's shared state.
        join_round: runs one join round; returns (committed, the size of its quorum, 0
            when it failed before its quorum formed).
    """

    def __init__(self, st: SyncState, join_round: Callable[[], Tuple[bool, int]]) -> None:
        self.st = st
        self.join_round = join_round
        self.outage = False  # set by the round when the final round met an inner outage

    def finish(self) -> None:
        """After the last step (module doc). Returns once the cluster is in one quorum,
        at once when there is nothing to do, or past ``sync.final_wait_s`` (module doc:
        Timeouts). Never raises."""
        st = self.st
        s = st.settings
        bound: timedelta = s.final_wait
        if not self.outage or bound.total_seconds() <= 0 or s.group_world_size != 1:
            return
        health = st.health["inner"]
        t0 = time.time()
        deadline = t0 + bound.total_seconds()
        st.events("final_wait", state="start", step=st.counters.step, bound_s=bound.total_seconds())
        while not health.probe():
            if time.time() >= deadline:
                return self._final_gave_up(t0, "the cluster lighthouse did not answer")
            time.sleep(min(1.0, max(0.0, deadline - time.time())))
        job_done, st.job_done = st.job_done, None
        try:
            return self._reconcile(t0, deadline)
        except (FatalSyncError, JobFinished) as e:
            return self._final_gave_up(t0, f"a join round failed ({type(e).__name__}: {str(e)[:200]})")
        finally:
            st.job_done = job_done

    def _reconcile(self, t0: float, deadline: float) -> None:
        """Join rounds until one commits with the whole cluster in its quorum."""
        st = self.st
        s = st.settings
        while True:
            committed, size = self.join_round()
            if committed and size >= s.replicas_per_cluster:
                self.outage = False
                st.events("final_wait", state="done", step=st.counters.step, quorum=size, waited_s=round(time.time() - t0, 2))
                logger.info("%s reconciled with its cluster after the final round's outage (%.1fs)", st.id, time.time() - t0)
                return
            if time.time() >= deadline:
                return self._final_gave_up(t0, f"{size} of {s.replicas_per_cluster} replica groups in the quorum")
            time.sleep(0.2)

    def _final_gave_up(self, t0: float, why: str) -> None:
        st = self.st
        st.events("final_wait", state="gave_up", step=st.counters.step, why=why, waited_s=round(time.time() - t0, 2))
        logger.warning("%s ends with its own model: %s within sync.final_wait_s=%gs after the final round's outage",
                       st.id, why, st.settings.final_wait.total_seconds())

    def await_version(self, asy: "AsyncOuter") -> None:
        """The asynchronous outer level's end (async_outer.py): join rounds, in which the
        leader asks the server for the job's final version, until the cluster has adopted
        it. The server fixes it once every cluster is final or silent (global_server.py),
        so the wait lasts as long as the slowest live cluster's remaining run. Gives up
        (``async_final`` ``gave_up``, the cluster ends with its own model) when the server
        has not answered for ``sync.final_wait_s`` (at least three polls) or a join round fails
        fatally. Never raises."""
        st = self.st
        t0 = time.time()
        asy.pulling, asy.heard = True, t0
        st.events("async_final", state="start", step=st.counters.step, outer_round=st.counters.outer_round)
        job_done, st.job_done = st.job_done, None
        bound = max(st.settings.final_wait.total_seconds(), 3 * POLL_S)  # final_wait_s=0 still polls a few times
        try:
            while not asy.final:
                if time.time() - asy.heard > bound:
                    why = f"the global model server did not answer for {bound:g}s (sync.final_wait_s, at least 3 polls)"
                    st.events("async_final", state="gave_up", step=st.counters.step, why=why, waited_s=round(time.time() - t0, 2))
                    logger.warning("%s ends with its own model: %s", st.id, why)
                    return
                self.join_round()
            st.events("async_final", state="done", step=st.counters.step, outer_round=st.counters.outer_round,
                      waited_s=round(time.time() - t0, 2))
            logger.info("%s holds the job's final version %d (%.1fs after its last step)", st.id, st.counters.outer_round, time.time() - t0)
        except (FatalSyncError, JobFinished) as e:
            st.events("async_final", state="gave_up", step=st.counters.step, why=f"{type(e).__name__}: {str(e)[:200]}",
                      waited_s=round(time.time() - t0, 2))
            logger.warning("%s ends with its own model: a join round failed: %s", st.id, e)
        finally:
            st.job_done = job_done
            asy.pulling = False
