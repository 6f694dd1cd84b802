"""sync.outer.auto re-chooses when the link changes (experiments/auto_watch.py, issue #29 §3):
the passive rate reading from the link counters, the watch's decision, and a real job on
kernel-shaped links whose WAN drops mid-run."""

import json
import time
from dataclasses import asdict, replace

import pytest

from hier_localsgd.config import load_config
from hier_localsgd.core.links.stats import sent_per_rank
from hier_localsgd.experiments.auto import AutoInputs, choose, replay
from hier_localsgd.experiments.auto_watch import WINDOWS, LinkWatch, outer_counters, wait_rechoosing, watch_for, window_rate
from hier_localsgd.experiments.summary import summarize
from hier_localsgd.launch import netns
from hier_localsgd.launch.local import LocalJob
from hier_localsgd.tools.plan.network import OuterVariant

from harness import FAST_JOB  # noqa: E402


def status(seconds, tensor_bytes, calls, op="allreduce", started_at=1.0):
    key = f"{op}/payload"
    return {"started_at": started_at, "link": {"outer": {"seconds": {key: seconds, "allreduce/meta": 9.0},
                                                          "tensor_bytes": {key: tensor_bytes}, "calls": {key: calls}}}}


def test_a_window_of_collectives_reads_as_bytes_sent_over_their_transfer_time():
    # Two all-reduces of 1 MB between 2 leaders since the last reading, 0.9 s inside them, 20 ms one way:
    # each sends 1 MB (the ring's 2(W-1)/W) in 0.9 - 2 x 2 x 0.02 s.
    before, after = outer_counters(status(1.0, 1e6, 1)), outer_counters(status(1.9, 3e6, 3))
    assert after == {"allreduce": (1.9, 3e6, 3)}  # metadata collectives are not the payload's
    sent = 2 * sent_per_rank("allreduce", 1e6, 2)
    assert window_rate(before, after, 2, 0.02) == pytest.approx(sent / (0.9 - 2 * 2 * 0.02))
    assert window_rate(after, after, 2, 0.02) is None  # nothing new
    assert window_rate(after, before, 2, 0.02) is None  # counters that went back (a restarted process)


class Published:
    """The statuses a job's groups published (the watch reads nothing else of the job)."""

    def __init__(self):
        self.st = {}

    def keys(self):
        return [(0, 0), (1, 0)]

    def last_status(self, key):
        return self.st.get(key)


# The tiny model (37,184 parameters), 2 clusters x 2 groups, H 5/2, a 0.1 s step, 200 steps.
BASE = AutoInputs(clusters=2, replicas=2, h_inner=5, h_outer=2, sync_bytes=148_736.0, step_s=0.1,
                  wan_bandwidth_Bps=100e6 / 8, wan_latency_s=0.001, lan_bandwidth_Bps=1.25e9, lan_latency_s=1e-4,
                  round_overhead_s=0.0, base=asdict(OuterVariant()), steps=200)


