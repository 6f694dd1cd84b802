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
