"""The early inner quorum (``sync.inner.early_quorum``, issue #13 §4).

Without it, every inner round starts with INNER_QUORUM at the sync point: a quorum
request to the cluster lighthouse, its quorum tick, the process-group (re)configuration
— time in which nothing trains (about 160 ms per round on the leader, docs/benchmarks.md).
With it, the round's last local step asks for the quorum meanwhile: ``before_forward`` of
that step starts :class:`EarlyQuorum` on a thread, and INNER_QUORUM at the sync point only
collects its result.

Why it commits nothing that might still fail (the rule of the blocking path):

* the quorum only says who takes part; the round's work is still all-reduced, voted
  (INNER_COMMIT) and committed or rolled back exactly as before. A member that dies
  between the early quorum and the reduce fails the reduce, and the vote rolls the round
  back, as it would after a quorum formed at the sync point;
* a heal the quorum decides is *received* on the thread (torchft's checkpoint transport)
  but *applied* on the training thread at the sync point (``committed.py`` defers the
  load while an early quorum runs), so the last local step never races the load. The
  donor serves its committed state, which does not change between the early quorum and
  the sync point (no round commits in between), so the result is the blocking path's;
* one quorum request at a time per Manager: a round that finds an early quorum it does
  not use (a join round) waits for it to end before asking again.

Failure semantics: what the quorum call raises (``LighthouseOutage``, ``QuorumFailed``,
``GroupRefused``) is re-raised at the sync point and handled there as before (a heal it
had received is dropped; the next round heals again). Every wait keeps a deadline: the
thread's call has the INNER_QUORUM budget less a heartbeat timeout (a call can overrun its
budget by a last short slice and a lighthouse probe), and the sync point waits at most its
own INNER_QUORUM budget, which ends later; a call still running then ends the process
(``FatalSyncError``), since a second request on the same Manager is never made.
``close()`` shuts the Manager down, which ends a call in flight.

Replica groups of one rank only (build.py turns it off for more): the ranks of a larger
group vote after each slice of their quorum request, on the training thread where the
group's other collectives run (core/ft/managers.py ``LevelManager.start_quorum`` says why).

What changes for planned faults: a fault at INNER_QUORUM (``faults``, the chaos
command's phase kills) fires at the sync point, after this member's early request has
already joined the quorum, so its peers meet the fault in the round's reduce rather than
forming the quorum without it.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Generic, Optional, TypeVar

from hier_localsgd.core.runtime.device import carry_device

T = TypeVar("T")


class EarlyQuorumStuck(RuntimeError):
    """The early quorum call outlived the sync point's INNER_QUORUM budget."""


class EarlyQuorum(Generic[T]):
    """One quorum call running on a thread, asked for the round at ``step``.

    Attributes:
        step: the step of the round whose quorum this is (the sync point's).
        seconds: how long the call took (None while it runs).
    """

    def __init__(self, call: Callable[[], T], step: int) -> None:
        self.step = step
        self.seconds: Optional[float] = None
        self._result: Optional[T] = None
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        t0 = time.perf_counter()
        on_device = carry_device()

        def run() -> None:
            try:
                on_device()  # torchft hands the current device to its NCCL subprocess
                self._result = call()
            except BaseException as e:  # re-raised on the training thread by result()
                self._error = e
            finally:
                self.seconds = time.perf_counter() - t0
                self._done.set()

        threading.Thread(target=run, name="early-inner-quorum", daemon=True).start()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: timedelta) -> T:
        """The quorum, waiting at most ``timeout``; re-raises what the call raised.

        Raises:
            EarlyQuorumStuck: the call is still running after ``timeout``.
        """
        if not self._done.wait(max(0.0, timeout.total_seconds())):
            raise EarlyQuorumStuck(f"the early inner quorum for step {self.step} did not end within {timeout}")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def settle(self, timeout: timedelta) -> None:
        """Waits (at most ``timeout``) for a call nobody will use, ignoring its outcome."""
        self._done.wait(max(0.0, timeout.total_seconds()))
