"""``hier-localsgd dashboard``: one live page for the whole hierarchy of a run.

torchft's Lighthouse serves a status page per lighthouse; a hierarchical job has
one global lighthouse plus one per cluster, and its replica groups' own state
(phase of the sync state machine, rounds, loss, link statistics) is not on any
of them. This dashboard reads a run directory (``run.dir``, see
:mod:`hier_localsgd.core.status`) and shows:

* the tree — global lighthouse → clusters (each with its lighthouse) → replica
  groups: role, process state, phase, step, inner/outer round, time since the
  last commit, train loss, "last seen" (age of its status file), link statistics;
  per lighthouse its quorum id, participants and a link to its own page;
* per-cluster train loss curves and their excess over the entropy floor;
* a timeline of quorum changes, commits, rollbacks, heals, resyncs, leader
  changes, faults, and the launcher's and the dashboard's kills/exits/restarts;
* with ``dashboard.allow_kill=true`` only, a kill button per replica group.

Sources (all files; nothing is scraped from a lighthouse's HTML)::

    <run.dir>/replicas/c<C>r<R>/status.json    current state (atomically replaced)
    <run.dir>/replicas/c<C>r<R>/events.jsonl   commits, rollbacks, heals, ... (append-only)
    <run.dir>/job_events.jsonl                 launcher: start / exit / restart / kill
    <run.dir>/dashboard_events.jsonl           this dashboard's kill requests (it writes them)

Quorums are derived from what replicas report: a cluster lighthouse's quorum is
the newest ``inner.quorum_id`` its replica groups report, its participants the
replica groups reporting that id; the global lighthouse's comes from the
leaders' ``outer`` blocks. "Last seen" is ``now - status.updated_at``: a process
rewrites its status at every local step and phase transition, so this is the
liveness signal the files offer (the lighthouses' own heartbeat ages are only on
their HTML pages).

Failure semantics:

* Reading never fails on a file being written: a JSONL line without its newline
  is left for the next poll, an unparsable complete line is skipped, a missing
  or half-replaced ``status.json`` keeps the last good copy. A truncated or
  replaced file is read again from the start.
* :func:`build_state` is a pure function of the files' contents and ``now``;
  the HTTP layer only serialises it. The page polls ``api/state`` every
  ``dashboard.refresh_ms`` and shows "disconnected" when a poll fails; it never
  acts on its own.
* Kill (``POST api/replicas/<C>/<R>/kill``) answers 403 unless the dashboard
  was started with ``allow_kill``; it also refuses requests that are not JSON
  or come from another origin (a page elsewhere cannot trigger it). It looks up
  the replica group's full torchft replica id and its cluster lighthouse in the
  status file (the client names only cluster and replica), calls torchft's
  ``POST <lighthouse>/replica/<id>/kill`` (the Manager's Kill RPC: the process
  exits with code 1, on whatever host it runs) with a 5 s timeout, and appends
  the request and its outcome to ``dashboard_events.jsonl``. The Manager exits
  before it answers, so the lighthouse reports a "transport error" (HTTP 500)
  for a kill that worked; that reply counts as sent. The page shows the replica
  group "killed" once its status stops updating, and ignores a kill after which
  it kept publishing for 5 s. Restarting the
  process is the launcher's job (``launch/replica.sh``, ``LocalJob.wait(restart=True)``).
* The server binds ``dashboard.host`` (127.0.0.1 by default); a bind failure
  raises :class:`~hier_localsgd.schema.ConfigError` naming ``dashboard.port``.

Web stack: Flask (its WSGI app, :func:`create_app`) served by Werkzeug's
threaded server; the page is static HTML + vanilla JS + inline SVG charts
(``static/``), no build step and no external resources.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from hier_localsgd.core.runtime import EXIT_CONFIG
from hier_localsgd.schema import ConfigError

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
DASHBOARD_EVENTS = "dashboard_events.jsonl"
JOB_EVENTS = "job_events.jsonl"

Key = Tuple[int, int]

# Replica event kinds the dashboard keeps (phase transitions are in status.json,
# and there are too many of them for a timeline).
SKIPPED_EVENT_KINDS = frozenset({"phase"})

# Timeline severities, used by the page for colours.
SEVERITY = {
    "commit": "info",
    "eval": "info",
    "start": "info",
    "heal": "good",
    "restart": "good",
    "leader": "warn",
    "resync": "warn",
    "quorum": "warn",
    "rollback": "bad",
    "timeout": "bad",
    "quorum_failed": "bad",
    "fault": "bad",
    "kill": "bad",
    "exit": "bad",
}


# -----------------------------------------------------------------------------
# Configuration


@dataclass
class DashboardConfig:
    """``dashboard.*``: what to watch, where to serve, whether kills are allowed.

    Attributes:
        run_dir: the run directory to watch (a job's ``run.dir``); required.
        host: address to bind; loopback by default. Anyone who can reach it sees
            the run (and, with ``allow_kill``, can kill its processes).
        port: TCP port; 0 picks a free one.
        allow_kill: show kill buttons and accept kill requests. Off by default:
            the kill endpoint then answers 403.
        refresh_ms: how often the page polls the state.
    """

    run_dir: str = ""
    host: str = "127.0.0.1"
    port: int = 8265
    allow_kill: bool = False
    refresh_ms: int = 1000


def validate(cfg: DashboardConfig, prefix: str = "dashboard") -> None:
    """Raises :class:`~hier_localsgd.schema.ConfigError` whose message starts with the field."""
    if not cfg.run_dir:
        raise ConfigError(f"{prefix}.run_dir: required: the run directory to watch, e.g. {prefix}.run_dir=runs/latest")
    if not Path(cfg.run_dir).is_dir():
        raise ConfigError(f"{prefix}.run_dir: {cfg.run_dir!r}: no such directory")
    if not cfg.host:
        raise ConfigError(f"{prefix}.host: required (127.0.0.1 serves this machine only)")
    if not 0 <= cfg.port <= 65535:
        raise ConfigError(f"{prefix}.port: {cfg.port} — must be in [0, 65535] (0 picks a free port)")
    if cfg.refresh_ms < 100:
        raise ConfigError(f"{prefix}.refresh_ms: {cfg.refresh_ms} — must be at least 100")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -----------------------------------------------------------------------------
# Reading the run directory


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
                st = self._read_status(key, d / "status.json")
                if st is not None:
                    out.statuses[key] = st
                tail = self._tails.get(key)
                if tail is None:
                    tail = self._tails[key] = JsonlTail(d / "events.jsonl", keep=lambda rec: rec.get("kind") not in SKIPPED_EVENT_KINDS)
                out.events[key] = list(tail.read())
            out.job_events = list(self._job.read())
            out.dashboard_events = list(self._dash.read())
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


# -----------------------------------------------------------------------------
# Aggregation: files -> one plain dict for the page


def _num(x: Any) -> Optional[float]:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _age(now: float, t: Any) -> Optional[float]:
    t = _num(t)
    return None if t is None else max(0.0, now - t)


def _plural(n: Any, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def name_of(key: Key) -> str:
    return f"c{key[0]}r{key[1]}"


def _health(key: Key, st: Optional[Dict[str, Any]], job: List[Dict[str, Any]], dash: List[Dict[str, Any]], now: float, stale_after_s: float) -> Tuple[str, str]:
    """The replica group's process state: (health, detail).

    health: absent | starting | live | waiting | stale | kill sent | killed |
    exited | restarting | finished | failed.
    """
    last_job = job[-1] if job else None
    if st is None:
        if last_job is not None and last_job.get("kind") in ("start", "restart"):
            return "starting", f"process {last_job.get('pid')} started, no status yet"
        return "absent", "no status published yet"
    pid = st.get("pid")
    state = str(st.get("state", ""))
    if last_job is not None:
        kind, jpid = last_job.get("kind"), last_job.get("pid")
        if kind in ("start", "restart") and jpid is not None and jpid != pid:
            return "restarting", f"process {jpid} started, not yet published"
        if kind == "exit" and (jpid is None or jpid == pid):
            code = last_job.get("code")
            if code == 0:
                return "finished", "exited with code 0"
            return "exited", f"exited with code {code}"
        if kind == "kill" and (jpid is None or jpid == pid) and state not in ("finished", "done"):
            return "killed", f"killed by the launcher ({last_job.get('signal', 'signal')})"
    if state in ("finished", "done"):
        return "finished", state
    if state.startswith("failed"):
        return "failed", state
    seen = _age(now, st.get("updated_at"))
    started = _num(st.get("started_at")) or 0.0
    kills = [d for d in dash if d.get("kind") == "kill" and d.get("ok") and (_num(d.get("t")) or 0.0) >= started]
    if kills:
        tk = _num(kills[-1].get("t")) or 0.0
        if (_num(st.get("updated_at")) or 0.0) <= tk + 5.0:  # still publishing 5 s after the kill: it did not take
            if seen is not None and seen > 2.0:
                return "killed", "killed from the dashboard; no status update since"
            return "kill sent", "kill requested from the dashboard"
    if state in ("starting", "ready"):
        if seen is not None and seen > max(stale_after_s, 60.0):
            return "stale", f"{state}, no status update for {seen:.0f} s"
        return "starting", state
    if seen is not None and seen > stale_after_s:
        deadline = _num(st.get("phase_deadline"))
        if st.get("phase") not in (None, "LOCAL") and deadline is not None and now < deadline:
            return "waiting", f"in {st.get('phase')}, deadline in {deadline - now:.0f} s"
        return "stale", f"no status update for {seen:.0f} s"
    return "live", state or "running"


def _flatten(prefix: str, v: Any, out: List[Tuple[str, Any]], depth: int = 0) -> None:
    if isinstance(v, dict) and depth < 2:
        for k, x in v.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), x, out, depth + 1)
    else:
        out.append((prefix, v))


def _link_view(link: Any) -> Dict[str, Any]:
    """Per level: bytes sent, collectives, and every other key flattened (lossy-link stats included)."""
    if not isinstance(link, dict):
        return {}
    out: Dict[str, Any] = {}
    for level, stats in link.items():
        if not isinstance(stats, dict):
            continue
        calls = stats.get("calls")
        sent = stats.get("sent_bytes") if isinstance(stats.get("sent_bytes"), dict) else {}
        extra: List[Tuple[str, Any]] = []
        for k, v in stats.items():
            if k in ("sent_bytes_total", "tensor_bytes", "calls"):
                continue
            _flatten(k, v, extra)
        loss = stats.get("loss") if isinstance(stats.get("loss"), dict) else None
        out[str(level)] = {
            "sent_bytes_total": _num(stats.get("sent_bytes_total")) if stats.get("sent_bytes_total") is not None else _num(sum(v for v in sent.values() if _num(v) is not None)),
            "payload_bytes": _num(sent.get("payload")),
            "calls": int(sum(v for v in calls.values() if isinstance(v, (int, float)))) if isinstance(calls, dict) else None,
            "injected_failures": stats.get("injected_failures"),
            "loss_rate": _num(loss.get("observed_loss_rate")) if loss else None,
            "details": [[k, v] for k, v in extra],
        }
    return out


def _replica_view(key: Key, st: Optional[Dict[str, Any]], job: List[Dict[str, Any]], dash: List[Dict[str, Any]], now: float, stale_after_s: float, allow_kill: bool) -> Dict[str, Any]:
    health, detail = _health(key, st, job, dash, now, stale_after_s)
    restarts = sum(1 for j in job if j.get("kind") == "restart")
    view: Dict[str, Any] = {"name": name_of(key), "cluster": key[0], "replica": key[1], "health": health, "health_detail": detail, "restarts": restarts, "published": st is not None}
    if st is None:
        view["kill"] = False
        return view
    inner = st.get("inner") if isinstance(st.get("inner"), dict) else None
    outer = st.get("outer") if isinstance(st.get("outer"), dict) else None
    floor = _num(st.get("entropy_floor"))
    loss = _num(st.get("loss"))
    lighthouses = st.get("lighthouses") if isinstance(st.get("lighthouses"), dict) else {}
    deadline = _num(st.get("phase_deadline"))
    view.update(
        role="leader" if st.get("leader") else "member",
        leader=bool(st.get("leader")),
        state=st.get("state"),
        pid=st.get("pid"),
        phase=st.get("phase"),
        phase_age_s=_age(now, st.get("phase_entered")),
        phase_deadline_in_s=None if deadline is None else deadline - now,
        step=st.get("step"),
        steps_total=st.get("steps_total"),
        inner_round=st.get("inner_round"),
        outer_round=st.get("outer_round"),
        last_commit_level=st.get("last_commit_level"),
        last_commit_round=st.get("last_commit_round"),
        last_commit_age_s=_age(now, st.get("last_commit_at")),
        loss=loss,
        loss_step=st.get("loss_step"),
        excess=None if loss is None or floor is None else loss - floor,
        eval_loss=_num(st.get("eval_loss")),
        eval_step=st.get("eval_step"),
        last_seen_s=_age(now, st.get("updated_at")),
        uptime_s=_age(now, st.get("started_at")),
        steps_run=st.get("steps_run"),
        steps_discarded=st.get("steps_discarded"),
        steps_since_commit=st.get("steps_since_commit"),
        replica_id=inner.get("replica_id") if inner else None,
        inner=inner,
        outer=outer,
        lighthouse=(inner or {}).get("lighthouse") or lighthouses.get("cluster"),
        link=_link_view(st.get("link")),
        # per level whose lighthouse is not answering: since, for_s, retries (outage.py)
        outage=st.get("outage") if isinstance(st.get("outage"), dict) else None,
    )
    view["kill"] = bool(allow_kill and view["replica_id"] and view["lighthouse"] and health in ("live", "waiting", "stale", "starting"))
    return view


def _quorum(members: List[Tuple[str, Optional[Dict[str, Any]], bool]]) -> Dict[str, Any]:
    """Quorum of one lighthouse from its members' status blocks: (name, block, alive)."""
    ids = [b.get("quorum_id") for _, b, alive in members if b and alive and isinstance(b.get("quorum_id"), int)]
    if not ids:
        ids = [b.get("quorum_id") for _, b, _ in members if b and isinstance(b.get("quorum_id"), int)]
    if not ids:
        return {"quorum_id": None, "quorum_size": None, "participants": []}
    qid = max(ids)
    # Participants: live members reporting it (a dead member's last status still names it).
    parts = [n for n, b, alive in members if b and alive and b.get("quorum_id") == qid] or [n for n, b, _ in members if b and b.get("quorum_id") == qid]
    sizes = [b.get("quorum_size") for _, b, _ in members if b and b.get("quorum_id") == qid and isinstance(b.get("quorum_size"), int)]
    return {"quorum_id": qid, "quorum_size": max(sizes) if sizes else len(parts), "participants": parts}


def _downsample(points: List[List[float]], limit: int) -> List[List[float]]:
    if len(points) <= limit:
        return points
    stride = math.ceil(len(points) / limit)
    out = points[::stride]
    if out[-1] is not points[-1]:
        out.append(points[-1])
    return out


def _series(events: Dict[Key, List[Dict[str, Any]]], kind: str, clusters: Iterable[int], limit: int) -> Dict[str, List[List[float]]]:
    """Per cluster: [step, mean over its replica groups of their latest ``kind`` loss at that step]."""
    per: Dict[int, Dict[int, Dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for (c, r), evs in events.items():
        for e in evs:
            if e.get("kind") != kind:
                continue
            step, loss = e.get("step"), _num(e.get("loss"))
            if isinstance(step, int) and loss is not None:
                per[c][step][r] = loss
    out = {}
    for c in clusters:
        pts = [[s, sum(v.values()) / len(v)] for s, v in sorted(per[c].items())]
        out[str(c)] = _downsample(pts, limit)
    return out


def _replica_entry(key: Key, e: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A timeline entry for one replica event (None: not a timeline event)."""
    kind = e.get("kind")
    who = name_of(key)
    level = e.get("level")
    step = e.get("step")
    at = f" at step {step}" if step is not None else ""
    if kind in ("loss", "phase", "commit", "eval"):
        return None  # loss: the charts; phase: status.json; commit and eval: merged across replica groups
    if kind == "leader":
        text = f"{who} became the leader of cluster {key[0]}" if e.get("leader") else f"{who} stopped leading cluster {key[0]}"
    elif kind == "heal":
        text = f"{who} healed its {level} state from a peer{at}"
    elif kind == "resync":
        text = f"{who} {level} resync from rank {e.get('source')}{at}" + (" (diverged)" if e.get("diverged") else "")
    elif kind == "rollback":
        text = f"{who} rolled back ({level}){at}: {e.get('reason', '')}"
    elif kind in ("timeout", "quorum_failed"):
        text = f"{who} {level} {e.get('op', '')} {'timed out' if kind == 'timeout' else 'failed'} in {e.get('phase')}: {e.get('detail', '')}"
    elif kind == "fault":
        text = f"{who} injected fault {e.get('action')} in {e.get('phase')}{at}"
    else:
        fields = {k: v for k, v in e.items() if k not in ("t", "kind", "cluster", "replica")}
        text = f"{who} {kind} {json.dumps(fields, default=str)[:200]}"
    return {"t": e.get("t"), "kind": kind, "who": who, "cluster": key[0], "level": level, "text": text}


def _commit_groups(events: Dict[Key, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One record per committed round: the replica groups' identical commit events merged."""
    groups: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for key, evs in events.items():
        for e in evs:
            if e.get("kind") != "commit" or _num(e.get("t")) is None:
                continue
            level = e.get("level")
            rnd = e.get("outer_round") if level == "outer" else e.get("inner_round")
            scope = None if level == "outer" else key[0]
            gk = (level, scope, rnd, e.get("step"))
            g = groups.get(gk)
            if g is not None and abs(e["t"] - g["t_first"]) > 30:
                gk = gk + (e["t"],)  # the same round number again (a whole cluster restarted)
                g = None
            if g is None:
                g = groups[gk] = {"t_first": e["t"], "t": e["t"], "level": level, "cluster": scope, "round": rnd, "step": e.get("step"),
                                  "participants": e.get("participants"), "outer": bool(e.get("outer")), "who": []}
            g["t"] = max(g["t"], e["t"])
            g["t_first"] = min(g["t_first"], e["t"])
            g["who"].append(name_of(key))
    return sorted(groups.values(), key=lambda g: g["t_first"])


def _eval_entries(events: Dict[Key, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One entry per evaluation step: the replica groups' eval events at that step merged."""
    groups: Dict[Tuple[Any, ...], List[Tuple[Key, Dict[str, Any]]]] = {}
    for key, evs in events.items():
        for e in evs:
            if e.get("kind") == "eval" and _num(e.get("t")) is not None and _num(e.get("loss")) is not None:
                gk: Tuple[Any, ...] = (e.get("step"),)
                if gk in groups and (abs(e["t"] - groups[gk][0][1]["t"]) > 60 or key in {k for k, _ in groups[gk]}):
                    gk = (e.get("step"), key, e["t"])  # another evaluation at that step (a restarted process)
                groups.setdefault(gk, []).append((key, e))
    out = []
    for members in groups.values():
        losses = [float(e["loss"]) for _, e in members]
        floors = [float(e["floor"]) for _, e in members if _num(e.get("floor")) is not None]
        mean = sum(losses) / len(losses)
        spread = f" (range {min(losses):.4f}–{max(losses):.4f})" if max(losses) - min(losses) > 5e-5 else ""
        excess = f", excess over the entropy floor {mean - floors[0]:.4f}" if floors else ""
        names = [name_of(k) for k, _ in sorted(members, key=lambda m: m[0])]
        step = members[0][1].get("step")
        text = f"eval at step {step}: loss {mean:.4f}{spread}{excess}"
        text = f"{names[0]} {text}" if len(names) == 1 else f"{text} [{', '.join(names)}]"
        out.append({"t": max(e["t"] for _, e in members), "kind": "eval", "who": names[0] if len(names) == 1 else f"{len(names)} replica groups",
                    "cluster": None, "level": None, "text": text})
    return out


def _timeline(files: RunFiles, limit: int) -> Tuple[List[Dict[str, Any]], Dict[str, int]]:
    """Chronological timeline (the last ``limit`` entries) and counts per kind.

    Consecutive commits of one level (per cluster for inner) with the same
    number of participants collapse into one entry ("rounds a–b"), closed by
    any event that concerns it (an event of that cluster; for the outer level a
    leader change or an outer-level event); a change in the number of
    participants is a "quorum" entry.
    """
    singles: List[Dict[str, Any]] = []
    for key, evs in files.events.items():
        for e in evs:
            ent = _replica_entry(key, e)
            if ent is not None and _num(ent["t"]) is not None:
                singles.append(ent)
    singles.extend(_eval_entries(files.events))
    for j in files.job_events:
        kind = j.get("kind")
        who = f"lighthouse {j['lighthouse']}" if j.get("lighthouse") else f"c{j.get('cluster')}r{j.get('replica')}"
        if j.get("replica") is None and isinstance(j.get("cluster"), int):  # partition / heal (run.netns)
            who = f"cluster {j['cluster']}'s network"
        if kind == "up":
            text = f"{who} answering"
        elif kind == "start":
            text = f"{who} started (pid {j.get('pid')})"
        elif kind == "restart":
            text = f"{who} restarted by the launcher (pid {j.get('pid')})"
        elif kind == "exit":
            text = f"{who} exited with code {j.get('code')} (pid {j.get('pid')})"
        elif kind == "kill":
            text = f"{who} killed by the launcher with {j.get('signal', 'a signal')} (pid {j.get('pid')})"
        else:
            text = f"{who} {kind}"
        if _num(j.get("t")) is not None:
            singles.append({"t": j["t"], "kind": kind, "who": who, "cluster": j.get("cluster"), "level": None, "text": text, "source": "launcher",
                            "severity": "info" if kind == "exit" and j.get("code") == 0 else None})
    for d in files.dashboard_events:
        who = f"c{d.get('cluster')}r{d.get('replica')}"
        if _num(d.get("t")) is None:
            continue
        if d.get("ok"):
            text = f"{who} killed from the dashboard (via its lighthouse {d.get('lighthouse')})"
        else:
            text = f"kill of {who} from the dashboard failed: {d.get('detail', '')}"
        singles.append({"t": d["t"], "kind": d.get("kind", "kill"), "who": who, "cluster": d.get("cluster"), "level": None, "text": text, "source": "dashboard"})

    counts: Dict[str, int] = defaultdict(int)
    for s in singles:
        counts[str(s["kind"])] += 1
        if s["kind"] == "exit" and s.get("severity") != "info":
            counts["exit_nonzero"] += 1
    commits = _commit_groups(files.events)
    counts["commit"] = len(commits)

    stream = sorted([(s["t"], 1, s) for s in singles] + [(g["t_first"], 0, g) for g in commits], key=lambda x: (x[0], x[1]))
    out: List[Dict[str, Any]] = []
    open_runs: Dict[Tuple[Any, Any], Dict[str, Any]] = {}
    last_participants: Dict[Tuple[Any, Any], Any] = {}

    def close(pred: Callable[[Tuple[Any, Any]], bool]) -> None:
        for rk in [rk for rk in open_runs if pred(rk)]:
            out.append(open_runs.pop(rk))

    for t, is_single, item in stream:
        if is_single:
            # An event closes the commit runs it concerns: its cluster's inner run, and
            # the outer run for leader changes and outer-level events. The other
            # clusters' runs go on (they are spans: "rounds a–b").
            c, outer = item.get("cluster"), item["kind"] == "leader" or item.get("level") == "outer"
            if c is not None or outer:
                close(lambda rk, c=c, outer=outer: (rk[0] == "outer" and outer) or (rk[0] != "outer" and rk[1] == c))
            item.setdefault("severity", None)
            if item["severity"] is None:
                item["severity"] = SEVERITY.get(str(item["kind"]), "info")
            out.append(item)
            continue
        rk = (item["level"], item["cluster"])
        where = "across clusters" if item["level"] == "outer" else f"in cluster {item['cluster']}"
        prev = last_participants.get(rk)
        if prev is not None and prev != item["participants"]:
            close(lambda k, rk=rk: k == rk)
            out.append({"t": t, "kind": "quorum", "who": "global" if item["level"] == "outer" else f"cluster {item['cluster']}", "level": item["level"],
                        "cluster": item["cluster"], "text": f"{item['level']} quorum {where}: {prev} → {_plural(item['participants'], 'participant')}", "severity": SEVERITY["quorum"]})
        last_participants[rk] = item["participants"]
        run = open_runs.get(rk)
        if run is None:
            run = open_runs[rk] = {"t": item["t"], "t_first": item["t_first"], "kind": "commit", "level": item["level"], "cluster": item["cluster"],
                                   "who": "global" if item["level"] == "outer" else f"cluster {item['cluster']}", "rounds": [item["round"], item["round"]],
                                   "count": 0, "participants": item["participants"], "severity": "info"}
        run["count"] += 1
        run["rounds"][1] = item["round"]
        run["t"] = item["t"]
        n, (a, b) = run["count"], run["rounds"]
        rounds = f"round {b}" if n == 1 else f"rounds {a}–{b} ({n} commits)"
        run["text"] = f"{item['level']} commit {where}, {rounds}, {_plural(run['participants'], 'participant')}"
    close(lambda rk: True)
    out.sort(key=lambda x: x["t"])
    return out[-limit:], dict(counts)


def build_state(files: RunFiles, now: Optional[float] = None, *, allow_kill: bool = False, refresh_ms: int = 1000,
                stale_after_s: float = 10.0, timeline_limit: int = 300, series_points: int = 400) -> Dict[str, Any]:
    """The whole page's data as one JSON-serialisable dict; a pure function of ``files`` and ``now``.

    Keys: ``run`` (topology, mode, progress, floor), ``global`` (lighthouse,
    quorum), ``clusters`` (lighthouse, quorum, leader, replica groups — one per
    topology slot, published or not), ``losses`` (per-cluster train and eval
    series as [step, loss]), ``timeline`` (chronological), ``counts``.
    """
    now = time.time() if now is None else now
    st = files.statuses
    topo = next((s["topology"] for s in st.values() if isinstance(s.get("topology"), dict)), None)
    keys = set(st) | set(files.events)
    if topo and isinstance(topo.get("clusters"), int) and isinstance(topo.get("replicas_per_cluster"), int):
        C, R = topo["clusters"], topo["replicas_per_cluster"]
    else:
        C = max((c for c, _ in keys), default=-1) + 1
        R = max((r for _, r in keys), default=-1) + 1
    keys |= {(c, r) for c in range(C) for r in range(R)}

    job_by_key: Dict[Key, List[Dict[str, Any]]] = defaultdict(list)
    for j in files.job_events:
        if isinstance(j.get("cluster"), int) and isinstance(j.get("replica"), int):
            job_by_key[(j["cluster"], j["replica"])].append(j)
    dash_by_key: Dict[Key, List[Dict[str, Any]]] = defaultdict(list)
    for d in files.dashboard_events:
        if isinstance(d.get("cluster"), int) and isinstance(d.get("replica"), int):
            dash_by_key[(d["cluster"], d["replica"])].append(d)

    replicas = {k: _replica_view(k, st.get(k), job_by_key[k], dash_by_key[k], now, stale_after_s, allow_kill) for k in sorted(keys)}
    alive = {k: v["health"] in ("live", "waiting", "starting", "kill sent") for k, v in replicas.items()}
    lighthouses = next((s["lighthouses"] for s in st.values() if isinstance(s.get("lighthouses"), dict)), {})
    floor = next((_num(s.get("entropy_floor")) for s in st.values() if _num(s.get("entropy_floor")) is not None), None)

    clusters = []
    for c in sorted({k[0] for k in keys}):
        members = [replicas[k] for k in sorted(keys) if k[0] == c]
        addr = next((m.get("lighthouse") for m in members if m.get("lighthouse")), None)
        if addr is None:
            addr = next((st[k]["lighthouses"].get("cluster") for k in st if k[0] == c and isinstance(st[k].get("lighthouses"), dict)), None)
        q = _quorum([(m["name"], m.get("inner"), alive[(m["cluster"], m["replica"])]) for m in members])
        leaders = [m["name"] for m in members if m.get("leader") and alive[(m["cluster"], m["replica"])]] or [m["name"] for m in members if m.get("leader")]
        losses = [m["loss"] for m in members if m.get("loss") is not None and alive[(m["cluster"], m["replica"])]] or [m["loss"] for m in members if m.get("loss") is not None]
        clusters.append({
            "cluster": c,
            "lighthouse": {"address": addr, **q},
            "leader": leaders[0] if leaders else None,
            "loss": sum(losses) / len(losses) if losses else None,
            "live": sum(1 for m in members if alive[(m["cluster"], m["replica"])]),
            "replicas": members,
        })

    leaders = [v for v in replicas.values() if v.get("outer")]
    g = _quorum([(v["name"], v.get("outer"), alive[(v["cluster"], v["replica"])]) for v in leaders])
    global_addr = lighthouses.get("global") or next((v["outer"].get("lighthouse") for v in leaders if v["outer"].get("lighthouse")), None)

    published = [v for v in replicas.values() if v["published"]]
    steps = [v["step"] for v in published if isinstance(v.get("step"), int)]
    timeline, counts = _timeline(files, timeline_limit)
    return {
        "now": now,
        "run_dir": files.run_dir,
        "config": {"allow_kill": allow_kill, "refresh_ms": refresh_ms, "stale_after_s": stale_after_s},
        "run": {
            "found": bool(published),
            "mode": next((s.get("mode") for s in st.values() if s.get("mode")), None),
            "clusters": C,
            "replicas_per_cluster": R,
            "steps_total": next((s.get("steps_total") for s in st.values() if s.get("steps_total")), None),
            "step_min": min(steps) if steps else None,
            "step_max": max(steps) if steps else None,
            "inner_round": max((v["inner_round"] for v in published if isinstance(v.get("inner_round"), int)), default=None),
            "outer_round": max((v["outer_round"] for v in published if isinstance(v.get("outer_round"), int)), default=None),
            "live": sum(1 for a in alive.values() if a),
            "replica_groups": len(replicas),
            "entropy_floor": floor,
            "model_params": next((s.get("model_params") for s in st.values() if s.get("model_params")), None),
            "started_at": min((_num(s.get("started_at")) or now for s in st.values()), default=None),
        },
        "global": {"address": global_addr, **g},
        "clusters": clusters,
        "losses": {
            "floor": floor,
            "train": _series(files.events, "loss", [c["cluster"] for c in clusters], series_points),
            "eval": _series(files.events, "eval", [c["cluster"] for c in clusters], series_points),
        },
        "timeline": timeline,
        "counts": counts,
    }


def read_state(run_dir: str | Path, now: Optional[float] = None, **kwargs: Any) -> Dict[str, Any]:
    """:func:`build_state` of a run directory read once (tests, scripts)."""
    return build_state(RunReader(run_dir).read(), now, **kwargs)


# -----------------------------------------------------------------------------
# Kill


def kill_replica(run_dir: str | Path, files: RunFiles, cluster: int, replica: int, timeout_s: float = 5.0) -> Tuple[int, Dict[str, Any]]:
    """Asks the replica group's cluster lighthouse to kill it; records the request.

    Returns (HTTP status for the page, JSON body). Appends a ``kill`` record
    (t, cluster, replica, source, replica_id, lighthouse, ok, detail) to
    ``<run_dir>/dashboard_events.jsonl`` for every request that reached a lighthouse
    or failed to.
    """
    st = files.statuses.get((cluster, replica))
    if st is None:
        return 404, {"ok": False, "error": f"c{cluster}r{replica}: no status published"}
    inner = st.get("inner") if isinstance(st.get("inner"), dict) else {}
    rid = inner.get("replica_id")
    lighthouse = inner.get("lighthouse") or (st.get("lighthouses") or {}).get("cluster")
    if not rid or not lighthouse:
        return 409, {"ok": False, "error": f"c{cluster}r{replica}: no torchft replica id or lighthouse published yet (has it joined a quorum?)"}
    url = f"{lighthouse.rstrip('/')}/replica/{urllib.parse.quote(rid, safe=':')}/kill"
    t = time.time()
    ok, detail, code = False, "", 502
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=timeout_s) as resp:
            ok, code = 200 <= resp.status < 300, 200
            detail = resp.read(300).decode(errors="replace")
    except urllib.error.HTTPError as e:
        body = e.read(300).decode(errors="replace")
        if e.code == 500 and "transport error" in body:
            # The Manager's Kill RPC exits the process before it answers: the lighthouse
            # sees the connection drop. This is what a kill that worked looks like.
            ok, code = True, 200
            detail = "the Manager exited before answering (Kill ends the process)"
        else:
            detail = f"lighthouse answered {e.code}: {body}"
    except (urllib.error.URLError, OSError) as e:
        detail = f"lighthouse {lighthouse} unreachable: {getattr(e, 'reason', e)}"
    rec = {"t": t, "kind": "kill", "cluster": cluster, "replica": replica, "source": "dashboard", "replica_id": rid,
           "lighthouse": lighthouse, "pid": st.get("pid"), "ok": ok, "detail": detail}
    with open(Path(run_dir) / DASHBOARD_EVENTS, "a") as f:
        f.write(json.dumps(rec) + "\n")
    logger.warning("dashboard: kill c%dr%d (%s) via %s: %s", cluster, replica, rid, lighthouse, "sent" if ok else detail)
    return code, {"ok": ok, "replica_id": rid, "lighthouse": lighthouse, "detail": detail}


# -----------------------------------------------------------------------------
# HTTP


def create_app(cfg: DashboardConfig, reader: Optional[RunReader] = None):  # type: ignore[no-untyped-def]
    """The Flask (WSGI) app: ``/`` the page, ``/api/state``, ``POST /api/replicas/<C>/<R>/kill``."""
    from flask import Flask, jsonify, request, send_from_directory

    app = Flask(__name__, static_folder=str(STATIC_DIR), static_url_path="/static")
    app.config["SEND_FILE_MAX_AGE_DEFAULT"] = 0
    app.json.sort_keys = False  # type: ignore[attr-defined]
    reader = reader or RunReader(cfg.run_dir)

    @app.get("/")
    def index():  # type: ignore[no-untyped-def]
        return send_from_directory(STATIC_DIR, "index.html")

    @app.get("/api/state")
    def state():  # type: ignore[no-untyped-def]
        body = build_state(reader.read(), allow_kill=cfg.allow_kill, refresh_ms=cfg.refresh_ms)
        resp = jsonify(body)
        resp.headers["Cache-Control"] = "no-store"
        return resp

    @app.get("/api/health")
    def health():  # type: ignore[no-untyped-def]
        return jsonify({"ok": True, "run_dir": cfg.run_dir, "allow_kill": cfg.allow_kill})

    @app.post("/api/replicas/<int:cluster>/<int:replica>/kill")
    def kill(cluster: int, replica: int):  # type: ignore[no-untyped-def]
        if not cfg.allow_kill:
            return jsonify({"ok": False, "error": "kills are disabled: start the dashboard with dashboard.allow_kill=true"}), 403
        if not request.is_json:
            return jsonify({"ok": False, "error": "send the request as JSON (Content-Type: application/json)"}), 415
        origin = request.headers.get("Origin")
        if origin and urllib.parse.urlsplit(origin).netloc != request.host:
            return jsonify({"ok": False, "error": f"cross-origin kill request from {origin} refused"}), 403
        code, body = kill_replica(cfg.run_dir, reader.read(), cluster, replica)
        return jsonify(body), code

    return app


def _bind(cfg: DashboardConfig) -> socket.socket:
    """A listening socket on ``host:port`` (bound here so a failure names the field)."""
    from werkzeug.serving import select_address_family

    family = select_address_family(cfg.host, cfg.port)
    try:
        addr = socket.getaddrinfo(cfg.host, cfg.port, family, socket.SOCK_STREAM, socket.IPPROTO_TCP)[0][4]
    except socket.gaierror as e:
        raise ConfigError(f"dashboard.host: {cfg.host!r}: cannot resolve: {e}") from e
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(64)
    except OSError as e:
        sock.close()
        raise ConfigError(f"dashboard.port: cannot serve on {cfg.host}:{cfg.port}: {e.strerror or e}") from e
    return sock


def _make_server(cfg: DashboardConfig):  # type: ignore[no-untyped-def]
    from werkzeug.serving import WSGIRequestHandler, make_server

    class QuietHandler(WSGIRequestHandler):
        """No access log: the page polls every second."""

        def log_request(self, *args: Any, **kwargs: Any) -> None:
            pass

    validate(cfg)
    if cfg.allow_kill and not is_loopback(cfg.host):
        logger.warning("dashboard: kills are enabled and the dashboard is bound to %s: anyone who reaches it can kill replica groups", cfg.host)
    app = create_app(cfg)
    sock = _bind(cfg)
    try:
        # werkzeug serves a duplicate of the descriptor; ours is closed right after.
        return make_server(cfg.host, sock.getsockname()[1], app, threaded=True, request_handler=QuietHandler, fd=sock.fileno())
    finally:
        sock.close()


def _url(host: str, port: int) -> str:
    h = "127.0.0.1" if host in ("0.0.0.0", "") else ("localhost" if host == "::" else host)
    if ":" in h and not h.startswith("["):
        h = f"[{h}]"
    return f"http://{h}:{port}/"


def start_in_thread(cfg: DashboardConfig) -> Tuple[str, Callable[[], None]]:
    """Serves the dashboard from a daemon thread; returns (url, stop).

    ``stop()`` shuts the server down and waits up to 5 s for it. Raises
    :class:`~hier_localsgd.schema.ConfigError` (naming the field) if the config
    is invalid or the address cannot be bound.
    """
    server = _make_server(cfg)
    url = _url(cfg.host, server.port)
    th = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="dashboard", daemon=True)
    th.start()
    stopped = threading.Event()

    def stop() -> None:
        if stopped.is_set():
            return
        stopped.set()
        server.shutdown()
        th.join(5.0)
        server.server_close()

    return url, stop


def serve(cfg: DashboardConfig) -> int:
    """The ``dashboard`` command: serve until SIGTERM/SIGINT/SIGHUP; 0 on a clean stop, 2 on a config error."""
    sigs = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)  # before the server thread starts: it inherits the mask
    try:
        url, stop = start_in_thread(cfg)
    except ConfigError as e:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)
        print(f"hier-localsgd dashboard: configuration error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    kills = "kills enabled" if cfg.allow_kill else "kills disabled; dashboard.allow_kill=true enables them"
    print(f"dashboard: {url} watching {cfg.run_dir} ({kills})", flush=True)
    sig = signal.sigwait(sigs)
    logger.info("dashboard stopping on %s", signal.Signals(sig).name)
    stop()
    return 0
