"""The asynchronous outer level's pushes, simulated (``sync.async_outer.enabled``; the
model: engine.py's docstring).

**Blocking.** At its push round the leader sends its push; it reaches the server half an
exchange later (:meth:`Pushes.on_push_up`), where it is merged if at most
``max_staleness`` versions behind, and then waits in the open batch until the grace window
closes it (batches.py, :meth:`Pushes.close_batch`: one version), or refused and answered at
once. The answer is back its download later (``SimParams.download_s``; the upload took ``upload_s``) (:meth:`Pushes.on_push_done`).

**Overlapped** (``sync.outer.delay`` > 0), as sync/async_outer.py runs them: at a push
round the cluster commits its inner round and goes on training while its leader's push is
out (:meth:`Pushes.launch`). The push reaches the server its upload later
(:meth:`Pushes.on_push_arrive`), where it is merged (it joins the open batch) or refused as
too stale, as a blocking push would be; the work it carries is committed (or discarded)
there, since the global model holds it from then on whatever happens to the cluster. The
answer is back its download after its batch closed (or after it was refused); the
cluster's next round (the apply round) merges it (``θ ← θ_v + (θ_now − θ_s)``), waiting for
it if it is not back yet, then broadcasts it inside the cluster (:meth:`Pushes.apply_round`).
The steps since the launch ride on the next push. The run's last push is blocking.

Failures, blocking: a leader that dies after its push reached the server leaves it merged;
the cluster trains the round again and its push from the same base is refused (the server
merges a cluster's push from one base once: :meth:`Pushes.merges`,
:meth:`Pushes.server_holds_push`).

Failures, overlapped: a leader that dies before its push reached the server takes the upload with it:
the push is dropped at the apply round and its work rides on the next push (its tokens
count again). One that dies later is recovered: the new leader asks the server at the apply
round and merges the newest version (async_outer.py ``recover``). A failed apply round
leaves the push for the next round. A cluster lost whole loses an upload in progress; a
push that arrived stays merged.

:class:`Pushes` is mixed into :class:`~hier_localsgd.tools.simulate.engine.Simulation`
and works on its state.
"""

from __future__ import annotations

from typing import Any, Dict

from hier_localsgd.sync.global_schedule import min_push_steps, overlap_floor, overlap_free_s
from hier_localsgd.sync.global_model import batch_share, contribution_weight, staleness_factor
from hier_localsgd.tools.simulate.state import APPLY, BATCH_END, COMMIT, PUSH_ARRIVE, PUSH_DONE, S_COMMIT, S_OUTER, Cluster


