"""Lighthouse outages and a job that moved on, with real processes and real lighthouses.

A lighthouse that dies is restarted at its address by the launcher's supervisor; replica
processes ride out the outage (they keep stepping, skip the level's rounds, retry) and
rejoin without restarting. A silent lighthouse ends them only past sync.outage_limit_s.
A replica group that comes back after the job finished exits 0 instead of looping."""

import os
import signal
import statistics
import time

import pytest

from harness import logs_tail, run_job
from hier_localsgd.core.ft.outage import LighthouseHealth, LighthouseOutage, OutageLimitExceeded

pytestmark = pytest.mark.slow

HB_S = 2.0  # lighthouse.heartbeat_timeout_ms in harness.FAST_JOB: one quorum slice
ALL = [(0, 0), (0, 1), (1, 0), (1, 1)]
OUTAGE = ["train.min_step_time_s=0.1", "sync.inner.every=5", "sync.outer.every=2", "train.steps=300",
          "train.log_every=1", "lighthouse.restart_delay_s=10"]


def history(run, event, key):
    return [h for h in run.job.history if h["event"] == event and h["key"] == key]


def steps_between(run, key, t0, t1):
    """Local steps ``key`` took between t0 and t1 (from its per-step loss events)."""
    steps = [e["step"] for e in run.kinds(key, "loss") if t0 <= e["t"] <= t1]
    return max(steps) - min(steps) if steps else 0


def outage_run(tmp_path, role, extra=()):
    """Kills lighthouse ``role`` once every group is past step 30; the supervisor brings
    it back 10 s later. Records whether a status file showed the outage meanwhile."""
    seen = {}

    def during(job):
        if "kill" not in seen and all(int((job.status(k) or {}).get("step", 0)) >= 30 for k in ALL):
            seen["kill"] = time.time()
            job.kill_lighthouse(role)
        if "kill" in seen:
            for k in ALL:
                out = (job.status(k) or {}).get("outage") or {}
                for level, o in out.items():
                    seen.setdefault("status", set()).add((k, level, o.get("field")))

    run = run_job(tmp_path, [*OUTAGE, *extra], during=during, restart=True, timeout_s=300)
    assert "kill" in seen, logs_tail(run)
    return run, seen


def check_common(run, role, seen):
    # No replica process exited or was restarted: every group rode out the outage.
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    assert not [h for h in run.job.history if h["event"] == "restart" and not isinstance(h["key"], str)], run.job.history
    assert all(len(history(run, "start", k)) == 1 for k in ALL)
    # The supervisor restarted the lighthouse once, at its address, ~10 s after the kill.
    (restart,) = history(run, "restart", role)
    (up,) = [h for h in history(run, "up", role) if h["t"] >= restart["t"]]
    assert 9.5 <= restart["t"] - seen["kill"] <= 10 + 5, restart["t"] - seen["kill"]
    assert run.summary["consistent"] is True
    return up["t"]


def saw_outage(run, seen, key, level, field):
    """``key`` published the outage (status file) and wrote its start and end events."""
    states = [e["state"] for e in run.kinds(key, "outage", level=level)]
    assert states[:1] == ["start"] and "end" in states, states
    assert (key, level, field) in seen.get("status", set()), seen


def resumed_after(run, key, level, t_kill, t_up):
    """Seconds from the lighthouse's return to ``key``'s next commit at ``level``, and the
    level's commit period measured before the kill."""
    times = sorted(e["t"] for e in run.kinds(key, "commit", level=level))
    period = statistics.median([b - a for a, b in zip(times, times[1:]) if b < t_kill])
    # No commit at the level can come between the outage's first slice and the return (t_up
    # is when the launcher saw the lighthouse answer: a member's quorum can be there first).
    return max(0.0, min(t for t in times if t > t_kill + HB_S) - t_up), period


