"""``hier-localsgd dashboard``: one live page for the whole hierarchy of a run.

torchft's Lighthouse serves a status page per lighthouse; a hierarchical job has
one global lighthouse plus one per cluster, and its replica groups' own state
(phase of the sync state machine, rounds, loss, link statistics) is not on any
of them. This dashboard reads a run directory (``run.dir``, see
:mod:`hier_localsgd.core.runtime.status`) and shows:

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
  raises :class:`~hier_localsgd.errors.ConfigError` naming ``dashboard.port``.

Web stack: Flask (its WSGI app, :func:`create_app`) served by Werkzeug's
threaded server; the page is static HTML + vanilla JS + inline SVG charts
(``static/``), no build step and no external resources.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from hier_localsgd.core.runtime.runtime import EXIT_CONFIG
from hier_localsgd.errors import ConfigError
from hier_localsgd.tools.dashboard.config import DASHBOARD_EVENTS, DashboardConfig, STATIC_DIR, host_allowed, is_loopback, validate
from hier_localsgd.tools.dashboard.reader import RunFiles, RunReader
from hier_localsgd.tools.dashboard.state import build_state

logger = logging.getLogger(__name__)


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


def create_app(cfg: DashboardConfig, reader: Optional[RunReader] = None):  # type: ignore[no-untyped-def]
    """The Flask (WSGI) app: ``/`` the page, ``/api/state``, ``POST /api/replicas/<C>/<R>/kill``."""
    from flask import Flask, jsonify, request, send_from_directory

    app = Flask(__name__, static_folder=str(STATIC_DIR), static_url_path="/static")
    app.config["SEND_FILE_MAX_AGE_DEFAULT"] = 0
    app.json.sort_keys = False  # type: ignore[attr-defined]
    reader = reader or RunReader(cfg.run_dir)

    @app.before_request
    def check_host():  # type: ignore[no-untyped-def]
        host = request.headers.get("Host", "")
        if not host_allowed(cfg, host):
            logger.warning("dashboard: refused %s %s for Host %r (not this dashboard's name; dashboard.allowed_hosts)",
                           request.method, request.path, host[:80])
            return jsonify({"ok": False, "error": f"Host {host[:80]!r} is not this dashboard (dashboard.allowed_hosts)"}), 403
        return None

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
    :class:`~hier_localsgd.errors.ConfigError` (naming the field) if the config
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
