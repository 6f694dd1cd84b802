"""The ddp and flat baselines run in the same trainer, as real processes."""

import pandas as pd
import pytest

from harness import logs_tail, run_job

from hier_localsgd.core.runtime.status import read_events, replica_dir

pytestmark = pytest.mark.slow


def test_ddp_baseline_syncs_every_step_and_ends_consistent(tmp_path):
    run = run_job(tmp_path, ["sync.mode=ddp", "train.steps=12"])
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    s = run.summary
    assert s["steps"] == 12 and s["consistent"] is True
    assert set(s["bytes_sent"]) == {"ddp"} and s["bytes_sent"]["ddp"]["payload"] > 0
    assert s["excess_loss"] < s["excess_loss_start"]


def test_flat_baseline_is_torchft_diloco_over_every_group_on_a_parquet_corpus(tmp_path):
    corpus = tmp_path / "corpus.parquet"
    pd.DataFrame({"body": [f"row {i}: sphinx of black quartz, judge my vow" for i in range(400)]}).to_parquet(corpus)
    run = run_job(
        tmp_path / "run",
        ["sync.mode=flat", "sync.flat.every=5", "train.steps=20", "data=parquet", f"data.path={corpus}", "data.text_column=body"],
    )
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    s = run.summary
    assert s["consistent"] is True and s["steps"] == 20
    assert s["entropy_floor"] is None and s["excess_loss"] is None  # unknown for real text
    assert s["final_eval_loss"] < s["eval_loss_start"]
    # torchft's DiLoCo commits once per sync: 20 / 5 syncs on every replica group.
    results = [run.job.result(k) for k in run.job.keys()]
    assert {r["inner_rounds"] for r in results} == {4}
    # ... and keeps the hierarchy's evidence, so chaos scores flat and hier alike: a commit
    # event per sync with the same checksum on every group, and work counters.
    commits = {k: [(e["step"], e["checksum"]) for e in read_events(replica_dir(run.job.run_dir, *k) / "events.jsonl")
                   if e["kind"] == "commit" and e["level"] == "flat"] for k in run.job.keys()}
    assert len({tuple(c) for c in commits.values()}) == 1, commits
    assert [s for s, _ in next(iter(commits.values()))] == [5, 10, 15, 20]
    assert [r["work"] for r in results] == [{"steps_run": 20, "steps_discarded": 0, "steps_since_commit": 0, "steps_since_outer": 0}] * 4


def test_flat_streaming_fragments_are_torchfts_sent_in_turn(tmp_path):
    """sync.flat.fragments=3 hands the hierarchy's split (the tiny model's three layer units)
    to torchft's DiLoCo as model_fragments: one fragment synced every 15/3 = 5 steps, in
    turn, so in 30 steps each is sent twice and each sync carries that fragment's bytes
    only. (The run does not end on one model: the fragments synced before the last one
    trained on after their sync, as in Streaming DiLoCo.)"""
    run = run_job(tmp_path, ["sync.mode=flat", "sync.flat.every=15", "sync.flat.fragments=3", "train.steps=30"])
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    results = [run.job.result(k) for k in run.job.keys()]
    assert {r["inner_rounds"] for r in results} == {6}
    commits = [[e["step"] for e in read_events(replica_dir(run.job.run_dir, *k) / "events.jsonl")
                if e["kind"] == "commit" and e["level"] == "flat"] for k in run.job.keys()]
    assert commits == [[5, 10, 15, 20, 25, 30]] * 4
    # The fragments partition the model and each was sent twice: six all-reduces (one bucket
    # each) carrying two models' bytes in all, where unfragmented syncs would carry six.
    for r in results:
        link = r["link"]["flat"]
        assert link["calls"]["allreduce/payload"] == 6, link["calls"]
        assert link["tensor_bytes"]["allreduce/payload"] == 2 * r["model_bytes"], (link["tensor_bytes"], r["model_bytes"])


def test_every_strategy_implements_what_the_loop_calls():
    """The loop calls a SyncStrategy without getattr fallbacks: every mode has every method."""
    import inspect

    from hier_localsgd.sync.baselines import DDPSync, FlatSync
    from hier_localsgd.sync.common import SyncStrategy
    from hier_localsgd.sync.hier import HierarchicalSync

    wanted = [n for n, v in vars(SyncStrategy).items() if inspect.isfunction(v) or isinstance(v, property)]
    assert {"start", "after_optimizer_step", "work_counters", "leader", "close"} <= set(wanted)
    for cls in (HierarchicalSync, FlatSync, DDPSync):
        missing = [n for n in wanted if not hasattr(cls, n)]
        assert missing == [], (cls.__name__, missing)
