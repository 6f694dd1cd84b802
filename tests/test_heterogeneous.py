"""Heterogeneous clusters (``topology.cluster_speed``, issue #33 §3) on real processes.

Each process pads its steps to ``max(compute, train.min_step_time_s) / speed`` of its own
cluster; its status and result carry its pace (steps, loop seconds, seconds inside sync
rounds), which the dashboard shows per cluster. How much the synchronous outer level costs
the fast cluster is measured by benchmarks/heterogeneous.py (docs/benchmarks.md); here only
a floor that padding guarantees: the fast cluster's leader waits for the slow one.
"""

from __future__ import annotations

import pytest

from hier_localsgd.sync.sections import padded_step_s
from hier_localsgd.tools.dashboard.state import read_state
from tests.harness import logs_tail, run_job


def test_a_steps_duration_is_the_compute_at_least_the_minimum_over_the_speed():
    assert padded_step_s(0.01, 0.05, 1.0) == 0.05
    assert padded_step_s(0.01, 0.05, 0.5) == 0.1
    assert padded_step_s(0.2, 0.05, 0.5) == 0.4  # a step slower than the minimum: its own time, scaled
    assert padded_step_s(0.02, 0.0, 0.25) == 0.08


@pytest.mark.slow
def test_a_half_speed_clusters_steps_last_twice_the_minimum_and_every_group_reports_its_pace(tmp_path):
    run = run_job(tmp_path, ["topology.cluster_speed=[1.0,0.5]", "train.min_step_time_s=0.05", "train.steps=30",
                             "sync.inner.every=5", "sync.outer.every=2"])
    assert all(c == 0 for c in run.codes.values()) and run.summary["consistent"], logs_tail(run)
    results = {k: run.job.result(k) for k in run.job.keys()}
    for (c, r), res in results.items():
        assert res["steps"] == 30 and res["loop_steps"] == 30 and res["local_steps_timed"] > 0, res
        # A step without a round lasts at least its padded time (a sleep): 0.05 s, 0.1 s at half speed.
        assert res["local_step_s"] >= (0.05 if c == 0 else 0.1), (c, r, res["local_step_s"])
        assert 0 <= res["sync_s"] < res["loop_s"] and res["loop_s"] >= 30 * (0.05 if c == 0 else 0.1), res
    state = read_state(tmp_path)
    for cluster in state["clusters"]:
        assert cluster["step_rate"] is not None and 0 < cluster["step_rate"] and 0 <= cluster["sync_share"] <= 1, cluster
    # The fast cluster's leader waits in the global quorums of steps 20 and 30 for the slow
    # one's 10 steps, at least 0.05 s longer each (padding is a sleep; a loaded machine only
    # widens the gap): about 0.5 s each; the first round's depends on the clusters' start.
    # The slow leader, last to ask, waits only for the quorum to form.
    waited = {c: max((run.job.last_status((c, r)) or {}).get("outer_wait_s") or 0.0 for r in (0, 1)) for c in (0, 1)}
    assert waited[0] >= 0.6 and waited[0] > waited[1] + 0.3, waited
    c0, c1 = state["clusters"]
    assert c0["wait_share"] > c1["wait_share"], (c0["wait_share"], c1["wait_share"])
