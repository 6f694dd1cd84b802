"""Replica groups of several ranks, launched by torchrun: 2 clusters x 2 groups x 2 ranks."""

import os
import signal
import time

import pytest

from harness import WAIT_FOR_RESTART, job_listeners, logs_tail, run_job, when_step, wildcard
from hier_localsgd.costs import ring_allreduce_bytes
from hier_localsgd.core.runtime.status import read_events, read_json, replica_dir

pytestmark = pytest.mark.slow

G2 = ["topology.ranks_per_replica=2", "sync.inner.every=5", "sync.outer.every=2"]


def rank_pid(job, key, rank):
    st = read_json(replica_dir(job.run_dir, *key, rank) / "status.json") or {}
    return st.get("pid")


def test_two_ranks_per_group_train_consistently_with_one_model_per_cluster_on_slow_links(tmp_path):
    seen: dict = {}
    ports: dict = {}  # each group's store: where its rank 0's torchrun told it (MASTER_PORT)

    def during(job):
        seen.update(job_listeners(job))
        for k in job.keys():
            pid = rank_pid(job, k, 0)
            try:
                env = dict(v.split("=", 1) for v in open(f"/proc/{pid}/environ").read().split("\0") if "=" in v)
                ports[k] = (pid, env["MASTER_PORT"])
            except (OSError, KeyError, TypeError):
                pass  # not started yet, or gone

    run = run_job(tmp_path, [*G2, "train.steps=40"], during=during)
    assert all(c == 0 for c in run.codes.values()), logs_tail(run)
    # No listener of the job on every interface, torchrun's included (launch/rendezvous.py:
    # its agent hosts no store; each group's rank 0 hosts the group's on run.hostname).
    assert not wildcard(seen), f"listeners on every interface: {wildcard(seen)}"
    agents = {p.popen.pid for p in run.job.replicas.values()}
    assert not agents & set(seen.values()), seen
    assert len(ports) == 4, ports
    for k, (pid, port) in ports.items():
        assert [a for a, p in seen.items() if p == pid and a.endswith(f":{port}")], (k, pid, port, seen)
    s = run.summary
    assert s["consistent"] is True and len(s["checksums"]) == 8  # every rank of every group
    # Each rank syncs half of the model over its own ring: together one model per cluster.
    rounds = s["outer_rounds_committed"]
    assert s["bytes_sent"]["outer"]["payload"] == pytest.approx(rounds * 2 * ring_allreduce_bytes(s["model_bytes"] / 2, 2) * 2, rel=1e-3)
    # One log file per rank; the group's console log carries rank 0 only, tagged.
    for c, r in run.job.keys():
        group_log = (run.job.run_dir / "logs" / f"c{c}r{r}.log").read_text()
        assert f"[c{c}r{r}g0 " in group_log and f"[c{c}r{r}g1 " not in group_log
        rank_logs = list((run.job.run_dir / "logs" / f"c{c}r{r}.ranks").rglob("stderr.log"))
        assert len(rank_logs) == 2
        assert any(f"[c{c}r{r}g1 " in p.read_text() for p in rank_logs)
    # every rank trained on its own data shard: rank results differ in train loss
    r0 = read_json(replica_dir(run.job.run_dir, 0, 0) / "result.json")
    r1 = read_json(replica_dir(run.job.run_dir, 0, 0, 1) / "result.json")
    assert r0["train_loss"] != r1["train_loss"] and r0["checksum"] == r1["checksum"]


def test_a_dead_rank_takes_its_group_down_and_the_group_restarts_and_heals(tmp_path):
    killed = {}

    def kill_rank1(job):
        pid = rank_pid(job, (0, 1), 1)
        if pid:
            killed["pid"], killed["t"] = pid, time.time()
            os.kill(pid, signal.SIGKILL)

    killer = when_step((0, 1), 12, kill_rank1)
    run = run_job(tmp_path, [*G2, *WAIT_FOR_RESTART, "train.min_step_time_s=0.1", "train.steps=60"], during=killer)
    assert killed, "never killed rank 1"
    assert all(c == 0 for c in run.codes.values()), logs_tail(run)
    # The surviving rank went down cleanly — its group collective failed (or torchrun sent
    # SIGTERM), and it stopped its heartbeat — before torchrun restarted both ranks ...
    group_log = (run.job.run_dir / "logs" / "c0r1.log").read_text()
    # the first sign of going down: both lines may come (it exits on the failed collective,
    # then torchrun's SIGTERM arrives after its Managers are already shut down)
    down = min((i for i in (group_log.find("exiting with code"), group_log.find("received SIGTERM")) if i >= 0), default=-1)
    stopped = group_log.find("inner manager c0_r0001 shut down (heartbeat stopped)", down)
    restarted = group_log.find("inner manager c0_r0001 up", down)
    assert 0 <= down < stopped < restarted, group_log[-3000:]
    # ... which healed from the other replica group of the cluster and finished consistent.
    heals = [e for e in run.kinds((0, 1), "heal", level="inner") if e["t"] > killed["t"]]
    assert heals and heals[0]["step"] > 12
    assert run.summary["consistent"] is True and len(run.summary["checksums"]) == 8


