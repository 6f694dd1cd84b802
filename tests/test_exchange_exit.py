"""A process that ran the outer level's point-to-point exchange leaves cleanly (issue #30).

The scripts are in tests/exchange_exit.py, which says what went wrong and how it was found."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).with_name("exchange_exit.py"))
pytestmark = pytest.mark.slow


def test_an_exchange_helper_still_completing_its_future_at_exit_does_not_abort_the_process():
    # Certain to abort (-6) with a daemon helper; three runs, each its own interpreter.
    for _ in range(3):
        p = subprocess.run([sys.executable, SCRIPT, "finalizing"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]
        assert "terminate called" not in p.stderr


def test_the_int8_exchange_in_fresh_processes_exits_cleanly_every_time():
    # About one pair in ten aborted before the fix; tests/exchange_exit.py pairs 200 for the figure.
    p = subprocess.run([sys.executable, SCRIPT, "pairs", "8"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    codes = json.loads(p.stdout.strip().splitlines()[-1])
    assert codes == [0] * 16, (codes, p.stderr[-2000:])
