"""Failures in the simulator: when they happen (independent, the chaos schedule, explicit
kills), what a crash or hang does to its cluster's round and the outer round, restarts,
watchdogs and whole-cluster restarts (the model: engine.py's docstring, "Failures").

:class:`Failures` is mixed into :class:`~hier_localsgd.tools.simulate.engine.Simulation`
and works on its state.
"""

from __future__ import annotations

from typing import List, Tuple

from hier_localsgd.tools.simulate.config import INF
from hier_localsgd.tools.simulate.state import (
    ABORT, CLUSTER_FAIL, CLUSTER_START, FAIL, KILL, PUSH_UP, RESTART, S_COMMIT, S_COMPUTE, S_DONE, S_DOWN, S_OUTER, S_QUORUM, S_SYNC, WATCHDOG,
    Cluster, Member,
)


class Failures:
    """Failure events and their consequences; a mixin of ``Simulation``."""

    def failures_active(self, t: float) -> bool:
        """No failures after ``stop_kills_at`` of the run (steps: of the slowest live cluster's steps)."""
        p = self.p
        if p.steps > 0:
            if self.kills_stopped:
                return False
            live = [c.step for c in self.clusters if c.state not in (S_DOWN, S_DONE)]
            return not live or min(live) < int(p.steps * p.stop_kills_at)
        return t < p.stop_kills_at * p.duration_s

    def schedule_failures(self) -> None:
        p = self.p
        if p.failure_model == "independent":
            if p.mtbf_s > 0:
                for c in self.clusters:
                    for m in c.members:
                        self.push(self.rng.expovariate(1.0 / p.mtbf_s), FAIL, c.idx, m.r, m.gen)
            if p.cluster_mtbf_s > 0:
                for c in self.clusters:
                    self.push(self.rng.expovariate(1.0 / p.cluster_mtbf_s), CLUSTER_FAIL, c.idx, 0, 0)
        elif p.failure_model == "chaos":
            self.push(self.rng.expovariate(1.0 / p.kill_every_s), KILL, 0, 0, 0)
        for t, c, r, step, phase in p.kills:
            if step >= 0:
                self.step_kills[c].append((step, r, phase))
                continue
            if r < 0:
                self.push(t, CLUSTER_FAIL, c, 0, -1)  # token -1: explicit, not rescheduled
            else:
                self.push(t, FAIL, c, r, -1)

    def new_failure(self, t: float, role: str, c: int, r: int, kind: str) -> int:
        fid = len(self.failures)
        self.failures.append({"id": fid, "t": t, "role": role, "cluster": c, "replica": r, "kind": kind})
        return fid

    def role_of(self, c: Cluster, r: int) -> str:
        return "leader" if self.hier and r == c.leader and r in c.active else "non_leader"

    def on_fail(self, t: float, ci: int, r: int, token: int) -> None:
        c = self.clusters[ci]
        m = c.members[r]
        p = self.p
        if token >= 0 and (token != m.gen or p.failure_model != "independent"):
            return
        if token >= 0 and not self.failures_active(t):
            return
        if not m.alive or m.hung or c.state in (S_DONE,):
            return
        hang = p.hang_fraction > 0 and self.rng.random() < p.hang_fraction
        fid = self.new_failure(t, self.role_of(c, r), ci, r, "hang" if hang else "crash")
        self.fail_member(c, r, t, fid, hang)

    def on_cluster_fail(self, t: float, ci: int, _b: int, token: int) -> None:
        c = self.clusters[ci]
        p = self.p
        if token >= 0:
            if p.cluster_mtbf_s > 0:
                self.push(t + self.rng.expovariate(1.0 / p.cluster_mtbf_s), CLUSTER_FAIL, ci, 0, 0)
            if not self.failures_active(t):
                return
        live = [r for r in range(p.replicas) if c.members[r].alive]
        if c.state in (S_DOWN, S_DONE) or not live:
            return
        fid = self.new_failure(t, "cluster", ci, -1, "crash")
        for r in live:
            self.fail_member(c, r, t, fid, hang=False)

    def on_kill(self, t: float, _a: int, _b: int, _t: int) -> None:
        """The chaos command's schedule (chaos.py ChaosMonkey)."""
        p = self.p
        if not self.failures_active(t):
            return
        running = [(c, m) for c in self.clusters for m in c.members if m.alive and not m.hung and c.state not in (S_DOWN, S_DONE)]
        if p.steps and running and min(c.step for c, _ in running) >= int(p.steps * p.stop_kills_at):
            self.kills_stopped = True
            return
        roles = list(p.roles)
        self.rng.shuffle(roles)
        for role in roles:
            cands = self.chaos_candidates(role, running)
            if cands:
                break
        else:
            self.push(t + 1.0, KILL)  # nothing eligible right now (restarting)
            return
        ci, r = self.rng.choice(cands)
        c = self.clusters[ci]
        if role == "cluster":
            fid = self.new_failure(t, "cluster", ci, -1, "crash")
            for rr in range(p.replicas):
                if c.members[rr].alive:
                    self.fail_member(c, rr, t, fid, hang=False)
        else:
            hang = p.hang_fraction > 0 and self.rng.random() < p.hang_fraction
            fid = self.new_failure(t, role, ci, r, "hang" if hang else "crash")
            self.fail_member(c, r, t, fid, hang)
        self.push(t + self.rng.expovariate(1.0 / p.kill_every_s), KILL)

    def chaos_candidates(self, role: str, running: List[Tuple[Cluster, Member]]) -> List[Tuple[int, int]]:
        if role == "leader":
            return [(c.idx, m.r) for c, m in running if self.hier and m.r == c.leader and m.r in c.active]
        if role == "non_leader":
            return [(c.idx, m.r) for c, m in running if not (self.hier and m.r == c.leader and m.r in c.active)]
        whole = [c.idx for c in self.clusters if c.state not in (S_DOWN, S_DONE) and all(m.alive and not m.hung for m in c.members)]
        return [(ci, -1) for ci in whole] if self.hier and len(whole) >= 2 else []

    def fire(self, c: Cluster, t: float, phases: Tuple[str, ...]) -> None:
        """The replayed kills armed for this round (:meth:`arm`) that fall in one of ``phases``."""
        for r, ph in [x for x in c.armed if x[1] in phases]:
            c.armed.remove((r, ph))
            self.kill_at(c, t, r)

    def kill_at(self, c: Cluster, t: float, r: int) -> None:
        """A replayed kill of replica group ``r`` of ``c`` (-1: the whole cluster) at ``t``."""
        self.push(t, CLUSTER_FAIL if r < 0 else FAIL, c.idx, max(r, 0), -1)

    def arm(self, c: Cluster) -> None:
        """At the end of a round's compute (``c.step`` = K): the replayed kills of the round
        ending at K that fell in a sync phase. They fire as the cluster enters that phase
        (engine.py, barrier.py); an outer phase on a round that is not an outer round here
        becomes INNER_REDUCE, and so does INNER_QUORUM with ``sync.inner.early_quorum`` (the
        round's quorum, the victim in it, formed during the last local step: the round's
        collectives fail). Kills still armed when a new round starts fire at once."""
        kills = self.step_kills.get(c.idx)
        if not kills:
            return
        outer = self.is_outer_round(c)
        # match_pace: the simulated rounds need not end where the recorded run's did
        ended = (lambda k: c.step - c.round_len < k <= c.step) if self.p.match_pace else (lambda k: k == c.step)
        for k, r, ph in [x for x in kills if ended(x[0]) and x[2] != "LOCAL"]:
            kills.remove((k, r, ph))
            if ph.startswith(("OUTER", "BROADCAST")) and not outer:
                ph = "INNER_REDUCE"
            elif ph == "INNER_QUORUM" and self.p.early_quorum:
                ph = "INNER_REDUCE"  # the quorum formed during the last local step: the victim is in it
            c.armed.append((r, ph))

    def fail_member(self, c: Cluster, r: int, t: float, fid: int, hang: bool) -> None:
        """Replica group r of cluster c crashes (or hangs) at t."""
        p = self.p
        m = c.members[r]
        self.book(c, t)
        m.gen += 1
        was_active = r in c.active
        if m.joining or not was_active:
            # Waiting to rejoin, or hung (a cluster outage takes it too): nothing of the cluster's is lost.
            if m.hung:
                self.totals["down"] += t - m.down_at
                self.ledger[m.fid]["down"] += t - m.down_at
                m.hung = False
            if m.joining:
                self.totals["wait"] += t - m.back_at
                self.ledger[m.fid]["down"] += t - m.down_at
                m.joining = False
                if r in c.joiners:
                    c.joiners.remove(r)
            self.take_down(c, m, t, fid, hang=False)
            return
        # its own steps since the last inner commit
        if c.state == S_COMPUTE:
            k = int((t - c.round_start) / c.round_step_s + 1e-9)
            partial = t - c.round_start
            self.steps_run += k
            self.steps_discarded += k
            self.lose("own_work", partial, fid)
        else:
            # It finished computing the round; its process has not committed it. Its steps
            # count as discarded (chaos.py's uncommitted_at_death) even where an outer
            # commit already holds its work; only then is the compute not lost.
            self.steps_discarded += c.round_len
            if not (c.state == S_COMMIT and c.outer_outcome == "committed"):
                share = c.round_compute / len(c.active) if c.active else 0.0
                c.round_compute -= share
                self.lose("own_work", share, fid)
        c.active.discard(r)
        c.acc0_sum -= m.acc0
        leader = self.hier and r == c.leader
        if leader:  # its cluster Manager goes with it (a hung one heartbeats until the watchdog)
            self.drop_upload(c, fid, whole=False)  # and an overlapped push's upload (pushes.py)
            self.drop_manager(c, t + (p.hang_watchdog_s if hang else 0.0) + p.heartbeat_s, fid)
        gone_at = t + p.hang_watchdog_s + p.heartbeat_s if hang else t + p.heartbeat_s
        c.blockers[r] = (gone_at, fid)
        self.take_down(c, m, t, fid, hang)
        if not c.active:
            self.cluster_lost(c, t, fid)
            return
        self.disrupt(c, t, fid, hang, leader)

    def take_down(self, c: Cluster, m: Member, t: float, fid: int, hang: bool) -> None:
        m.fid = fid
        m.down_at = t
        if hang:
            m.hung = True
            self.push(t + self.p.hang_watchdog_s, WATCHDOG, c.idx, m.r, m.gen)
        else:
            m.alive = False
            self.push(t + self.p.restart_s, RESTART, c.idx, m.r, m.gen)

    def disrupt(self, c: Cluster, t: float, fid: int, hang: bool, leader: bool) -> None:
        """What a member's failure does to its surviving peers, by the cluster's phase."""
        p = self.p
        if c.state == S_COMPUTE:
            # sync.inner.early_quorum: the round's last local step asked for the quorum
            # (sync/early.py), so a member that dies in it is in the quorum its peers get.
            if p.early_quorum and t >= c.round_start + (c.round_len - 1) * c.round_step_s - 1e-9:
                c.early_broken, c.early_hang = fid, hang
        elif c.state == S_QUORUM:
            self.schedule_quorum(c, t)  # waits for the lighthouse to drop it
        elif c.state == S_SYNC:
            if hang:  # the collective waits for it until the phase timeout
                c.epoch += 1
                self.push(max(t, c.phase_start + p.inner_reduce_s), ABORT, c.idx, fid, c.epoch)
            else:  # its connections close: the others fail at once
                self.abort(c, t, fid)
        elif c.state == S_OUTER:
            fl = self.in_flight
            if leader:
                if fl is not None and c.idx in fl["parts"]:
                    if hang:
                        fl["hung"] = True  # the outer all-reduce cannot complete
                        self.push(max(t, fl["start"] + p.outer_reduce_s), ABORT, c.idx, fid, c.epoch)
                    else:
                        self.fail_outer(t, c.idx, fid)
                        self.abort(c, t, fid)
                else:
                    self.arrived.pop(c.idx, None)
                    if not self.arrived:
                        self.first_arrival = INF
                    self.abort(c, t, fid)
                    self.evaluate_barrier(t)
            else:
                c.broken = True
                c.delay_cause = fid
        elif c.state == S_COMMIT:
            # BROADCAST (the leader hands the outer outcome to its cluster): a death breaks
            # it, so the cluster's inner round fails; an outer commit holding its work stands.
            c.broken = True
            c.delay_cause = fid

    def on_abort(self, t: float, ci: int, fid: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch:
            return
        if c.state == S_OUTER and self.in_flight is not None and ci in self.in_flight["parts"]:
            self.fail_outer(t, ci, fid)
        if c.state in (S_SYNC, S_OUTER):
            self.abort(c, t, fid)

    def abort(self, c: Cluster, t: float, fid: int) -> None:
        """The round failed for the cluster: roll back to the last commit, next round."""
        self.server_holds_push(c)  # a blocking push the server merged stays merged (pushes.py)
        self.book(c, t)
        self.steps_discarded += (len(c.active) - c.round_joiners) * c.round_len
        self.lose("rollback", c.round_compute, fid)
        c.round_compute = 0.0
        c.delay_cause = fid
        self.outstanding.discard(c.idx)
        self.start_round(c, t)
        if self.stop_pending and not self.outstanding:
            self.end = t

    def cluster_lost(self, c: Cluster, t: float, fid: int) -> None:
        """Every replica group of the cluster is down: its uncommitted work is gone (but
        for a blocking push the server merged, pushes.py ``server_holds_push``)."""
        self.server_holds_push(c)
        c.push_again = False  # restarted whole, it adopts at its join round
        self.lose("discarded", c.pending + c.round_compute, fid)
        c.pending = 0.0
        c.round_compute = 0.0
        c.carried_steps = 0
        self.drop_upload(c, fid, whole=True)
        c.epoch += 1
        c.blockers.clear()
        if self.hier:
            self.drop_manager(c, t + self.p.heartbeat_s, fid)
            if self.in_flight is not None and c.idx in self.in_flight["parts"] and c.state == S_OUTER:
                self.fail_outer(t, c.idx, fid)
            elif c.idx in self.arrived:
                del self.arrived[c.idx]
                if not self.arrived:
                    self.first_arrival = INF
            self.outstanding.discard(c.idx)
        c.state = S_DOWN
        c.restart_cause = fid
        c.first_back = INF
        back = [c.members[r].back_at for r in c.joiners if c.members[r].alive]
        if back:  # restarted replica groups already waiting start the cluster afresh
            c.first_back = min(back)
            self.push(max(t, c.first_back + self.p.startup_s), CLUSTER_START, c.idx, 0, c.epoch)
        if self.hier:
            self.evaluate_barrier(t)
        if self.stop_pending and not self.outstanding:
            self.end = t

    def on_watchdog(self, t: float, ci: int, r: int, gen: int) -> None:
        c = self.clusters[ci]
        m = c.members[r]
        if gen != m.gen or not m.hung:
            return
        m.hung = False
        m.alive = False
        self.push(t + self.p.restart_s, RESTART, ci, r, m.gen)

    def on_restart(self, t: float, ci: int, r: int, gen: int) -> None:
        c = self.clusters[ci]
        m = c.members[r]
        p = self.p
        if gen != m.gen or m.alive:
            return
        m.alive = True
        m.back_at = t
        m.gen += 1
        self.totals["down"] += t - m.down_at
        if p.failure_model == "independent" and p.mtbf_s > 0:
            self.push(t + self.rng.expovariate(1.0 / p.mtbf_s), FAIL, ci, r, m.gen)
        if c.state == S_DONE:
            self.book(c, t)
            c.active.add(r)  # idles (booked as wait) until the run ends
            return
        if c.state == S_DOWN:
            # Start-up barrier: the cluster starts when all are back, or startup_s after the first.
            m.joining = True
            c.joiners.append(r)
            if c.first_back == INF:
                c.first_back = t
                self.push(t + p.startup_s, CLUSTER_START, ci, 0, c.epoch)
            if all(mm.alive for mm in c.members):
                self.push(t, CLUSTER_START, ci, 0, c.epoch)
            return
        m.joining = True
        c.joiners.append(r)
        if c.state == S_QUORUM:
            self.schedule_quorum(c, t)

    def on_cluster_start(self, t: float, ci: int, _b: int, epoch: int) -> None:
        """A lost cluster restarts: a new cluster Manager, step 0 and the initial weights until
        its join round takes the global model (hier, once the job has moved on: an outer round
        of weight 0 before its first local step). flat/ddp, where the one "cluster" is the
        whole job: from its last commit."""
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_DOWN:
            return
        back = [r for r in c.joiners if c.members[r].alive]
        if not back:  # they failed again meanwhile: the next one back starts the clock again
            c.first_back = INF
            return
        for r in back:
            m = c.members[r]
            m.joining = False
            self.totals["wait"] += t - m.back_at
            self.ledger[m.fid]["down"] += t - m.down_at
            m.acc0 = 0
        c.joiners = [r for r in c.joiners if r not in back]
        c.active = set(back)
        c.cat_since = t
        if self.hier:
            c.step = 0  # flat/ddp: a total loss resumes from the last commit (as from a checkpoint)
            self.reset_schedule(c, t)  # fresh processes: the default push schedule
        c.pending = 0.0
        c.outer_acc = 0
        c.acc0_sum = 0
        c.base = -1  # derives from the initial weights: weight 0 at its first outer round
        c.stale_cause = c.restart_cause
        c.leader = min(back)
        self.new_manager(c, c.restart_cause)
        c.delay_cause = c.restart_cause
        asynchronous = self.p.asynchronous
        if self.hier and (self.round_no if asynchronous else self.global_step) > 0:
            # Its join round takes the global model before its first local step
            # (sync/outer_round.py join_wanted). Synchronous: an outer round of weight 0, the
            # leader waiting at the global lighthouse for the others' next outer round (if that
            # quorum does not form in time it trains from step 0). Asynchronous: a push of no
            # work; it adopts the newest version and resumes at its furthest push (engine.py adopt).
            c.epoch += 1
            c.outer_join = True
            c.round_compute = 0.0
            c.round_joiners = len(c.active)
            c.broken = False
            c.outer_outcome = None
            c.state = S_OUTER
            c.phase_start = t
            if asynchronous:
                c.push_start = t
                self.enter(c, t, "sync")
                self.push(t + self.p.upload_s, PUSH_UP, c.idx, 0, c.epoch)  # pushes.py on_push_up
            else:
                self.enter(c, t, "wait")
                self.arrive(c, t)
            return
        self.start_round(c, t)
