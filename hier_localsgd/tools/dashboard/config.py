"""``dashboard.*``: the dashboard's config section and its check, and the names of what it reads and writes."""

from __future__ import annotations

import ipaddress
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Tuple

from hier_localsgd.core.runtime.status import JOB_EVENTS_FILE
from hier_localsgd.errors import ConfigError



STATIC_DIR = Path(__file__).resolve().parent / "static"
DASHBOARD_EVENTS = "dashboard_events.jsonl"
JOB_EVENTS = JOB_EVENTS_FILE  # written by the launcher (launch/local.py)

Key = Tuple[int, int]

# Replica event kinds the dashboard skips: phase transitions (in status.json, and too many
# for a timeline); the global model's evaluations (train.eval_global: the bench's curve).
SKIPPED_EVENT_KINDS = frozenset({"phase", "eval_global"})

# Timeline severities, used by the page for colours.
SEVERITY = {
    "commit": "info",
    "eval": "info",
    "start": "info",
    "heal": "good",
    "restart": "good",
    "leader": "warn",
    "resync": "warn",
    "keep_local": "warn",
    "quorum": "warn",
    "rollback": "bad",
    "timeout": "bad",
    "quorum_failed": "bad",
    "fault": "bad",
    "excluded": "bad",
    "optimizer_restored": "warn",
    "kill": "bad",
    "exit": "bad",
}




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
        allowed_hosts: names (besides ``host`` itself, and loopback names on a loopback
            bind) that requests may carry in their Host header. A request naming any
            other host is refused (403): a web page cannot reach the dashboard through
            DNS rebinding. IP literals are always allowed (rebinding needs a name).
    """

    run_dir: str = ""
    host: str = "127.0.0.1"
    port: int = 8265
    allow_kill: bool = False
    refresh_ms: int = 1000
    allowed_hosts: List[str] = field(default_factory=list)


def validate(cfg: DashboardConfig, prefix: str = "dashboard") -> None:
    """Raises :class:`~hier_localsgd.errors.ConfigError` whose message starts with the field."""
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


def host_allowed(cfg: DashboardConfig, header: str) -> bool:
    """Whether a request's Host header (``name[:port]``) names this dashboard."""
    try:
        name = (urllib.parse.urlsplit("//" + header).hostname or "").lower()
    except ValueError:  # a malformed port or bracket
        return False
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    allowed = {cfg.host.lower(), *(h.lower() for h in cfg.allowed_hosts)}
    if is_loopback(cfg.host):
        allowed.add("localhost")
    return name in allowed


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


