"""The public API's own checks: registered state, the launcher's environment, a user's
program under launch/replica.sh (one rank and a torchrun group of two) and in every mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hier_localsgd import ConfigError, HierarchicalDiLoCo, OVERRIDES_ENV, config_from_env, load_config
from hier_localsgd.core.tensors.flat_params import FlatParams
from hier_localsgd.sync.user_state import UserState
from tests.harness import logs_tail, run_job
from tests.test_examples import corpus
from tests.test_launch_scripts import closed_addr

ROOT = Path(__file__).resolve().parent.parent
PLAIN = ROOT / "examples" / "plain_loop.py"


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def test_state_without_state_dict_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"state\['position'\]: int has no state_dict"):
        UserState({"position": 3})


def test_user_state_is_served_as_taken_and_a_donor_without_it_is_named():
    c = Counter()
    us = UserState({"data": c})
    c.n = 5
    assert us.served() == {"data": {"n": 0}}  # not read until taken (on the training thread)
    us.take()
    c.n = 7
    assert us.served() == {"data": {"n": 5}}
    us.load({"data": {"n": 9}}, "the donor", step=12)
    assert c.n == 9 and us.loads == 1 and us.loaded_step == 12
    with pytest.raises(ValueError, match=r"the donor holds no user state \['data'\]"):
        us.load({"other": {}}, "the donor", step=12)


def _counting(step: int, user: UserState) -> SimpleNamespace:
    return SimpleNamespace(counters=SimpleNamespace(step=step), user=user, steps_without_state=0)


def test_the_global_model_is_in_the_parameters_inside_the_block_and_the_live_one_after_it():
    model = torch.nn.Linear(3, 2)
    flat = FlatParams(model)
    live = flat.data.clone()
    held = torch.arange(flat.numel, dtype=flat.data.dtype)
    api = SimpleNamespace(flat=flat, strategy=SimpleNamespace(global_model=lambda: held))
    with HierarchicalDiLoCo.global_model(api) as inside:
        assert inside is True and torch.equal(flat.data, held)
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), held)  # the model's own views
    assert torch.equal(flat.data, live)
    with pytest.raises(RuntimeError, match="eval failed"):
        with HierarchicalDiLoCo.global_model(api):
            raise RuntimeError("eval failed")
    assert torch.equal(flat.data, live)  # back after an exception too
    api.strategy = SimpleNamespace(global_model=lambda: None)  # flat/ddp: none apart from the live model
    with HierarchicalDiLoCo.global_model(api) as inside:
        assert inside is False and torch.equal(flat.data, live)


def test_steps_after_a_heal_without_state_are_counted_from_the_heal():
    """A restarted group heals at step 30 (the user state comes with it) and, in the same
    join round, adopts another cluster's global model of step 40 without state: 10 steps
    without state (CI saw the whole jump counted as covered by the heal)."""
    us = UserState({"data": Counter()})
    api = _counting(0, us)
    with HierarchicalDiLoCo._count_steps_without_state(api):
        us.load({"data": {"n": 29}}, "the donor", step=30)
        api.counters.step = 30
        api.counters.step = 40  # the broadcast of the later global model
    assert api.steps_without_state == 10
    with HierarchicalDiLoCo._count_steps_without_state(api):  # a plain adoption: all of it
        api.counters.step = 50
    assert api.steps_without_state == 20
    with HierarchicalDiLoCo._count_steps_without_state(api):  # a heal alone: none
        us.load({"data": {"n": 59}}, "the donor", step=60)
        api.counters.step = 60
    assert api.steps_without_state == 20


def test_the_launchers_overrides_come_first_and_a_bad_variable_is_one_line(monkeypatch):
    monkeypatch.setenv(OVERRIDES_ENV, json.dumps(["train.steps=7", "run.replica=1"]))
    cfg = config_from_env(["train.steps=9"])
    assert cfg.train.steps == 9 and cfg.run.replica == 1
    monkeypatch.setenv(OVERRIDES_ENV, "train.steps=7")
    with pytest.raises(ConfigError, match=f"^{OVERRIDES_ENV}: not a JSON list"):
        config_from_env([])


def test_a_missing_program_is_one_line_naming_run_program(tmp_path):
    with pytest.raises(ConfigError, match=r"^run.program: .*nope.py' is not a file"):
        load_config([f"run.program={tmp_path / 'nope.py'}"], validate_for="demo")


def test_gather_grads_puts_reallocated_gradients_back_in_the_flat_buffer():
    m = torch.nn.Linear(3, 2)
    flat = FlatParams(m, flat_grads=True)
    m(torch.ones(1, 3)).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in m.parameters()]).clone()
    m.zero_grad(set_to_none=True)  # what a user's loop does
    m(torch.ones(1, 3)).sum().backward()  # backward allocates new gradients
    assert m.weight.grad.data_ptr() != flat.grad.data_ptr()
    flat.gather_grads()
    assert torch.equal(flat.grad, expected)
    assert m.weight.grad.data_ptr() == flat.grad.data_ptr()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_users_program_runs_under_replica_sh(tmp_path, ranks):
    """launch/replica.sh ... -- python examples/plain_loop.py: one rank, or a torchrun group of two."""
    g, c0 = closed_addr(), closed_addr()
    job = ["topology.clusters=1", "topology.replicas_per_cluster=1", f"topology.ranks_per_replica={ranks}",
           f"run.dir={tmp_path / 'run'}", "sync.min_clusters=1", "sync.min_replicas=1", "train.steps=20",
           "sync.inner.every=5", "sync.outer.every=2", "model=tiny", "model.dim=32", "train.seq_len=32", "train.batch_size=4",
           "data=text", f"data.path={corpus(tmp_path)}", f"lighthouse.global_addr='{g}'", f"lighthouse.cluster_addrs=[{c0}]"]
    env = dict(os.environ, RUST_LOG="warn")
    lh = subprocess.Popen([sys.executable, "-m", "hier_localsgd", "lighthouse", "lighthouse.until_done=true", *job],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        flags = ["--no-restart"] + (["--ranks", str(ranks)] if ranks > 1 else [])
        p = subprocess.run(["bash", str(ROOT / "launch" / "replica.sh"), *flags, "0", "0", g, c0, *job[:-2], "--",
                            sys.executable, str(PLAIN)], capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        lh.communicate(timeout=30)
    finally:
        if lh.poll() is None:
            lh.kill()
    subs = [""] + [f"rank{k}" for k in range(1, ranks)]
    results = [json.loads((tmp_path / "run" / "replicas" / "c0r0" / sub / "result.json").read_text()) for sub in subs]
    assert [r["steps"] for r in results] == [20] * ranks and [r["group_rank"] for r in results] == list(range(ranks))
    assert len({r["checksum"] for r in results}) == 1
    assert all(r["scheduler_steps"] == 20 and r["eval_loss"] < r["eval_loss_start"] for r in results), results


@pytest.mark.parametrize("mode", ["flat", "ddp"])
def test_a_users_program_runs_the_baselines(tmp_path, mode):
    """sync.mode=flat (torchft's DiLoCo in the optimizer's hooks) and ddp (the gradient
    all-reduce before the step, with the loop's own zero_grad) through the same API."""
    run = run_job(tmp_path / "run", [f"run.program={PLAIN}", "data=text", f"data.path={corpus(tmp_path)}", f"sync.mode={mode}",
                                     "train.steps=30", "train.seq_len=32", "train.batch_size=8", "model.dim=32",
                                     "sync.flat.every=10", "train.eval_every=0", "run.tensorboard=false"], timeout_s=300)
    tail = logs_tail(run)
    assert all(c == 0 for c in run.codes.values()), f"{run.codes}\n{tail}"
    assert run.summary["consistent"], tail
    for k in run.job.keys():
        r = run.job.result(k)
        assert r["mode"] == mode and r["steps"] == 30 and r["eval_loss"] < r["eval_loss_start"] - 0.1, r


def test_a_users_state_resumes_from_a_durable_checkpoint(tmp_path):
    """checkpoint.every: the registered state is in the checkpoint; a job resumed from step
    40 ends with the schedule and data position of 60 steps, not of the 20 it ran."""
    common = [f"run.program={PLAIN}", "data=text", f"data.path={corpus(tmp_path)}", "train.seq_len=32", "train.batch_size=8",
              "model.dim=32", "sync.inner.every=5", "sync.outer.every=2", "checkpoint.every=1", "train.eval_every=0",
              "run.tensorboard=false"]
    first = run_job(tmp_path / "run", [*common, "train.steps=40"], timeout_s=300)
    assert all(c == 0 for c in first.codes.values()), logs_tail(first)
    resumed = run_job(tmp_path / "run", [*common, "train.steps=60", "checkpoint.resume=true"], timeout_s=300)
    assert all(c == 0 for c in resumed.codes.values()), logs_tail(resumed)
    assert {e["step"] for k in resumed.job.keys() for e in resumed.kinds(k, "resume")} == {40}
    for k in resumed.job.keys():
        r = resumed.job.result(k)
        assert r["steps"] == 60 and r["scheduler_steps"] == 60 and r["data_position"] == 60, r
    assert resumed.summary["consistent"]


def test_a_rollback_keeps_the_schedulers_lr_and_a_heal_brings_the_donors():
    """optimizer.load_state_dict restores the lr of the commit; the live one is re-applied
    (rollback) or the donor's taken with its state (heal): ExponentialLR stays on schedule."""
    from hier_localsgd.sync.user_state import hyperparameters, set_hyperparameters

    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    backup = opt.state_dict()  # the commit, at lr 1.0
    for _ in range(3):
        opt.step()
        sched.step()
    live = hyperparameters(opt)
    opt.load_state_dict(backup)  # what a rollback does ...
    assert opt.param_groups[0]["lr"] == 1.0
    set_hyperparameters(opt, live)  # ... and what committed.py re-applies
    assert opt.param_groups[0]["lr"] == 0.125 and sched.get_last_lr() == [0.125]

    donor_opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=1.0)
    donor_sched = torch.optim.lr_scheduler.ExponentialLR(donor_opt, gamma=0.5)
    for _ in range(5):
        donor_opt.step()
        donor_sched.step()
    donor = UserState({"scheduler": donor_sched}, optimizer=donor_opt)
    healed = UserState({"scheduler": sched}, optimizer=opt)
    opt.load_state_dict(backup)  # a heal loads the donor's committed optimizer first ...
    healed.load(donor.served(), "the donor", step=0)  # ... then its state, lr included
    assert opt.param_groups[0]["lr"] == 0.5 ** 5 and sched.last_epoch == 5
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.5 ** 6
