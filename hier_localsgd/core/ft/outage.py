"""Lighthouse outages: is a level's lighthouse answering, and for how long has it not been?

Local SGD can keep training without a sync, so a lighthouse that dies or goes silent
must cost no process and no committed state: while a level's lighthouse does not
answer, that level's rounds are skipped (the replica keeps its local progress and
keeps stepping) and retried, and only past ``sync.outage_limit_s`` does the process
give up, with a message naming the lighthouse's config field.

Liveness is a real request, not a TCP connect: ``GET <lighthouse>/`` (torchft's
status page) must answer within ``probe_timeout``. A killed lighthouse refuses the
connection at once; a stopped (SIGSTOP) or wedged one accepts the connection in the
kernel but never answers, and the probe times out.

Why a quorum call is cut into slices (:meth:`hier_localsgd.core.ft.managers.LevelManager.start_quorum`):
torchft 0.2.0's ManagerServer never answers a quorum request whose lighthouse call
failed (manager.rs: "We don't broadcast in cases when this method returns an error,
resulting in a hang"), so a request made with a whole phase's budget sits out that
budget when the lighthouse dies under it. Each slice waits at most the lighthouse's
heartbeat timeout; between slices a probe decides: alive, so ask again; not
answering, so the level is in an outage.

Retry policy during an outage: a lighthouse that refuses the connection (killed, or
restarting) is probed again at every round: a refusal costs nothing, and a returned
lighthouse is noticed at the first round after it is back (seen: with the backoff below
for every failure, commits resumed 5.5-6.4 s after a killed cluster lighthouse returned,
a backoff of up to 5 s plus up to a round). A silent one (the connection accepted, no
answer: SIGSTOPped, wedged, or cut off) costs a probe timeout per probe, so after it a
round probes again only when its backoff has passed (starting at ``probe_timeout``,
doubling, capped at ``backoff_max`` = the heartbeat timeout, so a returned lighthouse is
noticed within a heartbeat timeout); otherwise the round is skipped without any network
call.

State is published (``describe``) for status files and the dashboard: since when the
level has been out, how many retries it made, which lighthouse.
"""

from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from datetime import timedelta
from typing import Callable, Dict, Optional, Union

logger = logging.getLogger(__name__)


class LighthouseOutage(RuntimeError):
    """The level's lighthouse does not answer: skip this round, keep training, retry later."""


class OutageLimitExceeded(RuntimeError):
    """The lighthouse has not answered for longer than ``sync.outage_limit_s``: give up."""


# What a probe saw (a probe may also return a bool: True is UP, False is SILENT).
UP, REFUSED, SILENT = "up", "refused", "silent"


def lighthouse_probe(addr: str, timeout: timedelta) -> str:
    """UP if the lighthouse at ``addr`` serves its status page within ``timeout``;
    REFUSED if the connection was refused or reset at once (nothing listens: killed or
    restarting); SILENT otherwise (timed out, unreachable, unresolvable)."""
    url = (addr if "://" in addr else f"http://{addr}").rstrip("/") + "/"
    try:
        with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as r:
            r.read(1)
            return UP
    except urllib.error.HTTPError:
        return UP  # it answered, if not with a page: alive
    except urllib.error.URLError as e:
        return REFUSED if isinstance(e.reason, (ConnectionRefusedError, ConnectionResetError)) else SILENT
    except (ConnectionRefusedError, ConnectionResetError):
        return REFUSED
    except (OSError, ValueError):
        return SILENT


def lighthouse_answers(addr: str, timeout: timedelta) -> bool:
    """Whether the lighthouse at ``addr`` serves its status page within ``timeout``."""
    return lighthouse_probe(addr, timeout) == UP


