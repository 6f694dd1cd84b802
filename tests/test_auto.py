"""sync.outer.auto (experiments/auto.py, issue #29 §3): the link fit, the choice as a function
of the logged inputs, and a real demo that measures, picks, logs, applies and shows it."""

import json
import subprocess
import sys
from dataclasses import asdict, replace

import pytest

from hier_localsgd import costs
from hier_localsgd.experiments.auto import AutoInputs, choose, fit_link, replay
from hier_localsgd.tools.dashboard.state import read_state
from hier_localsgd.tools.plan.network import OuterVariant


@pytest.mark.parametrize("clusters", [2, 4])
def test_the_link_fit_recovers_rate_and_latency_of_the_ring_model(clusters):
    rate, lat = 12.5e6, 0.02  # 100 Mbit/s, 20 ms one way
    small, large = 4096, 8 << 20
    t = [costs.allreduce_time(s, clusters, lat, rate) for s in (small, large)]
    got_rate, got_lat = fit_link((small, t[0]), (large, t[1]), clusters)
    assert got_rate == pytest.approx(rate, rel=1e-9)
    assert got_lat == pytest.approx(lat, rel=1e-9)
    with pytest.raises(ValueError, match="not slower"):
        fit_link((small, t[1]), (large, t[0]), clusters)


# The debugmodel's fp32 model (24.65 MB), 2 clusters x 2 groups, H 10/3, a 100 ms step, 300 steps.
BASE = AutoInputs(clusters=2, replicas=2, h_inner=10, h_outer=3, sync_bytes=24.65e6, step_s=0.1,
                  wan_bandwidth_Bps=0.0, wan_latency_s=0.02, lan_bandwidth_Bps=1.25e9, lan_latency_s=1e-4,
                  round_overhead_s=0.0, base=asdict(OuterVariant()), steps=300)


@pytest.mark.parametrize("mbit, latency_s, expect", [
    (100_000, 0.001, ("none", 0, 1)),  # the fp32 round takes ~4 ms: blocking costs under 1 %
    # fp32's ~0.24 s round hides behind one inner round but its merge lags 10 of 300 steps
    # (+3.3 %); blocking int8 exposes 4.3 ms per step (+4.2 %): equal within 1 %, and less stale
    (1000, 0.02, ("int8", 0, 1)),
    # fp32 (~20 s) and int8 (~5 s) outlast even 2 inner rounds (2 s); topk2's ~0.2 s hides
    # behind one: twice the steps (plan.topk2_step_cost), and still the least time
    (10, 0.02, ("topk2", 1, 1)),
    (1, 0.02, ("topk2", 2, 1)),  # topk2's ~1.8 s round needs two inner rounds to hide
])
def test_the_choice_follows_the_link_as_the_planners_model_says(mbit, latency_s, expect):
    got = choose(replace(BASE, wan_bandwidth_Bps=mbit * 1e6 / 8, wan_latency_s=latency_s))
    p = got["pick"]
    assert (p["compression"], p["delay"], p["fragments"]) == expect, p
    least = min(r["time_factor"] for r in got["rows"])
    assert p["time_factor"] <= least * 1.01
    # nothing less stale is as quick within the 1 % tolerance
    assert not [r for r in got["rows"] if r["delay"] < p["delay"] and r["time_factor"] <= least * 1.01]
    assert got["overrides"][:3] == [f"sync.outer.compression={expect[0]}", f"sync.outer.delay={expect[1]}",
                                    f"sync.outer.fragments={expect[2]}"]
    # the lag counts over the run: over a run 100x longer it weighs less, so the pick is never less overlapped
    long = choose(replace(BASE, wan_bandwidth_Bps=mbit * 1e6 / 8, wan_latency_s=latency_s, steps=30_000))["pick"]
    assert long["delay"] >= p["delay"]
    assert long["time_factor"] <= p["time_factor"]


def test_a_variant_the_config_refuses_is_never_picked_and_the_overrides_name_the_configuration():
    free = choose(replace(BASE, wan_bandwidth_Bps=10e6 / 8))
    assert free["pick"]["compression"] == "topk2"
    # Over a lossy outer link the config refuses topk2: the next best is picked instead.
    lossy = choose(replace(BASE, wan_bandwidth_Bps=10e6 / 8, refused=[["topk2", d, f] for d in range(3) for f in (1, 3)]))
    assert lossy["pick"]["compression"] != "topk2"
    assert all(r["compression"] != "topk2" for r in lossy["rows"])
    assert lossy["overrides"][-1] == "sync.outer.auto=false"  # every process checks the picked configuration
    blocking = choose(replace(BASE, wan_bandwidth_Bps=100e9 / 8, wan_latency_s=0.001, eager=True))
    assert blocking["pick"]["delay"] == 0 and "sync.outer.eager=false" in blocking["overrides"]


@pytest.mark.slow
def test_a_demo_with_auto_measures_picks_logs_applies_and_shows_the_choice(tmp_path):
    """The real launcher: probes over the emulated 10 Mbit/s 20 ms WAN and bare loops, picks,
    writes auto.json, passes the pick to every process; the choice replays from the log."""
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "hier_localsgd", "demo", "model=tiny", "train.steps=40", "sync.outer.auto=true",
         "sync.outer.every=2", "sync.inner.every=5", "demo.dashboard=false", "links.outer.bandwidth_gbps=0.01",
         "links.outer.latency_ms=20", f"run.dir={run_dir}"],
        capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec = json.loads((run_dir / "auto.json").read_text())
    inp = rec["inputs"]
    # Measured on the job's path: the emulated WAN's rate and latency within the collective's overhead.
    assert inp["wan_bandwidth_Bps"] == pytest.approx(0.01e9 / 8, rel=0.25), rec["wan_probe"]
    # The latency probe's 4 KiB all-reduce adds the collective's own time (more on a loaded machine).
    assert 0.015 <= inp["wan_latency_s"] <= 0.05, rec["wan_probe"]
    assert inp["step_s"] > 0 and inp["sync_bytes"] > 0
    assert [line for line in p.stdout.splitlines() if line.startswith("auto: ")], p.stdout[-2000:]
    assert replay(run_dir / "auto.json")["overrides"] == rec["overrides"]
    # Every process ran the pick: an overlapped pick launches outer rounds in the background.
    delay = next(int(o.split("=")[1]) for o in rec["overrides"] if o.startswith("sync.outer.delay="))
    for c in range(2):  # whichever group led the cluster launched them
        events = [json.loads(line) for r in range(2)
                  for line in (run_dir / "replicas" / f"c{c}r{r}" / "events.jsonl").read_text().splitlines()]
        launches = [e for e in events if e.get("kind") == "outer_launch"]
        assert bool(launches) == (delay > 0), (delay, len(launches))
    assert json.loads((run_dir / "summary.json").read_text())["consistent"]
    shown = read_state(run_dir)["run"]["outer_auto"]
    assert shown["overrides"] == rec["overrides"]
    assert shown["wan_mbit"] == pytest.approx(inp["wan_bandwidth_Bps"] * 8e-6)
