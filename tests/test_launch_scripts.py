"""launch/replica.sh restarts a failed replica group, and --no-restart turns that off."""

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent.parent / "launch" / "replica.sh"


def closed_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def run_script(tmp_path, *flags):
    g, c0 = closed_addr(), closed_addr()  # nothing listens: every attempt exits 1 quickly
    env = dict(os.environ, RESTART_DELAY="0.2", RUST_LOG="warn")
    t0 = time.time()
    p = subprocess.run(
        ["bash", str(SCRIPT), *flags, "0", "0", g, c0, "model=tiny", "topology.clusters=1",
         f"run.dir={tmp_path}", "timeouts.connect=1", "sync.min_clusters=1"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    return p, time.time() - t0


def test_replica_script_restarts_until_the_limit(tmp_path):
    p, _ = run_script(tmp_path, "--max-restarts", "2")
    assert p.returncode == 1
    assert "lighthouse unreachable" in p.stderr
    assert p.stderr.count("exiting with code 1") == 3  # first run + 2 restarts
    assert "restart 1/2" in p.stderr and "restart 2/2" in p.stderr
    assert "c0r0 exited with 1; not restarting" in p.stderr


def test_replica_script_no_restart_runs_once(tmp_path):
    p, _ = run_script(tmp_path, "--no-restart")
    assert p.returncode == 1
    assert p.stderr.count("exiting with code 1") == 1
    assert "restart 1/" not in p.stderr


def test_replica_script_never_retries_a_configuration_error(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT), "0", "0", "http://127.0.0.1:1", "http://127.0.0.1:2", "sync.inner.algorithm=adam"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "sync.inner.algorithm: unknown algorithm 'adam'" in p.stderr
    assert "restart 1/" not in p.stderr and "c0r0 exited with 2; not restarting" in p.stderr
