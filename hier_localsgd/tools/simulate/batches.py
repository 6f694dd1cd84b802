"""The global model server's grace window, simulated (sync/global_server.py: a batch of
pushes closes into one version when :func:`~hier_localsgd.sync.global_schedule.batch_closes`
says so; the simulator runs the same functions on its clock).

A push that the server merges joins the open batch (or opens one). The batch closes at
its end (:func:`~hier_localsgd.sync.global_schedule.batch_end`: ``grace_s``, at most a tenth
of a blocking contributor's period, and by an overlapped contributor's free time: its
arrival plus its seconds of training to its apply round, as the server reckons it,
:func:`~hier_localsgd.sync.global_schedule.free_until`), or before it once
``sync.async_outer.min_clusters`` contributors are in and no other running cluster is
expected to push by the end: from its last arrival plus its period (the seconds since it
last adopted a model, as its pushes report them), or where match_pace's answer put it
(:meth:`Batches.expect`). A cluster not heard yet is waited for (its pace is unknown). A
closed batch is one version; every push in it is answered then.

What the server learns is kept as it keeps it (``_arrived``, ``_free_until``): a moving
average of each cluster's period and the time of its last push. An overlapped push's age
at the server (the leader's seconds from building it to sending it) is 0 here.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from hier_localsgd.sync.global_schedule import average, batch_closes, batch_end, free_until

Token = Tuple[str, Any]  # the engine's: ("blocking", epoch) or ("overlapped", flight id)


class Batches:
    """The open batch (its contributors: cluster -> the engine's token for its push) and
    what the server knows of each cluster's pushes."""

    def __init__(self, clusters: int, grace_s: float, min_clusters: int) -> None:
        self.clusters, self.grace_s, self.min_clusters = clusters, grace_s, min_clusters
        self.period: Dict[int, float] = {}  # seconds from an adoption to the next push (moving average)
        self.last: Dict[int, float] = {}  # its last push's arrival
        self.expected: Dict[int, float] = {}  # match_pace: when the answer told it to push next
        self.free: Dict[int, float] = {}  # an overlapped push's answer must leave by then
        self.overlapped: Dict[int, bool] = {}
        self.inside: Dict[int, Token] = {}
        self.opened: Optional[float] = None
        self.gen = 0  # the open batch's number (an end event of a closed one is stale)

    def arrive(self, k: int, now: float, period_s: float, overlapped: bool = False, free_s: Optional[float] = None) -> None:
        """Cluster ``k``'s push arrives (``period_s`` 0: no steps since it adopted, a join
        push; ``free_s``: an overlapped push's seconds of training until its apply round)."""
        if period_s > 0:
            average(self.period, k, period_s)
        self.last[k] = now
        self.overlapped[k] = overlapped
        if overlapped and free_s is not None and free_s > 0:
            self.free[k] = free_until(now, now, free_s)  # its age at the server: 0 here
        else:
            self.free.pop(k, None)

    def expect(self, k: int, at: Optional[float]) -> None:
        """match_pace's answer: cluster ``k`` is expected at ``at`` (None: from its period)."""
        if at is None:
            self.expected.pop(k, None)
        else:
            self.expected[k] = at

    def join(self, k: int, now: float, token: Token) -> None:
        """A merged push joins the open batch, or opens one."""
        if self.opened is None:
            self.opened = now
        self.inside[k] = token

    def end(self) -> float:
        assert self.opened is not None
        return batch_end(self.opened, self.grace_s, self.inside, self.period, self.overlapped, self.free)

    def closes(self, now: float, running: Callable[[int], bool]) -> bool:
        """Whether the open batch closes at ``now`` (``running(k)``: cluster k has steps left;
        one that finished is final to the server here, a little later than for the real
        one, which knows it from the final push's arrival)."""
        return batch_closes(now, self.end(), self.inside, self.clusters, lambda k: not running(k), self.min_clusters,
                            self.period, self.last, self.expected)

    def close(self) -> List[Tuple[int, Token]]:
        """Closes the open batch: its ``(cluster, token)`` pairs."""
        out = list(self.inside.items())
        self.inside, self.opened = {}, None
        self.gen += 1
        return out