def test_global_lighthouse_killed_and_restarted_costs_no_process_and_no_sync_inside_clusters(tmp_path):
    run, seen = outage_run(tmp_path, "global")
    t_kill = seen["kill"]
    t_up = check_common(run, "global", seen)
    # Every group kept stepping during the outage (0.1 s steps: ~10 per second when not waiting).
    for k in ALL:
        n = steps_between(run, k, t_kill + HB_S, t_up)
        assert n >= 20, (k, n, logs_tail(run))
    # ... and kept committing inner rounds inside its cluster.
    for k in ALL:
        assert [e for e in run.kinds(k, "commit", level="inner") if t_kill + HB_S < e["t"] < t_up], k
    # The leaders saw the outage, published it, and it ended.
    for leader in [(0, 0), (1, 0)]:
        saw_outage(run, seen, leader, "outer", "lighthouse.global_addr")
    # Outer commits resume soon after the lighthouse answers again: within a probe backoff
    # (<= the heartbeat timeout) plus one outer period (measured before the kill).
    resumed, period = resumed_after(run, (0, 0), "outer", t_kill, t_up)
    print(f"global lighthouse outage: resumed {resumed:.2f}s after it answered (outer period {period:.2f}s, heartbeat {HB_S}s)")
    assert resumed <= HB_S + 2 * period + 1.0, (resumed, period)


def test_cluster_lighthouse_killed_and_restarted_costs_no_process(tmp_path):
    # A member trains alone for up to ~15 s of 0.1 s steps here (<= 30 rounds of 5): within
    # the inner stale-update bound, so its steps through the outage must all count.
    run, seen = outage_run(tmp_path, "cluster0", extra=["sync.inner.max_staleness=64"])
    t_kill = seen["kill"]
    t_up = check_common(run, "cluster0", seen)
    # Cluster 0's groups kept stepping without their lighthouse.
    for k in [(0, 0), (0, 1)]:
        n = steps_between(run, k, t_kill + HB_S, t_up)
        assert n >= 20, (k, n, logs_tail(run))
        saw_outage(run, seen, k, "inner", "lighthouse.cluster_addrs[0]")
    # Inner commits in cluster 0 resume within a probe backoff plus one inner period.
    resumed, period = resumed_after(run, (0, 1), "inner", t_kill, t_up)
    # Cluster 1 needs cluster 0's leader for its outer rounds (min_clusters=2): the leader
    # keeps syncing across clusters with its own model while its cluster lighthouse is out,
    # so cluster 1 never waits for the outage.
    assert [e for e in run.kinds((0, 0), "commit", level="outer") if t_kill + HB_S < e["t"] < t_up], logs_tail(run)
    times = sorted(e["t"] for e in run.kinds((1, 1), "loss") if t_kill <= e["t"] <= t_up + 5)
    pause = max(b - a for a, b in zip(times, times[1:]))
    # c0r1 missed those outer rounds: the leader is outer rounds ahead (training_progress
    # compares the outer round first), so torchft heals c0r1 from it once it can. Its local
    # steps through the outage are not lost: the heal contributes them as a stale update
    # (committed.py, _stale_inner), never as a weight-0 round. (Should that round fail
    # anyway, it rolls back: a rollback's loss, not a heal's.)
    # (From the outage's first slice on, not from t_up: the launcher records the lighthouse's
    # return after polling it, and a CI run's heal came 20 ms before that record.)
    back = t_kill + HB_S
    healed = [e for e in run.kinds((0, 1), "heal", level="inner") if e["t"] > back]
    stale = [e for e in run.kinds((0, 1), "stale_update", level="inner") if e["t"] > back]
    rolled = [e for e in run.kinds((0, 1), "rollback", level="inner") if e["t"] > back]
    assert healed and ((stale and stale[0]["steps"] >= 20) or rolled), (healed, stale, logs_tail(run))
    assert not [e for e in run.kinds((0, 1), "discard") if e["t"] > back and e.get("reason") == "heal"], logs_tail(run)
    print(f"cluster lighthouse outage: inner commits resumed {resumed:.2f}s after it answered (inner period {period:.2f}s); "
          f"cluster 1's longest pause between two steps during the outage {pause:.1f}s")
    assert pause <= HB_S + 2.0, pause
    assert resumed <= HB_S + 2 * period + 1.0, (resumed, period)


