"""Heals over HTTP that run no code and, with a job secret, serve only the job's members.

torchft's ``HTTPTransport`` (the Manager's default) binds every interface, serves the
whole model and optimizer state to any client, and loads what it receives with
``weights_only=False`` — a full unpickle of network bytes. :class:`HealTransport`
replaces it (one per Manager, passed as ``checkpoint_transport``):

* **Format**: the state goes as :mod:`hier_localsgd.core.security.wire` (typed JSON
  header and raw tensor bytes): decoding builds tensors and plain values only.
* **Listener**: binds the process's configured address (``run.hostname``, or ``run.bind``), port 0.
* **Requests** (``GET /heal/<step>``) carry ``Authorization: HL1 <time> <nonce> <mac>``,
  an HMAC of the level, the donor's heal URL (with the step), the time and the nonce
  under the heal key (secret.py ``derive``). The donor refuses a request without one,
  with a bad MAC (another secret, or signed for another donor or level: a relay), a time
  more than :data:`MAX_SKEW` away, or a nonce it has seen (a replay), with 403 and one
  log line naming the peer and the reason.
* **Responses** end with an HMAC over the level, the URL, the request's nonce and the
  payload: the receiver checks it before decoding a byte, so a payload from anyone
  without the secret, or one replayed from an earlier heal, is refused.
* **Sizes**: the receiver refuses a payload over :func:`payload_limit` of its own state's
  tensor bytes before reading it.
* **HTTP**: no proxy (``http_proxy`` is ignored), no redirects (they would carry the
  credentials elsewhere).

Without a secret (secret.py) requests and responses carry MACs under a fixed public key:
integrity against truncation, no authentication.

Failure semantics: :meth:`recv_checkpoint` raises :class:`HealRefused` (after one log
line) for any refused, malformed, truncated, oversized or forged payload, and for a
donor that does not answer within ``timeout``; torchft then reports the error, the round's
commit vote fails, and the next round's quorum heals again (torchft picks its donor).
A donor serves only the step it staged (:meth:`send_checkpoint`) and only until
:meth:`disallow_checkpoint`; a request for another step waits up to the heal timeout for it.
"""

from __future__ import annotations

import hmac
import http.client
import logging
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from hashlib import sha256
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional

from torchft.checkpointing.transport import CheckpointTransport

from hier_localsgd.core.security.wire import Encoded, LocalShard, WireError, decode, encode, tensor_bytes

logger = logging.getLogger(__name__)

MAX_SKEW = 120.0  # seconds between a request's time and the donor's clock
_PUBLIC_KEY = b"hier_localsgd heal: no job secret"  # integrity only (no secret configured)
_METADATA = re.compile(r"^http://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})/heal/$")
MAC_BYTES = 32


class HealRefused(RuntimeError):
    """A heal payload or request was refused (unauthenticated, malformed, too large...)."""


_AUTH = re.compile(r"HL1 (\d{1,12}(?:\.\d{1,6})?) ([0-9a-f]{32}) ([0-9a-f]{64})")


def _request_mac(key: bytes, level: str, url: str, ts: str, nonce: str) -> str:
    """The request's MAC names the donor (its heal URL, with the step) and the level: a
    request a healer signed for one donor (an impostor in its quorum, say) is refused by
    every other (a relay)."""
    return hmac.new(key, f"GET {level} {url} {ts} {nonce}".encode(), sha256).hexdigest()


def _response_mac(key: bytes, level: str, url: str, nonce: str) -> "hmac.HMAC":
    return hmac.new(key, f"heal {level} {url} {nonce}\n".encode(), sha256)


def bind_family(host: str) -> tuple:
    """(family, sockaddr) of ``host`` (a name or address; brackets allowed), port 0."""
    infos = socket.getaddrinfo(host.strip("[]"), 0, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host}: no address")
    fam, _, _, _, addr = infos[0]
    return fam, addr


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, host: str, handler: type) -> None:
        fam, addr = bind_family(host)
        self.address_family = fam
        super().__init__(addr[:2] if fam == socket.AF_INET else addr, handler)


