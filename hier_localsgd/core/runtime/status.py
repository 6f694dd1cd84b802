"""What each replica-group process publishes: status, events, result — as files.

Layout of a run directory (``run.dir``)::

    <run.dir>/replicas/c<C>r<R>/status.json   current phase, step, rounds, leader,
                                              last commit, last loss (rewritten atomically)
    <run.dir>/replicas/c<C>r<R>/events.jsonl  one JSON object per event: phase
                                              transitions, commits, rollbacks, heals,
                                              resyncs, leader changes, evals, faults
    <run.dir>/replicas/c<C>r<R>/result.json   written once, at a clean end of training (deleted
                                              when a process starts, so a restarted or resumed
                                              job never reads an earlier run's)
    <run.dir>/replicas/c<C>r<R>/rank<k>/...   the same for rank k > 0 of a multi-rank group
    <run.dir>/logs/c<C>r<R>.log               the process's log (written by the launcher)

Files are the interface: the demo, the tests and the dashboard read them without
touching the training processes. ``status.json`` is replaced with ``os.replace``
so readers never see a partial file; ``events.jsonl`` is append-only and each
line is flushed whole.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from hier_localsgd.core.runtime.phases import Transition


# The files of a run directory (written here and by the launcher; read by the experiments and the dashboard).
STATUS_FILE = "status.json"  # per replica group: its current state
EVENTS_FILE = "events.jsonl"  # per replica group: what happened
RESULT_FILE = "result.json"  # per replica group: written at the end
JOB_EVENTS_FILE = "job_events.jsonl"  # <run.dir>/: the launcher's starts, exits, restarts, kills
AUTO_FILE = "auto.json"  # <run.dir>/: sync.outer.auto's measured inputs and pick (experiments/auto.py)


def replica_dir(run_dir: str | Path, cluster: int, replica: int, rank: int = 0) -> Path:
    """A replica group's directory; ranks other than 0 of a group publish in ``rank<k>/`` under it."""
    d = Path(run_dir) / "replicas" / f"c{cluster}r{replica}"
    return d / f"rank{rank}" if rank else d


def inbox_path(run_dir: str | Path, cluster: int, replica: int) -> Path:
    """Where the chaos command hands a replica group a fault while it runs (core/runtime/faults.py,
    ``FaultPlan.from_inbox``; read by the group's rank 0 with ``run.fault_inbox``)."""
    return replica_dir(run_dir, cluster, replica) / "inbox.json"


def stop_path(run_dir: str | Path, cluster: int, replica: int) -> Path:
    """Written when a multi-rank group under torchrun exits for good (exit 2, e.g.
    sync/poison.PoisonLimit): torchrun restarts its workers after any exit, so a restarted
    worker that finds it exits 2 at once, and the launchers (launch/local.py,
    launch/replica.sh) read it as exit 2 and do not restart the group. A launcher removes it
    when it first starts the group."""
    return replica_dir(run_dir, cluster, replica) / "stopped"


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_events(path: Path) -> List[Dict[str, Any]]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        break  # a line being written right now
    except FileNotFoundError:
        pass
    return out


class ReplicaPublisher:
    """Status and event files of one replica-group process. Thread-safe."""

    def __init__(self, run_dir: str | Path, cluster: int, replica: int, static: Dict[str, Any], rank: int = 0) -> None:
        self.dir = replica_dir(run_dir, cluster, replica, rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.status_path = self.dir / STATUS_FILE
        self.events_path = self.dir / EVENTS_FILE
        self.result_path = self.dir / RESULT_FILE
        self.result_path.unlink(missing_ok=True)  # an earlier incarnation's or run's result is not ours
        self._lock = threading.Lock()
        self._status: Dict[str, Any] = dict(static, pid=os.getpid(), state="starting", started_at=time.time())
        self._events = open(self.events_path, "a", buffering=1)
        self._static = static
        self.update()

    def update(self, **fields: Any) -> None:
        with self._lock:
            self._status.update(fields)
            self._status["updated_at"] = time.time()
            write_json_atomic(self.status_path, self._status)

    def event(self, kind: str, **fields: Any) -> None:
        rec = {"t": time.time(), "kind": kind, "cluster": self._static.get("cluster"), "replica": self._static.get("replica")}
        rec.update(fields)
        with self._lock:
            if not self._events.closed:
                self._events.write(json.dumps(rec, default=str) + "\n")

    def on_transition(self, tr: Transition, snapshot: Dict[str, Any]) -> None:
        """PhaseTracker listener: status file and a ``phase`` event per transition."""
        self.event("phase", src=tr.src.value, dst=tr.dst.value, step=tr.step, inner_round=tr.inner_round, outer_round=tr.outer_round, reason=tr.reason)
        self.update(**snapshot)

    def result(self, result: Dict[str, Any]) -> None:
        write_json_atomic(self.result_path, result)

    def close(self, state: str) -> None:
        self.update(state=state)
        with self._lock:
            self._events.close()


def job_finished(run_dir: str | Path, keys: Iterable[Tuple[int, int]], steps_total: int) -> Optional[str]:
    """A message if any of ``keys`` (other replica groups of the job) has written a result
    for the whole run (``steps >= steps_total``), else None.

    This is how a late or lone replica group learns that the job moved on without it:
    the run directory is the job's shared state (as for ``lighthouse.until_done``). A
    job whose groups share no run directory never sees it and keeps today's behaviour
    (exit non-zero after ``sync.max_quorum_failures``). Each process deletes its own
    result file when it starts, so a result present here is from this job's run.
    """
    for c, r in keys:
        res = read_json(replica_dir(run_dir, c, r) / RESULT_FILE)
        if res and int(res.get("steps", 0)) >= steps_total:
            return f"the job has finished without this replica group: c{c}r{r} completed step {res['steps']}/{steps_total}"
    return None
