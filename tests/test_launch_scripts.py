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
    # torchrun's rendezvous went through a file (launch/rendezvous.py), not a store on every interface
    assert (tmp_path / "logs" / "c0r0.ranks" / "rendezvous").exists()


def test_replica_script_sets_the_rendezvous_environment_of_its_one_home():
    """launch/replica.sh writes rendezvous.ENV in bash; it must say what the module says."""
    from hier_localsgd.launch.rendezvous import ENV

    text = SCRIPT.read_text()
    for k, v in ENV.items():
        assert f"export {k}={v}\n" in text, k


LIGHTHOUSES = Path(__file__).resolve().parent.parent / "launch" / "lighthouses.sh"


def _lighthouse_children(script_pid: int) -> list:
    out = subprocess.run(["pgrep", "-P", str(script_pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _wait_answering(addr: str, timeout_s: float) -> float:
    from hier_localsgd.core.ft.outage import lighthouse_answers
    from datetime import timedelta

    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if lighthouse_answers(addr, timedelta(seconds=0.5)):
            return time.time()
        time.sleep(0.1)
    raise AssertionError(f"{addr} not answering after {timeout_s}s")


@pytest.mark.parametrize("restart", [True, False])
def test_lighthouse_script_restarts_a_dead_lighthouse_at_its_address(tmp_path, restart):
    """A SIGKILLed lighthouse comes back at the same address (replica processes then rejoin
    it: tests/test_outages.py); --no-restart leaves it dead."""
    addr = closed_addr()
    env = dict(os.environ, RESTART_DELAY="0.5", RUST_LOG="warn")
    flags = [] if restart else ["--no-restart"]
    p = subprocess.Popen(["bash", str(LIGHTHOUSES), *flags, "global", f"lighthouse.global_addr={addr}", f"run.dir={tmp_path}"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        _wait_answering(addr, 60)
        # with --no-restart the script execs the lighthouse: it is the process itself
        victims = _lighthouse_children(p.pid) if restart else [p.pid]
        assert len(victims) == 1, victims
        os.kill(victims[0], 9)
        if restart:
            _wait_answering(addr, 60)
            assert _lighthouse_children(p.pid) and _lighthouse_children(p.pid) != victims
            assert p.poll() is None
        else:
            assert p.wait(timeout=30) == -9
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 15)
            p.wait(timeout=30)
    if restart:
        assert "lighthouses.sh: global lighthouse exited with 137; restart 1" in p.stderr.read()


def test_lighthouse_script_stops_on_a_busy_port_with_one_line(tmp_path):
    """A port already taken is a configuration conflict: the lighthouse says so in one line
    naming the field and address and exits 2, and the script does not restart it (issue #30:
    it restarted 7 times in 30 s, a traceback each)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        addr = f"http://127.0.0.1:{s.getsockname()[1]}"
        env = dict(os.environ, RESTART_DELAY="0.5", RUST_LOG="warn")
        p = subprocess.run(["bash", str(LIGHTHOUSES), "global", f"lighthouse.global_addr={addr}", f"run.dir={tmp_path}"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines == [f"hier-localsgd lighthouse: lighthouse.global_addr={addr}: cannot start the global lighthouse: "
                     f"port {addr.rsplit(':', 1)[1]} is already in use (another process listens there)"], p.stderr
    assert "restart" not in p.stderr
