"""The launcher's side of warm spares (:class:`WarmSpares`, owned by
:class:`~hier_localsgd.launch.local.LocalJob`).

A warm spare (``hier_localsgd/spare.py``) is a process started ahead with the training
stack imported; a restarted replica group runs in it and joins in well under a second.
This module holds the launcher's bookkeeping for it: at most one spare at a time, when
the next may start, whether its log said it finished its imports, handing it a restart's
arguments, and killing it at the end. It is separate from local.py because it is one
small state machine with no other tie to the job than the paths and the interpreter it
is given; the job only asks it and feeds it.

Failure semantics: nothing here raises for a spare that died or was never started:
:meth:`WarmSpares.take` returns None and the caller starts the restart cold. A spare
disabled at construction is never started. :meth:`WarmSpares.drop` kills a live spare's
whole session and waits at most 10 s for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

SPARE_RESPAWN_S = 10.0  # after a restart took the spare, the next one starts this much later


class WarmSpares:
    """At most one warm spare of a local job (module doc).

    ``enabled``: where one can run a restart (single-rank groups outside network
    namespaces, the built-in program: the job decides); ``log_dir``: where ``spare.log``
    goes (the spare's output until it becomes a replica group)."""

    def __init__(self, python: str, log_dir: Path, enabled: bool) -> None:
        self.python = python
        self.log_dir = log_dir
        self.enabled = enabled
        self._proc: Optional[subprocess.Popen] = None
        self._due = 0.0  # when the next spare may start
        self._ready_pid: Optional[int] = None  # the spare whose log said it finished its imports

    def ensure(self, env: Dict[str, str]) -> None:
        """Starts a spare unless one is waiting or it is too early (it imports while the job trains)."""
        if not self.enabled or (self._proc is not None and self._proc.poll() is None) or time.time() < self._due:
            return
        f = open(self.log_dir / "spare.log", "ab")
        self._proc = subprocess.Popen([self.python, "-m", "hier_localsgd.spare"], stdin=subprocess.PIPE, stdout=f,
                                      stderr=subprocess.STDOUT, env=env, start_new_session=True)
        f.close()

    def ready(self) -> bool:
        """Whether a spare is waiting with its imports done (its log says so)."""
        spare = self._proc
        if spare is None or spare.poll() is not None:
            return False
        if self._ready_pid != spare.pid:  # the log is read until it says so, not after
            log = self.log_dir / "spare.log"
            if log.exists() and f"spare: ready (pid {spare.pid})" in log.read_text(errors="replace"):
                self._ready_pid = spare.pid
        return self._ready_pid == spare.pid

    def take(self, argv: List[str], log: Path) -> Optional[Tuple[subprocess.Popen, str]]:
        """Hands ``argv`` (``hier_localsgd`` arguments) and the group's ``log`` to the waiting
        spare: (its process, "ready" if it had finished its imports else "started"); None if
        there is none (it is forgotten either way)."""
        ready = self.ready()
        spare, self._proc = self._proc, None
        if spare is None or spare.poll() is not None or spare.stdin is None:
            return None
        try:
            spare.stdin.write((json.dumps({"argv": argv, "log": str(log)}) + "\n").encode())
            spare.stdin.close()
        except OSError:
            return None  # it died just now: start cold
        # The next spare starts a little later: importing beside a restart that is
        # starting up would slow both on a small machine.
        self._due = time.time() + SPARE_RESPAWN_S
        return spare, "ready" if ready else "started"

    def drop(self) -> None:
        """Kills a waiting spare (its whole session)."""
        spare, self._proc = self._proc, None
        if spare is not None and spare.poll() is None:
            try:
                os.killpg(spare.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            spare.wait(timeout=10)
