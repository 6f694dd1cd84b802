"""The global lighthouse's outer barrier (hier): leaders arrive, the outer quorum forms by
torchft's rule, the outer round runs, commits or fails (the model: engine.py's docstring).

:class:`OuterBarrier` is mixed into :class:`~hier_localsgd.tools.simulate.engine.Simulation`
and works on its state (``self.clusters``, ``self.arrived``, the event queue, the ledger).
"""

from __future__ import annotations

from hier_localsgd.tools.plan.network import outer_round_bytes
from hier_localsgd.tools.simulate.config import INF
from hier_localsgd.tools.simulate.state import BARRIER, COMMIT, OUTER_DONE, OUTER_TIMEOUT, S_COMMIT, S_OUTER, Cluster, lighthouse_forms_at


class OuterBarrier:
    """The outer level's events and bookkeeping; a mixin of ``Simulation``."""

    def arrive(self, c: Cluster, t: float) -> None:
        self.arrived[c.idx] = t
        self.first_arrival = min(self.first_arrival, t)
        self.push(t + self.p.outer_quorum_s, OUTER_TIMEOUT, c.idx, 0, c.epoch)
        self.evaluate_barrier(t)

    def on_outer_timeout(self, t: float, ci: int, _b: int, epoch: int) -> None:
        """OUTER_QUORUM timed out: the leader gives up this outer round (INNER_ONLY); the
        cluster commits its inner round and goes on. It is stale if the others committed one."""
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_OUTER or ci not in self.arrived:
            return
        del self.arrived[ci]
        if not self.arrived:
            self.first_arrival = INF
        c.outer_outcome = "inner_only"
        c.state = S_COMMIT
        self.fire(c, t, ("OUTER_REDUCE", "OUTER_COMMIT", "BROADCAST"))  # the header's broadcast; no outer round ran
        self.push(t + self.p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)
        self.evaluate_barrier(t)

    def new_manager(self, c: Cluster, cause: int) -> None:
        c.mgr_id = self.next_mgr_id
        self.next_mgr_id += 1
        c.mgr_new = True
        c.mgr_cause = cause

    def drop_manager(self, c: Cluster, gone_at: float, cause: int) -> None:
        """The cluster's Manager stops (dies, or is shut down): it counts until ``gone_at``."""
        if c.mgr_id >= 0:
            self.lingering[c.mgr_id] = (gone_at, cause)
            c.mgr_id = -1

    def evaluate_barrier(self, t: float) -> None:
        """The global lighthouse: form the outer quorum of the arrived leaders now, or
        schedule the next look (a heartbeat running out, the join timeout)."""
        if self.in_flight is not None or not self.arrived:
            return
        p = self.p
        for k in [k for k, (g, _) in self.lingering.items() if g <= t]:
            del self.lingering[k]
        joined = {self.clusters[ci].mgr_id for ci in self.arrived}
        waiting = [INF for c in self.clusters if c.mgr_id >= 0 and c.idx not in self.arrived]
        waiting += [g for g, _ in self.lingering.values()]
        at = lighthouse_forms_at(t, self.first_arrival, len(joined), waiting, p.join_s,
                                 fast=self.prev_quorum <= joined, min_joined=p.min_clusters)
        if at <= t:
            self.form_outer(t)
        elif at < INF:
            self.barrier_gen += 1
            self.push(at, BARRIER, 0, 0, self.barrier_gen)

    def on_barrier(self, t: float, _a: int, _b: int, gen: int) -> None:
        if gen == self.barrier_gen:
            self.evaluate_barrier(t)

    def form_outer(self, t: float) -> None:
        p = self.p
        parts = sorted(self.arrived)
        # who made the early arrivals wait: the last to arrive, or a Manager whose heartbeat ran out
        last = max(parts, key=lambda ci: self.arrived[ci])
        cause = self.clusters[last].delay_cause
        if self.arrived[last] < t - 1e-12:
            gone = [(g, fid) for g, fid in self.lingering.values() if g <= t + 1e-12]
            cause = max(gone)[1] if gone else -1
        for ci in parts:
            c = self.clusters[ci]
            wait = t - self.arrived[ci]
            if wait > 1e-12:
                # a cluster out of step because it restarted waits for the others' schedule: its own failure's cost
                k = c.stale_cause if (c.base != self.round_no and c.stale_cause >= 0) else cause
                if k >= 0:
                    self.ledger[k]["stall"] += wait * len(c.active)
                else:
                    self.unattributed_stall += wait * len(c.active)
        heal_needed = [ci for ci in parts if self.clusters[ci].mgr_new or self.clusters[ci].base != self.round_no]
        for ci in parts:
            c = self.clusters[ci]
            c.outer_weight = 1.0 if c.base == self.round_no else 0.0
            if c.outer_weight == 0 and c.stale_cause < 0:
                c.stale_cause = c.delay_cause
            self.enter(c, t, "sync")
            c.phase_start = t
            c.delay_cause = -1  # accounted for up to this barrier
        ids = {self.clusters[ci].mgr_id for ci in parts}
        changed = ids != self.prev_quorum
        for ci in parts:
            self.clusters[ci].mgr_new = False
        heal = p.outer_heal_s if heal_needed else 0.0
        reconf = p.reconfigure_s if changed else 0.0
        if heal + reconf > 0:
            hc = self.clusters[heal_needed[0]] if heal_needed else None
            fid = (hc.stale_cause if hc.stale_cause >= 0 else hc.mgr_cause) if hc else -1
            members = sum(len(self.clusters[ci].active) for ci in parts)
            if fid >= 0:
                self.ledger[fid]["stall"] += (heal + reconf) * members
            else:
                self.unattributed_stall += (heal + reconf) * members
        self.slow_bytes += p.ranks * (len(heal_needed) * p.outer_heal_bytes + len(parts) * outer_round_bytes(p.sync_bytes, len(parts), p.compression))
        self.prev_quorum = ids
        self.arrived.clear()
        self.first_arrival = INF
        self.barrier_gen += 1
        self.in_flight = {"parts": parts, "ids": ids, "start": t, "gen": self.barrier_gen}
        for ci in parts:
            self.fire(self.clusters[ci], t, ("OUTER_REDUCE", "OUTER_COMMIT"))
        self.push(t + heal + reconf + p.outer_time(len(parts)), OUTER_DONE, 0, 0, self.barrier_gen)

    def on_outer_done(self, t: float, _a: int, _b: int, gen: int) -> None:
        fl = self.in_flight
        if fl is None or fl["gen"] != gen or fl.get("hung"):
            return
        self.in_flight = None
        parts = [ci for ci in fl["parts"] if self.clusters[ci].state == S_OUTER]
        weight = sum(self.clusters[ci].outer_weight for ci in parts)
        self.global_step = max([self.clusters[ci].step for ci in parts if self.clusters[ci].outer_weight > 0] + [self.global_step])
        if weight > 0:
            self.round_no += 1
            # the round's share: the clusters whose full periods it merged (target.py)
            self.progress.step(self.round_no, sum(1 for ci in parts if self.clusters[ci].outer_weight > 0) / self.p.clusters)
        self.outer_rounds += 1
        horizon = self.p.steps == 0 and t >= self.p.duration_s
        for ci in parts:
            c = self.clusters[ci]
            c.outer_outcome = "committed"
            c.state = S_COMMIT
            self.outstanding.add(ci)
            self.fire(c, t, ("BROADCAST",))  # before the commit's event: a kill at the same instant comes first
            self.push(t + self.p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)
        if horizon:
            self.stop_pending = True
        self.evaluate_barrier(t)

    def fail_outer(self, t: float, dead: int, fid: int) -> None:
        """The outer round in flight failed (a participant's leader is gone): the others'
        inner rounds commit (INNER_ONLY); their work waits for the next outer round."""
        fl = self.in_flight
        assert fl is not None
        self.in_flight = None
        self.failed_outer += 1
        self.prev_quorum = set(fl["ids"])
        for ci in fl["parts"]:
            c = self.clusters[ci]
            if ci == dead or c.state != S_OUTER:
                continue
            self.ledger[fid]["stall"] += (t - fl["start"]) * len(c.active)
            c.outer_outcome = "inner_only"
            c.state = S_COMMIT
            c.delay_cause = fid
            self.fire(c, t, ("OUTER_REDUCE", "OUTER_COMMIT", "BROADCAST"))
            self.push(t + self.p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)
        self.evaluate_barrier(t)
