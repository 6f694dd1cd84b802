"""Lighthouse addresses: parsing and reachability, without torchft.

Kept apart from managers.py so that the configuration's checks (and ``hier-localsgd
plan``) do not import torchft.

Failure semantics: :func:`parse_address` raises ValueError naming the config field;
:func:`probe_lighthouse` retries a refused connection (a lighthouse that launchers like
TorchX start alongside the replica groups) and raises :class:`LighthouseUnreachable`,
naming the field and address, when nothing accepts a connection within the timeout.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from urllib.parse import urlparse


class LighthouseUnreachable(RuntimeError):
    pass


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