def test_workers_exit_when_their_torchrun_agent_is_killed(tmp_path):
    """torchrun starts workers in their own sessions: a SIGKILLed agent must not leave them
    heartbeating (invariant I7); the launcher then restarts the group, which heals."""
    seen = {}

    def kill_agent(job):
        seen["pids"] = [rank_pid(job, (1, 1), g) for g in (0, 1)]
        seen["t"] = time.time()
        os.kill(job.replicas[(1, 1)].popen.pid, signal.SIGKILL)  # the agent only

    killer = when_step((1, 1), 12, kill_agent)
    run = run_job(tmp_path, [*G2, *WAIT_FOR_RESTART, "train.min_step_time_s=0.1", "train.steps=60"], during=killer, restart=True, restart_delay_s=1.0)
    assert seen and all(seen["pids"])
    for pid in seen["pids"]:  # the orphaned workers are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # rank 0's log of the dead incarnation says why it stopped
    assert all(c == 0 for c in run.codes.values()), logs_tail(run)
    ranks_logs = "".join(p.read_text() for p in (run.job.run_dir / "logs" / "c1r1.ranks").rglob("stderr.log"))
    assert "received SIGTERM" in ranks_logs or "torchrun agent) is gone" in ranks_logs
    assert run.kinds((1, 1), "heal", level="inner"), "the restarted group never healed"
    assert run.summary["consistent"] is True



def test_a_failure_one_rank_of_a_group_sees_is_acted_on_by_both_ranks(tmp_path):
    """Issue #30: the leader group's rank 1 alone sees its inner consistency exchange fail
    at an outer-round step (step 10: inner every 5, outer every 2). Rank 0's ring went
    through, so on its own rank 0 would go on to OUTER_QUORUM while rank 1, with no weight
    in its plan, would go to INNER_COMMIT: the group's Manager calls split and rank 1's
    commit vote timed out (then the whole group exited and restarted). The ranks now vote:
    both see the failed inner round, both run the outer round without contributing, both
    roll the round back, and nobody restarts."""
    fault = "faults=[{cluster:0,replica:0,step:10,action:fail,phase:INNER_REDUCE,rank:1,collective:control}]"
    run = run_job(tmp_path, [*G2, "train.steps=30", fault])
    assert all(c == 0 for c in run.codes.values()), logs_tail(run)
    assert run.summary["consistent"] is True and len(run.summary["checksums"]) == 8
    ev = {g: read_events(replica_dir(run.job.run_dir, 0, 0, g) / "events.jsonl") for g in (0, 1)}
    fired = [e for e in ev[1] if e["kind"] == "fault"]
    assert [(e["step"], e["phase"]) for e in fired] == [(10, "INNER_REDUCE")], fired
    assert not [e for e in ev[0] if e["kind"] == "fault"]  # rank 0 saw no failure of its own ...
    votes = [e for e in ev[0] if e["kind"] == "group_vote"]
    assert [(e["what"], e["overruled"]) for e in votes] == [("inner round", ["inner_ok"])], votes  # ... its sibling's vote told it

    def path(g):  # what each rank did with the round at step 10: its rollbacks and commits, in order
        return [(e["kind"], e.get("level")) for e in ev[g] if e.get("step") == 10 and e["kind"] in ("rollback", "commit")]

    assert path(0) == path(1), (path(0), path(1))
    assert ("rollback", "inner") in path(0), path(0)
    # the run went on: both ranks committed the rounds after it
    assert all(any(e["kind"] == "commit" and e["level"] == "inner" and e["step"] == 30 for e in ev[g]) for g in (0, 1))


def _ddp_rank(rank: int, store_port: int, q) -> None:  # type: ignore[no-untyped-def]
    """One rank wired as the trainer wires it: FlatParams (parameters in one buffer) + DDP.
    Every wait has a deadline; an error goes back to the test with its traceback."""
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import TCPStore
    from torch.nn.parallel import DistributedDataParallel

    from hier_localsgd.core.tensors.flat_params import FlatParams
    from hier_localsgd.train.model import build_model, lm_loss

    try:
        torch.set_num_threads(1)
        # The test process holds the store's port (bound before the ranks start: no other
        # test's listener can take it), and no file lock is involved.
        store = TCPStore("127.0.0.1", store_port, world_size=2, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
        x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(100 + rank))  # a batch per rank
        solo = build_model("tiny", 64, 16, 32, seed=0)  # the same model without DDP: this rank's own gradient
        lm_loss(solo, x[:, :-1], x[:, 1:]).backward()
        own = torch.cat([p.grad.reshape(-1) for p in solo.parameters()])
        model = build_model("tiny", 64, 16, 32, seed=0)
        FlatParams(model)
        ddp = DistributedDataParallel(model, forward_sync_buffers=False)
        lm_loss(ddp, x[:, :-1], x[:, 1:]).backward()
        avg = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        q.put((rank, own.numpy(), avg.numpy()))  # numpy: pickled by value, not shared by fd
        dist.destroy_process_group()
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
        raise


