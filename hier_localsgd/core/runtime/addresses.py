"""Lighthouse addresses: parsing and reachability, without torchft.

Kept apart from managers.py so that the configuration's checks (and ``hier-localsgd
plan``) do not import torchft.

Failure semantics: :func:`parse_address` raises ValueError naming the config field;
:func:`probe_lighthouse` retries a refused connection (a lighthouse that launchers like
TorchX start alongside the replica groups) and raises :class:`LighthouseUnreachable`,
naming the field and address, when nothing accepts a connection within the timeout;
:func:`probe_store` raises :class:`StoreUnreachable` at once when a quorum's store
refuses connections (its host died after the quorum formed); :func:`connect_store` is
the bounded client connect built on it. :func:`quorum_tag` names one formed quorum in
its store (presence.py's keys, the link's rendezvous prefix).
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Optional
from urllib.parse import urlparse


class LighthouseUnreachable(RuntimeError):
    pass


class StoreUnreachable(ConnectionError):
    pass


# How long a refused store connection is retried: a store is listening from its
# Manager's start, before any quorum names it, so a refusal means its host is gone.
STORE_PROBE_S = 1.0
# One c10d connect attempt's timeout in connect_store: c10d retries a failed attempt
# itself for about twice its timeout plus a backoff, so attempts are kept short.
STORE_ATTEMPT_S = 2.0


def parse_address(field: str, addr: str) -> tuple[str, int]:
    """Splits ``http://host:port`` (scheme optional) into host and port, or raises ValueError naming ``field``."""
    text = addr if "://" in addr else f"http://{addr}"
    parsed = urlparse(text)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if not parsed.hostname or port is None:
        raise ValueError(f"{field}={addr!r}: expected an address like http://host:port")
    return parsed.hostname, port


def probe_lighthouse(field: str, addr: str, timeout: timedelta) -> None:
    """Raises :class:`LighthouseUnreachable` unless ``addr`` accepts a TCP connection within ``timeout``."""
    host, port = parse_address(field, addr)
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(left, 0.1)):
                return
        except OSError as e:
            if left <= 0.25 or not isinstance(e, ConnectionRefusedError):
                raise LighthouseUnreachable(
                    f"{field}={addr}: lighthouse unreachable ({e.__class__.__name__}: {e}); "
                    f"start it first (hier-localsgd lighthouse) or fix the address"
                ) from e
            time.sleep(0.25)  # not listening yet: it may be starting beside us


def probe_store(store_addr: str, timeout: timedelta) -> None:
    """Raises :class:`StoreUnreachable` if the quorum store ``host:port[/prefix]`` refuses
    connections for ``STORE_PROBE_S`` or accepts none within ``timeout``.

    Why: c10d's store client retries a refused connection until its whole timeout, twice
    (about 55 s with a 30 s timeout), so a quorum whose store host was killed just after
    the quorum formed would hold every member far past its phase deadline. A live store
    host accepts at the kernel even when busy, so the probe costs one round trip."""
    hostport = store_addr.split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    deadline = time.monotonic() + timeout.total_seconds()
    refused_until = time.monotonic() + STORE_PROBE_S
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=max(left, 0.1)):
                return
        except OSError as e:
            if left <= 0.1 or not isinstance(e, ConnectionRefusedError) or time.monotonic() >= refused_until:
                raise StoreUnreachable(f"quorum store {hostport} unreachable ({e.__class__.__name__}: {e}): its host is gone") from e
            time.sleep(0.1)


def connect_store(store_addr: str, timeout: timedelta, within: Optional[timedelta] = None) -> Any:
    """A c10d ``TCPStore`` client of the store ``host:port[/prefix]`` (the prefix is not
    applied), connected within ``within`` (default ``timeout``); its operations then wait
    at most ``timeout``.

    Why not ``TCPStore(..., timeout=timeout)``: c10d's constructor retries a connect or
    handshake that fails for its whole timeout, then again after a backoff. A store host
    that dies after :func:`probe_store` passed, in the middle of the handshake, held a
    quorum's configure 60 s with a 30 s timeout (seen in CI: the leader's phase watchdog
    ended it; reproduced in tests/test_link.py). And a host that accepts but never answers
    (a stopped process: the kernel completes the connection) holds the constructor
    forever: c10d's handshake read has no timeout. So the connect is made in attempts of
    at most ``STORE_ATTEMPT_S``, each in a daemon thread the caller stops waiting for when
    it hangs or the deadline comes (an abandoned attempt ends when its host dies or
    answers; its client is dropped), with the probe's rule between attempts: a host that refuses for
    ``STORE_PROBE_S`` is gone.

    Raises:
        StoreUnreachable: the store refuses, or no attempt connects within ``within``.
    """
    within = within or timeout
    hostport = store_addr.split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + within.total_seconds()
    while True:
        probe_store(hostport, timedelta(seconds=max(deadline - time.monotonic(), 0.1)))
        store, err = _connect_attempt(host, int(port), max(0.1, min(STORE_ATTEMPT_S, deadline - time.monotonic())), deadline)
        if store is not None:
            store.set_timeout(timeout)
            return store
        if time.monotonic() >= deadline:
            why = f"{err.__class__.__name__}: {str(err).splitlines()[0] if str(err) else ''}" if err else "no answer"
            raise StoreUnreachable(
                f"quorum store {hostport} did not complete a connection within {within.total_seconds():.3g}s ({why})") from err


def _connect_attempt(host: str, port: int, attempt_s: float, deadline: float) -> tuple:
    """One c10d connect of at most ``attempt_s`` (c10d's timeout), waited for until
    ``deadline`` at most: (store, None), (None, error), or (None, None) when it hangs."""
    from torch.distributed import TCPStore

    out: dict = {}

    def run() -> None:
        try:
            out["store"] = TCPStore(host_name=host, port=port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=attempt_s))
        except Exception as e:  # c10d's DistNetworkError / DistStoreError
            out["error"] = e

    t = threading.Thread(target=run, name=f"store-connect-{host}:{port}", daemon=True)
    t.start()
    # c10d gives up an attempt after about 3 x its timeout (two tries and a backoff); one
    # still running after that hangs in the handshake, and a fresh connection may pass.
    t.join(max(0.0, min(deadline - time.monotonic(), 3 * attempt_s + 1.0)))
    if t.is_alive():
        return None, None
    return out.get("store"), out.get("error")


def quorum_tag(quorum: object) -> str:
    """A short tag of one formed quorum, the same on every member (see presence.py's module doc)."""
    ids = ",".join(sorted(getattr(quorum, "replica_ids", None) or []))
    text = f"{getattr(quorum, 'quorum_id', '')}|{getattr(quorum, 'max_step', '')}|{ids}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]