def test_the_watch_re_chooses_only_after_readings_in_a_row_beyond_the_factor_and_a_different_pick():
    job = Published()
    start = choose(BASE)
    assert start["pick"]["delay"] == 0  # fp32 or int8, blocking, at 100 Mbit/s
    watch = LinkWatch(job, BASE, start["overrides"], factor=2.0)
    calls = {"n": 0, "s": 0.0}

    def rounds(seconds_each, n=1):
        """``n`` more outer all-reduces of the fp32 model, each ``seconds_each`` long, on both leaders."""
        calls["n"] += n
        calls["s"] += n * seconds_each
        for k in job.keys():
            job.st[k] = status(calls["s"], calls["n"] * BASE.sync_bytes, calls["n"])
        return watch.poll()

    assert rounds(0.05) is None  # the first reading of each group only sets its counters
    for _ in range(WINDOWS):
        assert rounds(0.05) is None
    assert watch.baseline is not None  # the readings under the start's pick, biased as they are
    assert rounds(0.06) is None and rounds(0.04) is None  # within the factor: nothing
    # 100x slower rounds: two readings are not enough, the third re-chooses
    assert rounds(5.0) is None and rounds(5.0) is None
    got = rounds(5.0)
    assert got is not None and all(r < 1 / 2.0 for r in got["ratios"])
    assert got["rate_Bps"] == pytest.approx(BASE.sync_bytes / (5.0 - 2 * 0.001))  # the readings' rate, not the ratio's
    again = choose(replace(BASE, wan_bandwidth_Bps=got["rate_Bps"]))
    assert got["pick"] == again["pick"] and again["overrides"] != start["overrides"]
    assert got["pick"]["delay"] >= 1  # at ~0.24 Mbit/s the round no longer hides blocking

    # Past the factor with the same pick: nothing (no restart). At 1 Mbit/s and at 0.48 the pick is int8, delay 1.
    slow = replace(BASE, wan_bandwidth_Bps=1e6 / 8)
    same = LinkWatch(job, slow, choose(slow)["overrides"], factor=2.0)
    watch = same
    assert rounds(1.0) is None
    for _ in range(WINDOWS):
        assert rounds(1.0) is None
    assert same.baseline == pytest.approx(BASE.sync_bytes / (1.0 - 0.002))
    for _ in range(WINDOWS + 1):
        assert rounds(2.5) is None
    assert all(x < 0.5 for x in [r / same.baseline for r in same.readings])  # it did see the change


def test_the_watch_needs_checkpoints_and_a_factor(tmp_path, capsys):
    cfg = load_config(["model=tiny", "sync.outer.auto=true"], validate_for="demo")
    assert watch_for(cfg, None) is None  # checkpoint.every = 0: a restart would lose the run
    assert "set checkpoint.every > 0" in capsys.readouterr().out
    assert watch_for(load_config(["model=tiny", "sync.outer.auto=true", "sync.outer.auto_rechoose=0", "checkpoint.every=1"],
                                 validate_for="demo"), None) is None
    for bad in ("1", "0.5", "-2", "true"):
        with pytest.raises(Exception, match="sync.outer.auto_rechoose"):
            load_config([f"sync.outer.auto_rechoose={bad}"], validate_for="demo")


