"""A short `hier-localsgd chaos` run in the suite: real kills, restarts, heals, a report."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_short_chaos_run_recovers_every_kill_and_reports(tmp_path):
    report_path = tmp_path / "report.json"
    p = subprocess.run(
        [sys.executable, "-m", "hier_localsgd", "chaos", f"run.dir={tmp_path}", f"chaos.report={report_path}",
         "model=tiny", "train.batch_size=16", "train.min_step_time_s=0.05", "train.steps=240",
         "sync.inner.every=5", "sync.outer.every=2", "sync.min_clusters=1",
         "chaos.kill_every_s=5", "chaos.seed=3", "chaos.restart_delay_s=1",
         "lighthouse.heartbeat_timeout_ms=2000", "lighthouse.quorum_tick_ms=50", "lighthouse.join_timeout_ms=10000",
         "timeouts.inner_quorum=30", "timeouts.outer_quorum=30", "timeouts.inner_reduce=30", "timeouts.outer_reduce=30",
         "timeouts.broadcast=30"],
        capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(report_path.read_text())
    for key in ("kills", "recovered", "hangs", "time_to_next_commit_s", "time_to_heal_s", "steps_run",
                "steps_discarded", "efficiency", "consistent", "final_eval_loss", "baseline"):
        assert key in r, key
    assert len(r["kills"]) >= 2, r["kills"]
    assert all(k["phase"] and k["role"] in ("non_leader", "leader", "cluster") for k in r["kills"])
    assert r["recovered"] == len(r["kills"])
    assert r["hangs"] == 0, r["hangs_detail"]
    assert r["consistent"] is True
    assert all(t is not None and t <= 2.0 + 30.0 for t in r["time_to_next_commit_s"])
    assert all(t is not None for t in r["time_to_heal_s"])
    assert 0 < r["steps_discarded"] < r["steps_run"] and 0.5 < r["efficiency"] < 1.0
    assert abs(r["final_eval_loss"] / r["baseline"]["final_eval_loss"] - 1) < 0.15
    assert "chaos:" in p.stdout and "efficiency" in p.stdout