def test_a_silent_lighthouse_is_ridden_out_until_the_outage_limit(tmp_path):
    """SIGSTOPped lighthouses accept connections but never answer: the groups keep
    stepping, then give up past sync.outage_limit_s with one line naming the field."""
    paused = {}

    def pause(job):
        if not paused and all(int((job.status(k) or {}).get("step", 0)) >= 10 for k in ALL):
            paused["t"] = time.time()
            for role in job.lighthouses:
                job.kill_lighthouse(role, signal.SIGSTOP)

    run = run_job(tmp_path, ["train.min_step_time_s=0.05", "sync.inner.every=5", "sync.outer.every=2", "train.steps=5000",
                             "train.log_every=1", "sync.outage_limit_s=8"], during=pause, timeout_s=120)
    assert paused, "never paused the lighthouses"
    for key in ALL:
        assert run.codes[key] == 1, logs_tail(run)
        log = (run.job.run_dir / "logs" / f"c{key[0]}r{key[1]}.log").read_text()
        assert "has not answered for" in log and "sync.outage_limit_s=8" in log, log[-2000:]
        assert f"lighthouse.cluster_addrs[{key[0]}]=" in log or "lighthouse.global_addr=" in log
        # It trained on during the outage ...
        assert steps_between(run, key, paused["t"] + HB_S, paused["t"] + 8) >= 10, key
        # ... and gave up after the limit, within a probe backoff and a round.
        (exit_,) = history(run, "exit", key)
        assert 8 <= exit_["t"] - paused["t"] <= 8 + 2 * HB_S + 5, exit_["t"] - paused["t"]


def test_a_run_that_ends_during_its_cluster_lighthouses_outage_ends_consistent(tmp_path):
    """Cluster 0's lighthouse is killed ~20 steps before the end and stays down 20 s: its
    groups skip their last rounds, the leader syncs across clusters alone, and the loop ends
    with the cluster on two models. Each waits for the lighthouse (sync.final_wait_s,
    sync/final.py), a join round brings the member to the leader's model, and the job ends
    consistent with no process restarted."""
    seen = {}

    def during(job):
        if "kill" not in seen and all(int((job.status(k) or {}).get("step", 0)) >= 280 for k in ALL):
            seen["kill"] = time.time()
            job.kill_lighthouse("cluster0")

    # sync.final_wait_s: the wait must outlast the lighthouse's restart delay and its cold start
    run = run_job(tmp_path, [*OUTAGE, "lighthouse.restart_delay_s=20", "sync.final_wait_s=240"], during=during, restart=True,
                  timeout_s=400)
    assert "kill" in seen, logs_tail(run)
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    assert not [h for h in run.job.history if h["event"] == "restart" and not isinstance(h["key"], str)], run.job.history
    for k in [(0, 0), (0, 1)]:
        waits = run.kinds(k, "final_wait")
        assert [e["state"] for e in waits] == ["start", "done"], (k, waits, logs_tail(run))
        done = waits[-1]
        assert done["quorum"] == 2 and done["step"] == 300, done
    assert not run.kinds((1, 0), "final_wait") and not run.kinds((1, 1), "final_wait")  # their last round ran
    assert run.summary["consistent"] is True, run.summary["checksums"]


