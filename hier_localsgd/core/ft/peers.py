"""Proactive abort: stop waiting for a quorum member whose process stopped heartbeating.

A replica group whose whole process is stopped (SIGSTOP, a wedged host, a paused VM)
keeps its connections open, so its peers already inside a collective with it would
wait for the collective's whole phase deadline (seen: 19.8 s stuck in a Gloo receive
with a 20 s phase). Its heartbeat lapses, though, and the level's lighthouse sees that.
While a collective waits, :class:`QuorumWatch` reads the lighthouse's status page (at
most every ``poll``) and reports a member of *our* quorum (same quorum id) whose last
heartbeat is older than the lighthouse's heartbeat timeout, or a quorum newer than ours
(a process that was itself stopped returns into a collective its peers abandoned long
ago, and would otherwise wait to its deadline); the caller
(:class:`hier_localsgd.core.ft.comm.LevelComm`) then abandons the collective, reports the
error so the round's commit vote fails, and the round rolls back. Survivors lose at
most the heartbeat timeout plus one poll (torchft#164 asks for the same upstream).

Why this is safe: the abandoned collective's round fails its commit, so at the next
quorum our ``commit_failures`` make torchft's lighthouse bump the quorum id and every
member reconfigures its process group (a fresh Gloo group; the abandoned operation
never shares one with a later collective). A stopped process that resumes fails its
own round (its collective fails or its phase deadline has passed and the watchdog ends
it) and heals from its peers.

The page is torchft 0.2.0's lighthouse ``/status`` (HTML, parsed here and nowhere else):
the previous quorum's id and members, and one "``<replica id>: seen <duration> ago``"
line per heartbeating replica. If the page cannot be read or parsed, or shows a quorum
other than ours, nothing is reported: the collective's own deadline still holds.
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional

_QUORUM_ID = re.compile(r"Previous quorum id:\s*(\d+)")
_STEP = re.compile(r"Step:\s*(\d+)")
_MEMBER = re.compile(r"<b>([^<]+)</b>")
_SEEN = re.compile(r"([^\s<>]+): seen ([0-9.]+)(ns|µs|us|ms|s) ago")
_UNITS = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class LighthouseView:
    quorum_id: Optional[int]  # the last quorum the lighthouse formed
    members: List[str]  # its members' full replica ids
    heartbeat_age_s: Dict[str, float]  # replica id -> seconds since its last heartbeat
    max_step: Optional[int] = None  # the highest step a member of the last quorum announced


def parse_status(html: str) -> LighthouseView:
    """Parses torchft's lighthouse ``/status`` page."""
    prev, _, beats = html.partition("<h2>Heartbeats</h2>")
    m = _QUORUM_ID.search(prev)
    section = prev[prev.find("Previous Quorum"):] if "Previous Quorum" in prev else ""
    return LighthouseView(
        quorum_id=int(m.group(1)) if m else None,
        members=[x.strip() for x in _MEMBER.findall(section)],
        heartbeat_age_s={rid: float(v) * _UNITS[u] for rid, v, u in _SEEN.findall(beats)},
        max_step=max((int(x) for x in _STEP.findall(section)), default=None),
    )


def fetch_status(addr: str, timeout: timedelta) -> Optional[str]:
    url = (addr if "://" in addr else f"http://{addr}").rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as r:
            return r.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None


class QuorumWatch:
    """Reports a member of our quorum whose heartbeat lapsed (see module docstring).

    Args:
        lighthouse_addr: the level's lighthouse.
        heartbeat_timeout: the lighthouse's ``heartbeat_timeout_ms``: older is lapsed.
        poll: the shortest interval between two reads of the page.
        fetch: reads the page (tests may pass their own).
    """

    def __init__(
        self,
        lighthouse_addr: str,
        heartbeat_timeout: timedelta,
        poll: timedelta = timedelta(milliseconds=250),
        fetch: Optional[Callable[[str, timedelta], Optional[str]]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.addr = lighthouse_addr
        self.heartbeat_timeout = heartbeat_timeout
        self.poll = poll
        self._fetch = fetch or fetch_status
        self._clock = clock
        self._last = float("-inf")

    def lapsed(self, quorum_id: int, own_id: str) -> Optional[str]:
        """Why waiting in quorum ``quorum_id`` is pointless, or None (also when not due yet):
        a member (not ``own_id``) whose heartbeat is older than the heartbeat timeout, or a
        newer quorum at the lighthouse (the others moved on without us: we were stopped,
        or are a join timeout behind; a restarted lighthouse counts from 1 again, so only a
        greater id counts)."""
        now = self._clock()
        if now - self._last < self.poll.total_seconds():
            return None
        self._last = now
        html = self._fetch(self.addr, max(self.poll, timedelta(milliseconds=500)))
        if html is None:
            return None
        view = parse_status(html)
        if view.quorum_id is not None and view.quorum_id > quorum_id:
            return f"the lighthouse formed quorum {view.quorum_id} since"
        if view.quorum_id != quorum_id:
            return None
        limit = self.heartbeat_timeout.total_seconds()
        for member in view.members:
            if member == own_id:
                continue
            age = view.heartbeat_age_s.get(member)
            if age is not None and age > limit:
                return f"member {member} stopped heartbeating"
        return None


def await_heartbeats(
    addr: str,
    replica_ids: List[str],
    heartbeat_timeout: timedelta,
    bound: timedelta,
    poll: timedelta = timedelta(milliseconds=100),
    fetch: Optional[Callable[[str, timedelta], Optional[str]]] = None,
    beat: Optional[Callable[[], None]] = None,
    clock: Callable[[], float] = time.monotonic,
) -> List[str]:
    """Waits until the lighthouse's status page shows a heartbeat younger than
    ``heartbeat_timeout`` from each of ``replica_ids``, for at most ``bound``;
    ``beat`` (the caller's own heartbeat) is called before each read of the page, so
    the caller stays heard while it waits.

    Returns the ids still not heard when it gave up (``[]``: all heard). A page that
    cannot be read counts as nobody heard; it never raises (nor may ``beat``)."""
    fetch = fetch or fetch_status
    end = clock() + bound.total_seconds()
    limit = heartbeat_timeout.total_seconds()
    missing = list(replica_ids)
    while True:
        if beat is not None:
            beat()
        if not missing:
            break
        html = fetch(addr, max(poll, timedelta(milliseconds=500)))
        if html is not None:
            ages = parse_status(html).heartbeat_age_s
            missing = [r for r in replica_ids if ages.get(r, float("inf")) >= limit]
        if not missing or clock() >= end:
            break
        time.sleep(min(poll.total_seconds(), max(0.0, end - clock())))
    return missing
