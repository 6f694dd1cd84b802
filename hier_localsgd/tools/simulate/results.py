"""A simulation's figures at its end (:func:`finish`) and the goodput it would have without
failures (:func:`expected_goodput`); the run itself is engine.py's."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Dict

from hier_localsgd.tools.plan.network import cluster_paces, comm_fraction, paced_shares
from hier_localsgd.tools.simulate.params import SimParams
from hier_localsgd.tools.simulate.state import S_COMPUTE, S_DOWN, RunResult

if TYPE_CHECKING:
    from hier_localsgd.tools.simulate.engine import Simulation


def finish(sim: "Simulation") -> RunResult:
    """Closes a run's books at its end (the work in flight, the members still down or
    joining, the balance of every replica-group-second, the losses per failure and role)
    into its :class:`RunResult`."""
    p = sim.p
    end = sim.end if sim.end is not None else sim.now
    uncommitted = 0.0
    for c in sim.clusters:
        if c.state != S_DOWN:
            sim.book(c, end)
            if c.state == S_COMPUTE:
                # the round in progress: computed so far, not committed
                uncommitted += len(c.active) * max(0.0, end - c.round_start)
            else:
                uncommitted += c.round_compute
            uncommitted += c.pending
            if c.flight is not None and not c.flight["arrived"]:  # not at the server yet
                uncommitted += c.flight["work"]
        for m in c.members:
            if not m.alive:
                sim.totals["down"] += end - m.down_at
                sim.ledger[m.fid]["down"] += end - m.down_at
            elif m.hung:
                sim.totals["down"] += end - m.down_at
                sim.ledger[m.fid]["down"] += end - m.down_at
            elif m.joining:
                sim.totals["wait"] += end - m.back_at
                sim.ledger[m.fid]["down"] += end - m.down_at
    capacity = p.clusters * p.replicas * end
    compute = sim.totals["compute"]
    balance = capacity - (compute + sim.totals["sync"] + sim.totals["wait"] + sim.totals["down"])
    balance_compute = compute - (sim.committed + sum(sim.lost.values()) + uncommitted)
    by_role: Dict[str, Dict[str, float]] = {}
    for f in sim.failures:
        lg = sim.ledger.get(f["id"], {})
        f["lost_replica_s"] = {k: v for k, v in lg.items()}
        f["lost_replica_s_total"] = sum(lg.values())
        agg = by_role.setdefault(f["role"], defaultdict(float))
        agg["count"] += 1
        for k, v in lg.items():
            agg[k] += v
        agg["total"] += sum(lg.values())
    for role, agg in by_role.items():
        n = agg["count"]
        by_role[role] = {"count": n, **{k: v / n for k, v in agg.items() if k != "count"}}
    sync = p.no_failure_sync_per_step()
    slow = sim.slow_bytes
    return RunResult(
        seed=sim.seed, end_s=end, capacity=capacity,
        goodput=sim.committed / capacity if capacity else 0.0,
        expected_no_failure_goodput=expected_goodput(p, sync),
        committed=sim.committed, compute=compute, lost=dict(sim.lost), uncommitted_at_end=uncommitted,
        sync=sim.totals["sync"], wait=sim.totals["wait"], down=sim.totals["down"],
        balance_error=max(abs(balance), abs(balance_compute)) / capacity if capacity else 0.0,
        failures=sim.failures, by_role=by_role, unattributed_stall=sim.unattributed_stall,
        slow_link_bytes=slow, steps_run=sim.steps_run, steps_discarded=sim.steps_discarded,
        efficiency=(sim.steps_run - sim.steps_discarded) / sim.steps_run if sim.steps_run else None,
        outer_rounds=sim.outer_rounds, failed_outer_rounds=sim.failed_outer,
        inner_rounds=sum(c.inner_rounds for c in sim.clusters), final_step=max(c.step for c in sim.clusters),
        truncated=sim.truncated, cluster_end_s=tuple(sim.cluster_end), target_rounds=p.target_rounds, target_s=sim.progress.reached_at,
        progress_rounds=sim.progress.rounds,
    )


def expected_goodput(p: SimParams, sync_per_step: float) -> float:
    """Goodput without failures: ``1 - comm_fraction`` (the planner's); with clusters of
    different speeds and the synchronous outer level, every cluster's steps at the slowest's
    pace: the mean over clusters of its compute per step over ``slowest step + sync``. With
    the asynchronous outer level each cluster keeps its own pace: over a fixed duration the
    mean of ``own step / (own step + sync)``; over a fixed number of steps the faster ones
    then idle until the slowest finishes, which gives the synchronous figure again."""
    if not p.speeds or len(set(p.speeds)) == 1 and p.speeds[0] == 1.0:
        return 1.0 - comm_fraction(p.step_s, sync_per_step)
    paces = cluster_paces(p.step_s, p.speeds, sync_per_step, p.asynchronous and p.steps == 0)
    return sum(paced_shares(p.step_s, p.speeds, paces)) / p.clusters
