"""The asynchronous outer level's authenticated exchange, both sides of it: the leaders'
:func:`call` (async_outer.py) and the MACs the server checks (global_server.py, whose
module doc states the requests, the answers and the security rules).

A request carries ``Authorization: HL1 <time> <nonce> <mac>`` (:data:`AUTH`), an HMAC
(:func:`request_mac`) over the path, time, nonce and body under ``derive(secret,
"global-model")``; an answer ends with :data:`MAC_BYTES` of HMAC (:func:`response_mac`)
over the nonce and the body, checked before a byte of it is decoded. Bodies are the no-code
wire format (core/security/wire.py): nothing from the network is unpickled.

Failure semantics: :func:`call` raises :class:`GlobalModelUnavailable` for any
unreachable, refused, malformed or forged exchange; the leader's outer round then reports
an inner-only round (its cluster trains on, async_outer.py).
"""

from __future__ import annotations

import hmac
import http.client
import re
import secrets
import time
import urllib.error
import urllib.request
from hashlib import sha256
from typing import Any, Dict, Optional

import torch

from hier_localsgd.core.ft.heals import no_redirect_opener
from hier_localsgd.core.security.wire import WireError, decode, encode

PUBLIC_KEY = b"hier_localsgd global model: no job secret"  # integrity only (no secret configured)
AUTH = re.compile(r"HL1 (\d{1,12}(?:\.\d{1,6})?) ([0-9a-f]{32}) ([0-9a-f]{64})")
MAC_BYTES = 32
UNKNOWN_MODEL_LIMIT = 8 << 30  # a body before any model is known (a registration carries two)
_OPENER = no_redirect_opener()


class GlobalModelUnavailable(RuntimeError):
    """The global model server could not be reached, refused, or answered malformed."""


def request_mac(key: bytes, path: str, ts: str, nonce: str, body: bytes) -> str:
    m = hmac.new(key, f"POST {path} {ts} {nonce}\n".encode(), sha256)
    m.update(body)
    return m.hexdigest()


def response_mac(key: bytes, path: str, nonce: str, body: bytes | memoryview) -> bytes:
    m = hmac.new(key, f"global-model {path} {nonce}\n".encode(), sha256)
    m.update(body)
    return m.digest()


def body_limit(model_numel: Optional[int]) -> int:
    """The largest body accepted either way: a delta and a model in fp32, plus 1 MiB."""
    return UNKNOWN_MODEL_LIMIT if model_numel is None else 8 * model_numel + (1 << 20)


def call(url: str, path: str, request: Dict[str, Any], key: Optional[bytes], timeout_s: float,
         sizes: Optional[Dict[str, int]] = None, limit: Optional[int] = None) -> Dict[str, Any]:
    """One authenticated exchange with the server at ``url`` (``http://host:port``);
    ``sizes`` (if given) gets the bytes of the request's and the answer's bodies; an answer
    over ``limit`` bytes (default :func:`body_limit` of an unknown model) is refused unread.

    Raises:
        GlobalModelUnavailable: unreachable, refused, too slow, malformed or forged.
    """
    k = key if key is not None else PUBLIC_KEY
    body = encode(request).to_bytes()
    if sizes is not None:
        sizes["sent"], sizes["received"] = len(body), 0
    ts, nonce = f"{time.time():.3f}", secrets.token_hex(16)
    req = urllib.request.Request(f"{url.rstrip('/')}{path}", data=body, method="POST", headers={
        "Authorization": f"HL1 {ts} {nonce} {request_mac(k, path, ts, nonce, body)}",
        "Content-Type": "application/octet-stream"})
    limit = body_limit(None) if limit is None else limit
    try:
        with _OPENER.open(req, timeout=timeout_s) as r:
            length = r.headers.get("Content-Length") or ""
            if re.fullmatch(r"[0-9]{1,15}", length) is None or not MAC_BYTES <= int(length) <= limit:
                raise GlobalModelUnavailable(f"{url}{path}: answer without a valid Content-Length")
            data = bytearray(r.read(int(length)))  # writable: the decoded tensors view it
            if sizes is not None:
                sizes["received"] = len(data)
    except urllib.error.HTTPError as e:
        raise GlobalModelUnavailable(f"{url}{path}: answered {e.code} {str(e.reason)[:120]}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
        raise GlobalModelUnavailable(f"{url}{path}: unreachable or malformed answer: {str(getattr(e, 'reason', e))[:160]}") from None
    n = len(data) - MAC_BYTES
    if n < 0 or not hmac.compare_digest(response_mac(k, path, nonce, memoryview(data)[:n]), bytes(data[n:])):
        raise GlobalModelUnavailable(f"{url}{path}: answer MAC does not match (not from a holder of the job's secret, or altered)")
    try:
        out = decode(memoryview(data)[:n], max_bytes=n)
    except WireError as e:
        raise GlobalModelUnavailable(f"{url}{path}: malformed answer: {e}") from None
    if not isinstance(out, dict):
        raise GlobalModelUnavailable(f"{url}{path}: malformed answer (not a dict)")
    return out


def tensor_or_none(x: Any, what: str) -> Optional[torch.Tensor]:
    if x is None or isinstance(x, torch.Tensor):
        return x
    raise GlobalModelUnavailable(f"{what}: not a tensor")