class HealTransport(CheckpointTransport[Dict[str, Any]]):
    """torchft's checkpoint transport, without pickle, bound to ``hostname``, and (with
    a ``key``) authenticated both ways. See the module docstring.

    Args:
        hostname: the address to advertise (``run.hostname``), and to bind unless ``bind``.
        timeout: a fetch's deadline; a request's wait for the step to be staged.
        key: the heal key (``derive(secret, "heal")``); None: no secret.
        template: this replica's own Manager state (called per heal): it sizes the largest
            payload accepted (:func:`payload_limit`) and gives the DTensors' meshes.
        level: the Manager's level: in the MACs (a request for one level is refused by
            another's donor) and the log lines.
        bind: the address to bind ("" = ``hostname``; ``run.bind``).
    """

    def __init__(self, hostname: str, timeout: timedelta, key: Optional[bytes], template: Callable[[], Any],
                 level: str = "", bind: str = "") -> None:
        self._host, self._timeout, self._level = hostname, timeout, level
        self._key = key if key is not None else _PUBLIC_KEY
        self._template = template
        self._cond = threading.Condition()
        self._step = -1
        self._staged: Optional[Encoded] = None
        self._nonces: Dict[str, float] = {}
        self.refusals: Deque[str] = deque(maxlen=1000)  # the reasons of refused requests, in order (tests, status)
        self._server = _Server(bind or hostname, self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"heal-{level}", daemon=True)
        self._thread.start()

    # -- donor -----------------------------------------------------------------
    def _handler(self) -> type:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            timeout = transport._timeout.total_seconds()

            def log_message(self, fmt: str, *args: Any) -> None:  # one line per refusal instead
                pass

            def do_GET(self) -> None:
                transport._serve(self)

            def do_POST(self) -> None:
                transport._refuse(self, 405, "method not allowed")

            do_PUT = do_DELETE = do_HEAD = do_POST

        return Handler

    def _refuse(self, h: BaseHTTPRequestHandler, code: int, why: str) -> None:
        peer = h.client_address[0] if h.client_address else "?"
        self.refusals.append(why)
        logger.warning("%s heal server: refused %s %s from %s: %s", self._level, h.command, h.path[:80], peer, why)
        try:
            h.send_error(code, why)
        except OSError:
            pass

    def _check_auth(self, h: BaseHTTPRequestHandler, url: str) -> Optional[str]:
        """None if the request is authentic for ``url`` (this donor's, with the step), else
        why not (a nonce that passed the MAC is then spent)."""
        header = h.headers.get("Authorization") or ""
        m = _AUTH.fullmatch(header)
        if m is None:
            return "no credentials" if not header else "malformed credentials"
        ts, nonce, mac = m.groups()
        t = float(ts)
        if not hmac.compare_digest(mac.encode(), _request_mac(self._key, self._level, url, ts, nonce).encode()):
            return "bad credentials (not the job's secret, or signed for another donor)"
        now = time.time()
        if abs(now - t) > MAX_SKEW:
            return f"request time {now - t:+.0f} s away from the donor's clock (limit {MAX_SKEW:.0f} s)"
        with self._cond:
            for n, seen in list(self._nonces.items()):
                if now - seen > 2 * MAX_SKEW:
                    del self._nonces[n]
            if nonce in self._nonces:
                return "replayed request (nonce seen before)"
            self._nonces[nonce] = now
        return None

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        m = re.fullmatch(r"/heal/(\d{1,18})", h.path)
        if m is None:
            return self._refuse(h, 404, "not a heal path")
        step = int(m.group(1))
        url = f"{self.metadata()}{step}"
        why = self._check_auth(h, url)
        if why is not None:
            return self._refuse(h, 403, why)
        deadline = time.monotonic() + self._timeout.total_seconds()
        with self._cond:
            while not (self._staged is not None and self._step == step):
                left = deadline - time.monotonic()
                if left <= 0:
                    return self._refuse(h, 409, f"step {step} is not served here (serving {self._step if self._staged is not None else 'none'})")
                self._cond.wait(left)
            payload = self._staged
        nonce = h.headers["Authorization"].split()[2]
        mac = _response_mac(self._key, self._level, url, nonce)
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/octet-stream")
            h.send_header("Content-Length", str(payload.size + MAC_BYTES))
            h.end_headers()
            for chunk in payload.chunks():
                mac.update(chunk)
                h.wfile.write(chunk)
            h.wfile.write(mac.digest())
        except OSError as e:
            logger.warning("%s heal server: sending step %d to %s failed: %s", self._level, step, h.client_address[0], e)

    def send_checkpoint(self, dst_ranks: List[int], step: int, state_dict: Dict[str, Any], timeout: timedelta) -> None:
        """Stages ``state_dict`` (encoded now: a value the format cannot carry raises here,
        naming its path) for the healing replicas' requests of ``step``."""
        staged = encode(state_dict)
        with self._cond:
            self._staged, self._step = staged, step
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._cond:
            self._staged = None

    def metadata(self) -> str:
        port = self._server.server_address[1]
        host = f"[{self._host.strip('[]')}]" if ":" in self._host else self._host
        return f"http://{host}:{port}/heal/"

    # -- healing replica ---------------------------------------------------------
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Dict[str, Any]:
        try:
            return self._fetch(str(metadata), step, timeout)
        except HealRefused as e:
            logger.warning("%s heal from %s refused: %s", self._level, str(metadata)[:80], e)
            raise

    def _fetch(self, metadata: str, step: int, timeout: timedelta) -> Dict[str, Any]:
        m = _METADATA.fullmatch(metadata)
        if m is None or int(m.group(2)) > 65535:
            raise HealRefused(f"malformed donor address {metadata[:80]!r}")
        url = f"{metadata}{step}"
        ts, nonce = f"{time.time():.3f}", secrets.token_hex(16)
        req = urllib.request.Request(url, headers={"Authorization": f"HL1 {ts} {nonce} {_request_mac(self._key, self._level, url, ts, nonce)}"})
        deadline = time.monotonic() + timeout.total_seconds()
        template = self._template()  # this replica's own state: the limit, and the DTensors' meshes
        limit = payload_limit(tensor_bytes(template))
        try:
            with _OPENER.open(req, timeout=timeout.total_seconds()) as r:
                length = r.headers.get("Content-Length") or ""
                if re.fullmatch(r"[0-9]{1,15}", length) is None:
                    raise HealRefused("donor sent no valid Content-Length")
                n = int(length)
                if n < MAC_BYTES or n - MAC_BYTES > limit:
                    raise HealRefused(f"payload of {n} bytes refused (limit {limit})")
                buf = bytearray(n)
                view, got = memoryview(buf), 0
                while got < n:
                    if time.monotonic() > deadline:
                        raise HealRefused(f"donor too slow: {got} of {n} bytes within {timeout.total_seconds():.0f} s")
                    k = r.readinto(view[got:])
                    if not k:
                        raise HealRefused(f"payload truncated at {got} of {n} bytes")
                    got += k
        except urllib.error.HTTPError as e:
            raise HealRefused(f"donor answered {e.code} {str(e.reason)[:80]}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
            raise HealRefused(f"donor unreachable or malformed answer: {str(getattr(e, 'reason', e))[:120]}") from None
        mac = _response_mac(self._key, self._level, url, nonce)
        mac.update(view[: n - MAC_BYTES])
        if not hmac.compare_digest(mac.digest(), bytes(view[n - MAC_BYTES:])):
            raise HealRefused("payload MAC does not match (not from a holder of the job's secret, altered, or replayed)")
        try:
            state = decode(view[: n - MAC_BYTES], max_bytes=limit)
        except WireError as e:
            raise HealRefused(f"malformed payload: {e}") from None
        if not isinstance(state, dict) or "torchft" not in state or "user" not in state:
            raise HealRefused("payload is not a Manager state (no torchft/user keys)")
        return rewrap(state, template)

    def shutdown(self, wait: bool = True) -> None:
        with self._cond:
            self._staged = None
            self._cond.notify_all()
        def stop() -> None:
            self._server.shutdown()
            self._server.server_close()

        if wait:
            stop()
            self._thread.join()
        else:  # never block a Manager's shutdown behind a request in flight
            threading.Thread(target=stop, daemon=True).start()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None  # a redirect would carry the request's credentials elsewhere


def no_redirect_opener() -> urllib.request.OpenerDirector:
    """No proxy (a request, inside a tunnel or not, never leaves through http_proxy), no
    redirects (they would carry its credentials elsewhere)."""
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


_OPENER = no_redirect_opener()


def rewrap(received: Any, own: Any, path: str = "") -> Any:
    """``received`` with each DTensor shard (wire.LocalShard) made a DTensor again, on the
    mesh and with the placements of the DTensor at the same place in ``own`` (this
    replica's state: the same program registers the same structure)."""
    if isinstance(received, LocalShard):
        if not (hasattr(own, "device_mesh") and hasattr(own, "placements")):
            raise HealRefused(f"{path or '<root>'}: a sharded tensor where this replica holds none")
        from torch.distributed.tensor import DTensor

        local = received.tensor.to(own.to_local().device)
        return DTensor.from_local(local, own.device_mesh, own.placements, run_check=False, shape=own.shape, stride=own.stride())
    if isinstance(received, dict):
        o = own if isinstance(own, dict) else {}
        return {k: rewrap(v, o.get(k), f"{path}.{k}") for k, v in received.items()}
    if isinstance(received, (list, tuple)):
        o = own if isinstance(own, (list, tuple)) and len(own) == len(received) else [None] * len(received)
        out = [rewrap(v, w, f"{path}[{i}]") for i, (v, w) in enumerate(zip(received, o))]
        return out if isinstance(received, list) else tuple(out)
    return received


def payload_limit(own_tensor_bytes: int) -> int:
    """The largest heal payload a replica accepts: four times its own state's tensor bytes
    plus 64 MiB (structure, padding). Four: a fresh replica's own state may hold only the
    model and its outer backup, where a donor's adds the optimizer's moments, an outer
    snapshot, a residual and a stand-in (at most seven model-sized tensors in all)."""
    return 4 * own_tensor_bytes + (64 << 20)
