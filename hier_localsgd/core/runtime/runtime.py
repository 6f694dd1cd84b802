"""Process lifecycle: every way a replica-group process fails ends its heartbeats and the process.

Seed 004's worst bug: a process whose training loop had died kept heartbeating
(its interpreter waited at exit for a thread stuck in a quorum call), so the
lighthouse kept counting it healthy and its peers waited for it forever
(invariant I7). Here every exit path goes through :meth:`Runtime.exit`:

1. shut down every registered Manager (``shutdown(wait=False)`` stops the
   heartbeat at once), bounded by ``timeouts.shutdown``;
2. publish the final state and flush logs;
3. ``os._exit`` — never the interpreter's normal exit, which joins non-daemon
   threads and can block forever behind a hung RPC.

Ways in:

* the training function returns → exit code 0;
* it raises → :data:`EXIT_ERROR`;
* SIGTERM / SIGINT / SIGHUP → 128 + signal number. Signals are blocked in every
  thread and taken by a dedicated thread with ``sigwait``, so they are handled
  even while the main thread is blocked inside a C++ collective;
* the watchdog: a thread that ends the process with :data:`EXIT_WATCHDOG` when the
  current phase is ``timeouts.watchdog_grace`` past its deadline (a hang inside a
  collective, a stuck lighthouse call, a wedged step);
* SIGKILL cannot be caught; the heartbeat threads die with the process.
* under torchrun (several ranks per replica group), the loss of the agent: torchrun
  starts workers in sessions of their own, so a SIGKILLed agent would leave them
  running (and heartbeating). Each worker asks the kernel for SIGTERM when its parent
  dies (``PR_SET_PDEATHSIG``) and its watchdog also notices a new parent pid; either
  way it exits through the same path.

:meth:`install` must run before any other thread starts (the signal mask is
inherited by threads created afterwards, including torchft's).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, List, Optional

from hier_localsgd.core.runtime.phases import PhaseTracker

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_CONFIG = 2
EXIT_WATCHDOG = 3
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass
class RunConfig:
    """The ``run`` section: which replica group this process is, and where it writes."""

    dir: str = "runs/latest"
    cluster: int = 0
    replica: int = 0
    hostname: str = ""  # address peers use to reach this process; "" = socket.gethostname()
    # The address its listeners bind: "" = the one run.hostname resolves to; 0.0.0.0 only
    # where run.hostname is not one of this host's addresses (NAT; docs/security.md).
    bind: str = ""
    log_level: str = "INFO"
    start_gate: str = ""  # local jobs: wait (up to timeouts.startup) for this file before training
    tensorboard: bool = True  # scalars under <run.dir>/tensorboard/c<C>r<R>
    # Local jobs: each cluster (and its lighthouse) in its own Linux network namespace on a
    # bridge, the global lighthouse in the hub's (launch/netns.py); needs root. Enables partitions.
    netns: bool = False
    # Take faults handed over while the process runs (core/runtime/faults.py FaultPlan.inbox): the
    # chaos command's poison. Off by default: a process in production takes none.
    fault_inbox: bool = False
    # Local jobs (demo, chaos, bench): each replica group runs this Python script (a user's
    # program on the public API, job.py) instead of the built-in `hier-localsgd train`; its
    # overrides reach it in OVERRIDES_ENV. "" = the built-in trainer.
    program: str = ""


# The hydra overrides a launcher hands a user's program (a JSON list): its run.cluster,
# run.replica, lighthouse addresses and the job's shared overrides (job.config_from_env).
OVERRIDES_ENV = "HIER_LOCALSGD_OVERRIDES"


class LogTag(logging.Filter):
    """Puts the process's identity and its current role into every log line: ``[c0r1g1 leader]``.

    One per process (:data:`LOG_TAG`, installed on the handler by the CLI); the trainer
    updates the role on every phase transition, so a line says whether its process led
    its cluster when it was written.
    """

    def __init__(self, tag: str = "") -> None:
        super().__init__()
        self.tag = tag
        self.role = ""

    def set_role(self, role: str) -> None:
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.tag = f"{self.tag} {self.role}" if self.role else self.tag
        return True


LOG_TAG = LogTag()

class Runtime:
    """Owns the exit path of one process (see module docstring).

    Args:
        describe: name of this process in log lines.
        shutdown_timeout: bound on running the closers.
        watchdog_grace: slack past a phase deadline before the watchdog fires.
    """

    def __init__(self, describe: str, shutdown_timeout: timedelta, watchdog_grace: timedelta) -> None:
        self.describe = describe
        self._shutdown_timeout = shutdown_timeout
        self._grace = watchdog_grace
        self._closers: List[Callable[[], None]] = []
        self._on_exit: List[Callable[[int, str], None]] = []
        self._lock = threading.Lock()
        self._exiting = False
        self._tracker: Optional[PhaseTracker] = None
        self._parent: Optional[int] = None

    def install(self, watch_parent: bool = False) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        threading.Thread(target=self._signal_loop, name="signals", daemon=True).start()
        self._parent = os.getppid() if watch_parent else None
        if watch_parent:
            try:
                import ctypes

                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
            except OSError:
                logger.warning("%s: PR_SET_PDEATHSIG unavailable; relying on parent polling", self.describe)

    def watch(self, tracker: PhaseTracker) -> None:
        """Starts the watchdog over ``tracker``'s phase deadlines."""
        self._tracker = tracker
        threading.Thread(target=self._watchdog_loop, name="watchdog", daemon=True).start()

    def add_closer(self, fn: Callable[[], None]) -> None:
        """``fn`` runs on every exit path (e.g. a Manager's shutdown)."""
        with self._lock:
            self._closers.append(fn)

    def on_exit(self, fn: Callable[[int, str], None]) -> None:
        """``fn(code, reason)`` runs after the closers (e.g. publish the final state)."""
        with self._lock:
            self._on_exit.append(fn)

    def run(self, main: Callable[[], None]) -> None:
        """Runs ``main`` and exits the process accordingly. Never returns."""
        try:
            main()
        except BaseException as e:  # includes KeyboardInterrupt/SystemExit from main
            code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else getattr(e, "exit_code", EXIT_ERROR)
            self.exit(code, f"{e.__class__.__name__}: {e}", error=e)
        self.exit(EXIT_OK, "finished")

    def exit(self, code: int, reason: str, error: Optional[BaseException] = None) -> None:
        """Stops heartbeats, publishes, exits. Safe from any thread; the first caller wins.

        A non-zero exit is logged as one ERROR record carrying ``error``'s traceback, which
        the console shows as one line unless HIER_LOCALSGD_DEBUG is set (cli.setup_logging).
        """
        with self._lock:
            if self._exiting:
                # Another thread is already exiting; don't return into a hung caller.
                while True:
                    time.sleep(1)
            self._exiting = True
            closers, on_exit = list(self._closers), list(self._on_exit)
        if code != EXIT_OK:
            logger.error("%s exiting with code %d: %s", self.describe, code, reason, exc_info=error)
        done = threading.Event()

        def close_all() -> None:
            for fn in reversed(closers):
                try:
                    fn()
                except Exception:
                    logger.exception("closer failed during exit")
            done.set()

        threading.Thread(target=close_all, name="closers", daemon=True).start()
        if not done.wait(self._shutdown_timeout.total_seconds()):
            logger.error("%s: shutdown took longer than %s; exiting anyway", self.describe, self._shutdown_timeout)
        for fn in on_exit:
            try:
                fn(code, reason)
            except Exception:
                logger.exception("exit hook failed")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _signal_loop(self) -> None:
        sig = signal.sigwait(_SIGNALS)
        name = signal.Signals(sig).name
        logger.warning("%s received %s", self.describe, name)
        self.exit(128 + sig, f"received {name}")

    def _watchdog_loop(self) -> None:
        assert self._tracker is not None
        grace = self._grace.total_seconds()
        while True:
            time.sleep(0.5)
            if self._parent is not None and os.getppid() != self._parent:
                self.exit(EXIT_ERROR, f"parent process {self._parent} (the torchrun agent) is gone")
            deadline = self._tracker.deadline()
            if deadline is not None and time.time() > deadline + grace:
                phase = self._tracker.phase
                self.exit(
                    EXIT_WATCHDOG,
                    f"watchdog: stuck in phase {phase.name} {time.time() - deadline:.1f}s past its deadline",
                )
