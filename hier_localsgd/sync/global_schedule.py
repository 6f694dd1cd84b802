"""The global model server's schedule rules (global_server.py module doc: the grace window
and match_pace), as pure functions of its clock and what it learned from each push, so
the simulator (tools/simulate/batches.py, paces.py) runs the very same rules on its own
clock."""

from __future__ import annotations

from typing import Callable, Collection, Dict, Iterable, Optional, Tuple

# A batch waits at most this share of its contributors' own push period: a fast cluster
# gives up at most a tenth of its time to merging with others (global_server.py).
GRACE_SHARE = 0.1
MAX_AGE_S = 60.0  # an overlapped push's reported age is taken up to this (a leader's clock is not trusted further)
SILENT_PERIODS = 3  # a cluster is silent at the end after this many of its periods without a push (and final_wait_s)


def batch_end(opened: float, grace_s: float, inside: Iterable[int], period: Dict[int, float],
              overlapped: Dict[int, bool], free: Dict[int, float]) -> float:
    """The latest time an open batch of the clusters ``inside`` closes (global_server.py module doc): ``grace_s``
    after it ``opened``, and at most :data:`GRACE_SHARE` of each blocking contributor's
    ``period``; an overlapped contributor waits behind its cluster's training, but only until
    its ``free`` time (:func:`free_until`)."""
    inside = list(inside)
    periods = [period[k] for k in inside if k in period and not overlapped.get(k)]
    frees = [free[k] for k in inside if overlapped.get(k) and k in free]
    return min([opened + min([grace_s] + [GRACE_SHARE * p for p in periods]), *frees])


def batch_closes(now: float, end: float, inside: Collection[int], clusters: int, final: Callable[[int], bool], min_clusters: int,
                 period: Dict[int, float], last: Dict[int, float], expect: Dict[int, float]) -> bool:
    """Whether an open batch of the clusters ``inside`` closes at ``now``: at its ``end``;
    before that once it has ``min_clusters`` and no other cluster that is not ``final`` may
    come by the end: one not heard yet (no ``period``: its pace is unknown) may, and one
    expected by then (at ``expect``, match_pace's, else its ``last`` push plus its period).
    tools/simulate/batches.py runs the same rule on the simulator's clock."""
    if now >= end:
        return True
    if len(inside) < min_clusters:
        return False
    for k in range(clusters):
        if k in inside or final(k):
            continue
        if k not in period or expect.get(k, last[k] + period[k]) <= end:
            return False
    return True


def free_until(now: float, at: float, free_s: float) -> float:
    """When the answer to an overlapped push that went out at ``at`` (server clock; it
    arrived ``now``) must leave, its cluster applying it ``free_s`` seconds of training
    later: ``at + free_s`` less the way back, taken as the way here (``now - at``)."""
    return at + min(free_s, MAX_AGE_S) - (now - at)


def expected_push(ref: float, transit: float, push_in: int, pace: float) -> float:
    """When match_pace expects a cluster's next push: ``push_in`` steps at its ``pace``
    (seconds per step) after ``ref``, plus its ``transit`` (global_server.py ``_answer_push``)."""
    return ref + transit + push_in * pace


def fastest_next(now: float, pushed: float, answered: Optional[float], overlapped: bool, transit: float, pace: float,
                 full: int) -> Tuple[float, float]:
    """match_pace's aim: when the fastest cluster's next push arrives, and its time between
    pushes. It trains ``full`` steps at its ``pace`` between pushes. A blocking one starts
    them at its answer (``answered``; ``now`` if its last push, which arrived at ``pushed``,
    is not answered yet: it is in the batch closing now) and adds its ``transit``
    (:func:`expected_push`); an overlapped one's count from its last push's arrival (its
    training waits for no answer). Counted from the answer, the aim leaves out what the
    fastest waited in its last batch (up to the grace window: before, its mean time between
    arrivals carried that wait into every aim, and a slower cluster's push missed it by
    up to 2 s: docs/benchmarks.md)."""
    if overlapped:
        return expected_push(pushed, 0.0, full, pace), full * pace
    ref = answered if answered is not None and answered >= pushed else now
    return expected_push(ref, transit, full, pace), transit + full * pace


def average(d: Dict[int, float], k: int, x: float) -> None:
    """``d[k]``'s moving average takes ``x`` (the first value as is, then halves)."""
    d[k] = x if k not in d else 0.5 * d[k] + 0.5 * x


def fastest(paces: Dict[int, float], current: Optional[int]) -> int:
    """match_pace's fastest cluster among ``paces`` (seconds per step of the live ones):
    ``current`` stays it until another is 5 % faster, so near-equal clusters do not trade
    the role at every push."""
    best = min(paces, key=lambda k: paces[k])
    return best if current not in paces or paces[best] < 0.95 * paces[current] else current  # type: ignore[return-value]


def meet_in(avail_s: float, pace: float, gap: float, lo: int, full: int) -> int:
    """match_pace's ``push_in`` for a cluster of ``pace`` seconds per step: the steps that
    fill ``avail_s`` (the seconds to the fastest cluster's next arrival less this cluster's
    transit); the push after that (``gap`` seconds later) if under ``lo`` steps are left;
    clamped to ``[lo, full]`` (docs/architecture.md "Matched paces")."""
    while avail_s < lo * pace:  # too near (or past): meet the push after it
        avail_s += gap
    return max(lo, min(full, int(round(avail_s / pace))))