REASON = netns.shaping_available()


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"kernel shaping unavailable: {REASON}")
def test_a_job_whose_wan_drops_mid_run_re_chooses_restarts_from_checkpoints_and_ends_consistent(tmp_path):
    """A real job in network namespaces, each cluster's uplink shaped by tbf at 100 Mbit/s:
    the launcher probes and picks a blocking outer round; at step 60 the uplinks drop to
    1 Mbit/s; the watch reads the slower rounds and finds the planner would pick otherwise;
    every group stops, the WAN is probed again, and every group restarts from its
    checkpoint with the pick for the probed link and finishes the run, consistent."""
    from hier_localsgd.experiments.auto import resolve

    run_dir = tmp_path / "run"
    overrides = [*FAST_JOB, "run.netns=true", "sync.outer.auto=true", "sync.inner.every=5", "sync.outer.every=2",
                 "train.steps=200", "train.min_step_time_s=0.1", "train.log_every=1", "checkpoint.every=1", f"run.dir={run_dir}"]
    cfg = load_config(overrides, validate_for="demo")
    job = LocalJob(cfg, overrides)
    dropped = {}

    def drop_at_step_60():
        if not dropped and int((job.status((0, 0)) or {}).get("step", 0)) >= 60:
            for c in range(2):
                job.netns.shape(c, 1_000_000, burst_bytes=16_000)  # a small bucket: a round must not fit in it
            dropped["t"] = time.time()

    with job:
        for c in range(2):
            job.netns.shape(c, 100_000_000)
        base = list(job.overrides)
        job.overrides = [*base, *resolve(cfg, job)]
        start = json.loads((run_dir / "auto.json").read_text())
        assert start["pick"]["delay"] == 0, start["pick"]  # the tiny model's round hides nowhere better than blocking
        watch = watch_for(cfg, job)
        assert watch is not None
        job.start_lighthouses()
        job.start_all()
        codes = wait_rechoosing(job, cfg, watch, lambda picked: [*base, *picked], 400, tick=drop_at_step_60)
    summary = summarize(cfg, job, 0.0)
    rec = json.loads((run_dir / "auto.json").read_text())
    tail = "\n".join(f"==== {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert all(c == 0 for c in codes.values()), (codes, tail)
    assert "t" in dropped
    hist = rec.get("history") or []
    assert [h["reason"] for h in hist] == ["start", "link"], hist
    link = hist[1]
    assert link["t"] > dropped["t"] and link["overrides"] != start["overrides"]
    assert all(r < 1 / cfg.sync.outer.auto_rechoose for r in link["seen"]["ratios"]), link
    # What the rounds read and what the WAN probe measured again: the tbf's 1 Mbit/s, within the collectives' overheads.
    assert 0.25e6 / 8 < link["seen"]["rate_Bps"] < 2e6 / 8, link["seen"]  # a leader's wait for the other counts in
    assert 0.5e6 / 8 < link["wan_probe"]["bandwidth_Bps"] < 1.25e6 / 8, link["wan_probe"]
    assert rec["overrides"] == link["overrides"] and replay(run_dir / "auto.json")["overrides"] == link["overrides"]
    assert link["pick"]["delay"] >= 1, link["pick"]
    # Every group ran the new pick: resumed from its checkpoint (not from step 0), then launched overlapped rounds.
    logs = [(run_dir / "logs" / f"c{c}r{r}.log").read_text(errors="replace") for c, r in job.keys()]
    assert all("resumed at step" in log for log in logs), tail
    stops = [h for h in job.history if h["event"] == "stop"]
    assert len(stops) == 4, job.history
    assert summary["consistent"] is True, summary
    assert not summary["missing_results"], summary
    assert [job.result(k)["steps"] for k in job.keys()] == [200] * 4


@pytest.mark.slow
def test_a_probe_that_fails_after_the_stop_resumes_every_group_with_the_running_pick(tmp_path, monkeypatch, capsys):
    """The stop came, then the WAN probe raised: every group restarts from its checkpoint with
    the running configuration, and the run ends consistent (real lighthouses and groups on
    loopback; the watch fires once by hand, the probe is made to fail)."""
    import hier_localsgd.experiments.auto_watch as aw

    run_dir = tmp_path / "run"
    overrides = [*FAST_JOB, "sync.inner.every=5", "sync.outer.every=2", "train.steps=60", "train.min_step_time_s=0.05",
                 "train.log_every=1", "checkpoint.every=1", f"run.dir={run_dir}"]
    cfg = load_config(overrides, validate_for="demo")
    job = LocalJob(cfg, overrides)

    class FiresOnceAtStep20(LinkWatch):
        def poll(self):
            if not getattr(self, "fired", False) and int((job.status((0, 0)) or {}).get("step", 0)) >= 20:
                self.fired = True
                return {"rate_Bps": 1e5, "ratios": [0.01] * WINDOWS, "baseline_Bps": 1e7, "pick": {}}
            return None

    def no_route(*_):
        raise RuntimeError("no route to the other cluster")

    monkeypatch.setattr(aw, "probe_wan", no_route)
    running = ["sync.outer.compression=none", "sync.outer.delay=0", "sync.outer.fragments=1", "sync.outer.auto=false"]
    watch = FiresOnceAtStep20(job, BASE, running, 2.0)
    with job:
        job.start_lighthouses()
        job.start_all()
        codes = wait_rechoosing(job, cfg, watch, lambda picked: [*overrides, *picked], 300)
    out = capsys.readouterr().out
    logs = [(run_dir / "logs" / f"c{c}r{r}.log").read_text(errors="replace") for c, r in job.keys()]
    assert all(c == 0 for c in codes.values()), (codes, [log[-2000:] for log in logs])
    assert "the WAN probe failed (no route to the other cluster); every group resumes with the running pick" in out, out
    assert watch.overrides == running and watch.baseline is None  # the running pick, a new baseline
    assert len([h for h in job.history if h["event"] == "stop"]) == 4, job.history
    assert all("resumed at step" in log for log in logs), [log[-2000:] for log in logs]
    assert [job.result(k)["steps"] for k in job.keys()] == [60] * 4
    assert summarize(cfg, job, 0.0)["consistent"] is True
