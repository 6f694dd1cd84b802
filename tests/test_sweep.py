"""`hier-localsgd sweep` end to end on a small grid: table, JSON and plot."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_small_sweep_writes_table_json_and_plot(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "hier_localsgd", "sweep", f"run.dir={tmp_path}", "sweep.rates=[0.0,0.1]",
         "sweep.models=[gilbert_elliott]", "sweep.fills=[rescale]", "sweep.modes=[hier]", "sweep.steps=40"],
        capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "sweep"
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    assert [(r["mode"], r["model"], r["fill"], r["rate"]) for r in rows] == [("hier", "none", "zero", 0.0), ("hier", "gilbert_elliott", "rescale", 0.1)]
    lossy = rows[1]
    assert lossy["observed_loss_rate"] is not None and 0.0 < lossy["observed_loss_rate"] < 0.3
    assert all(r["consistent"] for r in rows)  # per-sender loss with rescale keeps replicas identical
    assert all(r["excess_loss"] < r["excess_loss_start"] for r in rows)
    md = (out / "sweep.md").read_text()
    assert md.count("\n| hier |") == 2
    png = (out / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