def test_ddp_inside_a_group_averages_gradients(tmp_path):
    """Two real gloo ranks: after backward, each rank's gradients (what the inner optimizer
    steps on) are the average of the two ranks' own."""
    import queue

    import torch
    import torch.multiprocessing as mp

    from datetime import timedelta

    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, world_size=3, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, server.port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + 120
    while len(results) < len(procs):  # a rank that died fails the test at once, with its exit code
        try:
            results.append(q.get(timeout=1))
        except queue.Empty:
            dead = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            errors = [(r, tb) for r, own, tb in results if isinstance(own, str)]
            assert not dead and time.monotonic() < deadline, f"ranks {dead} died (rank, exit code), or 120 s passed; errors {errors}"
    errors = [(r, tb) for r, own, tb in results if isinstance(own, str)]
    assert not errors, errors
    got = {r: (torch.from_numpy(own), torch.from_numpy(avg)) for r, own, avg in results}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (own0, avg0), (own1, avg1) = got[0], got[1]
    assert not torch.allclose(own0, own1)  # the ranks' batches differ
    assert torch.equal(avg0, avg1)
    torch.testing.assert_close(avg0, (own0 + own1) / 2, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("eager", [False, True], ids=["plain", "eager"])
def test_two_ranks_per_group_with_overlapped_int8_fragments_stay_consistent(tmp_path, eager):
    """Every outer mechanism of #13 at once on groups of two ranks (each rank syncing its own
    slice of the model): streaming fragments (F = 2), overlap by one inner round, int8 with
    error feedback. Outer rounds at steps 10, 20, 30 sync fragments 0, 1, 0 (each rank the
    part of the fragment inside its slice); the last one, at 40, syncs everything, blocking.
    Eager updates too (#29 §2): every rank steps its slice of the launched fragment (a rank
    whose slice misses it steps nothing) and the group's all-gather runs on every rank."""
    frag = ["sync.outer.every=4", "sync.outer.fragments=2", "sync.outer.delay=1", "sync.outer.compression=int8",
            f"sync.outer.eager={eager}"]
    run = run_job(tmp_path, [*G2, *frag, "train.steps=40"])
    assert all(c == 0 for c in run.codes.values()), logs_tail(run)
    s = run.summary
    assert s["consistent"] is True and len(s["checksums"]) == 8
    assert s["outer_rounds_committed"] == 4
    for c in range(2):
        leader = run.kinds((c, 0), "commit", level="outer")
        assert [e["fragment"] for e in leader] == [0, 1, 0, None], leader
        assert not run.kinds((c, 0), "rollback") and not run.kinds((c, 1), "rollback")
    # both ranks of a group hold the same model, and it is not the initial one (it trained)
    r0 = read_json(replica_dir(run.job.run_dir, 1, 1) / "result.json")
    r1 = read_json(replica_dir(run.job.run_dir, 1, 1, 1) / "result.json")
    assert r0["checksum"] == r1["checksum"] and r0["train_loss"] != r1["train_loss"]
    if eager:
        for c in range(2):
            assert [e["step"] for e in run.kinds((c, 1), "eager_step")] == [10, 20, 30], run.kinds((c, 1), "eager_step")


def test_a_multi_rank_group_that_keeps_poisoning_stays_stopped_under_torchrun(tmp_path):
    """torchrun restarts a group's workers after any exit, exit 2 included, and hands the
    launcher its own code. A group that gave up on the poison limit (exit 2 on its ranks)
    leaves a stop file: torchrun's restarts exit 2 at once without training, and the
    launcher counts the group as exit 2 and does not restart it (issue #30: a multi-rank
    group came back with a fresh offence count)."""
    run = run_job(tmp_path, [*G2, "train.steps=30", "sync.poison.max_offences=1",
                             "faults=[{cluster:0,replica:1,step:7,action:poison}]"], restart=True)
    assert run.codes[(0, 1)] == 2, (run.codes, logs_tail(run))
    assert all(c == 0 for k, c in run.codes.items() if k != (0, 1)), logs_tail(run)
    assert sum(1 for h in run.job.history if h.get("event") == "restart") == 0
    stop = replica_dir(run.job.run_dir, 0, 1) / "stopped"
    assert "PoisonLimit" in stop.read_text()
    logs = "".join(p.read_text() for p in (run.job.run_dir / "logs").glob("c0r1*.log"))
    assert "stopped earlier in this launch, not rejoining" in logs  # torchrun's restarts went no further
    ev = read_events(replica_dir(run.job.run_dir, 0, 1) / "events.jsonl")
    assert not [e for e in ev if e["kind"] == "commit" and e["step"] > 10]  # it never trained again
