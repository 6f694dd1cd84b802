"""launch/replica.sh restarts a failed replica group, and --no-restart turns that off."""

import json
import os
import socket
import subprocess
import sys
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


def test_replica_script_runs_a_two_rank_group_under_torchrun(tmp_path):
    """--ranks 2: one torchrun, a log per rank, both ranks finish on the same model; the
    lighthouse (lighthouse.until_done) exits by itself once the group has finished."""
    g, c0 = closed_addr(), closed_addr()
    job = ["model=tiny", "topology.clusters=1", "topology.replicas_per_cluster=1", "topology.ranks_per_replica=2",
           f"run.dir={tmp_path}", "sync.min_clusters=1", "sync.min_replicas=1", "train.steps=20",
           "sync.inner.every=5", "sync.outer.every=2", f"lighthouse.global_addr='{g}'", f"lighthouse.cluster_addrs=[{c0}]"]
    env = dict(os.environ, RUST_LOG="warn")
    lh = subprocess.Popen([sys.executable, "-m", "hier_localsgd", "lighthouse", "lighthouse.until_done=true", *job],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        p = subprocess.run(["bash", str(SCRIPT), "--no-restart", "--ranks", "2", "0", "0", g, c0, *job],
                           capture_output=True, text=True, timeout=300, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        lh_out, _ = lh.communicate(timeout=30)
        assert lh.returncode == 0 and "every replica group served here finished (1 results)" in lh_out
    finally:
        if lh.poll() is None:
            lh.kill()
    results = [json.loads((tmp_path / "replicas" / "c0r0" / sub / "result.json").read_text()) for sub in ("", "rank1")]
    assert [r["steps"] for r in results] == [20, 20] and [r["group_rank"] for r in results] == [0, 1]
    assert results[0]["checksum"] == results[1]["checksum"]
    assert len(list((tmp_path / "logs" / "c0r0.ranks").rglob("stderr.log"))) == 2
    assert "[c0r0g0 leader]" in p.stderr and "[c0r0g1 " not in p.stderr  # the console shows rank 0 only
