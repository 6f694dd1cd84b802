"""benchmarks/gpu_check.py without a GPU: every check's command line is a valid
configuration, and its verdicts fail what they must (the script runs only on a GPU machine)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from hier_localsgd.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _all_checks(g):
    for c in g.checks(40):
        yield c
        if c.then is not None:
            yield c.then


def test_every_checks_command_line_is_a_valid_configuration():
    g = _gpu_check()
    checks = [c for c in _all_checks(g) if c.argv[0] != "pytest"]
    assert len(checks) >= 18
    for c in checks:
        # "plan" validation: cuda named for another machine is fine, everything else is checked
        load_config([*c.argv[1:], f"train.steps={c.steps}", "train.device=cuda", *g.QUIET], validate_for="plan")


def _write_run(run: Path, device: str, consistent: bool = True, outer: int = 4, loss=(8.0, 1.0)) -> None:
    (run / "replicas" / "c0r0").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"consistent": consistent, "outer_rounds_committed": outer,
                                                  "eval_loss_start": loss[0], "final_eval_loss": loss[1]}))
    (run / "replicas" / "c0r0" / "result.json").write_text(json.dumps({"device": device}))


@pytest.mark.parametrize("device, consistent, outer, loss, words", [
    ("cuda:0", True, 4, (8.0, 1.0), None),
    ("cpu", True, 4, (8.0, 1.0), "processes on ['cpu'], not cuda"),
    ("cuda:0", False, 4, (8.0, 1.0), "consistent=False"),
    ("cuda:0", True, 3, (8.0, 1.0), "outer_rounds_committed=3 < 4"),
    ("cuda:0", True, 4, (8.0, float("nan")), "not down or not finite"),
])
def test_a_demos_verdict_fails_a_wrong_device_an_inconsistent_end_a_lost_round_or_a_bad_loss(tmp_path, device, consistent, outer, loss, words):
    g = _gpu_check()
    check = next(c for c in g.checks(40) if c.name == "codec_int8")  # every outer round must commit
    _write_run(tmp_path, device, consistent, outer, loss)
    why = check.expect(check, tmp_path, "")
    assert (not why) if words is None else any(words in w for w in why), why
