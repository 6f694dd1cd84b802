"""`hier-localsgd bench` quick mode end to end: every arm runs; outputs have the right shape.

Speed and byte ratios are measured and recorded in docs/benchmarks.md, not asserted here.
"""

import json
import subprocess
import sys

import pytest

from hier_localsgd.experiments.bench import flat_budget_every

pytestmark = pytest.mark.slow


def test_flat_budget_matches_the_hierarchys_slow_link_bytes():
    # 2 clusters x 2 groups: a flat sync crosses the WAN with 2 * 2(4-1)/4 = 3 models,
    # an outer round with 2 * 2(2-1)/2 = 2: the flat arm may sync 1.5x less often.
    assert flat_budget_every(2, 2, 30) == 45
    assert flat_budget_every(4, 1, 30) == 30  # one group per cluster: the same ring
    assert flat_budget_every(1, 4, 30) == 30  # a single cluster has no WAN hops


def test_the_asynchronous_arms_curve_is_in_training_time_with_the_slow_bytes_so_far():
    """hier_async: clusters reach a step at different times; the curve is every evaluation
    in the order of training time (its start and evaluations before it taken out), with the
    job's slow bytes at each group's latest evaluation (by hand)."""
    from hier_localsgd.experiments.bench import _time_curve, to_target

    def ev(t, step, loss, outer, eval_s=1.0):
        return {"t": t, "kind": "eval", "step": step, "loss": loss, "eval_s": eval_s, "bytes": {"inner": 0, "outer": outer}}

    start = {"t": 100.0, "kind": "phase", "src": "START", "dst": "LOCAL"}
    events = {(0, 0): [start, ev(100.0, 0, 5.0, 0), ev(111.0, 20, 3.0, 1000), ev(122.0, 40, 2.0, 2000)],  # fast: 10 s per 20 steps
              (1, 0): [start, ev(100.0, 0, 5.0, 0), ev(121.5, 20, 2.5, 1000)]}  # half speed: about 20 s per 20 steps
    curve = _time_curve("hier", events, 2, 1)
    assert [(p["t"], p["step"], p["loss"], p["slow_bytes"]) for p in curve] == [
        (0.0, 0, 5.0, 0.0), (0.0, 0, 5.0, 0.0), (9.0, 20, 3.0, 1000.0), (19.0, 40, 2.0, 2000.0), (19.5, 20, 2.5, 3000.0)]
    assert to_target(curve, 2.5) == (19.0, 2000.0)  # cluster 0 got there first
    # The global version each group last adopted (train.eval_global) is its own curve; its
    # evaluation time is training time taken out too.
    g = {"t": 121.6, "kind": "eval_global", "step": 20, "loss": 2.2, "eval_s": 0.5, "bytes": {"inner": 0, "outer": 1000}}
    events[(1, 0)].append(g)
    assert [(pytest.approx(p["t"]), p["loss"]) for p in _time_curve("hier", events, 2, 1, kind="eval_global")] == [(19.1, 2.2)]  # 121.6 - 100 - 2.5 s of evals
    assert [p["loss"] for p in _time_curve("hier", events, 2, 1)] == [5.0, 5.0, 3.0, 2.0, 2.5]


def test_the_asynchronous_arm_also_evaluates_the_global_model():
    """Clusters on matched paces push off the hier grid, where the live model is the
    global version plus the cluster's steps since: the arm evaluates the global model too."""
    from hier_localsgd.config import load_config
    from hier_localsgd.experiments.bench import sync_eval

    assert "train.eval_global=true" in sync_eval(load_config(["sync.mode=hier", "sync.async_outer.enabled=true"], validate_for="demo"))
    assert "train.eval_global=true" not in sync_eval(load_config(["sync.mode=hier"], validate_for="demo"))