def test_a_group_back_after_the_job_finished_exits_0_and_is_not_restarted(tmp_path):
    """A group stopped until the others finished trains on alone, fails its outer quorums,
    learns the job is over and exits 0; started again, it exits 0 at once."""
    state = {}

    def during(job):
        st = job.status((1, 1)) or {}
        if "stop" not in state and int(st.get("step", 0)) >= 20:
            state["stop"] = time.time()
            os.kill(job.replicas[(1, 1)].popen.pid, signal.SIGSTOP)
        if "stop" in state and "cont" not in state and all(job.result(k) for k in ALL if k != (1, 1)):
            state["cont"] = time.time()
            os.kill(job.replicas[(1, 1)].popen.pid, signal.SIGCONT)

    run = run_job(tmp_path, ["train.min_step_time_s=0.05", "sync.inner.every=5", "sync.outer.every=2", "train.steps=100",
                             "timeouts.outer_quorum=4", "sync.max_quorum_failures=2"],
                  during=during, restart=True, timeout_s=180)
    assert "cont" in state, logs_tail(run)
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    assert len(history(run, "start", (1, 1))) == 1 and not history(run, "restart", (1, 1))
    log = (run.job.run_dir / "logs" / "c1r1.log").read_text()
    assert "the job has finished without this replica group" in log, log[-2000:]
    assert run.job.result((1, 1)) is None  # no result: it did not finish the run
    # Started again on the finished job, it says so and exits 0 at once: before any quorum
    # or phase (no timeout waited out; its cold start is not the point, so no clock here).
    glog = run.job.run_dir / "logs" / "c1r1.log"
    before = glog.stat().st_size
    proc = run.job.start_replica(1, 1)
    assert proc.popen.wait(timeout=180) == 0
    second = glog.read_bytes()[before:].decode(errors="replace")
    assert "the job has finished without this replica group" in second, second
    assert "quorum" not in second and " phase " not in second, second
    assert (run.job.run_dir / "logs" / "c1r1.log").read_text().count("the job has finished without this replica group") == 2


def test_outage_clock_backs_off_and_gives_up_after_the_limit():
    """The retry policy on a fake clock: probes only when due, backoff capped at the
    heartbeat timeout, limit enforced, recovery resets the clock."""
    from datetime import timedelta

    now = [0.0]
    answers = []
    h = LighthouseHealth("outer", "lighthouse.global_addr", "http://x:1", timedelta(seconds=1), timedelta(seconds=2),
                         timedelta(seconds=10), probe=lambda addr, t: answers.append(now[0]) or False, clock=lambda: now[0])
    h.before_quorum()  # not down: no probe
    assert answers == []
    assert h.probe() is False and h.down and answers == [0.0]
    with pytest.raises(LighthouseOutage, match="skipping"):
        h.before_quorum()  # next probe due at 1.0
    assert answers == [0.0]
    for t in (1.0, 3.0, 5.0, 7.0, 9.0):  # backoff 1, then 2 (capped)
        now[0] = t
        with pytest.raises(LighthouseOutage, match="retry"):
            h.before_quorum()
    assert answers == [0.0, 1.0, 3.0, 5.0, 7.0, 9.0]
    assert h.describe()["retries"] == 5
    now[0] = 10.5
    with pytest.raises(OutageLimitExceeded, match="sync.outage_limit_s=10"):
        h.before_quorum()
    h.mark_up()
    assert not h.down and h.describe() is None


def test_a_refused_probe_is_retried_at_every_round_a_silent_one_backs_off():
    """A lighthouse that refuses connections (killed, restarting) costs a probe nothing, so
    every round probes it and its return is seen at the next round; a silent one keeps the
    backoff (each of its probes costs a probe timeout: 1 s, then 2 s here)."""
    from datetime import timedelta

    from hier_localsgd.core.ft.outage import REFUSED, SILENT

    for seen, probed_at in ((REFUSED, [0.0, 0.5, 1.0, 1.5, 2.0]), (SILENT, [0.0, 1.0])):
        now, answers = [0.0], []
        h = LighthouseHealth("inner", "lighthouse.cluster_addrs[0]", "http://x:1", timedelta(seconds=1), timedelta(seconds=5),
                             timedelta(seconds=60), probe=lambda addr, t: answers.append(now[0]) or seen, clock=lambda: now[0])
        assert h.probe() is False and h.down
        for t in (0.5, 1.0, 1.5, 2.0):  # a round every 0.5 s
            now[0] = t
            with pytest.raises(LighthouseOutage):
                h.before_quorum()
        assert answers == probed_at, seen


