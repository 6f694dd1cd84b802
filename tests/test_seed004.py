"""Seed 004's worst bug, reproduced with raw torchft and shown fixed (invariant I7).

A replica group's training loop died, but the process did not exit (another non-daemon
thread was still blocked), so its Manager kept heartbeating. The lighthouse counted it
healthy, needed more than half of the heartbeating replicas to join, and its peer waited
for it until the quorum timed out — and again at every retry.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from torchft.coordination import LighthouseServer

from harness import first_commit_after, logs_tail, run_job

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "seed004_raw_replica.py"


def test_reproduce_a_crashed_process_that_keeps_heartbeating_stalls_its_peer(tmp_path):
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=60000, quorum_tick_ms=50, heartbeat_timeout_ms=2000)
    env = {"RUST_LOG": "warn", "PATH": "/usr/bin:/bin"}
    procs = []
    try:
        crasher = subprocess.Popen([sys.executable, str(SCRIPT), lh.address(), "a_0", "2", "crash", "60", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        survivor = subprocess.Popen([sys.executable, str(SCRIPT), lh.address(), "b_1", "2", "survive", "8", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        procs = [crasher, survivor]
        out, _ = survivor.communicate(timeout=120)
        assert "round 1 committed=True participants=2" in out, out
        # The peer could not form a quorum for its whole 8 s timeout...
        assert "QUORUM_FAILED" in out, out
        waited = float(out.split("QUORUM_FAILED ")[1].split()[0])
        assert waited >= 7.5
        # ...because the crashed process is still alive (and heartbeating).
        assert crasher.poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        lh.shutdown()


def test_fixed_a_crashing_replica_group_exits_and_its_peer_commits_within_the_heartbeat_timeout(tmp_path):
    """The same crash under hier_localsgd's runtime: the process shuts its Managers down and
    exits despite the blocked thread; the peer's next commit follows within a heartbeat timeout."""
    run = run_job(tmp_path, ["train.min_step_time_s=0.05", "sync.inner.every=5", "sync.outer.every=2", "train.steps=40",
                             "faults=[{cluster:0,replica:1,step:12,action:raise}]"])
    assert run.codes[(0, 1)] == 1, logs_tail(run)
    t_exit = next(h["t"] for h in run.job.history if h["event"] == "exit" and h["key"] == (0, 1))
    status = run.job.status((0, 1))
    assert status["state"].startswith("failed (InjectedFault")
    # exited within the shutdown bound, not after the blocked thread's hour
    assert t_exit - status["updated_at"] < 5
    dt = first_commit_after(run, [(0, 0)], t_exit)
    assert dt is not None and dt < 2.0 + 2.0, dt  # heartbeat timeout + a round
    assert run.codes[(0, 0)] == 0
