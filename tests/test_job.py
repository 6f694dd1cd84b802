"""Whole jobs as real processes: lighthouses plus one `hier-localsgd train` per replica group."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from harness import logs_tail, run_job
from hier_localsgd.costs import ring_allreduce_bytes

pytestmark = pytest.mark.slow

C, R, H_IN, H_OUT, STEPS = 2, 2, 5, 2, 40


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """A failure-free 2x2 run: 8 inner rounds per cluster, 4 outer rounds."""
    return run_job(
        tmp_path_factory.mktemp("clean"),
        [f"train.steps={STEPS}", f"sync.inner.every={H_IN}", f"sync.outer.every={H_OUT}"],
    )


def commits_by_step(run, level):
    out = defaultdict(dict)  # step -> key -> checksum
    for key, evs in run.events.items():
        for e in evs:
            if e["kind"] == "commit" and e["level"] == level:
                out[e["step"]][key] = e
    return out


def test_job_completes_and_every_process_reports(clean_run):
    assert all(code == 0 for code in clean_run.codes.values()), logs_tail(clean_run)
    s = clean_run.summary
    assert s["missing_results"] == []
    assert s["steps"] == STEPS
    assert s["outer_rounds_committed"] == STEPS // (H_IN * H_OUT)
    assert s["inner_rounds_committed"]["per_cluster"] == {"0": STEPS // H_IN, "1": STEPS // H_IN}


def test_inner_sync_makes_a_clusters_replicas_identical(clean_run):
    inner = commits_by_step(clean_run, "inner")
    rounds = [s for s in inner if s > 0]
    assert len(rounds) == STEPS // H_IN
    differs_across_clusters = 0
    for step in rounds:
        per = inner[step]
        assert len(per) == C * R, (step, per.keys())
        for c in range(C):
            sums = {per[(c, r)]["checksum"] for r in range(R)}
            assert len(sums) == 1, f"cluster {c} replicas differ after the inner round at step {step}"
        if per[(0, 0)]["checksum"] != per[(1, 0)]["checksum"]:
            differs_across_clusters += 1
            assert step % (H_IN * H_OUT), "clusters must agree after an outer round"
    # Between outer rounds the clusters train on different shards: they do differ.
    assert differs_across_clusters == (STEPS // H_IN) - (STEPS // (H_IN * H_OUT))


def test_outer_sync_and_broadcast_make_every_replica_identical(clean_run):
    inner = commits_by_step(clean_run, "inner")
    outer_steps = [s for s in inner if s > 0 and s % (H_IN * H_OUT) == 0]
    assert len(outer_steps) == STEPS // (H_IN * H_OUT)
    for step in outer_steps:
        per = inner[step]
        assert all(e["outer"] for e in per.values())
        assert len({e["checksum"] for e in per.values()}) == 1, f"replicas differ after the outer round at step {step}"
    # ...and it is the model the leaders committed at the outer level.
    outer = commits_by_step(clean_run, "outer")
    for step in outer_steps:
        leaders = outer[step]
        assert len(leaders) == C  # only leaders hold cluster Managers
        assert {e["checksum"] for e in leaders.values()} == {e["checksum"] for e in inner[step].values()}
    assert clean_run.summary["consistent"] is True
    assert len(set(clean_run.summary["checksums"].values())) == 1


def test_slow_link_bytes_per_outer_round_is_one_model_per_cluster(clean_run):
    s = clean_run.summary
    rounds = s["outer_rounds_committed"]
    expected = C * ring_allreduce_bytes(s["model_bytes"], C)
    assert s["bytes_sent"]["outer"]["payload"] == pytest.approx(rounds * expected, rel=1e-12)
    # Only leaders put bytes on the slow links.
    for key, res in ((k, clean_run.job.result(k)) for k in clean_run.job.keys()):
        outer_sent = res["link"]["outer"]["sent_bytes"]
        if res["leader"]:
            assert outer_sent.get("payload", 0) == pytest.approx(rounds * ring_allreduce_bytes(s["model_bytes"], C))
        else:
            assert outer_sent == {}, key
    # Control traffic (consistency check) is small next to the model.
    assert s["bytes_sent"]["outer"]["control"] < 0.01 * s["bytes_sent"]["outer"]["payload"]


def test_counters_advance_on_every_replica_not_only_leaders(clean_run):
    """Seed 004 counted local steps inside a leader-only path (I5)."""
    results = [clean_run.job.result(k) for k in clean_run.job.keys()]
    assert {r["steps"] for r in results} == {STEPS}
    assert {r["outer_rounds"] for r in results} == {STEPS // (H_IN * H_OUT)}
    assert {r["inner_rounds"] for r in results} == {STEPS // H_IN}
    assert sorted(r["leader"] for r in results) == [False, False, True, True]


def test_every_log_line_names_the_process_and_its_role(clean_run):
    logs = clean_run.job.run_dir / "logs"
    for key, role in (("c0r0", "leader"), ("c0r1", "member"), ("c1r0", "leader")):
        lines = [ln for ln in (logs / f"{key}.log").read_text().splitlines() if " INFO [" in ln]
        assert lines, f"no INFO lines in {key}.log"
        assert any(f"[{key} {role}] hier_localsgd.api: {key} step" in ln for ln in lines), lines[-5:]


def test_injected_allreduce_failures_roll_back_and_next_round_succeeds(tmp_path):
    faults = (
        "faults=[{cluster:0,replica:1,step:10,action:fail,phase:INNER_REDUCE},"
        "{cluster:1,replica:0,step:10,action:fail,phase:OUTER_REDUCE}]"
    )
    run = run_job(tmp_path, [f"train.steps={STEPS}", f"sync.inner.every={H_IN}", f"sync.outer.every={H_OUT}", faults])
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    # c0r1: its inner all-reduce at step 10 failed -> rollback; the next round heals and commits.
    assert [e["step"] for e in run.kinds((0, 1), "rollback", level="inner")] == [10]
    # (a heal at step 0 is the start-up join, when a peer committed a join round first)
    assert [e["step"] for e in run.kinds((0, 1), "heal", level="inner") if e["step"] > 0] == [15]
    assert any(e["step"] == 15 for e in run.kinds((0, 1), "commit", level="inner"))
    # c1r0 (leader): its outer all-reduce at step 10 failed -> its outer level keeps its
    # last commit, the cluster commits its inner result; the next outer round heals it.
    assert [e["step"] for e in run.kinds((1, 0), "rollback", level="outer")] == [10]
    assert [e["step"] for e in run.kinds((1, 0), "heal", level="outer")] == [20]
    assert [e["step"] for e in run.kinds((1, 0), "commit", level="outer")] == [20, 30, 40]
    assert not run.kinds((1, 1), "rollback") and not run.kinds((0, 0), "rollback")
    assert run.summary["consistent"] is True


def test_demo_command_with_torchtitan_debugmodel_writes_summary(tmp_path):
    """The README's demo command, shortened: torchtitan Llama3 debugmodel, 2x2, real processes."""
    summary_path = tmp_path / "summary.json"
    p = subprocess.run(
        [sys.executable, "-m", "hier_localsgd", "demo", f"run.dir={tmp_path / 'run'}", f"demo.summary={summary_path}",
         "train.steps=20", "sync.inner.every=5", "sync.outer.every=2", "train.eval_batches=2", "demo.progress=false"],
        capture_output=True, text=True, timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(summary_path.read_text())
    for key in ("topology", "steps", "inner_rounds_committed", "outer_rounds_committed", "final_eval_loss", "entropy_floor",
                "excess_loss", "excess_loss_start", "bytes_sent", "model_bytes", "consistent"):
        assert key in s, key
    assert s["model"] == "llama3_debugmodel" and s["model_params"] == 6163712
    assert s["model_bytes"] == 6163712 * 4
    assert s["topology"]["clusters"] == 2 and s["topology"]["replicas_per_cluster"] == 2
    assert s["steps"] == 20 and s["outer_rounds_committed"] == 2
    assert s["consistent"] is True
    assert s["excess_loss"] < s["excess_loss_start"]
    assert s["bytes_sent"]["outer"]["payload"] == pytest.approx(2 * 2 * ring_allreduce_bytes(s["model_bytes"], 2))
    assert "consistent: True" in p.stdout


def test_tensorboard_scalars_per_replica_group(clean_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for c, r in clean_run.job.keys():
        ea = EventAccumulator(str(clean_run.job.run_dir / "tensorboard" / f"c{c}r{r}"))
        ea.Reload()
        tags = set(ea.Tags()["scalars"])
        assert {"train/loss", "eval/loss", "eval/excess", "sync/inner_round", "sync/outer_round", "link/inner_bytes", "link/outer_bytes"} <= tags
        evals = ea.Scalars("eval/loss")
        assert [e.step for e in evals][0] == 0 and evals[-1].step == STEPS
        assert evals[-1].value < evals[0].value


def test_a_demo_stopped_by_sigterm_stops_everything_it_started(tmp_path):
    """SIGTERM (a scheduler's stop; SIGHUP, a closed terminal, takes the same path) to
    `hier-localsgd demo`: it stops every process it started and removes the network
    namespaces it made (run.netns=true where namespaces exist), says so in one line, and
    exits 128+15. Before, the default handler ended it at once, and its lighthouses,
    replica groups and namespaces lived on."""
    import re

    from harness import FAST_JOB
    from hier_localsgd.launch import netns

    sig = signal.SIGTERM
    run_dir = tmp_path / "run"
    ns = ["run.netns=true"] if netns.available() is None else []
    p = subprocess.Popen(
        [sys.executable, "-m", "hier_localsgd", "demo", *FAST_JOB, f"run.dir={run_dir}", "train.steps=3000",
         "train.min_step_time_s=0.1", "demo.progress=false", "demo.dashboard=false", *ns],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.time() + 240
        def committed(k):
            f = run_dir / "replicas" / k / "events.jsonl"
            return f.exists() and '"kind": "commit"' in f.read_text()
        while not all(committed(f"c{c}r{r}") for c in range(2) for r in range(2)):
            assert p.poll() is None and time.time() < deadline, p.communicate(timeout=30)
            time.sleep(0.5)
        os.kill(p.pid, sig)
        out, err = p.communicate(timeout=120)
        left = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:  # whatever the outcome, leave nothing behind for the tests after this one
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
        subprocess.run(["pkill", "-9", "-f", str(run_dir)], capture_output=True)
        if ns:
            time.sleep(0.5)
            netns.cleanup_stale()  # namespaces of dead pids
    assert p.returncode == 128 + sig, (p.returncode, err[-2000:])
    assert f"stopped by {signal.Signals(sig).name}" in err, err[-2000:]
    assert left == "", left
    if ns:  # the namespaces it made are named hln<its pid><letter>
        assert not re.search(rf"\bhln{p.pid}[a-z]", names), names


def test_a_run_of_any_length_ends_on_a_final_partial_round(tmp_path):
    """train.steps=23 with rounds every 5 steps and an outer round every 10 (issue #30: any
    positive number of steps): rounds at 5, 10, 15, 20, and a final partial one at 23 that
    carries the outer level, so the run ends where it was asked to, on one model."""
    run = run_job(tmp_path, ["train.steps=23", f"sync.inner.every={H_IN}", f"sync.outer.every={H_OUT}"])
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    s = run.summary
    assert s["steps"] == 23 and s["consistent"] is True
    inner = commits_by_step(run, "inner")
    assert sorted(st for st in inner if st > 0) == [5, 10, 15, 20, 23]
    assert sorted(commits_by_step(run, "outer")) == [10, 20, 23]
    assert len({e["checksum"] for e in inner[23].values()}) == 1  # every group committed the same last model


def test_a_final_partial_round_waits_for_an_overlapped_round_still_in_flight(tmp_path):
    """Overlapped outer rounds (sync.outer.delay=1: launched at step 10, applied at 15) and
    train.steps=13: the final partial round at 13 is blocking, and 1.5 s of one-way latency
    on the outer link keeps the round launched at 10 in flight (it needs four one-way
    trips, ~6 s; steps 11 to 13 take well under 1 s here, ~1 s in a loaded CI run). The
    leader waits for it on the same Manager before the final round (one outer round at a
    time), then ends the run on one model carrying all 13 steps.

    A CI run under load ended the clusters on different models when the leader dropped the
    stage instead (its wait had no budget): now every leader sees the stage's own outcome,
    the same everywhere (its commit vote is one), and nobody's Manager is shut down."""
    run = run_job(tmp_path, ["train.steps=13", f"sync.inner.every={H_IN}", f"sync.outer.every={H_OUT}",
                             "sync.outer.delay=1", "links.outer.latency_ms=1500"])
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    s = run.summary
    outer = {k: [e for e in run.events[k] if e.get("level") == "outer" or e["kind"] in ("outer_folded", "timeout")]
             for k in run.job.keys()}
    assert s["steps"] == 13 and s["consistent"] is True, (s["checksums"], outer)
    inner = commits_by_step(run, "inner")
    assert sorted(st for st in inner if st > 0) == [5, 10, 13]
    assert all(e["outer"] for e in inner[13].values()), inner[13]
    folded = [e for k in run.job.keys() for e in run.kinds(k, "outer_folded")]
    assert len(folded) == C and all(e["step"] == 13 for e in folded), folded
    assert any(e["was_running"] for e in folded), folded  # it was in flight (the margin: above)
    assert len({e["committed"] for e in folded}) == 1, folded  # one outcome everywhere
    assert not [e for k in run.job.keys() for e in run.kinds(k, "timeout")], "a leader dropped the stage"