def test_lighthouse_probe_tells_up_refused_and_silent_apart_on_real_sockets():
    """Loopback only: an HTTP server answers (UP); a closed port refuses (REFUSED); a
    socket that listens but never answers times out (SILENT)."""
    import socket
    import threading
    from datetime import timedelta
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from hier_localsgd.core.ft.outage import REFUSED, SILENT, UP, lighthouse_probe

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # the kernel completes the handshake; nobody ever reads or answers
    try:
        t = timedelta(seconds=0.5)
        assert lighthouse_probe(f"http://127.0.0.1:{srv.server_address[1]}", t) == UP
        assert lighthouse_probe(f"http://127.0.0.1:{closed_port}", t) == REFUSED
        assert lighthouse_probe(f"http://127.0.0.1:{mute.getsockname()[1]}", t) == SILENT
    finally:
        srv.shutdown()
        srv.server_close()
        mute.close()


def process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_survivors_abandon_a_collective_with_a_stopped_peer_within_the_heartbeat_timeout(tmp_path):
    """c0r1 SIGSTOPs itself as it enters INNER_REDUCE at step 10 (a wedged host, heartbeat
    and all). Its cluster peer, waiting for it in the round's first all-reduce, gives up
    once the lighthouse shows c0r1's heartbeat lapsed, not at the 30 s phase deadline;
    c0r1, continued 8 s later, rejoins (or its watchdog ends it and it restarts) and heals."""
    state = {}

    def during(job):
        pid = job.replicas[(0, 1)].popen.pid
        if "stopped" not in state and process_state(pid) == "T":
            state["stopped"] = time.time()
        if "stopped" in state and "cont" not in state and time.time() - state["stopped"] >= 8:
            state["cont"] = time.time()
            os.kill(pid, signal.SIGCONT)

    run = run_job(tmp_path, ["train.min_step_time_s=0.05", "sync.inner.every=5", "sync.outer.every=2", "train.steps=150", "train.log_every=1",
                             "faults=[{cluster:0,replica:1,step:10,action:stop,phase:INNER_REDUCE}]"],
                  during=during, restart=True, timeout_s=240)
    assert "cont" in state, logs_tail(run)
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    (lapse,) = [e for e in run.kinds((0, 0), "peer_lapsed", level="inner") if e["t"] < state["cont"]][:1]
    assert lapse["reason"].startswith("member c0_r0001:") and lapse["reason"].endswith("stopped heartbeating"), lapse
    # From when both were in the round: c0r1 stops (and its heartbeat with it) as it enters
    # INNER_REDUCE, which under load can be well after c0r0 did (its phase event is
    # written before the stop fires).
    entered = max(e["t"] for k in [(0, 0), (0, 1)] for e in run.kinds(k, "phase", dst="INNER_REDUCE") if e["t"] < lapse["t"])
    waited = lapse["t"] - entered
    print(f"stopped peer: c0r0 abandoned its {lapse['op']} {waited:.2f}s after entering INNER_REDUCE "
          f"(heartbeat timeout {HB_S}s, phase timeout 30s)")
    assert waited <= HB_S + 1.5, waited
    # No wait ran into its deadline in that round: the watch ended it.
    assert not [e for e in run.kinds((0, 0), "timeout") if entered <= e["t"] <= state["cont"]]
    # c0r0 kept training while c0r1 was stopped, and its inner level kept working: it
    # committed rounds (alone) on a freshly configured group, before and after c0r1 returned.
    assert steps_between(run, (0, 0), lapse["t"], state["cont"]) >= 20
    assert [e for e in run.kinds((0, 0), "commit", level="inner") if lapse["t"] < e["t"] < state["cont"]], logs_tail(run)
    assert [e for e in run.kinds((0, 0), "commit", level="inner", participants=2) if e["t"] > state["cont"]], logs_tail(run)
    # c0r1 came back and healed from its cluster (the same process, or its restart).
    assert [e for e in run.kinds((0, 1), "heal", level="inner") if e["t"] > state["cont"]], logs_tail(run)
    assert run.summary["consistent"] is True



def test_a_replica_group_restarted_during_its_lighthouses_outage_waits_for_it(tmp_path):
    """c0r1 is killed while cluster 0's lighthouse is down. Its restart finds no
    lighthouse: it waits for it instead of exiting (a first start would exit with one
    line). So that nothing races the restart's start-up time, every other group stops
    itself (fault action ``stop``: SIGSTOP) at its step-60 round, and the test brings the
    lighthouse back and resumes them (SIGCONT) only once the restart says it is waiting.
    c0r1 then heals from c0r0 — which trained on through the outage (rounds skipped) and
    must not heal from the restarted group's no-op join rounds — and the job ends
    consistent: one restart, no exit of its own, c0r0 never healed."""
    seen = {}
    log = tmp_path / "logs" / "c0r1.log"
    others = [(0, 0), (1, 0), (1, 1)]
    stop = "faults=[" + ",".join(f"{{cluster:{c},replica:{r},step:60,action:stop,phase:INNER_QUORUM}}" for c, r in others) + "]"

    def during(job):
        if "kill" not in seen and all(int((job.status(k) or {}).get("step", 0)) >= 30 for k in ALL):
            seen["kill"] = time.time()
            job.kill_lighthouse("cluster0")
            job.kill((0, 1))
        elif ("kill" in seen and "back" not in seen and log.exists() and "waiting for it" in log.read_text()
              and all(process_state(job.replicas[k].popen.pid) == "T" for k in others)):  # a fast restart waits for the stops
            seen["back"] = time.time()
            job.start_lighthouse("cluster0")
            for k in others:
                os.killpg(job.replicas[k].popen.pid, signal.SIGCONT)

    # the stopped groups' quorum deadline outlasts any cold restart: the watchdog, counting
    # wall time, would end them on SIGCONT otherwise
    run = run_job(tmp_path, [*OUTAGE, "lighthouse.supervise=false", "timeouts.inner_quorum=240", stop], during=during,
                  restart=True, timeout_s=300)
    assert "back" in seen, logs_tail(run)
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    exits = [h["code"] for h in history(run, "exit", (0, 1))]
    assert exits == [-9, 0], (exits, logs_tail(run))  # the kill, then the restart's clean end
    assert len(history(run, "restart", (0, 1))) == 1
    assert run.kinds((0, 1), "heal", level="inner"), "the restarted group must heal from c0r0"
    assert "answers again" in log.read_text()
    assert not run.kinds((0, 0), "heal", level="inner")  # c0r0's training was not reset
    assert run.summary["consistent"] is True


def test_a_failed_quorum_checks_whether_the_job_finished_at_the_first_failure():
    """HierarchicalSync._quorum_failed asks job_done at every failure, so a group behind a
    finished job leaves after one quorum timeout (JobFinished: exit 0), not after
    sync.max_quorum_failures of them; with the job not finished it counts as before."""
    import types

    from hier_localsgd.sync.common import FatalSyncError, JobFinished
    from hier_localsgd.sync.hier import HierarchicalSync

    def stub(done):
        s = types.SimpleNamespace(_quorum_failures={"inner": 0, "outer": 0}, id="c1r0", settings=types.SimpleNamespace(max_quorum_failures=3),
                                  job_done=lambda: done, events=lambda *a, **k: None, tracker=types.SimpleNamespace(phase=types.SimpleNamespace(value="OUTER_QUORUM")))
        s._check_job_done = lambda: HierarchicalSync._check_job_done(s)
        return s

    finished = stub("the job has finished without this replica group: c0r0 completed step 400/400")
    with pytest.raises(JobFinished):
        HierarchicalSync._quorum_failed(finished, "outer", TimeoutError("Timeout expired"))
    assert finished._quorum_failures["outer"] == 1
    running = stub(None)
    for _ in range(2):
        HierarchicalSync._quorum_failed(running, "outer", TimeoutError("Timeout expired"))
    with pytest.raises(FatalSyncError):
        HierarchicalSync._quorum_failed(running, "outer", TimeoutError("Timeout expired"))
