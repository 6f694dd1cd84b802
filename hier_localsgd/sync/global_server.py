"""The asynchronous outer level's server: the global model (global_model.py) behind one
authenticated HTTP endpoint, run by the global lighthouse's process (launch/lighthouse.py)
at ``sync.async_outer.addr``. The leaders' side of the exchange is global_wire.py; the
grace window's and match_pace's rules, as functions the simulator runs too, global_schedule.py.

Requests (``POST``, body and answer in the no-code wire format, core/security/wire.py)::

    /push   {cluster, base, step, tokens, period_s, period_steps, match_pace, min_steps, full_steps,
             final, delta|None, model|None, down}      (delta: fp32, or compressed: compression.py encode_push)
            -> {version, model|None, updates, checksum, weight, staleness, final, need_model, refused, epoch,
                cluster_step, push_in, waited_s, merged (no delta)}
    /final  {cluster, wait_s}  -> {final, version, model|None, need_model}
    /version {cluster}         -> {version (-1: no model), final, cluster_step}

``/push``: the contribution is weighed and added to the open batch (global_model.py);
the batch closes (one outer step) when the grace window decides (:meth:`_should_close`),
and every request of that batch gets the new model. A server without a model (fresh, or
restarted), or one whose version is below ``base``, answers ``need_model``: the leader
sends the same request again with ``model`` (its copy of the global model of version
``base``), which the server adopts (:meth:`GlobalModel.adopt`: the open batch stays, weighed
against the adopted version). A leader new to the server sends that registration on its own
while its cluster trains its first period (async_outer.py ``register_early``), so its first
push is not answered ``need_model``. A registration's answer carries no model (its leader
takes none from it). ``final``: the cluster has
trained its last step; once every cluster is final, or the ones that are not have been
silent for ``sync.final_wait_s`` and three of their own periods, the job's final version is fixed: every later request
gets it and merges nothing, so every cluster ends on one model.

``push_in`` (a request with ``match_pace``: sync.async_outer.match_pace): the steps the
cluster trains before its next push, so that it arrives with the fastest live cluster's
next push (:meth:`_push_in`); 0 for a request without it. The leader hands it to its
cluster in BROADCAST's header (async_outer.py).

``down`` (a leader whose copy of version ``base`` is fp32): it can take ``updates``, the
quantized steps from ``base`` to the answer's version (``sync.async_outer.compress_down``,
global_model.py), with ``checksum``, the CRC-32 of the model they give, instead of
``model``. Only for a base of this server's life (``epoch``) whose chain is kept;
otherwise, and always at ``/final``, the model comes whole.

``cluster_step``: the furthest step the cluster has pushed at: a cluster that restarted
whole (every group lost, back at step 0) resumes its step count there when it adopts the
model, instead of training its steps again. It asks ``/version`` at its join round and, if
the job has moved on, pushes no work there and adopts the answer before its first step (as
the synchronous level's join round takes the global model, outer_round.py ``join_wanted``).
A push without a delta also says whether a push of its cluster from its base was merged
(``merged``): a leader that finds no answer of its own at an overlapped push's apply round
(the pushing leader died) asks, and merges the answer if so (async_outer.py ``recover``).
A second push with work from the base of a merged one is not merged (at most once); its
answer's ``held_to`` is the step of the first, whose work the global model holds, so the
cluster counts as lost only its steps past it (sync/committed.py).
A push of no steps since its cluster last adopted (``period_steps`` 0) tells nothing of the
cluster's period or pace: it only marks the cluster alive.

The grace window is adaptive: each push says the cluster's period (seconds since it last
adopted a model, or since it began training), and
a batch waits, at most ``sync.async_outer.grace_s`` and at most ``GRACE_SHARE`` (global_schedule.py) of its
contributors' own period after it opened, only for clusters expected to push inside that
window and for ``sync.async_outer.min_clusters`` contributors. Equal-speed clusters,
whose pushes come close together, merge into one batch (the synchronous round); a cluster
twice as slow is half a period late, outside the window, and is never waited for. An
overlapped push (``overlap``: its cluster trains on while it is out, async_outer.py) costs
its cluster nothing while it waits, until its cluster's next round, which applies the
answer: its period does not cap the window, its ``free_s`` does (its cluster's seconds of
training from the push to that round; the answer must leave an upload's time before it:
:meth:`_free_until`). Without that cap a fast cluster whose rounds are shorter than
``grace_s`` waited at each apply round for a slower cluster's push (2 x 2, H 5/4, 0.05 s
steps, one cluster at half speed: the fast one ran at 0.55x its own rate). match_pace
times its cluster from when the push went out (its arrival less its ``age_s``), not from
its answer.

Security as heals (core/ft/heals.py): requests carry ``Authorization: HL1 <time> <nonce>
<mac>``, an HMAC over the path, time, nonce and body under ``derive(secret,
"global-model")``; a bad MAC, a time more than ``MAX_SKEW`` away or a replayed nonce is
refused with 403 and one log line; answers end with an HMAC over the nonce and the body,
checked before decoding (the MACs and the leaders' :func:`~hier_localsgd.sync.global_wire.call`: global_wire.py).
Bodies over ``body_limit`` are refused before they are read.
The listener binds the given host, never every interface unless told (``lighthouse.bind``).

Failure semantics: global_wire.py's ``call`` raises ``GlobalModelUnavailable`` for any
unreachable, refused, malformed or forged exchange; the leader's outer round then
reports an inner-only round (its cluster trains on, async_outer.py).
"""