class LighthouseHealth:
    """The outage clock of one level's lighthouse (used by one thread: the sync's).

    Args:
        level: "inner", "outer" or a baseline's name (messages).
        field: the config field holding ``addr`` (messages).
        addr: the lighthouse.
        probe_timeout: how long a probe waits for an answer.
        backoff_max: the longest wait between probes during an outage (the
            lighthouse heartbeat timeout: a returned lighthouse is seen within it).
        limit: how long an outage may last before :meth:`check_limit` raises.
        probe: the liveness check, UP / REFUSED / SILENT or a bool (tests may pass
            their own; default :func:`lighthouse_probe`, HTTP).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        level: str,
        field: str,
        addr: str,
        probe_timeout: timedelta,
        backoff_max: timedelta,
        limit: timedelta,
        probe: Optional[Callable[[str, timedelta], Union[bool, str]]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.level, self.field, self.addr = level, field, addr
        self.probe_timeout, self.backoff_max, self.limit = probe_timeout, backoff_max, limit
        self._probe = probe or lighthouse_probe
        self._clock = clock
        self.down_since: Optional[float] = None  # monotonic; None while answering
        self.down_since_wall: Optional[float] = None  # time.time(), for status files
        self.retries = 0
        self.outages = 0  # outages seen so far (each one counted once)
        self._next_probe = 0.0
        self._backoff = probe_timeout.total_seconds()

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def probe(self) -> bool:
        """Probes now; updates the outage clock. Returns whether the lighthouse answered."""
        seen = self._probe(self.addr, self.probe_timeout)
        if seen is True or seen == UP:
            self.mark_up()
            return True
        self.mark_down(refused=seen == REFUSED)
        return False

    def mark_up(self) -> None:
        if self.down_since is not None:
            logger.warning(
                "%s lighthouse %s=%s answers again after %.1fs (%d retries)",
                self.level, self.field, self.addr, self._clock() - self.down_since, self.retries,
            )
        self.down_since = self.down_since_wall = None
        self.retries = 0
        self._backoff = self.probe_timeout.total_seconds()
        self._next_probe = 0.0

    def mark_down(self, refused: bool = False) -> None:
        """``refused``: the connection was refused at once, so the next round probes
        again (free); otherwise the next probe waits out the backoff."""
        now = self._clock()
        if self.down_since is None:
            self.down_since, self.down_since_wall = now, time.time()
            self.outages += 1
            logger.warning(
                "%s lighthouse %s=%s does not answer: training on without %s syncs, retrying (gives up after %s)",
                self.level, self.field, self.addr, self.level, self.limit,
            )
        if refused:
            self._next_probe = now
            return
        self._next_probe = now + self._backoff
        self._backoff = min(self._backoff * 2, self.backoff_max.total_seconds())

    def before_quorum(self) -> None:
        """Call before a quorum. Raises :class:`LighthouseOutage` while the outage lasts:
        at once if the next probe is not due yet, else after a failed probe."""
        if self.down_since is None:
            return
        self.check_limit()
        if self._clock() < self._next_probe:
            raise LighthouseOutage(self.message("skipping this round"))
        self.retries += 1
        if not self.probe():
            raise LighthouseOutage(self.message(f"retry {self.retries} failed"))

    def check_limit(self) -> None:
        """Raises :class:`OutageLimitExceeded` once the outage has lasted longer than the limit."""
        if self.down_since is not None and self._clock() - self.down_since > self.limit.total_seconds():
            raise OutageLimitExceeded(
                f"{self.field}={self.addr}: the {self.level} lighthouse has not answered for "
                f"{self._clock() - self.down_since:.0f}s ({self.retries} retries), longer than "
                f"sync.outage_limit_s={self.limit.total_seconds():g}; giving up"
            )

    def message(self, what: str) -> str:
        since = 0.0 if self.down_since is None else self._clock() - self.down_since
        return f"{self.field}={self.addr}: {self.level} lighthouse not answering for {since:.1f}s; {what}"

    def describe(self) -> Optional[Dict[str, object]]:
        """What status files publish: None while the lighthouse answers."""
        if self.down_since is None:
            return None
        return {"since": self.down_since_wall, "for_s": round(self._clock() - self.down_since, 1),
                "retries": self.retries, "lighthouse": self.addr, "field": self.field}