class Pushes:
    """A blocking push's arrival and answer, the server's batches, and an overlapped push's
    launch, arrival and apply round; a mixin of ``Simulation``."""

    def on_push_up(self, t: float, ci: int, _b: int, epoch: int) -> None:
        """A blocking push reaches the server: merged if at most ``max_staleness`` versions
        behind (sync/global_model.py), then it waits in the open batch (batches.py);
        refused, it is answered at once."""
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_OUTER:
            return
        p = self.p
        if c.outer_join:  # a restarted cluster's join push (no steps): it marks the cluster alive, merges nothing
            self.batches.arrive(ci, t, 0.0)
            c.answer_version = self.round_no
            self.push(t + p.download_s, PUSH_DONE, ci, 0, c.epoch)
            self.check_batch(t)
            return
        period_s = c.push_start - c.period_t0
        self.batches.arrive(ci, t, period_s)
        if p.match_pace:
            self.paces.arrive(ci, t, period_s, c.step - c.period_step0)
        c.push_arrived = True
        c.push_repeat = c.base == c.merged_base  # its first push from this base merged (server_holds_push)
        c.push_merged = self.merges(c, c.base)
        if c.push_merged:
            self.batches.join(ci, t, ("blocking", epoch))
            self.weigh(ci, c.group_steps(c.round_len), c.base)
        else:
            self.answer_blocking(c, t)
        self.check_batch(t)  # its arrival moved what the server expects of it

    def merges(self, c: Cluster, base: int) -> bool:
        """The server's rule for a push from ``base`` that carries work: merged if at most
        ``max_staleness`` versions behind (sync/global_model.py) and not a second push from
        a base it merged a push of this cluster's from (global_server.py: at most once)."""
        if base == c.merged_base or staleness_factor(self.round_no - base, self.p.max_staleness) <= 0:
            return False
        c.merged_base = base
        return True

    def server_holds_push(self, c: Cluster) -> None:
        """The round of a blocking push fails after the server merged it (its leader died):
        the global model holds the work its earlier rounds carried (goodput; the failed
        round's own steps count as lost, rolled back or at death, as chaos.py counts them).
        The cluster rolls back, trains the round again and pushes from the same base
        (``push_again``: its next round), which the server refuses (:meth:`merges`), saying
        that the model holds the first push's steps: the real cluster trained the failed
        round's steps again, so nothing more is lost there (sync/committed.py ``held_to``),
        and the simulated round stands for them (``push_repeat``: committed, as the real
        processes count it). A cluster lost whole clears ``push_again`` (restarted, it adopts
        at its join round: failures.py ``cluster_lost``)."""
        if self.p.asynchronous and c.state == S_OUTER and c.push_arrived and c.push_merged and not c.outer_join:
            self.committed += c.pending
            c.pending = 0.0
            c.push_arrived, c.push_again = False, True

    def weigh(self, k: int, group_steps: float, base: int) -> None:
        """A merged push's ``a_i`` as the server weighs it when it arrives (sync/global_model.py
        ``weigh``), kept until its batch closes (target.py: the version's share)."""
        p = self.p
        self.batch_weights[k] = contribution_weight(group_steps, p.replicas * p.period, self.round_no - base, p.max_staleness)

    def check_batch(self, t: float) -> None:
        """Closes the open batch if the grace window says so, else looks again at its end."""
        b = self.batches
        if b.opened is None:
            return
        if b.closes(t, self.running):
            self.close_batch(t)
        else:
            self.push(b.end(), BATCH_END, 0, 0, b.gen)

    def on_batch_end(self, t: float, _a: int, _b: int, gen: int) -> None:
        if gen == self.batches.gen:
            self.check_batch(t)

    def close_batch(self, t: float) -> None:
        """The open batch becomes one version; every push in it is answered."""
        self.round_no += 1
        # its share of a round (target.py)
        self.progress.step(self.round_no, batch_share(sum(self.batch_weights.values()), self.p.clusters))
        self.batch_weights = {}
        for k, (kind, token) in self.batches.close():
            c = self.clusters[k]
            if kind == "blocking" and token == c.epoch and c.state == S_OUTER:
                self.answer_blocking(c, t)
            elif kind == "overlapped" and c.flight is not None and c.flight["id"] == token:
                self.answer_flight(c, t, self.round_no)

    def answer_blocking(self, c: Cluster, t: float) -> None:
        """The server answers a blocking push at ``t`` (match_pace: with the cluster's next
        push, global_server.py ``_answer_push``); the answer is back its download later."""
        p = self.p
        c.answer_version = self.round_no  # the version the answer carries (the cluster's base once adopted)
        if p.match_pace:
            c.answer_push_in = self.paces.answer(c.idx, t, self.running)
            self.batches.expect(c.idx, self.paces.expected_at(c.idx, t, c.answer_push_in))
        self.push(t + p.download_s, PUSH_DONE, c.idx, 0, c.epoch)

    def on_push_done(self, t: float, ci: int, _b: int, epoch: int) -> None:
        """The asynchronous outer level: the answer to this cluster's push is back with the
        newest version (its push merged into it, or refused as too stale: on_push_up); the
        cluster adopts it and keeps its own step count."""
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_OUTER:
            return
        p = self.p
        self.slow_bytes += p.ranks * (p.push_bytes + p.answer_bytes)
        if c.outer_join:  # a restarted cluster's join push: no work, nothing merged; it adopts
            c.outer_weight, c.outer_outcome, c.state = 0.0, "committed", S_COMMIT
            self.fire(c, t, ("OUTER_REDUCE", "OUTER_COMMIT", "BROADCAST"))
            self.push(t + p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)
            return
        if not c.push_merged:
            c.stale_cause = c.delay_cause if c.stale_cause < 0 else c.stale_cause
        c.outer_weight = 1.0 if c.push_merged else 0.0
        if p.match_pace:  # the server's schedule (answer_blocking): the next period starts at the adoption
            c.push_period, c.due = c.answer_push_in, c.step + c.answer_push_in
        self.outer_rounds += 1
        c.outer_outcome = "committed"
        c.state = S_COMMIT
        self.fire(c, t, ("OUTER_REDUCE", "OUTER_COMMIT", "BROADCAST"))
        if p.steps == 0 and t >= p.duration_s:
            self.stop_pending = True
            self.outstanding.add(ci)
        self.push(t + p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)

    def launch(self, c: Cluster, t: float) -> None:
        """The push round committed: the cluster's work since its last push leaves with the
        push (its replica-seconds and group-steps), and the next push's period starts."""
        p = self.p
        self.seq += 1
        c.flight = {"id": self.seq, "t": t, "step": c.step, "base": c.base, "work": c.pending,
                    "steps": c.group_steps(),
                    "period_t0": c.period_t0, "period_step0": c.period_step0,
                    "answer": None, "lost": False, "arrived": False, "version": None, "push_in": 0, "apply_epoch": None}
        c.pending = 0.0
        c.outer_acc = c.acc0_sum = c.carried_steps = 0
        for r in c.active:
            c.members[r].acc0 = 0
        c.period_t0, c.period_step0 = t, c.step  # async_outer.py launch: the next period starts here
        c.push_start = t
        self.pushes_at[c.idx].append(t)
        c.pushed_step = max(c.pushed_step, c.step)
        self.slow_bytes += p.ranks * (p.push_bytes + p.answer_bytes)
        self.push(t + p.upload_s, PUSH_ARRIVE, c.idx, 0, c.flight["id"])

    def on_push_arrive(self, t: float, ci: int, _b: int, token: int) -> None:
        """The push reaches the server: merged if at most ``max_staleness`` versions behind
        (its work committed: the global model holds it), and it waits in the open batch
        (batches.py; answered when the batch closes); else refused (its work discarded) and
        answered at once. The answer carries the newest version."""
        c = self.clusters[ci]
        fl = c.flight
        if fl is None or fl["id"] != token or fl["lost"]:
            return
        p = self.p
        fl["arrived"], fl["arrived_t"] = True, t
        period_s, steps = fl["t"] - fl["period_t0"], fl["step"] - fl["period_step0"]
        self.batches.arrive(ci, t, period_s, overlapped=True,
                            free_s=overlap_free_s(fl["step"], c.due, c.push_period, p.h_inner, period_s, steps))
        if p.match_pace:
            self.paces.arrive(ci, t, period_s, steps)
        self.outer_rounds += 1
        if self.merges(c, fl["base"]):
            self.committed += fl["work"]
            self.batches.join(ci, t, ("overlapped", fl["id"]))
            self.weigh(ci, fl["steps"], fl["base"])
        else:
            self.lose("discarded", fl["work"], c.stale_cause if c.stale_cause >= 0 else c.delay_cause)
            self.steps_discarded += fl["steps"]
            self.answer_flight(c, t, self.round_no)
        self.check_batch(t)  # its arrival moved what the server expects of it

    def answer_flight(self, c: Cluster, t: float, version: int) -> None:
        """The server answers the push in flight at ``t`` with ``version``; back half an
        exchange later. An apply round already waiting for it merges it then."""
        fl = c.flight
        assert fl is not None
        p = self.p
        fl["version"], fl["answer"] = version, t + p.download_s
        if p.match_pace:  # the server's schedule, from the push's own period, counted from its arrival
            lo = overlap_floor(fl["step"], c.due, c.push_period, p.h_inner, p.period)  # async_outer.py floor_for
            fl["push_in"] = self.paces.answer(c.idx, t, self.running, lo=lo, ref=fl["arrived_t"], transit=0.0)
            self.batches.expect(c.idx, self.paces.expected_at(c.idx, fl["arrived_t"], fl["push_in"], transit=0.0))
        if fl["apply_epoch"] is not None:
            self.push(max(fl["apply_t"], fl["answer"]) + self.p.broadcast_time(len(c.active)), APPLY, c.idx, 0, fl["apply_epoch"])

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
            if not fl["arrived"]:
                self.lose("discarded", fl["work"], fid)
                self.steps_discarded += fl["steps"]
        elif not fl["arrived"]:
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
        if fl["lost"] or fl["answer"] is not None:
            ready = t if fl["lost"] else max(t, fl["answer"])
            self.push(ready + self.p.broadcast_time(len(c.active)), APPLY, c.idx, 0, c.epoch)
        else:  # not answered yet (its batch is open, or it is on its way): answer_flight schedules the merge
            fl["apply_t"], fl["apply_epoch"] = t, c.epoch

    def on_apply(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_OUTER:
            return
        fl: Dict[str, Any] = c.flight  # type: ignore[assignment]
        c.flight = None
        p = self.p
        if not fl["arrived"]:
            # Never reached the server: dropped; its work rides on the next push.
            c.pending += fl["work"]
            c.carried_steps += fl["steps"]
        else:
            c.base = fl["version"]
            self.progress.adopted(t, c.base)
            c.stale_cause = -1
            if p.match_pace and fl["push_in"] > 0:  # async_outer.py adopted(merge=True)
                c.push_period = fl["push_in"]
                c.due = max(fl["step"] + fl["push_in"], c.step + min_push_steps(p.h_inner))
        self.after_apply(c, t)