from __future__ import annotations

import hmac
import logging
import math
import re
import secrets
import socket
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Deque, Dict, Optional, Tuple

import torch

from hier_localsgd.core.ft.heals import MAX_SKEW, bind_family
from hier_localsgd.core.security.wire import WireError, decode, encode
from hier_localsgd.core.tensors.level import LevelAlgorithm
from hier_localsgd.sync.compression import decode_push, encode_update
from hier_localsgd.sync.global_model import GlobalModel
from hier_localsgd.sync.global_schedule import (MAX_AGE_S, SILENT_PERIODS, average, batch_closes, batch_end, expected_push,
                                                fastest, fastest_next, free_until, meet_in)
from hier_localsgd.sync.global_wire import AUTH, MAC_BYTES, PUBLIC_KEY, body_limit, request_mac, response_mac

logger = logging.getLogger(__name__)

READ_SLOTS = 8  # request bodies read at once (each before its MAC can be checked)
SOCKET_TIMEOUT_S = 120.0  # per blocking read or write of one connection


def _positive(x: Any) -> bool:
    """A finite number above 0 (not a bool): a request's period or steps."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


class GlobalModelServer:
    """The server of the module doc. ``host``/``port``: where to listen (port 0: any).

    Args:
        algorithm: the outer optimizer; ``full_tokens``/``max_staleness``: global_model.py.
        clusters: how many clusters the job has (the final version waits for each).
        grace_s, min_clusters: the batch window (module doc).
        final_wait_s: how long a silent cluster is waited for at the end.
        key: the job's ``derive(secret, "global-model")`` bytes; None: no secret.
        down: the updates' ``(fmt, block)`` on the way down (compression.py ``down_format``);
            None: answers carry the model in fp32.
    """

    def __init__(self, host: str, port: int, algorithm: LevelAlgorithm, full_tokens: float, max_staleness: int,
                 clusters: int, grace_s: float, min_clusters: int, final_wait_s: float, key: Optional[bytes],
                 down: Optional[Tuple[str, int]] = None) -> None:
        self.algorithm, self.full_tokens, self.max_staleness = algorithm, full_tokens, max_staleness
        self.clusters, self.grace_s, self.min_clusters, self.final_wait_s = clusters, grace_s, min_clusters, final_wait_s
        self.down = down
        self._key = key if key is not None else PUBLIC_KEY
        self.model: Optional[GlobalModel] = None
        self._cond = threading.Condition()
        self._batch = 0  # the open batch's number
        self._batch_opened: Optional[float] = None
        self._last: Dict[int, float] = {}  # cluster -> time of its last push
        self._period: Dict[int, float] = {}  # cluster -> its push period (moving average)
        self._pace: Dict[int, float] = {}  # cluster -> seconds per step over its periods (moving average)
        self._expect: Dict[int, float] = {}  # match_pace cluster -> when its next push is due (the fastest's next)
        self._pushed: Dict[int, float] = {}  # cluster -> when it last pushed work (a delta; not a registration or pull)
        self._answered: Dict[int, float] = {}  # cluster -> when its last push was answered
        self._transit: Dict[int, float] = {}  # cluster -> answer to next arrival less its training (moving average)
        self._fastest: Optional[int] = None  # the cluster the others' pushes meet (_push_in)
        self._overlapped: Dict[int, bool] = {}  # cluster -> its last push runs behind its training (the module doc)
        self._free: Dict[int, float] = {}  # cluster -> until when its overlapped push waits for free (server clock)
        self._finals: set = set()
        self._merged: Dict[int, int] = {}  # cluster -> the base of its last merged push
        self._merged_step: Dict[int, int] = {}  # cluster -> the step of that push
        self._steps: Dict[int, int] = {}  # cluster -> the furthest step it pushed at (a cluster restarted whole resumes there)
        self._started = time.time()  # a cluster not heard yet is silent since then
        self.final_version: Optional[int] = None
        self._nonces: Dict[str, float] = {}
        self._reading = threading.BoundedSemaphore(READ_SLOTS)
        self.refusals: Deque[str] = deque(maxlen=1000)  # why requests were refused, in order (tests, logs)
        self.epoch = secrets.token_hex(8)  # this server's life: versions of an earlier one are not its own
        self._adopted_at = 0  # the version it took from a leader when it got its model
        self._server = _Listener(host, port, self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="global-model", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ HTTP
    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _handler(self) -> type:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = SOCKET_TIMEOUT_S  # a client that stops sending mid-body is dropped

            def log_message(self, fmt: str, *args: Any) -> None:  # one line per refusal instead
                pass

            def do_POST(self) -> None:
                server._serve(self)

            def do_GET(self) -> None:
                server._refuse(self, 405, "only POST is served")

        return Handler

    def _refuse(self, h: BaseHTTPRequestHandler, code: int, why: str) -> None:
        peer = h.client_address[0] if h.client_address else "?"
        self.refusals.append(why)
        logger.warning("global model server: refused %s %s from %s: %s", h.command, h.path[:80], peer, why)
        try:
            h.send_error(code, why)
        except OSError:
            pass

    def _read(self, h: BaseHTTPRequestHandler) -> Optional[tuple]:
        """(body, nonce) of an authentic request, or None after refusing it."""
        if h.path not in ("/push", "/final", "/version"):
            return self._refuse(h, 404, "not a global model path")
        length = h.headers.get("Content-Length") or ""
        if re.fullmatch(r"[0-9]{1,15}", length) is None:
            return self._refuse(h, 411, "no valid Content-Length")
        n = int(length)
        with self._cond:
            limit = body_limit(None if self.model is None else self.model.params.numel())
        if n > limit:
            return self._refuse(h, 413, f"body of {n} bytes refused (limit {limit})")
        m = AUTH.fullmatch(h.headers.get("Authorization") or "")
        if m is None:
            return self._refuse(h, 403, "no credentials" if not h.headers.get("Authorization") else "malformed credentials")
        ts, nonce, mac = m.groups()
        now = time.time()
        if abs(now - float(ts)) > MAX_SKEW:  # before reading a byte of the body
            return self._refuse(h, 403, f"request time {now - float(ts):+.0f} s away from the server's clock (limit {MAX_SKEW:.0f} s)")
        # Bodies are read before their MAC can be checked: at most READ_SLOTS at a time.
        if not self._reading.acquire(blocking=False):
            return self._refuse(h, 503, f"{READ_SLOTS} requests are being read already")
        try:
            body = h.rfile.read(n)
        except OSError as e:
            return self._refuse(h, 400, f"body not received: {e}")
        finally:
            self._reading.release()
        if len(body) != n:
            return self._refuse(h, 400, f"body truncated at {len(body)} of {n} bytes")
        if not hmac.compare_digest(mac.encode(), request_mac(self._key, h.path, ts, nonce, body).encode()):
            return self._refuse(h, 403, "bad credentials (not the job's secret, or the body was altered)")
        with self._cond:
            for k, seen in list(self._nonces.items()):
                if now - seen > 2 * MAX_SKEW:
                    del self._nonces[k]
            if nonce in self._nonces:
                return self._refuse(h, 403, "replayed request (nonce seen before)")
            self._nonces[nonce] = now
        return body, nonce

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        got = self._read(h)
        if got is None:
            return
        body, nonce = got
        try:
            req = decode(bytearray(body), max_bytes=len(body))  # writable: the tensors view it
            if not isinstance(req, dict) or not isinstance(req.get("cluster"), int) or not 0 <= req["cluster"] < self.clusters:
                raise WireError("not a request of this job (cluster missing or out of range)")
            answer = self.push(req) if h.path == "/push" else self.final(req) if h.path == "/final" else self.version(req)
        except (WireError, ValueError, TypeError, KeyError) as e:
            return self._refuse(h, 400, f"malformed request: {str(e)[:160]}")
        out = encode(answer).to_bytes()
        mac = response_mac(self._key, h.path, nonce, out)
        try:
            h.send_response(200)
            h.send_header("Content-Type", "application/octet-stream")
            h.send_header("Content-Length", str(len(out) + MAC_BYTES))
            h.end_headers()
            h.wfile.write(out)
            h.wfile.write(mac)
        except OSError as e:
            logger.warning("global model server: answering %s failed: %s", h.client_address[0], e)

    # ------------------------------------------------------------------ the protocol
    def push(self, req: Dict[str, Any]) -> Dict[str, Any]:
        """A leader's contribution (module doc); blocks until its batch closes."""
        cluster, base, tokens = int(req["cluster"]), int(req["base"]), float(req["tokens"])
        final, delta, model, step = bool(req.get("final")), req.get("delta"), req.get("model"), int(req.get("step", -1))
        if not (math.isfinite(tokens) and tokens >= 0) or base < 0:
            raise ValueError(f"tokens {tokens} / base {base}: must be finite and at least 0")
        if delta is not None and not isinstance(delta, torch.Tensor):
            # A compressed push (sync.outer.compression, compression.py encode_push), decoded
            # for the model's size (one the server holds, else the one this request brings).
            with self._cond:
                held = self.model
            numel = held.params.numel() if held is not None else model.numel() if isinstance(model, torch.Tensor) else None
            if numel is None:
                return {"need_model": True}
            delta = decode_push(delta, numel)
        for name, t in (("delta", delta), ("model", model)):
            if t is not None and not (isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype.is_floating_point):
                raise ValueError(f"{name}: not a flat floating-point tensor")
        if model is not None and not bool(torch.isfinite(model).all()):
            raise ValueError("model: non-finite values")
        with self._cond:
            now = time.time()
            if self.model is None or base > self.model.version:
                if model is None:
                    return {"need_model": True}
                if self.model is None:
                    self.model = GlobalModel(self.algorithm, self.full_tokens, self.max_staleness, model, base, self.clusters, self.down)
                    logger.info("global model server: holds version %d (from cluster %d)", base, cluster)
                else:
                    logger.warning("global model server: cluster %d holds version %d above this server's %d: adopted, momentum reset",
                                   cluster, base, self.model.version)
                    self.model.adopt(model, base)
                self._adopted_at = base
                if not self.model.pending:  # else the open batch goes on, on top of the adopted version
                    self._batch += 1
                    self._batch_opened = None
                self._cond.notify_all()
            gm = self.model
            ahead = self._steps.get(cluster, 0)
            if step > ahead and delta is not None:
                self._steps[cluster] = step
            if req.get("epoch") and req["epoch"] != self.epoch and base > self._adopted_at:
                # Its base came from an earlier server, past the version this one took over:
                # the same number here may be another model. Measured from the one both share.
                # (A leader that never pushed does not know its base's server: taken as is.)
                base = self._adopted_at
            # An overlapped push is timed from when its cluster sent it out (its age: the
            # leader's seconds from building it to sending it, a registration included), so
            # its cluster's schedule is in step with its training, not with the server's answers.
            overlap = req.get("overlap") is True
            age = req.get("age_s")
            at = now - min(float(age), MAX_AGE_S) if overlap and _positive(age) else now
            self._arrived(cluster, at, req.get("period_s"), req.get("period_steps"))
            self._overlapped[cluster] = overlap
            self._free_until(cluster, now, at, req.get("free_s") if overlap else None)
            if delta is not None and not final:
                self._pushed_work(cluster, at, req.get("period_s"))
            if final:
                self._finals.add(cluster)
            if self.final_version is not None or (delta is None and not final):
                ans = self._answer_push(gm, cluster, req, weight=0.0, staleness=gm.version - base, arrived=at)
                ans["merged"] = self._merged.get(cluster) == base  # a new leader's question (module doc)
                return ans
            held_to: Optional[int] = None  # a repeat's: the step of the push from this base it merged
            if delta is not None and self._merged.get(cluster) == base:
                # A second push from the same version: the cluster never adopted the answer
                # to its first (its leader died after the push, or the answer was lost), so
                # this delta holds the first one's work again. At most once: not merged; it
                # adopts the newest version, which holds the first.
                logger.info("global model server: cluster %d pushed step %d from version %d again: not merged twice", cluster, step, base)
                delta = None
                held_to = self._merged_step.get(cluster, step)
            c = gm.add(cluster, base, tokens, delta)
            waited = 0.0
            if c.weight > 0:
                self._merged[cluster], self._merged_step[cluster] = base, step
                if self._batch_opened is None:
                    self._batch_opened = now
                mine, waiting = self._batch, time.time()
                while self._batch == mine and not self._should_close(time.time()):
                    self._cond.wait(timeout=0.05)
                if self._batch == mine:
                    self._close()
                waited = time.time() - waiting
                if not c.applied:  # refused when the server adopted a leader's newer version meanwhile (too stale then)
                    c.weight, c.refused = 0.0, c.refused or "dropped: the server took a newer version from another leader"
                    self._merged.pop(cluster, None)
            elif c.refused:
                logger.warning("global model server: cluster %d's contribution from version %d not merged (%s): it adopts version %d",
                               cluster, base, c.refused, gm.version)
            self._maybe_final(time.time())
            ans = self._answer_push(gm, cluster, req, weight=c.weight, staleness=c.staleness, refused=c.refused, arrived=at)
            ans["waited_s"] = round(waited, 4)  # in the open batch, for other clusters (the dashboard's waiting time)
            if held_to is not None:
                ans["held_to"] = held_to
            return ans

    def final(self, req: Dict[str, Any]) -> Dict[str, Any]:
        """Waits up to ``wait_s`` for the job's final version (module doc)."""
        cluster, wait = int(req["cluster"]), min(float(req.get("wait_s", 0.0)), 60.0)
        end = time.time() + max(0.0, wait)
        with self._cond:
            if self.model is None:  # restarted empty: the leader registers its copy (a /push) and asks again
                return {"final": False, "need_model": True, "version": -1, "model": None}
            self._finals.add(cluster)
            self._last[cluster] = time.time()  # a cluster waiting at its end is alive, not silent
            while True:
                self._maybe_final(time.time())
                if self.final_version is not None or time.time() >= end:
                    break
                self._cond.wait(timeout=0.1)
            gm = self.model
            if self.final_version is None or gm is None:
                return {"final": False, "version": -1 if gm is None else gm.version, "model": None}
            return {"final": True, "version": gm.version, "model": gm.params.clone()}

    def version(self, req: Dict[str, Any]) -> Dict[str, Any]:
        """How far the job is, for a cluster's join round (module doc); no model, no wait."""
        with self._cond:
            return {"version": -1 if self.model is None else self.model.version, "final": self.final_version is not None,
                    "cluster_step": self._steps.get(int(req["cluster"]), 0)}

    def _answer(self, gm: GlobalModel, cluster: int, weight: float, staleness: int, refused: str = "",
                model: bool = True) -> Dict[str, Any]:
        return {"need_model": False, "version": gm.version, "model": gm.params.clone() if model else None, "weight": float(weight),
                "staleness": int(staleness), "final": self.final_version is not None, "refused": refused, "epoch": self.epoch,
                "cluster_step": self._steps.get(cluster, 0), "push_in": 0}

    def _answer_push(self, gm: GlobalModel, cluster: int, req: Dict[str, Any], weight: float, staleness: int,
                     refused: str = "", *, arrived: float) -> Dict[str, Any]:
        """A push's answer; with match_pace, its ``push_in``, and the cluster is expected back
        when it aims to be (the grace window waits for it then, :meth:`_should_close`). An
        overlapped push's cluster trained on since it sent it: its ``push_in`` counts from
        the push's arrival (``arrived``), and nothing stands between an answer and its next
        push but training (no transit)."""
        chain = gm.chain(int(req["base"])) if req.get("down") is True and req.get("epoch") == self.epoch else None
        # A registration (a model, no work) gets no model back: its leader takes none from
        # the answer (it pushes again, or asks /final), and a whole model is a WAN transfer.
        registration = req.get("model") is not None and req.get("delta") is None
        ans = self._answer(gm, cluster, weight=weight, staleness=staleness, refused=refused, model=chain is None and not registration)
        if chain is not None:  # the steps since its base instead of the model (module doc)
            ans["updates"], ans["checksum"] = [encode_update(q) for q in chain], gm.checksum
        now = time.time()
        self._answered[cluster] = now
        lo, full = req.get("min_steps"), req.get("full_steps")
        if req.get("match_pace") is True and isinstance(lo, int) and isinstance(full, int) and 1 <= lo <= full:
            ref, transit = (arrived, 0.0) if self._overlapped.get(cluster) else (now, self._transit.get(cluster, 0.0))
            ans["push_in"] = self._push_in(cluster, ref, lo, full, transit)
            if cluster != self._fastest and cluster in self._pace:
                self._expect[cluster] = expected_push(ref, transit, ans["push_in"], self._pace[cluster])
            else:
                self._expect.pop(cluster, None)
        return ans

    def _push_in(self, cluster: int, now: float, lo: int, full: int, transit: float) -> int:
        """match_pace's schedule (docs/architecture.md "Matched paces"): the fastest live
        cluster (least seconds per step; it stays the fastest until another is 5 % faster,
        so near-equal clusters do not trade the role at every push) trains ``full`` steps
        between pushes; any other cluster ``round((t_f - transit) / pace)`` steps, ``t_f``
        the time to the fastest's next push's arrival (its answer, its transit and its
        full period at its pace: global_schedule.py ``fastest_next``; known from its first
        push on), ``transit`` the cluster's own time from an answer to its next arrival
        that is not training (the model down the WAN and to its groups, its push up: seconds
        on a slow link); the push after that if under ``lo`` steps are left; clamped to
        ``[lo, full]``."""
        live = {k: p for k, p in self._pace.items() if k not in self._finals
                and (k == cluster or now - self._last.get(k, 0.0) < SILENT_PERIODS * self._period.get(k, 0.0))}
        if cluster not in live:
            return full
        f = self._fastest = fastest(live, self._fastest)
        if f == cluster or f not in self._pushed:
            return full
        t_f, gap = fastest_next(time.time(), self._pushed[f], self._answered.get(f), self._overlapped.get(f, False),
                                self._transit.get(f, 0.0), live[f], full)
        n = meet_in(t_f - now - transit, live[cluster], gap, lo, full)
        # What each aim rests on, to read a missed meeting from the log (docs/benchmarks.md).
        logger.info("global model server: cluster %d pushes in %d steps (%.3f s a step, transit %.2f s): cluster %d "
                    "(%.3f s a step, transit %.2f s) due in %.2f s", cluster, n, live[cluster], transit, f, live[f],
                    self._transit.get(f, 0.0), t_f - now)
        return n

    def _arrived(self, cluster: int, now: float, period_s: Any = None, period_steps: Any = None) -> None:
        """Records a push: its time, and the cluster's period between pushes, as the
        cluster measured it (``period_s``: since it last adopted a model, or since it began
        training) or, without one, the gap since its last push (moving average); its pace
        over ``period_steps`` steps."""
        if type(period_steps) is int and period_steps == 0:  # no steps since its last adoption (a join round's push): alive, no period
            self._last[cluster] = now
            return
        last = self._last.get(cluster)
        gap = float(period_s) if _positive(period_s) else (None if last is None or cluster in self._finals else now - last)
        if gap is not None:
            average(self._period, cluster, gap)
        if _positive(period_s) and _positive(period_steps):
            pace = float(period_s) / float(period_steps)
            average(self._pace, cluster, pace)
        self._last[cluster] = now

    def _pushed_work(self, cluster: int, now: float, period_s: Any) -> None:
        """A push that carries work (not a registration or a pull): when it arrived, and
        the part of the time since the last answer that was not its training
        (``period_s``): the transit."""
        answered = self._answered.get(cluster)
        if answered is not None and _positive(period_s) and now - answered - float(period_s) >= 0:
            t = now - answered - float(period_s)
            average(self._transit, cluster, t)
        self._pushed[cluster] = now

    def _free_until(self, cluster: int, now: float, at: float, free_s: object) -> None:
        """An overlapped push that went out at ``at`` (server clock) and whose cluster
        applies the answer ``free_s`` seconds of training later: its answer must leave by
        ``at + free_s`` less the way back (taken as the way here, ``now - at``), or its
        cluster waits. Not given (a blocking push, an older leader): no such cap."""
        if _positive(free_s):
            self._free[cluster] = free_until(now, at, float(free_s))  # type: ignore[arg-type]
        else:
            self._free.pop(cluster, None)

    def _should_close(self, now: float) -> bool:
        """Whether the open batch closes now: its window is over, or every cluster that
        could still join it in time has (module doc)."""
        assert self.model is not None and self._batch_opened is not None
        inside = {c.cluster for c in self.model.pending}
        end = batch_end(self._batch_opened, self.grace_s, inside, self._period, self._overlapped, self._free)
        return batch_closes(now, end, inside, self.clusters, self._finals.__contains__, self.min_clusters, self._period, self._last, self._expect)

    def _close(self) -> None:
        assert self.model is not None
        if self.model.apply():
            h = self.model.history[-1]
            logger.info("global model server: version %d from clusters %s (weights %s, staleness %s)",
                        h["version"], h["clusters"], h["weights"], h["staleness"])
        self._batch += 1
        self._batch_opened = None
        self._cond.notify_all()

    def _maybe_final(self, now: float) -> None:
        """Fixes the final version once every cluster is final or silent (module doc)."""
        if self.final_version is not None or self.model is None or not self._finals:
            return
        waiting = [k for k in range(self.clusters) if k not in self._finals and now - self._last.get(k, self._started) < self._silent_after(k)]
        if waiting or self.model.pending:
            return
        self.final_version = self.model.version
        logger.info("global model server: final version %d (clusters final: %s)", self.final_version, sorted(self._finals))
        self._cond.notify_all()

    def _silent_after(self, k: int) -> float:
        """How long without a push makes cluster ``k`` silent at the end: ``final_wait_s``,
        and at least three of its own periods (a slow cluster is not silent between pushes)."""
        return max(self.final_wait_s, SILENT_PERIODS * self._period.get(k, 0.0))

    def status(self) -> Dict[str, Any]:
        """What the server holds, for logs and tests (no tensors)."""
        with self._cond:
            return {"version": None if self.model is None else self.model.version, "final_version": self.final_version,
                    "history": [] if self.model is None else list(self.model.history)}

    def shutdown(self) -> None:
        with self._cond:
            self._batch += 1
            self._cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


class _Listener(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64

    def __init__(self, host: str, port: int, handler: type) -> None:
        fam, addr = bind_family(host)
        self.address_family = fam
        super().__init__((addr[0], port) if fam == socket.AF_INET else (addr[0], port, *addr[2:]), handler)
