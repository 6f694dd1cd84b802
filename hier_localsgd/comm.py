"""Collectives of one level, with torchft failure semantics and phase deadlines.

Every collective the hierarchy issues goes through :class:`LevelComm`:

1. it must run inside the level's open quorum (invariant I3, checked by the
   phase tracker);
2. no other level's collective may be in flight in this process (I1, the gate);
3. it is skipped if the level's Manager already recorded an error this round (the
   round is lost anyway; torchft's own all-reduce does the same);
4. its wait is bounded by the time left in the current phase; an error or a
   timeout is reported to the Manager, which makes the round's commit vote fail,
   and the call returns False. It never raises for a network failure.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllreduceOptions, Work

from hier_localsgd.invariants import CollectiveGate
from hier_localsgd.link import LinkProcessGroup
from hier_localsgd.managers import LevelManager
from hier_localsgd.phases import PhaseTracker

logger = logging.getLogger(__name__)

_FAILED = object()


class LevelComm:
    def __init__(self, mgr: LevelManager, link: LinkProcessGroup, tracker: PhaseTracker, gate: CollectiveGate) -> None:
        self.mgr = mgr
        self.link = link
        self.level = mgr.level
        self._tracker = tracker
        self._gate = gate

    def _run(self, op: str, kind: str, issue: Callable[[], Work]) -> bool:
        self._tracker.require(self.level)
        if self.mgr.errored() is not None:
            logger.info("%s %s skipped: round already failed (%s)", self.level, op, self.mgr.errored())
            return False
        with self._gate.collective(self.level, op), self.link.kind(kind):
            try:
                work = issue()
                fut = self.mgr.manager.wrap_future(
                    work.get_future(), default=_FAILED, timeout=self._tracker.remaining()
                )
                result = fut.wait()
            except Exception as e:  # a broken group can raise at issue time
                logger.warning("%s %s failed: %s", self.level, op, e)
                self.mgr.report_error(e)
                return False
        if result is _FAILED or self.mgr.errored() is not None:
            logger.warning("%s %s failed: %s", self.level, op, self.mgr.errored())
            return False
        return True

    def allreduce_sum(self, tensor: torch.Tensor, kind: str) -> bool:
        """Sums ``tensor`` in place across the level's quorum."""
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        return self._run("allreduce", kind, lambda: self.link.allreduce([tensor], opts))

    def broadcast(self, tensor: torch.Tensor, root: int, kind: str) -> bool:
        """Broadcasts ``tensor`` from quorum rank ``root`` (in place on the receivers)."""
        return self._run("broadcast", kind, lambda: self.link.broadcast_one(tensor, root))
