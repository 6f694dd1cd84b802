"""The job secret: one random key that every process of a job holds, and no one else.

Where it comes from (never the command line, never a log line):

* ``security.secret_file``: a file holding the secret (hex), readable by its owner only
  (mode 0600; a file others can read is refused: they would hold the job's key);
* else the environment variable :data:`SECRET_ENV` (the hex secret itself), for launchers
  that inject secrets as environment (Kubernetes, Slurm's ``--export``);
* else none: heals are still in the no-code format (wire.py) and checked for integrity,
  but not authenticated, and the process says so once at start.

``hier-localsgd keygen PATH`` writes a fresh secret (:func:`keygen`). Each use takes its own
key derived from the secret (:func:`derive`), so a key that leaks from one use (a log of
a heal's MAC, say) says nothing about another's.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path
from typing import Optional

from hier_localsgd.errors import ConfigError, fail

SECRET_ENV = "HIER_LOCALSGD_SECRET"
MIN_SECRET_BYTES = 16  # 128 bits: a secret shorter than this is refused
WAN_MODES = ("off", "tunnel")
# The tunnel interface's MTU. WireGuard's default (1420) fits a 1500-byte WAN path over IPv4
# or IPv6; a smaller one suits a WAN path with a smaller MTU (a PPPoE or IPsec hop), a larger
# one a path of jumbo frames. The tunnel refuses one whose encrypted datagrams exceed the WAN
# interface's MTU (launch/tunnel.py, largest_mtu).
TUNNEL_MTU = 1420
TUNNEL_MTU_RANGE = (1280, 65440)  # IPv6's minimum; the largest whose datagram fits UDP's 64 KiB


@dataclass
class SecurityConfig:
    """The ``security`` section (docs/security.md)."""

    # A file holding the job secret (``hier-localsgd keygen PATH`` writes one); "" = the
    # HIER_LOCALSGD_SECRET environment variable, or no secret.
    secret_file: str = ""
    # The WAN: "off" (plain TCP), or "tunnel" (every cross-cluster connection inside a
    # WireGuard mesh keyed by the secret; launch/tunnel.py). Local jobs (demo, chaos, bench)
    # then run each cluster in a network namespace of its own (run.netns).
    wan: str = "off"
    # The WireGuard interface's MTU (security.wan=tunnel, and ``hier-localsgd tunnel``):
    # see TUNNEL_MTU above.
    tunnel_mtu: int = TUNNEL_MTU

    def check(self) -> None:
        if self.secret_file:
            read_secret_file(self.secret_file)
        if self.wan not in WAN_MODES:
            fail("security.wan", f"{self.wan!r} — expected one of {WAN_MODES}")
        lo, hi = TUNNEL_MTU_RANGE
        if isinstance(self.tunnel_mtu, bool) or not isinstance(self.tunnel_mtu, int) or not lo <= self.tunnel_mtu <= hi:
            fail("security.tunnel_mtu", f"{self.tunnel_mtu!r} — an integer in [{lo}, {hi}] (bytes; WireGuard's default is {TUNNEL_MTU})")


def _parse(text: str, where: str, field: str) -> bytes:
    text = text.strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        fail(field, f"{where} does not hold a hex secret (write one with `hier-localsgd keygen PATH`)")
    if len(raw) < MIN_SECRET_BYTES:
        fail(field, f"{where} holds {len(raw)} bytes; a job secret needs at least {MIN_SECRET_BYTES}")
    return raw


def read_secret_file(path: str) -> bytes:
    """The secret in ``path``; :class:`ConfigError` naming ``security.secret_file`` if the
    file is missing, not a regular file, readable by group or others, or not a secret."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        fail("security.secret_file", f"{path}: {e.strerror}")
    if not stat.S_ISREG(st.st_mode):
        fail("security.secret_file", f"{path} is not a regular file")
    if st.st_mode & 0o077:
        fail("security.secret_file", f"{path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}): chmod 600 {path}")
    return _parse(p.read_text(), path, "security.secret_file")


def load_secret(cfg: SecurityConfig) -> Optional[bytes]:
    """The job secret: from ``cfg.secret_file``, else :data:`SECRET_ENV`, else None."""
    if cfg.secret_file:
        return read_secret_file(cfg.secret_file)
    env = os.environ.get(SECRET_ENV, "")
    if env:
        return _parse(env, f"the environment variable {SECRET_ENV}", SECRET_ENV)
    return None


class Key:
    """A key derived from the job secret for one use; its repr hides it (settings objects
    that hold one get printed and logged)."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def bytes(self) -> bytes:
        return self._raw

    def __repr__(self) -> str:
        return "Key(<hidden>)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and hmac.compare_digest(self._raw, other._raw)

    __hash__ = None  # type: ignore[assignment]


def derive(secret: bytes, purpose: str) -> Key:
    """The key for one use of the secret (``"heal"``, ...)."""
    return Key(hmac.new(secret, f"hier_localsgd/{purpose}/v1".encode(), sha256).digest())


def heal_key(cfg: SecurityConfig) -> Optional[Key]:
    """The heal key of this job (None without a secret)."""
    secret = load_secret(cfg)
    return None if secret is None else derive(secret, "heal")


def global_model_key(cfg: SecurityConfig) -> Optional[Key]:
    """The key of the asynchronous outer level's exchanges (sync/global_server.py); None
    without a secret."""
    secret = load_secret(cfg)
    return None if secret is None else derive(secret, "global-model")


def keygen(path: str) -> None:
    """Writes a fresh 256-bit secret to ``path`` (mode 0600); refuses to overwrite a file."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"{path}: exists; keygen does not overwrite a secret (remove it first)") from None
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
