"""Lighthouse addresses: parsing and reachability, without torchft.

Kept apart from managers.py so that the configuration's checks (and ``hier-localsgd
plan``) do not import torchft.

Failure semantics: :func:`parse_address` raises ValueError naming the config field;
:func:`probe_lighthouse` retries a refused connection (a lighthouse that launchers like
TorchX start alongside the replica groups) and raises :class:`LighthouseUnreachable`,
naming the field and address, when nothing accepts a connection within the timeout;
:func:`probe_store` raises :class:`StoreUnreachable` at once when a quorum's store
refuses connections (its host died after the quorum formed).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from urllib.parse import urlparse


class LighthouseUnreachable(RuntimeError):
    pass


class StoreUnreachable(ConnectionError):
    pass


# How long a refused store connection is retried: a store is listening from its
# Manager's start, before any quorum names it, so a refusal means its host is gone.
STORE_PROBE_S = 1.0


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
