"""Durable checkpoints: atomic files, corrupt ones skipped, exact resume after a full stop."""

import time
from pathlib import Path

import pytest
import torch

from harness import logs_tail, run_job
from hier_localsgd.core.runtime.checkpoint import Checkpointer


def make_state(v: float) -> dict:
    return {"model": torch.full((100,), v), "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "counters": {"step": int(v), "inner_round": 1, "outer_round": 1}}


def test_newest_valid_checkpoint_wins_and_bad_ones_are_skipped_with_a_reason(tmp_path):
    events = []
    ck = Checkpointer(tmp_path, 0, 1, keep=5, events=lambda kind, **kw: events.append((kind, kw)))
    for step in (10, 20):
        ck.save_async(step, make_state(step))
        ck.wait()
    good = ck.dir / "ckpt_000000020.pt"
    # newer but partial (truncated), newer but garbage, newer with a flipped value
    (ck.dir / "ckpt_000000030.pt").write_bytes(good.read_bytes()[: len(good.read_bytes()) // 2])
    (ck.dir / "ckpt_000000040.pt").write_bytes(b"not a checkpoint at all")
    tampered = torch.load(good, weights_only=True)
    tampered["state"]["model"][7] = -1.0
    torch.save(tampered, ck.dir / "ckpt_000000050.pt")
    (ck.dir / ".ckpt_000000060.pt.123.tmp").write_bytes(b"an interrupted write")  # never listed
    payload = ck.load_latest()
    assert payload is not None and payload["step"] == 20
    assert torch.equal(payload["state"]["model"], torch.full((100,), 20.0))
    skipped = [(Path(kw["path"]).name, kw["reason"]) for kind, kw in events if kind == "checkpoint_skipped"]
    assert [name for name, _ in skipped] == ["ckpt_000000050.pt", "ckpt_000000040.pt", "ckpt_000000030.pt"]
    assert "checksum mismatch" in skipped[0][1]
    assert all(".tmp" not in p.name for p in ck.list())


def test_retention_keeps_the_newest(tmp_path):
    ck = Checkpointer(tmp_path, 1, 0, keep=2, events=lambda *a, **k: None)
    for step in (10, 20, 30, 40):
        ck.save_async(step, make_state(step))
    ck.wait()
    assert [p.name for p in ck.list()] == ["ckpt_000000040.pt", "ckpt_000000030.pt"]


COMMON = ["train.min_step_time_s=0.05", "sync.inner.every=5", "sync.outer.every=2", "train.steps=60",
          "checkpoint.every=1", "train.log_every=1"]


def step_losses(run, key, after_t=0.0):
    return {e["step"]: e["loss"] for e in run.events[key] if e["kind"] == "loss" and e["t"] > after_t}


@pytest.mark.slow
def test_resume_after_the_whole_job_stopped_matches_an_uninterrupted_run(tmp_path):
    full = run_job(tmp_path / "full", COMMON)
    assert all(c == 0 for c in full.codes.values()), logs_tail(full)

    # Same job, stopped entirely (every process and the lighthouses) while every group is
    # held at step 35 by an injected hang: no group can reach the step-40 checkpoint, and
    # the stop comes only once each group's step-30 checkpoint is on disk. (Stopping "at
    # step >= 37" raced the step-40 checkpoint.)
    part_dir = tmp_path / "part"
    hang = "faults=[" + ",".join(f"{{cluster:{c},replica:{r},step:35,action:hang}}" for c in (0, 1) for r in (0, 1)) + "]"
    ckpt30 = [part_dir / "checkpoints" / f"c{c}r{r}" / "ckpt_000000030.pt" for c in (0, 1) for r in (0, 1)]
    stopped = {}

    def stopper(job):
        held = all(int((job.status(k) or {}).get("step", 0)) == 35 for k in job.keys())
        if not stopped and held and all(p.exists() for p in ckpt30):
            stopped["t"] = time.time()
            job.stop(grace_s=10)

    part = run_job(part_dir, [*COMMON, hang], during=stopper, timeout_s=120)
    assert stopped, logs_tail(part)
    assert all(c != 0 for c in part.codes.values())  # stopped, not finished
    assert all(not (part_dir / "checkpoints" / f"c{c}r{r}" / "ckpt_000000040.pt").exists() for c in (0, 1) for r in (0, 1))
    # ... a newer but corrupt checkpoint is lying around for one group ...
    corrupt = part_dir / "checkpoints" / "c0r0" / "ckpt_000000039.pt"
    corrupt.write_bytes(b"\x00" * 100)
    t_resume = time.time()
    # ... and the resumed job continues from the newest complete checkpoint (step 30).
    resumed = run_job(part_dir, [*COMMON, "checkpoint.resume=true"])
    assert all(c == 0 for c in resumed.codes.values()), logs_tail(resumed)
    resumes = [e for k in resumed.job.keys() for e in resumed.kinds(k, "resume")]
    assert len(resumes) == 4 and {e["step"] for e in resumes} == {30}
    skipped = resumed.kinds((0, 0), "checkpoint_skipped")
    assert skipped and skipped[-1]["path"].endswith("ckpt_000000039.pt")
    # Same final parameters, bit for bit, and the same loss at every step after 30.
    assert resumed.summary["checksums"] == full.summary["checksums"]
    for key in full.job.keys():
        a, b = step_losses(full, key), step_losses(resumed, key, after_t=t_resume)
        assert sorted(b) == list(range(31, 61)), sorted(b)[:5]
        assert all(a[s] == b[s] for s in b), [(s, a[s], b[s]) for s in b if a[s] != b[s]][:3]