@pytest.mark.timeout(900)  # as the bench subprocess below: 189 s, and 290 s under CI's heaviest load
def test_quick_bench_runs_every_arm_and_writes_table_json_and_plots(tmp_path):
    p = subprocess.run([sys.executable, "-m", "hier_localsgd", "bench", f"run.dir={tmp_path}", "bench.mode=quick"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "bench"
    rep = json.loads((out / "bench.json").read_text())
    arms = {a["arm"]: a for a in rep["arms"]}
    assert set(arms) == {"ddp", "flat_budget", "flat_count", "hier"}
    for a in arms.values():
        assert not a.get("failed") and a["consistent"] is True
        for key in ("wall_s", "slow_link_bytes", "fast_link_bytes", "final_eval_loss", "excess_loss", "time_to_target_s", "slow_bytes_to_target", "curve", "sync"):
            assert key in a, (a["arm"], key)
        assert a["curve"] and a["curve"][0]["step"] == 0 and a["curve"][-1]["step"] == rep["steps"]
        assert all(s is None or s["ratio"] >= 0.99 for s in a["sync"].values())  # never faster than the emulated bound
    assert set(arms["hier"]["sync"]) == {"inner", "outer"}
    assert arms["ddp"]["slow_link_bytes"] > arms["hier"]["slow_link_bytes"]
    assert rep["target_loss"] == pytest.approx(arms["ddp"]["final_eval_loss"] + 0.02)
    assert rep["bare_step_s"] > 0 and rep["nonsync_step_overhead"] is not None
    assert len(rep["goals"]) >= 5
    md = (out / "bench.md").read_text()
    assert all(f"| {a} |" in md for a in arms)
    for png in rep["plots"]:
        data = open(png, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_sync_ratio_counts_a_compressed_round_and_bounds_each_collective_through_tbf():
    """bench.sync_ratio on link stats written by hand: an all-reduce round and a compressed
    round (all-to-all + all-gather), per collective the larger of its sent bytes through tbf
    (stats.sent_per_rank) and the latency floor the emulation slept; without tbf the
    emulation's own bound."""
    from hier_localsgd.core.links.stats import sent_per_rank
    from hier_localsgd.experiments.bench import sync_ratio
    from hier_localsgd.launch.netns import tbf_transfer_s

    rate = 10e6
    S = 4_000_000  # a compressed round's all-to-all input; its all-gather's input is one row of it
    compressed = {"link": {"outer": {"calls": {"alltoall/payload": 2, "allgather/payload": 2, "allreduce/control": 5},
                                     "tensor_bytes": {"alltoall/payload": 2 * S, "allgather/payload": S, "allreduce/control": 40},
                                     "seconds": {"alltoall/payload": 4.0, "allgather/payload": 4.2, "allreduce/control": 9.0},
                                     "bound_seconds": {"alltoall/payload": 0.04, "allgather/payload": 0.04, "allreduce/control": 0.2}}}}
    assert sent_per_rank("alltoall", S, 2) == S / 2 and sent_per_rank("allgather", S / 2, 2) == S / 2
    r = sync_ratio([compressed], "outer", 2, lambda sent: tbf_transfer_s(sent, rate))
    per_round = 2 * tbf_transfer_s(S / 2, rate)  # each collective sends S/2 through tbf (bucket first)
    assert r["calls"] == 2 and r["measured_s"] == pytest.approx(4.1) and r["bound_s"] == pytest.approx(per_round)
    assert r["ratio"] == pytest.approx(8.2 / (2 * per_round))
    # Without tbf (emulated links): the emulation's bound, control traffic left out.
    assert sync_ratio([compressed], "outer", 2)["bound_s"] == pytest.approx(0.04)
    # A latency floor longer than the bytes' time through tbf is the bound.
    ring = {"link": {"flat": {"calls": {"allreduce/payload": 3}, "tensor_bytes": {"allreduce/payload": 3 * 1000},
                              "seconds": {"allreduce/payload": 0.4}, "bound_seconds": {"allreduce/payload": 0.36}}}}
    assert sync_ratio([ring], "flat", 4, lambda sent: tbf_transfer_s(sent, rate))["bound_s"] == pytest.approx(0.12)
    assert sync_ratio([ring], "outer", 4) is None


def test_a_round_is_timed_from_its_last_members_arrival_where_the_calls_line_up():
    """bench.after_last_arrival on spans written by hand: two leaders' compressed rounds (an
    all-to-all and an all-gather each); the second leader arrives 0.6 s and 0.1 s late. A
    member's own clock holds its wait for the late one; from the last arrival only the
    exchange is left. Calls that do not line up (a member made fewer) give no figure."""
    from hier_localsgd.experiments.bench import after_last_arrival, sync_ratio

    def leader(cluster, a2a, ag):
        secs = {"alltoall/payload": sum(e - s for s, e in a2a), "allgather/payload": sum(e - s for s, e in ag)}
        return {"cluster": cluster, "link": {"outer": {
            "calls": {"alltoall/payload": len(a2a), "allgather/payload": len(ag)},
            "tensor_bytes": {"alltoall/payload": 2000 * len(a2a), "allgather/payload": 1000 * len(ag)},
            "seconds": secs, "bound_seconds": {"alltoall/payload": 0.05 * len(a2a), "allgather/payload": 0.05 * len(ag)},
            "spans": {"alltoall/payload": a2a, "allgather/payload": ag}}}}

    a = leader(0, [[10.0, 10.7], [20.0, 20.2]], [[10.7, 10.8], [20.2, 20.3]])
    b = leader(1, [[10.6, 10.7], [20.1, 20.2]], [[10.7, 10.8], [20.2, 20.3]])
    late = after_last_arrival([a, b], "outer")
    # round 1: 0.1 + 0.1 after the last arrival, skew 0.6; round 2: 0.1 + 0.1, skew 0.1
    assert late["rounds"] == 2 and late["round_s"] == pytest.approx(0.2) and late["skew_s"] == pytest.approx(0.35)
    r = sync_ratio([a, b], "outer", 2)
    assert r["bound_s"] == pytest.approx(0.1) and r["measured_s"] == pytest.approx((1.1 + 0.4) / 4)  # a: 0.9 + 0.2 s, b: 0.2 + 0.2 s
    assert r["after_arrival_s"] == pytest.approx(0.2) and r["after_arrival_ratio"] == pytest.approx(2.0)
    b_short = leader(1, [[10.6, 10.7]], [[10.7, 10.8]])
    assert after_last_arrival([a, b_short], "outer") is None and "after_arrival_s" not in sync_ratio([a, b_short], "outer", 2)
    assert after_last_arrival([a], "outer") is None  # one member: nothing to line up
    # inner: one group per cluster, never lined up across clusters
    inner = [{"cluster": c, "link": {"inner": {"spans": {"allreduce/payload": [[1.0 + c, 1.5 + c]]}}}} for c in (0, 1)]
    assert after_last_arrival(inner, "inner") is None


def test_a_users_setting_wins_over_the_workloads_own(tmp_path):
    """The quick workload pads steps to 0.02 s; a user's train.min_step_time_s (or model) is
    what every arm, the bare loop and the chaos arm run with, and the workload's other
    settings stay."""
    from hier_localsgd.config import load_config
    from hier_localsgd.experiments.bench import prepare

    over = [f"run.dir={tmp_path}", "bench.mode=quick", "train.min_step_time_s=0.1"]
    _, _, _, base = prepare(load_config(over, validate_for="demo"), over)
    cfg = load_config(base, validate_for="demo")
    assert cfg.train.min_step_time_s == 0.1 and "train.min_step_time_s=0.02" not in base
    assert cfg.model.name == "tiny" and cfg.train.batch_size == 16  # the workload's, not given
