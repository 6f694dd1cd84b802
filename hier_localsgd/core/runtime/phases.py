"""The sync state machine's phases and the tracker that enforces their order.

One sync round, top to bottom (see :mod:`hier_localsgd.sync.hier` for the code)::

    LOCAL ──► INNER_QUORUM ──► INNER_REDUCE ──┬──────────────────────────────► INNER_COMMIT ──► LOCAL
                                              │ (outer round, leader)                ▲
                                              ├─► OUTER_QUORUM ► OUTER_REDUCE ►      │
                                              │       OUTER_COMMIT ─► BROADCAST ─────┤
                                              └─► (outer round, non-leader) BROADCAST┘

Any failure goes straight to ROLLBACK (restore the last commit) and then LOCAL; the
next round starts from a fresh quorum. A round whose lighthouse does not answer
(outage.py) goes from its QUORUM phase straight back to LOCAL: nothing was exchanged
and the replica keeps its local progress (INNER_QUORUM -> LOCAL; OUTER_QUORUM ->
BROADCAST as for any failed outer level). STOPPED is terminal.

Invariants enforced here (docs/invariants.md):

* I3 — a collective on a level's process group only runs inside that level's open
  quorum: :meth:`PhaseTracker.require` raises unless the current phase is one
  that follows the level's QUORUM phase in this round. This makes seed 004's
  "broadcast without a quorum" impossible: BROADCAST is reachable only from
  INNER_REDUCE or the outer phases, never from LOCAL.
* Every phase has a deadline (:class:`hier_localsgd.core.runtime.timeouts.Timeouts`); waits
  inside it use :meth:`PhaseTracker.remaining`.

The tracker's :meth:`snapshot` is the state other components read (status file,
dashboard): current phase, deadline, step, rounds, leadership, last commit.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Protocol, Union

logger = logging.getLogger(__name__)


class Phase(str, enum.Enum):
    START = "START"
    LOCAL = "LOCAL"
    INNER_QUORUM = "INNER_QUORUM"
    INNER_REDUCE = "INNER_REDUCE"
    OUTER_QUORUM = "OUTER_QUORUM"
    OUTER_REDUCE = "OUTER_REDUCE"
    OUTER_COMMIT = "OUTER_COMMIT"
    BROADCAST = "BROADCAST"
    INNER_COMMIT = "INNER_COMMIT"
    ROLLBACK = "ROLLBACK"
    STOPPED = "STOPPED"


# Legal forward transitions. ROLLBACK and STOPPED are reachable from every phase.
TRANSITIONS: Dict[Phase, FrozenSet[Phase]] = {
    Phase.START: frozenset({Phase.LOCAL, Phase.INNER_QUORUM}),
    Phase.LOCAL: frozenset({Phase.LOCAL, Phase.INNER_QUORUM}),
    # -> LOCAL: the cluster lighthouse does not answer; the round is skipped (outage.py).
    # -> OUTER_QUORUM: ... and at an outer round the leader syncs across clusters alone,
    # then returns to LOCAL from OUTER_QUORUM or OUTER_COMMIT (no cluster to broadcast to).
    Phase.INNER_QUORUM: frozenset({Phase.INNER_REDUCE, Phase.LOCAL, Phase.OUTER_QUORUM}),
    Phase.INNER_REDUCE: frozenset({Phase.INNER_COMMIT, Phase.OUTER_QUORUM, Phase.BROADCAST}),
    # A failed outer quorum/reduce still ends in BROADCAST: the leader tells its
    # cluster the outer level failed so nobody waits for the broadcast timeout.
    # -> OUTER_QUORUM: re-armed for the quorum itself after the final partial round waited
    # in it for an overlapped outer round still in flight (sync/outer_stage.py, await_stage).
    Phase.OUTER_QUORUM: frozenset({Phase.OUTER_QUORUM, Phase.OUTER_REDUCE, Phase.BROADCAST, Phase.LOCAL}),
    Phase.OUTER_REDUCE: frozenset({Phase.OUTER_COMMIT, Phase.BROADCAST}),
    Phase.OUTER_COMMIT: frozenset({Phase.BROADCAST, Phase.LOCAL}),
    Phase.BROADCAST: frozenset({Phase.INNER_COMMIT}),
    Phase.INNER_COMMIT: frozenset({Phase.LOCAL}),
    Phase.ROLLBACK: frozenset({Phase.LOCAL}),
    Phase.STOPPED: frozenset(),
}

# Phases in which each level's process group may issue collectives (I3).
COLLECTIVE_PHASES: Dict[str, FrozenSet[Phase]] = {
    "inner": frozenset({Phase.INNER_REDUCE, Phase.BROADCAST}),
    "outer": frozenset({Phase.OUTER_REDUCE}),
    "ddp": frozenset({Phase.INNER_REDUCE}),  # the ddp baseline's per-step gradient all-reduce
}


class PhaseError(RuntimeError):
    """An illegal transition or a collective outside its level's open quorum."""


