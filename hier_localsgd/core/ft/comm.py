"""Collectives of one level, with torchft failure semantics and phase deadlines.

Every collective the hierarchy issues goes through :class:`LevelComm`:

1. it must run inside the level's open quorum (invariant I3, checked by the
   phase tracker);
2. no other level's collective may be in flight in this process (I1, the gate);
3. it runs even if the level's Manager already recorded an error this round:
   peers in the same quorum are waiting for it, and skipping it (as torchft's
   own all-reduce does) would make them wait for their timeout. The error has
   already doomed this member's commit vote;
4. it carries its own Gloo timeout, the time left in the current phase, so the
   process group's default timeout only bounds rendezvous (see timeouts.py); the
   wait for its result is bounded the same way. An error or timeout is reported
   to the Manager, which makes the round's commit vote fail, and the call returns
   False. It never raises for a network failure;
5. with a :class:`hier_localsgd.core.ft.peers.QuorumWatch`, a wait whose peer stopped
   heartbeating (a stopped process) is abandoned within the heartbeat timeout plus a
   poll instead of running to the deadline (peers.py says why that is safe), and the
   round's remaining collectives in the same quorum fail at once;
6. a collective abandoned that way still ends later (its own timeout, or its group's
   peers giving up). That failure belongs to a round that is over and is *not* reported
   to the Manager: torchft's ``wrap_future`` would report it into whatever round is open
   then, and fail that round's commit (seen: an outer all-reduce abandoned during a
   partition timed out 30 s later, inside the run's final outer round, and the two
   clusters ended one outer round apart). The round is told by the Manager's count of
   quorum requests (``LevelManager.rounds_started``).

:meth:`LevelComm.compressed_allreduce_sum` keeps the same contract for the compressed
outer reduce (an all-to-all then an all-gather, :mod:`hier_localsgd.core.tensors.compressed_allreduce`):
one gate entry for both, each collective bounded by the phase's remaining time and
watched like any other wait, and a failure of the first does not skip the second (peers
are waiting in it).

A wait that ran into its deadline writes a ``timeout`` event (what ``hier-localsgd chaos``
counts as a hang). The clock decides, not the error's text: the collective failed at or
after the phase deadline it was given. A peer that died fails the collective at once (a
closed connection), which is no timeout; a peer that is alive but stuck makes us wait to
the deadline, which is.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Callable, Optional

import torch
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import AllreduceOptions, BroadcastOptions, Work

from torchft.futures import future_timeout
from torchft.utils import get_stream_context

from hier_localsgd.core.tensors.compress import ErrorFeedback
from hier_localsgd.core.tensors.compressed_allreduce import SUM, compressed_allreduce
from hier_localsgd.core.tensors import sparse
from hier_localsgd.core.runtime.invariants import CollectiveGate
from hier_localsgd.core.links.link import LinkProcessGroup
from hier_localsgd.core.ft.managers import LevelManager
from hier_localsgd.core.ft.peers import QuorumWatch
from hier_localsgd.core.runtime.phases import PhaseTracker
from hier_localsgd.core.runtime.timeouts import ran_into_deadline

logger = logging.getLogger(__name__)

_FAILED = object()


class PeerLapsed(RuntimeError):
    """A member of the open quorum stopped heartbeating while we waited for it."""


def is_timeout(err: object) -> bool:
    """Whether a failed wait ran into its deadline, as the clock decided where it failed
    (:class:`hier_localsgd.core.ft.managers.QuorumFailed` carries ``timed_out``). The error's text
    is not consulted."""
    return bool(getattr(err, "timed_out", False))


class LevelComm:
    def __init__(
        self,
        mgr: LevelManager,
        link: LinkProcessGroup,
        tracker: PhaseTracker,
        gate: CollectiveGate,
        events: Optional[Callable[..., None]] = None,
        watch: Optional[QuorumWatch] = None,
    ) -> None:
        self.mgr = mgr
        self.watch = watch
        self._lapsed_quorum: Optional[int] = None  # a quorum with a lapsed member: fail at once
        self._events = events
        self.link = link
        self.level = mgr.level
        self._tracker = tracker
        self._gate = gate

    def use_tracker(self, tracker: PhaseTracker) -> None:
        """The phases (and deadlines) this level's collectives run in from now on: the
        round's, or the overlapped outer stage's (overlap.py)."""
        self._tracker = tracker

    def _run(self, op: str, kind: str, issue: Callable[[timedelta], Work]) -> bool:
        return self._guarded(op, kind, lambda remaining: self._complete(issue(remaining), op, remaining))

    def _complete(self, work: Work, op: str, remaining: timedelta) -> object:
        """Waits for ``work`` (at most ``remaining``); ``_FAILED`` if it failed (reported to the
        Manager while its round lasts: contract point 6)."""
        issued = self.mgr.rounds_started
        stream = torch.accelerator.current_stream() if torch.accelerator.is_available() else None

        def settle(f: torch.futures.Future) -> object:
            with get_stream_context(stream):
                try:
                    return f.value()
                except Exception as e:
                    if self.mgr.rounds_started == issued:
                        self.mgr.report_error(e)  # _guarded logs it
                    else:
                        logger.info("%s %s of an earlier round failed after it was abandoned (%s): not this round's error",
                                    self.level, op, str(e)[:200])
                        if self._events is not None:
                            self._events("stale_failure", level=self.level, op=op, detail=str(e)[:200])
                    return _FAILED

        return self._wait(future_timeout(work.get_future(), remaining).then(settle), op)

    def _check_lapsed(self, op: str) -> None:
        if self._lapsed_quorum is not None and self._lapsed_quorum == self.mgr.quorum_id:
            raise PeerLapsed(f"{self.level} {op} skipped: a member of quorum {self._lapsed_quorum} stopped heartbeating")

    def _guarded(self, op: str, kind: str, body: Callable[[timedelta], object]) -> bool:
        """Runs ``body(remaining)`` (the collectives of one operation) under the contract
        above; ``body`` returns ``_FAILED`` or raises when a collective failed."""
        self._tracker.require(self.level)
        already_failed = self.mgr.errored() is not None
        deadline = self._tracker.deadline()
        with self._gate.collective(self.level, op), self.link.kind(kind):
            try:
                remaining = self._tracker.remaining()
                self._check_lapsed(op)
                result = body(remaining)
            except Exception as e:  # a broken group can raise at issue time
                logger.warning("%s %s failed: %s", self.level, op, e)
                self.mgr.report_error(e)
                return False
        if result is _FAILED or self.mgr.errored() is not None:
            err = self.mgr.errored()
            if not already_failed:
                logger.warning("%s %s failed: %s", self.level, op, err)
                if self._events is not None and ran_into_deadline(deadline):
                    self._events("timeout", level=self.level, op=op, phase=self._tracker.phase.value, deadline=deadline, detail=str(err)[:200])
            return False
        return True

    def _wait(self, fut: object, op: str) -> object:
        """Waits for ``fut``; with a watch, gives up once a quorum member's heartbeat lapsed."""
        if self.watch is None:
            return fut.wait()  # type: ignore[attr-defined]
        done = threading.Event()
        fut.add_done_callback(lambda _f: done.set())  # type: ignore[attr-defined]
        while not done.wait(self.watch.poll.total_seconds()):
            quorum = self.mgr.quorum_id
            who = self.watch.lapsed(quorum, self.mgr.full_replica_id)
            if who is not None:
                self._lapsed_quorum = quorum
                self.link.retire()
                if self._events is not None:
                    self._events("peer_lapsed", level=self.level, op=op, reason=who, quorum_id=quorum, phase=self._tracker.phase.value)
                raise PeerLapsed(f"{self.level} quorum {quorum}: {who} (heartbeat timeout {self.watch.heartbeat_timeout}): abandoning the {op}")
        return fut.value()  # type: ignore[attr-defined]

    def allreduce_sum(self, tensor: torch.Tensor, kind: str) -> bool:
        """Sums ``tensor`` in place across the level's quorum."""

        def issue(timeout: timedelta) -> Work:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            opts.timeout = timeout
            return self.link.allreduce([tensor], opts)

        return self._run("allreduce", kind, issue)

    def compressed_allreduce_sum(
        self, tensor: torch.Tensor, kind: str, fmt: str, block: int,
        error_feedback: Optional[ErrorFeedback], fold_feedback: Optional[ErrorFeedback],
    ) -> bool:
        """Sums ``tensor`` in place across the level's quorum with quantized payloads
        (``fmt``/``block``; every member passes the same). ``error_feedback``: add this
        member's residual and stage the new one (None: send ``tensor`` as it is, e.g.
        zeros at weight 0); ``fold_feedback``: the residual the reduced shard's
        requantization error is folded into. Both residuals are only *staged*: the caller
        commits or rolls them back with the round. On failure ``tensor`` is unchanged
        and the call returns False (the Manager knows; the commit vote fails)."""

        def wait(work: object, what: str) -> bool:
            self._check_lapsed(what)
            return self._complete(work, what, self._tracker.remaining()) is not _FAILED  # type: ignore[arg-type]

        def body(remaining: timedelta) -> object:
            res = compressed_allreduce(
                tensor, self.link, fmt, block, op=SUM, timeout=remaining,
                error_feedback=error_feedback, fold_feedback=fold_feedback,
                wait=wait, remaining=self._tracker.remaining,
                rank=self.link.quorum_rank, world=self.link.quorum_size,
            )
            return True if res.ok else _FAILED

        return self._guarded("compressed_allreduce", kind, body)

    def sparse_allreduce_sum(
        self, tensor: torch.Tensor, kind: str, chunk: int, k: int, error_feedback: Optional[ErrorFeedback],
    ) -> bool:
        """Sums ``tensor`` in place across the level's quorum with sparse 2-bit payloads
        (core/tensors/sparse.py; every member passes the same ``chunk`` and ``k``): an
        all-gather of each member's payload, summed in rank order on every member.
        ``error_feedback``: add this member's residual and stage the new one (None: send
        ``tensor`` as it is, e.g. zeros at weight 0). On failure ``tensor`` is unchanged
        and the call returns False (the Manager knows; the commit vote fails)."""

        def codec(v: torch.Tensor) -> tuple:
            return sparse.encode(v, chunk, k)

        def wait(work: object, what: str) -> bool:
            self._check_lapsed(what)
            return self._complete(work, what, self._tracker.remaining()) is not _FAILED  # type: ignore[arg-type]

        def body(remaining: timedelta) -> object:
            # encoded here, under the contract: an encoder error is this member's failure, returned as False
            payload = codec(tensor)[0] if error_feedback is None else error_feedback.encode_with(tensor, codec)
            res = sparse.sparse_allreduce_sum(
                tensor, self.link, chunk, k, payload, timeout=remaining, wait=wait, remaining=self._tracker.remaining,
                rank=self.link.quorum_rank, world=self.link.quorum_size,
            )
            return True if res.ok else _FAILED

        return self._guarded("sparse_allreduce", kind, body)

    def broadcast(self, tensor: torch.Tensor, root: int, kind: str) -> bool:
        """Broadcasts ``tensor`` from quorum rank ``root`` (in place on the receivers)."""

        def issue(timeout: timedelta) -> Work:
            opts = BroadcastOptions()
            opts.rootRank = root
            opts.rootTensor = 0
            opts.timeout = timeout
            return self.link.broadcast([tensor], opts)

        return self._run("broadcast", kind, issue)
