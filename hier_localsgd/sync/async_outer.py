"""The leader's side of the asynchronous outer level (:class:`AsyncOuter`, owned by
:class:`~hier_localsgd.sync.outer_round.OuterLevel` when ``sync.async_outer.enabled``).

At its cluster's outer round the leader sends the cluster's pseudo-gradient, measured
from the global model of version ``base`` (the cluster's ``outer_round`` counter: in this
mode it counts global versions), with the group-steps it holds (``tokens``, counted by
every member from the inner rounds' weights since the last adoption: a new leader knows
them too, and a member that healed got them with the heal), to the global model server (global_server.py) and gets the newest global model
back; BROADCAST hands it to the cluster as a synchronous outer result would. No cluster
Manager, no global quorum: nothing waits for another cluster beyond the server's grace
window.

Overlapped pushes (``sync.outer.delay=1``): the push runs on the leader's stage thread
(overlap.py ``OuterStage``) while its cluster trains on; every member keeps the committed
model of the push round as the snapshot ``θ_s``, and at the cluster's next round (whatever
its step: :meth:`AsyncOuter.is_apply_round`) the answer ``θ_v`` is merged as a synchronous
overlapped round's is, ``θ ← θ_v + (θ_now − θ_s)``, with ``θ_v`` the outer backup. The
steps since the push are in no version yet: their tokens stay counted (:meth:`launch`
sets aside what the push carried) and the next push carries them, measured from ``θ_v``.
A push whose answer does not come by the apply round is dropped there (an inner-only
round: its tokens count again and its work rides on the next push; the server merges a
base at most once). A leader without an answer of its own there (the pushing leader died)
asks the server whether the push was merged and, if so, merges the newest version
(:meth:`AsyncOuter.recover`); a failed apply round leaves the push for the next round.
The run's last push is blocking: it first applies an answer in flight and pushes the steps
since it from its version (hier.py ``OuterLevel.run``).

At the end (:meth:`pulling`) every member runs join rounds in which the leader asks the
server for the job's final version (long polls of at most ``POLL_S``) until it is
fixed, so every cluster ends on one model (global_server.py). Work the run's last push did
not deliver (the server was out) is pushed first, at the first join round the server
answers (:meth:`_push_at_end`).

Failure semantics: a push the server does not answer (down, restarting, refused) is an
inner-only round: the cluster's work stays in its model and its tokens keep counting, so
the next push carries it. A leader that dies mid-push is replaced (leader failover, hier.py);
the server merged its contribution or not. The cluster's base did not move (the answer
was never adopted), so the new leader's next push comes from the same base: the server
merges a cluster's work at most once per base, so if the first push was merged the second
is not (the work since the failed round is lost; nothing is merged twice) and the cluster
adopts the newest version, which holds the first (the answer's ``held_to``, the step of the
first push: the members count only their steps past it as lost, committed.py). A server that restarted empty asks for the
leader's model (``need_model``) and continues from the highest version a leader brings.
Past ``sync.final_wait_s`` without any answer from the server the final pull gives up and
the cluster ends with its own model (an ``async_final`` event says so; the job's
consistency check reports it).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional, Tuple

import torch

from hier_localsgd.core.links.stats import PAYLOAD, LinkStats
from hier_localsgd.core.runtime.phases import Phase, PhaseTracker
from hier_localsgd.core.security.wire import tensor_bytes
from hier_localsgd.core.tensors.flat_params import checksum as model_checksum
from hier_localsgd.sync.common import OuterResult, Status
from hier_localsgd.sync.compression import OuterCompression, decode_push
from hier_localsgd.sync.global_model import apply_update, checksum
from hier_localsgd.sync.global_schedule import (is_push_step, min_push_steps, overlap_floor, overlap_free_s, skips_round,
                                                  steps_to_apply)
from hier_localsgd.sync.global_wire import GlobalModelUnavailable, body_limit, call, tensor_or_none
from hier_localsgd.sync.state import SyncState, fault_point

logger = logging.getLogger("hier_localsgd.sync.hier")  # one logger name for the whole round

POLL_S = 5.0  # one final poll's wait at the server: well inside OUTER_QUORUM's budget
MOVED_ON_S = 5.0  # the join round's question to the server: a few round trips, no model


@dataclass(frozen=True)
class AsyncOuterSettings:
    """What build.py maps from ``sync.async_outer`` (sections.py)."""

    url: str
    key: Optional[bytes]
    grace: timedelta
    match_pace: bool = False  # sync.async_outer.match_pace: the outer period follows the cluster's pace
    compress_down: bool = False  # sync.async_outer.compress_down with a compression: take the steps since the base

    def __repr__(self) -> str:  # settings get logged: never the key
        return (f"AsyncOuterSettings(url={self.url!r}, grace={self.grace}, match_pace={self.match_pace}, "
                f"compress_down={self.compress_down})")


class AsyncOuter:
    """The leader's pushes and final pulls (module doc).

    ``settings``: the server's address, the job's ``derive(secret, "global-model")`` bytes
    (None: no secret) and its grace window (a push waits at most that long for its
    batch). An exchange ends by its phase's deadline (a push: ``timeouts.outer_reduce``; a
    final poll: ``timeouts.outer_quorum``, which covers :data:`POLL_S`).
    """

    def __init__(self, st: SyncState, settings: AsyncOuterSettings, stats: LinkStats) -> None:
        self.st, self.url, self._key = st, settings.url, settings.key
        self.stats = stats  # the outer level's account: a push's bytes both ways are WAN traffic
        self.grace, self.match_pace = settings.grace, settings.match_pace
        self.compress_down = settings.compress_down
        self._whole_next = False  # the last updates did not give the server's model: ask for it whole once
        self.tokens = 0.0  # committed group-steps since the cluster last adopted a global model (every member counts)
        self.round_work = 0.0  # this round's, counted once its inner round commits
        self.pulling = False  # finish(): join rounds that ask for the final version
        self.final = False  # this member adopted the job's final version
        self.heard = 0.0  # when this cluster last heard the server at the end (the leader's header says)
        self.since = time.time()  # when this member last adopted a global model (or began): its period
        self.since_step = st.counters.step  # the step it was at then
        self.epoch = ""  # the server life that gave the cluster's base (global_server.py); "": unknown
        # The push schedule (:meth:`is_push_step`): from step `due` on, every `period` steps.
        # Without match_pace: every H_inner·H_outer steps from step 0, as a synchronous
        # cluster's outer rounds; with it, every member sets it from the leader's header.
        s = st.settings
        self.full = s.h_inner * s.h_outer
        self.min_steps = min_push_steps(s.h_inner)  # the shortest period between pushes (a push's min_steps)
        self.period = self.due = self.full
        self.last_round = st.counters.step  # the step of this cluster's last inner round
        # Overlapped pushes (module doc): the step of the push in flight (-1: none), and the
        # tokens it carried (counted again if its answer is not applied).
        self.launched, self.sent = -1, 0.0
        # The leader's push, at the end, of work its run's last push did not deliver (:meth:`pull_final`):
        # the base it went out from (None: not made), and the merge's weight and held_to.
        self._end_base: Optional[int] = None
        self._end_weight, self._end_held = 0.0, -1
        self._failing: Optional[Exception] = None  # a planned 'fail' at the push (:meth:`_arm_failure`)
        self._early: Optional[Tuple[threading.Thread, dict]] = None  # :meth:`register_early`'s call and its outcome
        st.tracker.set_extra(asynchronous=True)  # the dashboard shows versions and their lag

    def started(self, step: int) -> None:
        """Training begins (or resumes) at ``step``: the first period starts here."""
        self.since, self.since_step, self.last_round = time.time(), step, step

    def note_work(self, total_weight: float, step: int) -> None:
        """This inner round's work: its weight sum × its steps (the group-steps it merges)."""
        self.round_work = total_weight * max(0, step - self.last_round)

    def round_ended(self, committed: bool, step: Optional[int]) -> None:
        """The inner round at ``step`` committed (its work counts) or rolled back (it does
        not); ``step`` None: not a round of the cluster (the leader's push alone while its
        cluster lighthouse is out), which leaves the count where the members have it."""
        if committed:
            self.tokens += self.round_work
        self.round_work = 0.0
        if step is not None:
            self.last_round = step
            if committed and 0 <= self.launched < step:  # the push's apply round: applied (adopted) or dropped
                self.tokens += self.sent
                self.launched, self.sent = -1, 0.0
            # A failed apply round (rolled back) leaves the push in flight: the next round
            # applies it, with the server's answer if this leader no longer holds it (:meth:`recover`).

    def launch(self, step: int) -> None:
        """An overlapped push went out at ``step`` (every member, after the round's commit):
        its tokens are set aside; the steps from here on count for the next push."""
        self.launched, self.sent, self.tokens = step, self.tokens, 0.0
        self.since, self.since_step = time.time(), step  # the next push's period starts with this one

    def is_apply_round(self, step: int) -> bool:
        """Whether the round at ``step`` applies the overlapped push in flight: the first
        round after it, on every member (the launch is in the committed state a heal carries)."""
        return 0 <= self.launched < step

    def state_dict(self) -> dict:
        """What heals and checkpoints with the committed state (committed.py ``carry``): the
        cluster's group-steps since its last adoption, the server life of its base, and its
        push schedule."""
        return {"tokens": self.tokens, "epoch": self.epoch, "period": self.period, "due": self.due, "last_round": self.last_round,
                "launched": self.launched, "sent": self.sent}

    def load_state_dict(self, sd: Optional[dict]) -> None:
        """A heal's or checkpoint's; None (a donor or checkpoint without it) keeps this
        member's own count (and a state without a schedule, this member's schedule)."""
        if sd is None:
            return
        self.tokens, self.epoch = float(sd["tokens"]), str(sd["epoch"])
        if all(k in sd for k in ("period", "due", "last_round")):
            self.period, self.due, self.last_round = int(sd["period"]), int(sd["due"]), int(sd["last_round"])
        if "launched" in sd and "sent" in sd:
            self.launched, self.sent = int(sd["launched"]), float(sd["sent"])

    def is_push_step(self, step: int) -> bool:
        """Whether a round at ``step`` carries this cluster's push (:func:`is_push_step`).
        Every member holds the same schedule."""
        return is_push_step(step, self.due, self.period)

    def skips_round(self, step: int) -> bool:
        """Whether the inner round due at ``step`` on the H_inner grid is left out (:func:`skips_round`)."""
        return skips_round(step, self.due, self.period, self.st.settings.h_inner)

    def floor_for(self, step: int, overlap: bool) -> int:
        """The fewest steps from a push at ``step`` to the next that this cluster can run
        (the request's ``min_steps``, match_pace's floor at the server): ``min_steps``; for an
        overlapped push, counted from its apply round, the next round on the current schedule
        (which holds until then), since the next push comes at least ``min_steps`` after
        that (:meth:`adopted`). Without it the server aims at a push the cluster cannot make
        and its schedule slips past the other clusters' (docs/benchmarks.md)."""
        if not overlap:
            return self.min_steps
        return overlap_floor(step, self.due, self.period, self.st.settings.h_inner, self.full)

    def apply_in(self, step: int) -> int:
        """Steps from an overlapped push at ``step`` to its apply round on the current
        schedule (:func:`steps_to_apply`)."""
        return steps_to_apply(step, self.due, self.period, self.st.settings.h_inner)

    def next_push(self, push_in: object) -> int:
        """The server's ``push_in`` (match_pace: the steps to this cluster's next push, so it
        meets the fastest cluster's; global_server.py ``_push_in``) if it is one, else 0
        (unchanged)."""
        if not self.match_pace or isinstance(push_in, bool) or not isinstance(push_in, int) or not 1 <= push_in <= self.full:
            return 0
        return push_in

    def adopted(self, final: bool = False, step: Optional[int] = None, push_in: int = 0, merge: bool = False) -> None:
        """The cluster adopted a global model at ``step``: its work so far is in it (or was
        refused). ``push_in`` > 0 (the leader's header, match_pace): the next push comes that
        many steps after ``step``, and again every ``push_in`` steps until one is answered.
        ``merge``: an overlapped push's answer, merged at its apply round: the work since the
        push is not in it (its tokens stay), and ``push_in`` counts from the push, but no
        round is shorter than half of H_inner steps."""
        if merge:
            self.sent = 0.0
        else:
            self.tokens = self.round_work = self.sent = 0.0
            self.launched = -1
            self.since = time.time()
            if step is not None:
                self.since_step = self.last_round = step
        if push_in > 0 and step is not None:
            self.period = push_in
            if merge:
                start = self.launched if 0 <= self.launched <= step else step
                self.due = max(start + push_in, step + self.min_steps)
            else:
                self.due = step + push_in
        if final:
            self.final = True

    def _register(self, final: bool, tr: PhaseTracker, base: Optional[torch.Tensor] = None,
                  version: Optional[int] = None, step: Optional[int] = None) -> None:
        """A server without this cluster's version (restarted empty): send it the cluster's
        copy of the global model (``base``, version ``version``; by default the outer
        backup, version ``outer_round``) alone."""
        ans = self._call("/push", self._registration(final, base, version, step), tr)
        if ans.get("need_model") or not isinstance(ans.get("version"), int):
            raise GlobalModelUnavailable(f"{self.url}/push: the server did not take this cluster's model")
        self.epoch = str(ans.get("epoch") or "")

    def _registration(self, final: bool, base: Optional[torch.Tensor] = None, version: Optional[int] = None,
                      step: Optional[int] = None, copy: bool = False) -> dict:
        """A registration request: the cluster's copy of the global model alone (``base``,
        version ``version``; by default the outer backup, version ``outer_round``);
        ``copy``: a copy of it (sent on a thread while training moves on)."""
        st = self.st
        c = st.counters
        base = st.outer.backup if base is None else base
        return {"cluster": st.id.cluster, "base": c.outer_round if version is None else version, "epoch": self.epoch,
                "step": c.step if step is None else step, "tokens": 0.0, "final": final, "delta": None,
                "model": base.detach().to("cpu", torch.float32, copy=copy)}

    def register_early(self) -> None:
        """The leader of a cluster that has heard no server life yet (``epoch`` ""): sends
        its copy of the global model (the outer backup, version ``outer_round``) on a thread
        while the cluster trains its first period. Without it the first push is answered
        ``need_model`` and registers the model inside the round, then pushes again (the first
        push cost 5.4-5.8 s more than the later ones at 100 Mbit/s, docs/benchmarks.md).
        Every exchange waits for it first, within its own deadline (:meth:`_call`); one that
        failed or is still out changes nothing (the push registers as before). Called at each
        round the group leads (outer_round.py ``promote``): sent once."""
        if self.epoch or self._early is not None:
            return
        st = self.st
        req = {**self._registration(final=False, copy=True), "period_steps": 0}  # no steps: it only marks the cluster alive
        model = req["model"]
        wait = st.timeouts.phase(Phase.OUTER_REDUCE).total_seconds()
        out: dict = {}

        def run() -> None:
            sizes: dict = {}
            t0 = time.time()
            try:
                out["answer"] = call(self.url, "/push", req, self._key, wait, sizes, limit=body_limit(model.numel()))
            except GlobalModelUnavailable as e:
                out["error"] = e
            finally:
                out["seconds"] = time.time() - t0
                if sizes:  # WAN bytes all the same (not timed: nothing waited for it)
                    self.stats.record("push", PAYLOAD, 0, float(sizes["sent"] + sizes["received"]))

        th = threading.Thread(target=run, name=f"{st.id} register", daemon=True)
        self._early = (th, out)
        th.start()

    def _await_early(self, left: float) -> None:
        """Waits at most ``left`` seconds for :meth:`register_early`'s call; takes its server
        life (``epoch``) once it has answered."""
        early = self._early
        if early is None or early[1].get("taken"):
            return
        th, out = early
        th.join(timeout=max(0.0, left))
        if th.is_alive():
            return  # still out: this exchange goes on without it
        ans = out.get("answer")
        if isinstance(ans, dict) and not ans.get("need_model") and isinstance(ans.get("version"), int) and not self.epoch:
            self.epoch = str(ans.get("epoch") or "")
            logger.info("%s registered the global model (version %s) with the server while training (%.1f s)",
                        self.st.id, ans["version"], out.get("seconds", 0.0))
        elif "error" in out:
            logger.warning("%s early registration with the global model server: %s (the first push registers)", self.st.id, out["error"])
        out["taken"] = True  # later exchanges do not wait

    def _takes_updates(self, base: torch.Tensor) -> bool:
        """Whether this push asks for the steps since its base instead of the model: only
        with an fp32 copy of the base (the server's bits), and not right after a mismatch."""
        return self.compress_down and not self._whole_next and base.dtype == torch.float32

    def _model_of(self, ans: dict, like: torch.Tensor, path: str, base: torch.Tensor, version: int) -> torch.Tensor:
        if ans.get("updates") is not None:
            return self._updated(ans, path, base, version)
        self._whole_next = False
        model = tensor_or_none(ans.get("model"), f"{path}: the server's model")
        if model is None or model.shape != like.shape or not isinstance(ans.get("version"), int) or not bool(torch.isfinite(model).all()):
            raise GlobalModelUnavailable(f"{self.url}{path}: answer without a finite model of {tuple(like.shape)} elements and a version")
        return model

    def _updated(self, ans: dict, path: str, base: torch.Tensor, version: int) -> torch.Tensor:
        """The cluster's copy of its base (version ``version``) plus the answer's
        ``updates``, in order, the way the server took them (global_model.py
        ``apply_update``), checked against the answer's checksum; a mismatch asks for the
        model whole at the next push."""
        updates, crc = ans.get("updates"), ans.get("checksum")
        if not isinstance(updates, list) or type(crc) is not int or not isinstance(ans.get("version"), int):
            raise GlobalModelUnavailable(f"{self.url}{path}: answer with updates but without a list, a checksum and a version")
        x = base.detach().to("cpu", torch.float32, copy=True)
        try:
            for u in updates:
                apply_update(x, decode_push(u, x.numel()))
        except ValueError as e:
            raise GlobalModelUnavailable(f"{self.url}{path}: malformed update: {e}") from None
        if checksum(x) != crc:
            self._whole_next = True
            raise GlobalModelUnavailable(f"{self.url}{path}: {len(updates)} updates from version {version} "
                                         "did not give the server's model (checksum): the next push asks for it whole")
        return x

    def recover(self, like: torch.Tensor, tr: PhaseTracker) -> Optional[OuterResult]:
        """A leader at an apply round with no answer of its own (the leader that pushed died,
        or handed the lead to a restarted lower index): asks the server whether it merged a
        push of this cluster from the cluster's base (version ``outer_round``). If it did,
        the newest version, which holds that push's work, merged as its answer would have been
        (``θ ← θ_v + (θ_now − θ_s)``: the steps since the push ride on the next push); else
        None: the round drops the push (its tokens count again) and the next push carries its
        work. The residual stays the cluster's committed one, as after a repeated push (at most
        one quantization error per element, once). Never raises for the server."""
        st = self.st
        c = st.counters
        req = {"cluster": st.id.cluster, "base": c.outer_round, "epoch": self.epoch, "step": c.step, "tokens": 0.0,
               "period_s": 0.0, "period_steps": 0, "final": False, "delta": None, "model": None, "down": False}
        try:
            ans = self._call("/push", req, tr)
            if ans.get("merged") is not True:
                return None
            model = self._model_of(ans, like, "/push", st.outer.backup, c.outer_round)
        except GlobalModelUnavailable as e:
            logger.warning("%s global model server, asked for the push in flight of the last leader: %s", st.id, e)
            return None
        self.epoch = str(ans.get("epoch") or "")
        version = int(ans["version"])
        st.tracker.mark_commit("outer", version)
        st.events("recovered", level="outer", step=self.launched, base=c.outer_round, outer_round=version)
        logger.info("%s the last leader's push from step %d was merged: the cluster merges version %d", st.id, self.launched, version)
        return OuterResult(Status.OUTER_COMMITTED, model.to(like.dtype), version, c.step, 1.0, merge=True, checksum=model_checksum(model))

    def moved_on(self) -> bool:
        """Whether the job has moved on without this cluster (its join round at step 0,
        outer_round.py ``join_wanted``): the server holds a version past 0. False when the
        server does not answer within :data:`MOVED_ON_S` (the cluster trains from step 0)."""
        try:
            ans = call(self.url, "/version", {"cluster": self.st.id.cluster}, self._key, MOVED_ON_S, limit=1 << 16)
        except GlobalModelUnavailable as e:
            logger.warning("%s global model server at the join round: %s; the cluster starts from step 0", self.st.id, e)
            return False
        v = ans.get("version")
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    def answered(self, status: Status, server_answered: bool) -> None:
        """A final pull round's broadcast: the leader heard the server (or not)."""
        if status == Status.OUTER_COMMITTED or server_answered:
            self.heard = time.time()

    def _call(self, path: str, req: dict, tr: PhaseTracker) -> dict:
        """One exchange within the phase's deadline (``timeouts.outer_reduce`` for a push)."""
        self._await_early(tr.remaining().total_seconds())
        if req.get("epoch") == "" and self.epoch:  # built before the early registration's answer came
            req = {**req, "epoch": self.epoch}
        left = tr.remaining().total_seconds()
        if left <= 0:
            raise GlobalModelUnavailable(f"{self.url}{path}: no time left in {tr.phase.value}")
        sizes: dict = {}
        t0 = time.time()
        try:  # an answer holds at most one model: refused above that before its MAC is checked
            return call(self.url, path, req, self._key, left, sizes, limit=body_limit(self.st.outer.backup.numel()))
        finally:
            if sizes:
                self.stats.record(path.strip("/"), PAYLOAD, tensor_bytes(req.get("delta")), float(sizes["sent"] + sizes["received"]))
                self.stats.timed(path.strip("/"), PAYLOAD, t0, 0.0)

    def request(self, cluster_model: torch.Tensor, contribute: bool, comp: Optional[OuterCompression] = None,
                base: Optional[torch.Tensor] = None, version: Optional[int] = None, overlap: bool = False) -> dict:
        """A push of ``cluster_model``'s work measured from ``base`` (version ``version``;
        by default the outer backup, version ``outer_round``), with the tokens counted so
        far; ``comp`` (the compression state, or the stage's copy of it) stages its
        residual; ``overlap``: the cluster trains on while it is out (the server times the
        cluster's next push from its arrival, global_server.py). Built on the training
        thread (counters and tokens move on with training); :meth:`exchange` sends it."""
        st = self.st
        c = st.counters
        base = st.outer.backup if base is None else base
        delta = st.outer.pseudo_grad(cluster_model, base=base).to("cpu", torch.float32) if contribute else None
        payload = comp.encode_push(delta) if comp is not None and delta is not None else delta
        period_s, period_steps = time.time() - self.since, c.step - self.since_step
        # An overlapped push waits at the server for free only until its apply round
        # (global_server.py _free_until): the seconds of training to it, at this period's pace.
        free_s = overlap_free_s(c.step, self.due, self.period, st.settings.h_inner, period_s, period_steps) if overlap else None
        return {"cluster": st.id.cluster, "base": c.outer_round if version is None else version, "epoch": self.epoch, "step": c.step,
                "tokens": self.tokens + self.round_work if contribute else 0.0,
                "period_s": period_s, "period_steps": period_steps, "free_s": free_s,
                "match_pace": self.match_pace,
                "min_steps": self.floor_for(c.step, overlap), "full_steps": self.full,
                "final": st.settings.final_step > 0 and c.step >= st.settings.final_step, "delta": payload, "model": None,
                "down": self._takes_updates(base), "overlap": overlap}

    def run(self, cluster_model: torch.Tensor, contribute: bool, inner_ok: bool, tr: PhaseTracker) -> OuterResult:
        """The leader's blocking push at its outer round (module doc); never raises for the server."""
        st = self.st
        req = self.request(cluster_model, contribute, st.comp)
        return self.exchange(req, st.outer.backup, cluster_model, inner_ok, st.comp, tr)

    def exchange(self, req: dict, base: torch.Tensor, like: torch.Tensor, inner_ok: bool,
                 comp: Optional[OuterCompression], tr: PhaseTracker, built: Optional[float] = None,
                 adopts: bool = True) -> OuterResult:
        """Sends the push ``req`` (:meth:`request`, from ``base``) and takes its answer; on
        the round's tracker (blocking) or the stage's (overlapped: then it touches only
        ``comp``, the stage's copy, and this object's server state; ``built``: when the
        push was built, so each attempt says its age). Never raises for the server: an
        unanswered push is an INNER_ONLY result with ``like`` (ABORT if not ``inner_ok``).

        ``adopts``: the caller adopts the answer now (a blocking round). Else (an overlapped
        push, whose apply round may drop it; an end push, whose version no member adopts)
        its ``commit`` event carries no checksum, ``pending`` instead: a model the cluster
        never held is no heal evidence. The apply round writes an ``adopt`` event with it
        (outer_round.py)."""
        st = self.st

        def aged(r: dict) -> dict:
            return r if built is None else {**r, "age_s": round(time.time() - built, 4)}

        fallback = OuterResult(Status.INNER_ONLY if inner_ok else Status.ABORT, like, req["base"], req["step"])
        t0 = time.time()
        tr.enter(Phase.OUTER_QUORUM, reason="asynchronous: push to the global model server")
        fault_point(st, Phase.OUTER_QUORUM, req["step"])
        tr.enter(Phase.OUTER_REDUCE)  # the push: its answer comes when its batch closes
        fault_point(st, Phase.OUTER_REDUCE, req["step"], arm_failure=self._arm_failure)
        try:
            if self._failing is not None:
                failing, self._failing = self._failing, None
                raise GlobalModelUnavailable(f"{self.url}/push: {failing}")
            ans = self._call("/push", aged(req), tr)
            if ans.get("need_model"):
                logger.info("%s the global model server does not hold version %d: this push registers it, then pushes again",
                            st.id, req["base"])
                self._register(final=False, tr=tr, base=base, version=req["base"], step=req["step"])  # the model alone, then the push again
                req = {**req, "epoch": self.epoch}
                ans = self._call("/push", aged(req), tr)
            if comp is not None:
                # Merged (weight > 0): what the payload did not deliver is the residual (the
                # members get it in BROADCAST, outer_round.py), even if the model in the
                # answer is then refused. Refused or dropped: the work is lost with the
                # adoption; the residual (earlier, merged work's) is kept.
                w = ans.get("weight")
                if type(w) in (int, float) and w > 0:
                    comp.commit()
                else:
                    comp.rollback()
            model = self._model_of(ans, like, "/push", base, req["base"])
        except GlobalModelUnavailable as e:
            if comp is not None:
                comp.rollback()  # not merged (or not known to be: at most once, global_server.py); no-op once settled
            tr.enter(Phase.OUTER_COMMIT)
            st.events("outer_unavailable", level="outer", step=req["step"], detail=str(e)[:200])
            logger.warning("%s global model server: %s; the cluster trains on", st.id, e)
            return fallback
        tr.enter(Phase.OUTER_COMMIT)  # nothing to vote on: the server's version is final
        crc = model_checksum(model)
        self.epoch = str(ans.get("epoch") or "")
        version, weight, staleness = int(ans["version"]), float(ans.get("weight", 0.0)), int(ans.get("staleness", 0))
        st.tracker.mark_commit("outer", version)
        st.tracker.set_extra(version_lag=staleness)
        waited = ans.get("waited_s")
        # the server's say, but never more than the exchange took here
        waited = min(float(waited), time.time() - t0) if type(waited) in (int, float) and math.isfinite(waited) and waited > 0 else 0.0
        st.waited_for_clusters(waited)
        push_in = self.next_push(ans.get("push_in"))
        held = ans.get("held_to")
        held_to = held if weight == 0 and type(held) is int and 0 <= held <= req["step"] else -1  # a repeat (global_server.py)
        st.events("commit", level="outer", outer_round=version, step=req["step"], base=req["base"], staleness=staleness,
                  weight=round(weight, 6), tokens=req["tokens"], final=bool(ans.get("final")), wait_s=round(time.time() - t0, 4), server_wait_s=waited,
                  asynchronous=True, refused=str(ans.get("refused") or "")[:100], push_in=push_in or self.period,
                  down_steps=len(ans["updates"]) if isinstance(ans.get("updates"), list) else None,  # None: the model came whole
                  # the version's model: the evidence another cluster's commit of it matches
                  **({"checksum": crc} if adopts else {"pending": True}),
                  **({"held_to": held_to} if held_to >= 0 else {}))
        # A cluster restarted whole (behind the steps it had pushed before) resumes its count there.
        ahead = ans.get("cluster_step")
        last = st.settings.final_step
        at = req["step"]
        step = max(at, ahead) if isinstance(ahead, int) and not isinstance(ahead, bool) and (last <= 0 or ahead <= last) else at
        if step > at:
            st.events("resume_step", level="outer", step=at, to=step, version=version)
            logger.info("%s resumes its step count at %d (this cluster's furthest push) with version %d", st.id, step, version)
        return OuterResult(Status.OUTER_COMMITTED, model.to(like.dtype), version, step, weight, push_in=push_in, held_to=held_to,
                           checksum=crc)

    def _arm_failure(self, exc: Exception, collective: str) -> None:
        """A planned ``fail`` at OUTER_REDUCE (core/runtime/faults.py), on the thread that
        pushes: this push is not sent and counts as unanswered, as on a broken WAN (the
        cluster trains on; its work rides the next push). ``collective`` is moot: a push is
        one exchange."""
        self._failing = exc

    def _push_at_end(self, cluster_model: torch.Tensor) -> bool:
        """The run's last push did not deliver the cluster's work (the server was down or
        did not answer): the leader pushes it now, once per base, final, before it asks for
        the job's final version, which then holds it (the next poll asks for it). Returns
        whether the server answered. The cluster keeps its own model until the final
        version comes (the answer's newer version is not adopted: every member waits for
        the final one)."""
        st = self.st
        c = st.counters
        req = self.request(cluster_model, contribute=True, comp=st.comp)
        res = self.exchange(req, st.outer.backup, cluster_model, True, st.comp, st.tracker, adopts=False)
        if res.status != Status.OUTER_COMMITTED:
            return False
        self._end_base, self._end_weight, self._end_held = c.outer_round, res.cluster_weight, res.held_to
        st.events("end_push", level="outer", step=req["step"], base=req["base"], tokens=req["tokens"], weight=round(res.cluster_weight, 6))
        logger.info("%s pushed the work its last push did not deliver (%g group-steps from version %d): weight %g",
                    st.id, req["tokens"], req["base"], res.cluster_weight)
        return True

    def pull_final(self, cluster_model: torch.Tensor) -> OuterResult:
        """The leader's poll for the job's final version: OUTER_COMMITTED with it, or
        INNER_ONLY (its own cluster model) while it is not fixed or the server is down.
        Work the run's last push did not deliver is pushed first (:meth:`_push_at_end`);
        the final version's ``cluster_weight`` is then that push's weight, so the members
        count the steps it carried as kept (committed.py), else 0."""
        st = self.st
        c = st.counters
        # cluster_weight tells the members whether the server answered (final.py's bound).
        waiting = OuterResult(Status.INNER_ONLY, cluster_model, c.outer_round, c.step, 1.0)
        if self.tokens > 0 and self._end_base != c.outer_round and st.settings.final_step > 0 and c.step >= st.settings.final_step:
            # One exchange per round (each within its phase's deadline): the next round polls.
            if not self._push_at_end(cluster_model):
                waiting.cluster_weight = 0.0  # not heard: final.py's bound runs
            return waiting
        try:
            ans = self._call("/final", {"cluster": st.id.cluster, "wait_s": POLL_S}, st.tracker)
            if ans.get("need_model"):  # restarted empty: hand it this cluster's version, then ask again
                self._register(final=True, tr=st.tracker)
                ans = self._call("/final", {"cluster": st.id.cluster, "wait_s": POLL_S}, st.tracker)
            if not ans.get("final"):
                if not isinstance(ans.get("version"), int) or ans["version"] < 0:
                    raise GlobalModelUnavailable(f"{self.url}/final: the server holds no model")
                return waiting
            model = self._model_of(ans, cluster_model, "/final", st.outer.backup, c.outer_round)
        except GlobalModelUnavailable as e:
            logger.warning("%s global model server at the end: %s", st.id, e)
            waiting.cluster_weight = 0.0  # not heard: final.py's bound runs
            return waiting
        version = int(ans["version"])
        mine = self._end_base is not None and self._end_base == c.outer_round  # this leader's end push carried the work
        weight, held = (self._end_weight, self._end_held) if mine else (0.0, -1)
        st.events("commit", level="outer", outer_round=version, step=c.step, final=True, asynchronous=True, pull=True,
                  weight=round(weight, 6), checksum=model_checksum(model))
        return OuterResult(Status.OUTER_COMMITTED, model.to(cluster_model.dtype), version, c.step, weight, held_to=held)
