"""The examples (examples/*.py) as a user runs them: each a 2 x 2 job launched by the local
launcher (hier-localsgd demo's) with ``run.program``, through the public API only.

Each run: the loss falls, the run ends consistent, and a SIGKILLed replica group restarts
and heals — the model and its registered user state (LR schedule, data position).
"""

from __future__ import annotations

import ast
import signal
from pathlib import Path

import pytest

import hier_localsgd
from tests.harness import WAIT_FOR_RESTART, logs_tail, run_job, when_step

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
STEPS = 150


def _package_imports(path: Path) -> list:
    """(module, names) of every import of hier_localsgd in ``path``, and every attribute
    read off the package object (``hier_localsgd.X``)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, ()) for a in node.names if a.name.split(".")[0] == "hier_localsgd"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hier_localsgd":
            found.append((node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "hier_localsgd":
            found.append(("hier_localsgd", (node.attr,)))
    return found


def test_there_are_three_examples():
    assert {p.name for p in EXAMPLES} == {"plain_loop.py", "torchtitan_llama3.py", "hf_causal_lm.py"}


@pytest.mark.parametrize("path", EXAMPLES + [ROOT / "hier_localsgd" / "train" / "trainer.py"], ids=lambda p: p.name)
def test_examples_and_the_builtin_trainer_use_only_the_public_api(path):
    public = set(hier_localsgd.__all__)
    imports = _package_imports(path)
    assert any(names and set(names) & {"HierarchicalDiLoCo"} for _, names in imports), f"{path.name} does not use HierarchicalDiLoCo"
    for module, names in imports:
        if path.name == "trainer.py" and module.startswith("hier_localsgd.train."):
            continue  # the built-in trainer's own data and model (its package)
        assert module == "hier_localsgd", f"{path.name} imports the private module {module}"
        assert set(names) <= public, f"{path.name} uses {sorted(set(names) - public)}, not in hier_localsgd.__all__"


def test_the_public_names_all_resolve():
    for name in hier_localsgd.__all__:
        assert getattr(hier_localsgd, name) is not None


def corpus(tmp_path: Path) -> Path:
    """Real text: the project's own documentation (a few hundred kB)."""
    out = tmp_path / "corpus.txt"
    out.write_text("\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))))
    return out


def _kill(key):
    def act(job):
        job.kill(key, signal.SIGKILL)

    return act


@pytest.mark.timeout(900)  # torchtitan's took 236 s on CI (its job's own bound: 400 s)
@pytest.mark.parametrize("name, extra", [
    ("plain_loop.py", ["model.dim=32"]),
    ("torchtitan_llama3.py", ["model.name=llama3_debugmodel", "train.lr=1e-3"]),
    ("hf_causal_lm.py", ["model.dim=32"]),
])
def test_an_example_trains_ends_consistent_and_a_killed_group_heals_with_its_state(tmp_path, name, extra):
    victim = (0, 1)
    kill = when_step(victim, 20, _kill(victim))
    run = run_job(tmp_path / "run", [f"run.program={ROOT / 'examples' / name}", "data=text", f"data.path={corpus(tmp_path)}",
                                     f"train.steps={STEPS}", "train.seq_len=32", "train.batch_size=8", "sync.inner.every=5",
                                     "sync.outer.every=2", "train.eval_every=0", "run.tensorboard=false",
                                     "train.min_step_time_s=0.1",  # emulated compute
                                     # The victim's cluster waits for it: its peer cannot form an inner quorum alone, so
                                     # the restarted group rejoins mid-run however long its start-up takes (harness.py).
                                     *WAIT_FOR_RESTART,
                                     *extra],
                  timeout_s=400, during=kill, restart=True)
    tail = logs_tail(run)
    assert kill.fired["done"], f"the kill never fired\n{tail}"
    assert all(c == 0 for c in run.codes.values()), f"{run.codes}\n{tail}"
    s = run.summary
    assert not s["missing_results"] and s["consistent"], f"{s}\n{tail}"
    results = {k: run.job.result(k) for k in run.job.keys()}
    assert len(results) == 4 and all(results.values())
    for key, r in results.items():
        assert r["steps"] == STEPS and r["finite"], r
        assert r["eval_loss"] < r["eval_loss_start"] - 0.1 or key == victim, (key, r["eval_loss_start"], r["eval_loss"])
        # Every group's schedule and data position went through every step it counts: a heal
        # carries the donor's as of one step before the sync point (user_state.py), and a
        # cluster that adopts another cluster's later step skips those steps without state,
        # which the API counts. Without the user state the restarted group's would miss every
        # step before its restart (20 or more) and its loads would be 0.
        heals = len(run.kinds(key, "heal", level="inner"))
        skipped = r["user_state"]["steps_without_state"]
        for what in ("scheduler_steps", "data_position"):
            assert STEPS - heals - skipped <= r[what] <= STEPS, (key, what, r[what], heals, skipped)
    assert results[victim]["user_state"]["loads"] >= 1 and results[victim]["user_state"]["names"] == ["data", "scheduler"]
    assert run.job.replicas[victim].restarts >= 1
    assert run.kinds(victim, "heal"), f"the restarted group did not heal\n{tail}"
    # The healed group's final model is the others' (consistent), and it trained on after the heal.
    assert results[victim]["eval_loss"] < results[(0, 0)]["eval_loss_start"] - 0.1
