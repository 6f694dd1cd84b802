"""Overlapped pushes of the asynchronous outer level, simulated (``sync.outer.delay`` > 0
with ``sync.async_outer.enabled``; the model: engine.py's docstring).

As sync/async_outer.py runs them: at a push round the cluster commits its inner round and
goes on training while its leader's push is out (:meth:`OverlappedPushes.launch`). The
push reaches the server half an exchange later (:meth:`on_push_arrive`), where it is merged
(one version) or refused as too stale, as a blocking push would be; the work it carries is
committed (or discarded) there, since the global model holds it from then on whatever
happens to the cluster. The answer is back one exchange after the launch; the cluster's
next round (the apply round) merges it (``θ ← θ_v + (θ_now − θ_s)``), waiting for it if
it is not back yet, then broadcasts it inside the cluster (:meth:`apply_round`). The steps
since the launch ride on the next push. The run's last push is blocking (engine.py).

Failures: a leader that dies before its push reached the server takes the upload with it:
the push is dropped at the apply round and its work rides on the next push (its tokens
count again). One that dies later is recovered: the new leader asks the server at the apply
round and merges the newest version (async_outer.py ``recover``). A failed apply round
leaves the push for the next round. A cluster lost whole loses an upload in progress; a
push that arrived stays merged.

:class:`OverlappedPushes` is mixed into :class:`~hier_localsgd.tools.simulate.engine.Simulation`
and works on its state.
"""

from __future__ import annotations

from typing import Any, Dict

from hier_localsgd.sync.async_outer import min_push_steps, overlap_floor
from hier_localsgd.sync.global_model import staleness_factor
from hier_localsgd.tools.simulate.state import APPLY, PUSH_ARRIVE, S_OUTER, Cluster


class OverlappedPushes:
    """Launch, arrival and apply round of an overlapped push; a mixin of ``Simulation``."""

    def launch(self, c: Cluster, t: float) -> None:
        """The push round committed: the cluster's work since its last push leaves with the
        push (its replica-seconds and group-steps), and the next push's period starts."""
        p = self.p
        self.seq += 1
        c.flight = {"id": self.seq, "t": t, "step": c.step, "base": c.base, "work": c.pending,
                    "steps": len(c.active) * c.outer_acc - c.acc0_sum + c.carried_steps,
                    "period_t0": c.period_t0, "period_step0": c.period_step0,
                    "answer": t + p.push_time(), "lost": False, "version": None, "push_in": 0}
        c.pending = 0.0
        c.outer_acc = c.acc0_sum = c.carried_steps = 0
        for r in c.active:
            c.members[r].acc0 = 0
        c.period_t0, c.period_step0 = t, c.step  # async_outer.py launch: the next period starts here
        c.push_start = t
        self.pushes_at[c.idx].append(t)
        c.pushed_step = max(c.pushed_step, c.step)
        self.slow_bytes += p.ranks * 2 * p.sync_bytes
        self.push(t + p.push_time() / 2, PUSH_ARRIVE, c.idx, 0, c.flight["id"])

    def on_push_arrive(self, t: float, ci: int, _b: int, token: int) -> None:
        """The push reaches the server: merged if at most ``max_staleness`` versions behind
        (its work committed: the global model holds it), else refused (its work discarded);
        either way the answer carries the newest version."""
        c = self.clusters[ci]
        fl = c.flight
        if fl is None or fl["id"] != token or fl["lost"]:
            return
        p = self.p
        if staleness_factor(self.round_no - fl["base"], p.max_staleness) > 0:
            self.round_no += 1
            self.committed += fl["work"]
        else:
            self.lose("discarded", fl["work"], c.stale_cause if c.stale_cause >= 0 else c.delay_cause)
            self.steps_discarded += fl["steps"]
        fl["version"] = self.round_no
        self.outer_rounds += 1
        if p.match_pace:  # the server's schedule, from the push's own period (engine.py set_schedule)
            lo = overlap_floor(fl["step"], c.due, c.push_period, p.h_inner, p.period)  # async_outer.py floor_for
            fl["push_in"] = self.paces.push(ci, t, fl["t"] - fl["period_t0"], fl["step"] - fl["period_step0"], self.running, lo=lo)

    def drop_upload(self, c: Cluster, fid: int, whole: bool) -> None:
        """The leader (``whole``: the whole cluster) failed (failure ``fid``): a push not yet
        at the server is lost with its upload. Whole: its work with it (a push that arrived
        stays merged); otherwise its work rides on the next push (the cluster's model still
        holds it)."""
        fl = c.flight
        if fl is None:
            return
        if whole:
            c.flight = None
            if fl["version"] is None:
                self.lose("discarded", fl["work"], fid)
                self.steps_discarded += fl["steps"]
        elif fl["version"] is None:
            fl["lost"] = True

    def apply_round(self, c: Cluster, t: float) -> None:
        """The round after the launch: waits for the answer (if not back), then merges and
        broadcasts it inside the cluster (the APPLY event)."""
        fl = c.flight
        assert fl is not None
        c.state = S_OUTER
        c.phase_start = t
        self.enter(c, t, "sync")
        self.fire(c, t, ("BROADCAST",))
        c.epoch += 1
        ready = t if fl["lost"] else max(t, fl["answer"])
        self.push(ready + self.p.broadcast_time(len(c.active)), APPLY, c.idx, 0, c.epoch)

    def on_apply(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_OUTER:
            return
        fl: Dict[str, Any] = c.flight  # type: ignore[assignment]
        c.flight = None
        p = self.p
        if fl["version"] is None:
            # Never reached the server: dropped; its work rides on the next push.
            c.pending += fl["work"]
            c.carried_steps += fl["steps"]
        else:
            c.base = fl["version"]
            c.stale_cause = -1
            if p.match_pace and fl["push_in"] > 0:  # async_outer.py adopted(merge=True)
                c.push_period = fl["push_in"]
                c.due = max(fl["step"] + fl["push_in"], c.step + min_push_steps(p.h_inner))
        self.after_apply(c, t)
