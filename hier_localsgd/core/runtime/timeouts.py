"""Every timeout in hier_localsgd, named once.

Nothing in the package waits without one of these. Each phase of the sync state
machine (:mod:`hier_localsgd.core.runtime.phases`) has its own deadline; every wait inside a
phase (quorum RPC, collective, commit vote, checkpoint transfer) is bounded by the
time left before that deadline, and the watchdog (:mod:`hier_localsgd.core.runtime.runtime`)
ends a process that is still inside a phase ``watchdog_grace`` after its deadline.

Values come from the ``timeouts`` section of the config, in seconds, and are
turned into :class:`datetime.timedelta` here.

Derived waits (computed, never configured separately):

* ``broadcast_wait`` — how long a non-leader waits in BROADCAST: the leader runs
  the whole outer level (quorum, reduce, commit: ``outer_level``) before it sends, so
  the wait is the sum of those phase timeouts plus ``broadcast``; at a run's final
  partial round with overlapped outer rounds, one ``outer_level`` more
  (``final_broadcast_wait``: the leader first waits for the stage still in flight).
* ``inner_pg`` / ``outer_pg`` — the Gloo process-group timeout of each level. It
  bounds the group's rendezvous (done inside the level's QUORUM phase, so it is
  at most that phase's timeout) and nothing else: every collective passes its own
  timeout, the time left in its phase (comm.py). A long default here would let a
  rendezvous with a member that never comes (a quorum that included a timed-out
  join) outlast the phase, and the watchdog would end the process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Mapping, Optional

from hier_localsgd.core.runtime.phases import Phase

# Timers fire at or after their deadline; this much earlier still counts as "at" it (the
# deadline and a timer's start are read from the clock at slightly different times).
CLOCK_SLACK_S = 0.05


def ran_into_deadline(deadline: Optional[float], now: Optional[float] = None) -> bool:
    """Whether a wait that failed at ``now`` (default: now) had run into ``deadline`` (epoch
    seconds): how a timeout is told from a failure, by the clock rather than the error's text."""
    if deadline is None:
        return False
    return (time.time() if now is None else now) >= deadline - CLOCK_SLACK_S


@dataclass(frozen=True)
class Timeouts:
    """Timeouts of one replica-group process. All are :class:`timedelta`.

    Attributes:
        connect: opening an RPC connection (lighthouse, manager servers) and the
            start-up probe of each lighthouse address.
        inner_quorum: INNER_QUORUM, including healing from a live peer.
        inner_reduce: INNER_REDUCE (consistency check and pseudo-gradient all-reduce).
        inner_commit: INNER_COMMIT (torchft ``should_commit`` vote).
        outer_quorum: OUTER_QUORUM at the global lighthouse, including healing from
            another cluster. Must cover the skew between clusters reaching an outer round.
        outer_reduce: OUTER_REDUCE across cluster leaders (slow links).
        outer_commit: OUTER_COMMIT.
        broadcast: BROADCAST from the leader once it has its result.
        local_step: one local training step (LOCAL); only the watchdog uses it.
        startup: how long a fresh replica group (no one has trained yet) keeps
            repeating its join round until every replica group of its cluster is in
            the quorum; then it starts with whoever is there.
        watchdog_grace: slack past a phase deadline before the watchdog ends the process.
        shutdown: how long a failing process waits for its managers to stop before exiting.
    """

    connect: timedelta = timedelta(seconds=10)
    inner_quorum: timedelta = timedelta(seconds=60)
    inner_reduce: timedelta = timedelta(seconds=60)
    inner_commit: timedelta = timedelta(seconds=30)
    outer_quorum: timedelta = timedelta(seconds=120)
    outer_reduce: timedelta = timedelta(seconds=120)
    outer_commit: timedelta = timedelta(seconds=30)
    broadcast: timedelta = timedelta(seconds=60)
    local_step: timedelta = timedelta(seconds=120)
    startup: timedelta = timedelta(seconds=60)
    watchdog_grace: timedelta = timedelta(seconds=30)
    shutdown: timedelta = timedelta(seconds=10)

    @classmethod
    def from_seconds(cls, values: Mapping[str, float]) -> "Timeouts":
        """Builds Timeouts from a mapping of field name to seconds (the config section)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"timeouts.{unknown[0]}: unknown timeout (known: {sorted(known)})")
        kwargs = {}
        for name, seconds in values.items():
            if seconds is None or float(seconds) <= 0:
                raise ValueError(f"timeouts.{name}={seconds}: must be a positive number of seconds")
            kwargs[name] = timedelta(seconds=float(seconds))
        return cls(**kwargs)

    @property
    def outer_level(self) -> timedelta:
        """The leader's whole outer level (quorum, reduce, commit): what a blocking outer
        round, or an overlapped one on its stage, can legitimately take."""
        return self.outer_quorum + self.outer_reduce + self.outer_commit

    @property
    def broadcast_wait(self) -> timedelta:
        """A non-leader's BROADCAST wait: the leader's whole outer level, then the send."""
        return self.outer_level + self.broadcast

    @property
    def final_broadcast_wait(self) -> timedelta:
        """A non-leader's BROADCAST wait at a run's final partial round with overlapped
        outer rounds: the leader may first wait for the stage still in flight (at most its
        whole outer level, in OUTER_QUORUM), then runs the blocking one."""
        return self.outer_level + self.broadcast_wait

    @property
    def inner_pg(self) -> timedelta:
        """Gloo default timeout of the inner process group: bounds its rendezvous."""
        return min(self.inner_quorum, self.inner_reduce)

    @property
    def outer_pg(self) -> timedelta:
        """Gloo default timeout of the outer process group: bounds its rendezvous."""
        return min(self.outer_quorum, self.outer_reduce)

    def phase(self, phase: Phase, leader: bool = True) -> timedelta:
        """The deadline budget of one phase of the sync state machine."""
        table = {
            Phase.LOCAL: self.local_step,
            Phase.INNER_QUORUM: self.inner_quorum,
            Phase.INNER_REDUCE: self.inner_reduce,
            Phase.INNER_COMMIT: self.inner_commit,
            Phase.OUTER_QUORUM: self.outer_quorum,
            Phase.OUTER_REDUCE: self.outer_reduce,
            Phase.OUTER_COMMIT: self.outer_commit,
            Phase.BROADCAST: self.broadcast if leader else self.broadcast_wait,
        }
        if phase not in table:
            raise KeyError(f"phase {phase.name} has no timeout")
        return table[phase]


_DEFAULT = Timeouts()


def _seconds(name: str) -> float:
    return getattr(_DEFAULT, name).total_seconds()


@dataclass
class TimeoutsConfig:
    """The ``timeouts`` section, in seconds; its defaults are :class:`Timeouts`' (named once)."""

    connect: float = _seconds("connect")
    inner_quorum: float = _seconds("inner_quorum")
    inner_reduce: float = _seconds("inner_reduce")
    inner_commit: float = _seconds("inner_commit")
    outer_quorum: float = _seconds("outer_quorum")
    outer_reduce: float = _seconds("outer_reduce")
    outer_commit: float = _seconds("outer_commit")
    broadcast: float = _seconds("broadcast")
    local_step: float = _seconds("local_step")
    startup: float = _seconds("startup")
    watchdog_grace: float = _seconds("watchdog_grace")
    shutdown: float = _seconds("shutdown")

    def timeouts(self) -> Timeouts:
        """Raises ValueError naming the field of a non-positive value."""
        return Timeouts.from_seconds({f.name: getattr(self, f.name) for f in fields(self)})
