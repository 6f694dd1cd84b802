"""The works a link's collectives return (core/links/link.py): torch ``Work`` objects for a
collective that already completed, one reported as failed, one timed when it completes, a
set of point-to-point exchanges completed by a helper thread, and a collective chained to
the copy back of its staged result."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, List, Optional

import torch
from torch.distributed.distributed_c10d import Work


class DoneWork(Work):
    """A collective that already completed (emulated links run synchronously)."""

    def __init__(self, result: List[torch.Tensor]) -> None:
        super().__init__()
        self._fut: torch.futures.Future = torch.futures.Future()
        self._fut.set_result(result)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut


class FailedWork(Work):
    """The real collective's work, reported as failed (an injected link failure)."""

    def __init__(self, work: Work, exc: Exception) -> None:
        super().__init__()
        self._work = work
        self._exc = exc

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self._work.wait()
        raise self._exc

    def get_future(self) -> torch.futures.Future:
        exc = self._exc

        def fail(_: torch.futures.Future) -> None:
            raise exc

        return self._work.get_future().then(fail)


class TimedWork(Work):
    """The real collective's work; ``done`` runs once, when the collective is seen complete:
    its ``wait`` returned, or its future resolved (the comm layer waits on the future, whose
    callback runs as the collective ends). A collective that fails is not timed."""

    def __init__(self, work: Work, done: Callable[[], None]) -> None:
        super().__init__()
        self._work = work
        self._done: Optional[Callable[[], None]] = done
        self._lock = threading.Lock()

    def _fire(self) -> None:
        with self._lock:
            done, self._done = self._done, None
        if done is not None:
            done()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._fire()
        return ok

    def get_future(self) -> torch.futures.Future:
        def then(fut: torch.futures.Future) -> object:
            value = fut.value()  # raises the collective's error: then it is not timed
            self._fire()
            return value

        return self._work.get_future().then(then)


class PeerWork(Work):
    """The point-to-point sends and receives of one exchange, as one work with a future.

    Gloo's send/recv works have no future (``Work::getFuture not implemented``), which the
    comm layer waits on (comm.LevelComm._complete): a helper thread waits on them, at most
    ``timeout`` in all, and completes the future with ``result`` or their error.

    The helper is not a daemon, so the interpreter joins it before it finalizes. Completing
    a torch future releases the GIL (pybind11) and wakes the waiter, and the helper takes
    the GIL back only afterwards. Woken first, a main thread that then leaves the
    interpreter starts finalization; a daemon helper that asks for the GIL during it is
    ended with ``pthread_exit``, whose unwinding through that C++ frame calls
    ``std::terminate`` ("terminate called without an active exception", SIGABRT: issue
    #30, seen in gdb). Joining costs microseconds after a completed exchange and at most
    the exchange's own ``timeout`` after an abandoned one (a peer stopped mid-exchange)."""

    def __init__(self, works: List[Work], result: List[torch.Tensor], timeout: timedelta) -> None:
        super().__init__()
        self._fut: torch.futures.Future = torch.futures.Future()
        if not works:
            self._fut.set_result(result)
            return

        def wait_all() -> None:
            end = time.monotonic() + timeout.total_seconds()
            try:
                for w in works:  # c10d reads a zero timeout as "none": never pass one
                    w.wait(timedelta(seconds=max(0.001, end - time.monotonic())))
            except Exception as e:
                self._fut.set_exception(e)
                return
            self._fut.set_result(result)

        threading.Thread(target=wait_all, name="link-exchange", daemon=False).start()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self._fut.wait()  # raises the exchange's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut


class ChainedWork(Work):
    """A collective's work followed by the copy of its staged result back (``fut``)."""

    def __init__(self, work: Work, fut: torch.futures.Future) -> None:
        super().__init__()
        self._work, self._fut = work, fut

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self._work.wait()
        self._fut.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut
