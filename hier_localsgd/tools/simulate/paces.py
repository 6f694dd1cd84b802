"""The global model server's push schedule under ``sync.async_outer.match_pace``, simulated.

What sync/global_server.py learns from each push (``_arrived``, ``_pushed_work``) and the
``push_in`` it answers (``_push_in``), with its rules (:func:`fastest`, :func:`fastest_next`, :func:`meet_in`,
:func:`average`), on the simulator's clock. pushes.py calls :meth:`PaceServer.arrive` as a push arrives and
:meth:`PaceServer.answer` when its batch closes (batches.py) or it is refused, and sets the
cluster's schedule from the answer (an overlapped push's counted from its arrival).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from hier_localsgd.sync.global_schedule import min_push_steps
from hier_localsgd.sync.global_schedule import SILENT_PERIODS, average, expected_push, fastest, fastest_next, meet_in


class PaceServer:
    """Per cluster: its period between pushes and pace (seconds per step, as its leader
    reports them), its transit (from an answer to its next arrival, less its training), the
    time of its last push and of its last answer, and whether that push was overlapped; the
    fastest cluster."""

    def __init__(self, full: int, h_inner: int) -> None:
        self.full, self.lo = full, min_push_steps(h_inner)  # the request's full_steps and min_steps (async_outer.py)
        self.period: Dict[int, float] = {}
        self.pace: Dict[int, float] = {}
        self.transit: Dict[int, float] = {}
        self.overlapped: Dict[int, bool] = {}
        self.pushed: Dict[int, float] = {}
        self.answered: Dict[int, float] = {}
        self.fastest: Optional[int] = None

    def arrive(self, k: int, now: float, period_s: float, steps: int) -> None:
        """Cluster ``k``'s push arrives at ``now``, ``period_s`` seconds and ``steps`` steps
        after it last adopted a model."""
        if period_s > 0:
            average(self.period, k, period_s)
            if steps > 0:
                average(self.pace, k, period_s / steps)
            if k in self.answered and now - self.answered[k] - period_s >= 0:
                average(self.transit, k, now - self.answered[k] - period_s)
        self.pushed[k] = now

    def answer(self, k: int, now: float, running: Callable[[int], bool], lo: Optional[int] = None,
               ref: Optional[float] = None, transit: Optional[float] = None) -> int:
        """Cluster ``k``'s push is answered at ``now`` (when its batch closes). Returns its
        ``push_in``, counted from ``ref`` plus ``transit`` (by default ``now`` and the
        cluster's learnt transit; an overlapped push's: its arrival and 0, as
        global_server.py ``_answer_push``). ``running(j)``: whether cluster j has steps left
        (a finished one is not waited for). ``lo``: the push's ``min_steps`` (an overlapped
        push's counts from its apply round: async_outer.py ``overlap_floor``); by default
        half of H_inner."""
        self.answered[k] = now
        self.overlapped[k] = ref is not None
        ref = now if ref is None else ref
        transit = self.transit.get(k, 0.0) if transit is None else transit
        live = {j: x for j, x in self.pace.items() if running(j)
                and (j == k or ref - self.pushed[j] < SILENT_PERIODS * self.period.get(j, 0.0))}
        if k not in live:
            return self.full
        f = self.fastest = fastest(live, self.fastest)
        if f == k or f not in self.pushed:
            return self.full
        t_f, gap = fastest_next(now, self.pushed[f], self.answered.get(f), self.overlapped.get(f, False),
                                self.transit.get(f, 0.0), live[f], self.full)
        return meet_in(t_f - ref - transit, live[k], gap, self.lo if lo is None else lo, self.full)

    def expected_at(self, k: int, ref: float, push_in: int, transit: Optional[float] = None) -> Optional[float]:
        """When the server expects cluster ``k``'s next push after answering it with
        ``push_in`` from ``ref`` (global_schedule.py ``expected_push``; ``transit`` by default
        the cluster's learnt one): None for the fastest cluster or an unknown pace (its
        period says then)."""
        if k == self.fastest or k not in self.pace:
            return None
        return expected_push(ref, self.transit.get(k, 0.0) if transit is None else transit, push_in, self.pace[k])