@dataclass
class Transition:
    at: float
    src: Phase
    dst: Phase
    step: int
    inner_round: int
    outer_round: int
    reason: str = ""


@dataclass
class _State:
    phase: Phase = Phase.START
    entered: float = field(default_factory=time.time)
    deadline: Optional[float] = None
    step: int = 0
    inner_round: int = 0
    outer_round: int = 0
    leader: bool = False
    last_commit_at: Optional[float] = None
    last_commit_level: Optional[str] = None
    last_commit_round: Optional[int] = None
    extra: Dict[str, object] = field(default_factory=dict)


class PhaseBudgets(Protocol):
    """Where a phase's deadline budget is named once (core/runtime/timeouts.py ``Timeouts``)."""

    def phase(self, phase: "Phase", leader: bool = True) -> timedelta: ...


class _FromBudgets:
    """``enter``'s default: the phase's budget from :attr:`PhaseTracker.budgets`."""


FROM_BUDGETS = _FromBudgets()


class PhaseTracker:
    """Holds the current phase, checks transitions, and publishes each one.

    Thread-safe for readers: the watchdog and status writer read :meth:`snapshot`
    and :meth:`deadline` from other threads.

    Args:
        describe: short text naming this process in log lines (cluster/replica/role).
        listeners: called with each :class:`Transition` (status file, event log).
        transitions: the legal forward transitions (default :data:`TRANSITIONS`, one
            sync round; overlap.py's background outer stage has its own).
    """

    def __init__(
        self,
        describe: str = "",
        listeners: Iterable[Callable[[Transition, Dict[str, object]], None]] = (),
        transitions: Optional[Dict[Phase, FrozenSet[Phase]]] = None,
    ) -> None:
        self._describe = describe
        self._transitions = TRANSITIONS if transitions is None else transitions
        self._listeners: List[Callable[[Transition, Dict[str, object]], None]] = list(listeners)
        self._lock = threading.Lock()
        self._s = _State()
        # Each sync phase's deadline budget (Timeouts); set by the sync that drives the phases.
        self.budgets: Optional[PhaseBudgets] = None

    # -- transitions -------------------------------------------------------
    def enter(self, dst: Phase, timeout: Union[timedelta, None, _FromBudgets] = FROM_BUDGETS, reason: str = "", leader: bool = True) -> None:
        """Moves to ``dst``, arming a deadline ``timeout`` from now (None: no deadline). By
        default the budget is the phase's own in :attr:`budgets` (``Timeouts.phase``; for
        BROADCAST, the leader's or a member's), so each deadline is named once there.

        Raises:
            PhaseError: if ``dst`` does not follow the current phase.
            ValueError: no ``timeout`` given and no :attr:`budgets` set.
        """
        if isinstance(timeout, _FromBudgets):
            if self.budgets is None:
                raise ValueError(f"{self._describe}: entering {dst.name} without a timeout and without phase budgets")
            timeout = self.budgets.phase(dst, leader)
        with self._lock:
            src = self._s.phase
            if src == Phase.STOPPED:
                raise PhaseError(f"{self._describe}: no transition out of STOPPED (to {dst.name})")
            legal = dst in (Phase.ROLLBACK, Phase.STOPPED) or dst in self._transitions.get(src, frozenset())
            if not legal:
                raise PhaseError(
                    f"{self._describe}: illegal phase transition {src.name} -> {dst.name} "
                    f"(allowed from {src.name}: {sorted(p.name for p in self._transitions.get(src, frozenset()))})"
                )
            now = time.time()
            self._s.phase = dst
            self._s.entered = now
            self._s.deadline = None if timeout is None else now + timeout.total_seconds()
            tr = Transition(
                at=now,
                src=src,
                dst=dst,
                step=self._s.step,
                inner_round=self._s.inner_round,
                outer_round=self._s.outer_round,
                reason=reason,
            )
            snap = self._snapshot_locked()
        # LOCAL -> LOCAL re-arms the per-step deadline; it is not worth a log line.
        if not (src == dst == Phase.LOCAL):
            logger.info(
                "%s phase %s -> %s step=%d inner_round=%d outer_round=%d%s",
                self._describe,
                src.name,
                dst.name,
                tr.step,
                tr.inner_round,
                tr.outer_round,
                f" ({reason})" if reason else "",
            )
            for listener in self._listeners:
                listener(tr, snap)

    def require(self, level: str) -> None:
        """Raises :class:`PhaseError` unless ``level`` may issue a collective now (I3)."""
        phase = self.phase
        if phase not in COLLECTIVE_PHASES[level]:
            raise PhaseError(
                f"{self._describe}: {level} collective in phase {phase.name}; allowed only in "
                f"{sorted(p.name for p in COLLECTIVE_PHASES[level])}, after the {level} quorum"
            )

    # -- counters published with each transition ----------------------------
    def set_counters(
        self,
        step: Optional[int] = None,
        inner_round: Optional[int] = None,
        outer_round: Optional[int] = None,
        leader: Optional[bool] = None,
    ) -> None:
        with self._lock:
            if step is not None:
                self._s.step = step
            if inner_round is not None:
                self._s.inner_round = inner_round
            if outer_round is not None:
                self._s.outer_round = outer_round
            if leader is not None:
                self._s.leader = leader

    def set_extra(self, **values: object) -> None:
        """Extra fields published with every snapshot (e.g. work accounting)."""
        with self._lock:
            self._s.extra.update(values)

    def mark_commit(self, level: str, round_: int) -> None:
        with self._lock:
            self._s.last_commit_at = time.time()
            self._s.last_commit_level = level
            self._s.last_commit_round = round_

    # -- readers -------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        with self._lock:
            return self._s.phase

    def deadline(self) -> Optional[float]:
        with self._lock:
            return self._s.deadline

    def remaining(self, floor: timedelta = timedelta(milliseconds=100)) -> timedelta:
        """Time left before the current phase's deadline (at least ``floor``)."""
        with self._lock:
            deadline = self._s.deadline
        if deadline is None:
            raise PhaseError(f"{self._describe}: phase {self.phase.name} has no deadline")
        return max(floor, timedelta(seconds=deadline - time.time()))

    def snapshot(self) -> Dict[str, object]:
        with self._lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> Dict[str, object]:
        s = self._s
        return {
            "phase": s.phase.value,
            "phase_entered": s.entered,
            "phase_deadline": s.deadline,
            "step": s.step,
            "inner_round": s.inner_round,
            "outer_round": s.outer_round,
            "leader": s.leader,
            "last_commit_at": s.last_commit_at,
            "last_commit_level": s.last_commit_level,
            "last_commit_round": s.last_commit_round,
            **s.extra,
        }
