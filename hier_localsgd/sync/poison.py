"""What the poison screen (core/tensors/guard.py ``screen``) decided, as one replica group saw it.

Every member of a level computes the same exclusions from the same exchange, so every
member records each one: an ``excluded`` event naming the excluded member (``c1r0`` at
the inner level, ``c1`` for a cluster at the outer), the level, the step and why, with
``mine`` true on the excluded group itself. The summary and the chaos report count each
(level, step, member) once.

An excluded group loses the round's work (weight 0; its model becomes the committed one
and its inner optimizer goes back to the last commit's state, hier.py). At the inner level
it also counts an offence; a cluster excluded at the outer level is no group's offence
(its model is what its inner level committed) and only its work is lost. ``sync.poison.max_offences`` offences within ``sync.poison.window`` of its
own rounds end the process with one line and exit code 2 (:class:`PoisonLimit`): its
launcher does not restart it, so bad hardware or a bad shard cannot keep rejoining and
costing its peers a round each time.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable, Deque, Optional

from hier_localsgd.core.tensors.guard import NONFINITE
from hier_localsgd.sync.common import PoisonLimit
from hier_localsgd.sync.sections import PoisonConfig

logger = logging.getLogger(__name__)


class PoisonRecord:
    """Exclusions seen by one process, and its own offences.

    Args:
        name: this replica group (``c0r1``), for messages.
        config: ``sync.poison``.
        events: the process's event sink.
    """

    def __init__(self, name: str, config: PoisonConfig, events: Callable[..., None]) -> None:
        self.name = name
        self.config = config
        self._events = events
        self._round = 0
        self._offences: Deque[int] = deque()  # the rounds (of this process) it was excluded in
        self._give_up: Optional[str] = None
        self._lock = threading.Lock()  # an overlapped outer stage records from its own thread
        self.count = 0  # contributions of this group excluded so far

    def begin_round(self) -> None:
        with self._lock:
            self._round += 1

    def excluded(self, level: str, member: str, why: str, norm: float, mine: bool, step: int) -> None:
        """A member's contribution was excluded from this round of ``level`` (every member calls this)."""
        self._events("excluded", level=level, member=member, reason=why, norm=None if norm == NONFINITE else norm,
                     mine=mine, step=step)
        logger.warning("%s: %s contribution of %s excluded at step %d: %s", self.name, level, member, step, why)
        if not mine or level != "inner":
            return
        with self._lock:
            self.count += 1
            self._offences.append(self._round)
            while self._offences and self._offences[0] <= self._round - self.config.window:
                self._offences.popleft()
            n, limit = len(self._offences), self.config.max_offences
            if limit and n >= limit and self._give_up is None:
                self._give_up = (f"{self.name}: contribution excluded {n} times within {self.config.window} rounds "
                                 f"(last at step {step}, {level} level: {why}); giving up (sync.poison.max_offences={limit})")

    def end_round(self) -> None:
        """Raises :class:`PoisonLimit` once this group has offended too often (between rounds)."""
        with self._lock:
            why = self._give_up
        if why is not None:
            raise PoisonLimit(why)
