"""The fair sweep (bench_sweep.py): its statistics on given inputs, and one small sweep end to end.

The end-to-end run checks what does not depend on speed: the target comes from the pilot, each
arm is evaluated at its own sync points, the blocking arm's groups hold one model there, the
compute bound is the bare loop's step time x the steps the arm needed, and the outputs exist.
Figures (seconds, ratios) are recorded in docs/benchmarks.md, not asserted."""

import json
import subprocess
import sys

import pytest

from hier_localsgd.config import load_config
from hier_localsgd.experiments.bench import sync_eval
from hier_localsgd.experiments.bench_sweep import reach, stats, summarize, table
from hier_localsgd.errors import ConfigError


def curve(losses, every):
    return [{"step": i * every, "loss": x, "t": float(i), "slow_bytes": 100.0 * i, "spread": 0.0} for i, x in enumerate(losses)]


def run(arm, seed, losses=(), every=10, failed=False):
    r = {"arm": arm, "wan_gbps": 0.1, "seed": seed, "failed": failed}
    if not failed:
        c = curve(losses, every)
        r.update(curve=c, final_eval_loss=losses[-1], wall_s=9.0, wire=None, reached=reach(c, 2.0))
    return r


def test_statistics_over_seeds_and_the_compute_bound():
    runs = [run("hier", 0, [5, 3, 1.9, 1.5]), run("hier", 1, [5, 2.5, 1.8, 1.6]), run("hier", 2, [5, 1.9, 1.7, 1.4]),
            run("flat", 0, [5, 4, 3, 2.5]), run("flat", 1, [5, 4, 2.0, 1.9]), run("flat", 2, failed=True)]
    pts = {p["arm"]: p for p in summarize(runs, 2.0, bare_s=0.5)}
    h, f = pts["hier"], pts["flat"]
    assert h["steps_to_target"] == {"median": 20, "min": 10, "max": 20, "n": 3, "of": 3}
    assert h["time_to_target_s"]["median"] == 2.0 and h["slow_bytes_to_target"]["max"] == 200.0
    assert h["compute_bound_s"] == 0.5 * 20 and h["compute_bound_fewest_s"] == 0.5 * 10  # fewest: hier seed 2, 10 steps
    assert f["failed"] == 1 and f["runs"] == 3
    assert f["steps_to_target"] == {"median": 20, "min": 20, "max": 20, "n": 1, "of": 2}  # seed 0 never reached 2.0
    assert stats([None, None]) is None
    md = table(list(pts.values()), 2.0)
    assert "(1/2 reached)" in md and "| 1/3 |" in md
    assert h["time_to_target_global_s"] is None and "global model" not in md


def test_an_overlapped_arm_reports_where_its_global_model_reached_the_target():
    """Overlapped arms also evaluate the global model at the merges (curve_global): its steps,
    seconds and WAN bytes to the target are reported beside the live models'."""
    r = run("hier_overlap", 0, [5, 3, 2.2, 1.9], every=10)
    g = curve([5, 2.5, 1.9, 1.7], 10)
    r.update(curve_global=g, reached_global=reach(g, 2.0))
    p = summarize([r], 2.0, bare_s=0.5)[0]
    assert p["steps_to_target"]["median"] == 30 and p["steps_to_target_global"]["median"] == 20
    assert p["time_to_target_global_s"]["median"] == 2.0 and p["slow_bytes_to_target_global"]["median"] == 200.0
    md = table([p], 2.0)
    assert "30 [30, 30]; global model 20 [20, 20]" in md and "3.0 [3.0, 3.0]; global model 2.0 [2.0, 2.0]" in md


def test_each_arm_is_evaluated_at_its_own_sync_points():
    def ev(*over):
        return sync_eval(load_config(["sync.inner.every=5", "sync.outer.every=2", "sync.flat.every=15", *over], validate_for="demo"))

    assert ev("sync.mode=hier") == ["train.eval_every=10", "train.eval_offset=0"]
    # the merge step, and the global model there too (the clusters' live models differ)
    assert ev("sync.mode=hier", "sync.outer.delay=1") == ["train.eval_every=10", "train.eval_offset=5", "train.eval_global=true"]
    assert ev("sync.mode=flat", "sync.flat.delay=5") == ["train.eval_every=15", "train.eval_offset=0"]  # torchft merges at the sync step
    assert ev("sync.mode=ddp") == ["train.eval_every=10", "train.eval_offset=0"]


def test_the_pilot_seed_must_not_be_an_arm_seed():
    with pytest.raises(ConfigError, match="bench.pilot_seed"):
        load_config(["bench.seeds=[0,1000]"], validate_for="demo")
    with pytest.raises(ConfigError, match="bench.links"):
        load_config(["bench.links=fiber"], validate_for="demo")
    with pytest.raises(ConfigError, match=r"bench.sweep_gbps\[1\]"):
        load_config(["bench.sweep_gbps=[1,0]"], validate_for="demo")


@pytest.mark.slow
def test_a_small_sweep_end_to_end(tmp_path):
    over = ["bench.mode=quick", "topology.replicas_per_cluster=1", "bench.sweep_gbps=[0.01]", "bench.arms=[flat_count,hier_overlap]", "bench.seeds=[0]"]
    p = subprocess.run([sys.executable, "-m", "hier_localsgd", "bench", f"run.dir={tmp_path}", *over], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((tmp_path / "bench" / "sweep.json").read_text())
    assert rep["target_loss"] == pytest.approx(rep["pilot"]["final_eval_loss"] + 0.02)
    runs = {r["arm"]: r for r in rep["runs"]}
    flat, ov = runs["flat_count"], runs["hier_overlap"]
    assert [p["step"] for p in flat["curve"]] == list(range(0, rep["steps"] + 1, 10))  # every flat sync (every 10)
    assert [p["step"] for p in ov["curve"]] == [0, *range(5, rep["steps"], 10), rep["steps"]]  # the merges, then the blocking end
    assert all(p["spread"] == 0.0 for p in flat["curve"])  # one model at every flat sync
    assert any(p["spread"] > 0.0 for p in ov["curve"][1:-1])  # merged clusters keep their own progress
    for pt in rep["points"]:
        assert pt["steps_to_target"] is not None, pt
        assert pt["compute_bound_s"] == pytest.approx(rep["bare_step_s"] * pt["steps_to_target"]["median"])
        assert pt["compute_bound_fewest_s"] == pytest.approx(rep["bare_step_s"] * rep["fewest_steps_to_target"])
    md = (tmp_path / "bench" / "sweep.md").read_text()
    assert "| 10 Mbit/s | flat_count |" in md and "| 10 Mbit/s | hier_overlap |" in md
    for png in rep["plots"]:
        assert open(png, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"
