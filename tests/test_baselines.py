"""The ddp and flat baselines run in the same trainer, as real processes."""

import pandas as pd
import pytest

from harness import logs_tail, run_job

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
