"""The global model server's schedule rules (global_server.py module doc: the grace window
and match_pace), as pure functions of its clock and what it learned from each push, so
the simulator (tools/simulate/batches.py, paces.py) runs the very same rules on its own
clock; and each cluster's push schedule (async_outer.py: which steps push, which inner
rounds are left out, an overlapped push's floor and free time), which the simulator's
rounds follow too."""

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


# ---- a cluster's push schedule (async_outer.py AsyncOuter)

def is_push_step(step: int, due: int, period: int) -> bool:
    """Whether a round at ``step`` carries a push on the schedule (``due``, ``period``): from
    ``due`` on, every ``period`` steps (a push the server did not answer is tried again one
    period later, never at every round). With match_pace ``due`` need not be on the inner
    rounds' grid: the cluster runs an inner round there (hier.py ``is_sync_step``)."""
    return step > 0 and step >= due and (step - due) % period == 0


def skips_round(step: int, due: int, period: int, h_inner: int) -> bool:
    """Whether the inner round due at ``step`` on the H_inner grid is left out: it falls
    within half a round of a push step off the grid (match_pace), so no round is shorter
    than half of H_inner steps (a few-step round's norm would skew the poison screen's
    reference, guard.py). Never on the default schedule, whose pushes are on the grid."""
    if step >= due:
        prev = due + (step - due) // period * period
        nxt = prev + period
    else:
        prev, nxt = due - period, due
    return 0 < step - prev < h_inner / 2 or 0 < nxt - step < h_inner / 2


def next_round_step(step: int, due: int, period: int, h_inner: int) -> int:
    """The step at which the next inner round after ``step`` ends on the schedule: a grid
    step not left out, or a push step (hier.py ``is_sync_step``; the simulator's rounds)."""
    s = step + 1
    while not ((s % h_inner == 0 and not skips_round(s, due, period, h_inner)) or is_push_step(s, due, period)):
        s += 1
    return s


def steps_to_apply(step: int, due: int, period: int, h_inner: int) -> int:
    """Steps from an overlapped push at ``step`` to its apply round: the next round on the
    schedule (``due``, ``period``; :func:`next_round_step`), which holds until then."""
    return next_round_step(step, due, period, h_inner) - step


def min_push_steps(h_inner: int) -> int:
    """The fewest steps between two pushes (a push's ``min_steps``): half an inner round,
    the shortest round the schedule allows (:func:`skips_round`)."""
    return max(1, h_inner // 2)


def overlap_floor(step: int, due: int, period: int, h_inner: int, full: int) -> int:
    """An overlapped push's ``min_steps`` at ``step`` on the schedule (``due``, ``period``):
    counted from its apply round (:func:`steps_to_apply`), clamped to the full period
    (:meth:`AsyncOuter.floor_for`)."""
    return min(full, steps_to_apply(step, due, period, h_inner) + min_push_steps(h_inner))


def overlap_free_s(step: int, due: int, period: int, h_inner: int, period_s: float, period_steps: int) -> Optional[float]:
    """An overlapped push's ``free_s`` at ``step``: the seconds of training to its apply round
    (:func:`steps_to_apply`) at the pace of its period (``period_s`` over ``period_steps``);
    None without a step in the period. The server answers it by then (global_server.py
    ``free_until``)."""
    if period_steps <= 0:
        return None
    return steps_to_apply(step, due, period, h_inner) * period_s / period_steps
