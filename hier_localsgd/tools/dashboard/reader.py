"""Reading a run directory: each process's status and events files, tailed incrementally."""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from hier_localsgd.core.runtime.status import AUTO_FILE, EVENTS_FILE, STATUS_FILE
from hier_localsgd.tools.dashboard.config import DASHBOARD_EVENTS, JOB_EVENTS, Key, SKIPPED_EVENT_KINDS


class JsonlTail:
    """Incremental reader of one append-only JSONL file.

    Each :meth:`read` parses only what was appended since the last one. A last
    line without its newline is being written: it is left for the next read. A
    complete line that does not parse is skipped. If the file shrank or was
    replaced (another inode), it is read again from the start.
    """

    def __init__(self, path: Path, keep: Callable[[Dict[str, Any]], bool] = lambda rec: True) -> None:
        self.path = path
        self.keep = keep
        self.records: List[Dict[str, Any]] = []
        self._offset = 0
        self._inode: Optional[int] = None

    def read(self) -> List[Dict[str, Any]]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.records, self._offset, self._inode = [], 0, None
            return self.records
        if st.st_ino != self._inode or st.st_size < self._offset:
            self.records, self._offset, self._inode = [], 0, st.st_ino
        if st.st_size == self._offset:
            return self.records
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read(st.st_size - self._offset)
        except FileNotFoundError:
            return self.records
        end = chunk.rfind(b"\n")
        if end < 0:
            return self.records
        self._offset += end + 1
        for line in chunk[: end + 1].splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict) and self.keep(rec):
                self.records.append(rec)
        return self.records


def _parse_key(name: str) -> Optional[Key]:
    """``c3r12`` -> (3, 12); anything else -> None."""
    if not name.startswith("c") or "r" not in name:
        return None
    c, _, r = name[1:].partition("r")
    if c.isdigit() and r.isdigit():
        return int(c), int(r)
    return None


@dataclass
class RunFiles:
    """Everything the dashboard reads from a run directory, as plain data."""

    run_dir: str
    statuses: Dict[Key, Dict[str, Any]] = field(default_factory=dict)
    events: Dict[Key, List[Dict[str, Any]]] = field(default_factory=dict)
    job_events: List[Dict[str, Any]] = field(default_factory=list)
    dashboard_events: List[Dict[str, Any]] = field(default_factory=list)
    auto: Optional[Dict[str, Any]] = None  # sync.outer.auto's record (<run.dir>/auto.json), if any


class RunReader:
    """Reads a run directory incrementally (JSONL tails, last good status per replica).

    Thread-safe: the server's request threads share one reader.
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self._lock = threading.Lock()
        self._tails: Dict[Key, JsonlTail] = {}
        self._status: Dict[Key, Tuple[float, Dict[str, Any]]] = {}
        self._job = JsonlTail(self.run_dir / JOB_EVENTS)
        self._dash = JsonlTail(self.run_dir / DASHBOARD_EVENTS)

    def read(self) -> RunFiles:
        with self._lock:
            out = RunFiles(str(self.run_dir))
            root = self.run_dir / "replicas"
            try:
                dirs = sorted(p for p in root.iterdir() if p.is_dir())
            except FileNotFoundError:
                dirs = []
            for d in dirs:
                key = _parse_key(d.name)
                if key is None:
                    continue
                st = self._read_status(key, d / STATUS_FILE)
                if st is not None:
                    out.statuses[key] = st
                tail = self._tails.get(key)
                if tail is None:
                    tail = self._tails[key] = JsonlTail(d / EVENTS_FILE, keep=lambda rec: rec.get("kind") not in SKIPPED_EVENT_KINDS)
                out.events[key] = list(tail.read())
            out.job_events = list(self._job.read())
            out.dashboard_events = list(self._dash.read())
            out.auto = _read_json(self.run_dir / AUTO_FILE)
            return out

    def _read_status(self, key: Key, path: Path) -> Optional[Dict[str, Any]]:
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return self._status.get(key, (0.0, None))[1]
        cached = self._status.get(key)
        if cached is not None and cached[0] == mtime:
            return cached[1]
        try:
            with open(path) as f:
                st = json.load(f)
        except (OSError, json.JSONDecodeError):
            return cached[1] if cached else None
        if not isinstance(st, dict):
            return cached[1] if cached else None
        self._status[key] = (mtime, st)
        return st


def number(x: Any) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def age(now: float, t: Any) -> Optional[float]:
    t = number(t)
    return None if t is None else max(0.0, now - t)


def plural(n: Any, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def name_of(key: Key) -> str:
    return f"c{key[0]}r{key[1]}"


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    """A small JSON object file, or None (absent, partial or not an object)."""
    try:
        v = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return v if isinstance(v, dict) else None
