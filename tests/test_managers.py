"""LevelManager against real torchft lighthouses: a lighthouse restarted on its address
numbers quorums from 1 again, and a reissued quorum id with other members must get a
freshly configured process group (managers.LevelManager._on_quorum); a quorum formed with
a request its replica had given up is dropped within the presence timeout and formed
again with the replica's live request (presence.py)."""

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
from torch.distributed import ReduceOp, TCPStore
from torchft.coordination import LighthouseServer

from hier_localsgd.core.links.link import LinkProcessGroup
from hier_localsgd.core.ft.managers import LevelManager, QuorumFailed
from hier_localsgd.core.ft.outage import LighthouseHealth, LighthouseOutage, lighthouse_answers
from hier_localsgd.core.ft.peers import await_heartbeats
from hier_localsgd.core.ft.presence import PresenceCheck, QuorumAbsent
from hier_localsgd.core.runtime.timeouts import Timeouts

OP_S = 8  # each collective's timeout: a stale two-member group waits this long, then fails


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lighthouse(port: int) -> LighthouseServer:
    return LighthouseServer(bind=f"127.0.0.1:{port}", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=20,
                            heartbeat_timeout_ms=1000)


def level_manager(addr: str, rid: str, presence_s: float = 0.0, heartbeat_s: float = 0.1) -> LevelManager:
    t = Timeouts(connect=timedelta(seconds=5), inner_quorum=timedelta(seconds=15),
                 inner_reduce=timedelta(seconds=OP_S), inner_commit=timedelta(seconds=OP_S))
    pg = LinkProcessGroup("inner", timedelta(seconds=OP_S))
    return LevelManager("inner", rid, addr, "lighthouse.cluster_addrs[0]", pg, state_dict=lambda: {},
                        load_state_dict=lambda sd: None, min_replicas=1, timeouts=t, hostname="127.0.0.1",
                        presence_timeout=timedelta(seconds=presence_s) if presence_s else None,
                        heartbeat_interval=timedelta(seconds=heartbeat_s))


def _beat_until(addr: str, replica_id: str, stop: threading.Event) -> None:
    """Heartbeats ``replica_id`` to the lighthouse every 0.1 s until ``stop`` is set."""
    from torchft.coordination import LighthouseClient

    client = LighthouseClient(addr, connect_timeout=timedelta(seconds=5))
    while not stop.is_set():
        try:
            client.heartbeat(replica_id, timeout=timedelta(seconds=1))
        except Exception:  # the lighthouse is starting: the next beat tries again
            pass
        stop.wait(0.1)


def allreduce_sum(m: LevelManager, value: float) -> float:
    t = torch.tensor([value])
    m.manager._pg.allreduce([t], ReduceOp.SUM).wait()
    return float(t.item())


def test_a_restarted_lighthouse_reissuing_a_quorum_id_gets_a_fresh_group():
    port = free_port()
    lh = lighthouse(port)
    addr = f"http://127.0.0.1:{port}"
    a, b = level_manager(addr, "a_r0000"), level_manager(addr, "b_r0001")
    try:
        views = quorum_of_both(addr, a, b, timedelta(seconds=15))
        assert {getattr(v, "size", v) for v in views.values()} == {2}, views
        first_id = a.quorum_id
        sums = {}
        ths = [threading.Thread(target=lambda m=m, v=v: sums.__setitem__(m.replica_id, allreduce_sum(m, v)))
               for m, v in ((a, 1.0), (b, 2.0))]
        for th in ths:
            th.start()
        for th in ths:
            th.join(30)
        assert sums == {"a_r0000": 3.0, "b_r0001": 3.0}

        # The lighthouse dies and comes back on its address; b is gone for good.
        lh.shutdown()
        b.shutdown()
        b = None
        lh = lighthouse(port)
        # torchft's own heartbeat reaches the new lighthouse only after its reconnect backoff
        # (up to ~10 s, longer on a loaded machine; the quorum waits for a heartbeat): beat
        # directly while asking, as a returning member does (LevelManager._rejoin). 90 s: a
        # fresh-clone CI run under full load once ran past 30 s here.
        asked = threading.Event()
        beater = threading.Thread(target=_beat_until, args=(addr, a.full_replica_id, asked), daemon=True)
        beater.start()
        try:
            view = a.start_quorum(timedelta(seconds=90))
        finally:
            asked.set()
            beater.join(5)
        assert view.size == 1
        assert a.quorum_id == first_id, "the test needs the restarted lighthouse to reissue the id"
        # Before the fix torchft kept the two-member group of the old quorum with this id and
        # ran this all-reduce on it (it failed: b's end is closed; a live b elsewhere would
        # have left it waiting OP_S). On a fresh group of one it is a's own value.
        assert allreduce_sum(a, 5.0) == 5.0
    finally:
        for m in (a, b):
            if m is not None:
                m.shutdown()
        lh.shutdown()


def in_threads(*calls):
    """Runs each (name, fn) in its own thread; returns name -> result or exception."""
    out = {}

    def run(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # reported to the test, which asserts on it
            out[name] = e

    ths = [threading.Thread(target=run, args=c) for c in calls]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    return out


def quorum_of_both(addr: str, a: LevelManager, b: LevelManager, timeout: timedelta) -> dict:
    """a and b ask for their first quorum together, once the lighthouse has heard both.

    With min_replicas=1 a lighthouse that has not yet heard a's heartbeat forms a quorum of
    b alone at once, and a's request then waits behind the split-brain guard (b heartbeats
    but does not ask) until it fails: a CI run on a loaded machine, a QuorumFailed after 15 s.
    Once both are heard, neither can get a quorum without the other."""
    missing = await_heartbeats(addr, [a.full_replica_id, b.full_replica_id], timedelta(seconds=1), timedelta(seconds=30),
                               poll=timedelta(milliseconds=50))
    assert missing == [], f"the lighthouse never heard {missing}"
    return in_threads(("a", lambda: a.start_quorum(timeout)), ("b", lambda: b.start_quorum(timeout)))


def test_a_quorum_formed_with_a_given_up_request_is_dropped_and_formed_again_with_the_live_one(caplog):
    port = free_port()
    lh = lighthouse(port)
    addr = f"http://127.0.0.1:{port}"
    a, b = level_manager(addr, "a_r0000", presence_s=1.0), level_manager(addr, "b_r0001", presence_s=1.0)
    try:
        q = timedelta(seconds=15)
        views = quorum_of_both(addr, a, b, q)
        assert views["a"].size == views["b"].size == 2, views
        assert in_threads(("a", lambda: allreduce_sum(a, 1.0)), ("b", lambda: allreduce_sum(b, 2.0))) == {"a": 3.0, "b": 3.0}
        assert in_threads(("a", lambda: a.should_commit(q)), ("b", lambda: b.should_commit(q))) == {"a": True, "b": True}

        # b asks alone and gives up (a heartbeats but does not ask: torchft's split-brain
        # rule forms no quorum of one of two). Its request stays at the lighthouse.
        try:
            b.start_quorum(timedelta(seconds=1.5))
            raise AssertionError("b formed a quorum alone")
        except QuorumFailed:
            pass
        caplog.clear()
        # a asks: the lighthouse forms a quorum with b's left-over request at once. b asks
        # again once a holds that quorum (a starts confirming it): too late for it.
        formed = threading.Event()
        confirm = a._presence.confirm

        def confirm_and_tell(quorum, me):
            formed.set()
            return confirm(quorum, me)

        a._presence.confirm = confirm_and_tell

        def b_later():
            assert formed.wait(30), "a never got a quorum"
            return b.start_quorum(q)

        views = in_threads(("a", lambda: a.start_quorum(q)), ("b", b_later))
        assert not isinstance(views["a"], Exception) and not isinstance(views["b"], Exception), views
        assert views["a"].size == views["b"].size == 2, views
        assert a.quorum_id == b.quorum_id
        dropped = [r.getMessage() for r in caplog.records if "quorum presence abort" in r.getMessage()]
        assert dropped and "b_r0001" in dropped[0], [r.getMessage() for r in caplog.records]
        # Both are in the same group: without the check a all-reduced in the quorum with
        # b's left-over request while b waited for the next one (a failed after OP_S).
        assert in_threads(("a", lambda: allreduce_sum(a, 1.0)), ("b", lambda: allreduce_sum(b, 2.0))) == {"a": 3.0, "b": 3.0}
        assert a.manager._commit_failures == 0  # the dropped quorum's failure is taken back
    finally:
        for m in (a, b):
            m.shutdown()
        lh.shutdown()


def test_after_its_lighthouse_restarts_a_member_does_not_take_rank_0_from_one_not_heard_yet():
    """The split quorum after a lighthouse's restart (managers.LevelManager._rejoin).

    a and b held a quorum of two (a is rank 0: its cluster's leader); the lighthouse dies,
    both see the outage, it comes back on its address. b asks first, while the fresh
    lighthouse has heard only b: a's own heartbeat comes once a minute here (torchft's
    reconnects with a backoff of up to 10 s), so without the rejoin step the lighthouse
    formed a quorum of b alone at once, with b as rank 0. With it, b waits until a is
    heard, and a's request (a heartbeats first) makes the quorum of both, a still rank 0."""
    port = free_port()
    hb = timedelta(seconds=5)
    addr = f"http://127.0.0.1:{port}"

    def start():
        """A lighthouse in a process of its own, so that killing it closes its connections
        (an in-process LighthouseServer's shutdown() keeps serving connected clients).
        A heartbeat timeout of 5 s: b's wait may last 2 x 5 s, far longer than the test needs."""
        code = ("import time; from torchft.coordination import LighthouseServer; "
                f"s = LighthouseServer(bind='127.0.0.1:{port}', min_replicas=1, join_timeout_ms=200, quorum_tick_ms=20, "
                f"heartbeat_timeout_ms={int(hb.total_seconds() * 1000)}); time.sleep(600)")
        proc = subprocess.Popen([sys.executable, "-c", code])
        deadline = time.monotonic() + 60
        while not lighthouse_answers(addr, timedelta(seconds=0.5)):
            assert proc.poll() is None and time.monotonic() < deadline, "the lighthouse did not start"
            time.sleep(0.05)
        return proc

    lh = start()
    a, b = level_manager(addr, "a_r0000", heartbeat_s=60), level_manager(addr, "b_r0001", heartbeat_s=60)
    # probe timeout 2 s: a probe slower than its timeout is an outage, and a loaded machine
    # has answered a live lighthouse's probe in more than 0.2 s (a refused one is instant)
    health = {m: LighthouseHealth("inner", "lighthouse.cluster_addrs[0]", addr, timedelta(seconds=2), hb,
                                  timedelta(seconds=600)) for m in ("a", "b")}
    q = timedelta(seconds=30)
    try:
        # both heard first (quorum_of_both says why)
        assert await_heartbeats(addr, [a.full_replica_id, b.full_replica_id], hb, timedelta(seconds=30)) == []
        views = in_threads(("a", lambda: a.start_quorum(q, health["a"], hb)), ("b", lambda: b.start_quorum(q, health["b"], hb)))
        assert (views["a"].rank, views["b"].rank, views["a"].size) == (0, 1, 2), views
        lh.kill()
        lh.wait()
        for name, m in (("a", a), ("b", b)):  # each sees the outage the way a round does
            try:
                m.start_quorum(q, health[name], hb)
                raise AssertionError(f"{name} formed a quorum without a lighthouse")
            except LighthouseOutage:
                pass
            assert health[name].down
        lh = start()
        time.sleep(2.1)  # past the first probe backoff (the probe timeout, 2 s): the next request probes

        def a_later():
            # b comes first: a asks once the lighthouse has heard b (its rejoin heartbeat, or
            # without the rejoin step its request, which formed its quorum of one at once)
            await_heartbeats(addr, [b.full_replica_id], hb, timedelta(seconds=30), poll=timedelta(milliseconds=50))
            return a.start_quorum(q, health["a"], hb)

        views = in_threads(("b", lambda: b.start_quorum(q, health["b"], hb)), ("a", a_later))
        assert not isinstance(views["a"], Exception) and not isinstance(views["b"], Exception), views
        assert (views["a"].rank, views["b"].rank, views["a"].size, views["b"].size) == (0, 1, 2, 2), views
        assert not health["a"].down and not health["b"].down
    finally:
        for m in (a, b):
            m.shutdown()
        lh.kill()
        lh.wait()


class FakeQuorum:
    def __init__(self, store_address: str, ids, quorum_id: int = 7, max_step: int = 3):
        self.store_address, self.replica_ids, self.quorum_id, self.max_step = store_address, list(ids), quorum_id, max_step


def test_presence_verdict_is_one_for_every_member():
    """A real TCPStore; three members of which one never comes: both present members drop
    the quorum, the later one too although it saw no timeout of its own first; all three
    present: all use it. A quorum of one is not checked."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    where = f"127.0.0.1:{store.port}/torchft/7/0"
    ghost = FakeQuorum(where, ["x:1", "y:2", "z:3"])
    checks = [PresenceCheck(timedelta(seconds=0.5)) for _ in range(3)]
    t0 = time.monotonic()
    out = in_threads(("x", lambda: checks[0].confirm(ghost, "x:1")), ("y", lambda: checks[1].confirm(ghost, "y:2")))
    assert all(isinstance(e, QuorumAbsent) and "z:3" in str(e) for e in out.values()), out
    assert time.monotonic() - t0 < 10
    # z's own request arrives late: the verdict stands, z drops it too.
    try:
        checks[2].confirm(ghost, "z:3")
        raise AssertionError("z used a dropped quorum")
    except QuorumAbsent:
        pass
    whole = FakeQuorum(where, ["x:1", "y:2", "z:3"], max_step=4)  # the next formation: another tag
    out = in_threads(*[(n, lambda c=c, n=n: c.confirm(whole, n)) for c, n in zip(checks, ["x:1", "y:2", "z:3"])])
    assert out == {"x:1": None, "y:2": None, "z:3": None}, out
    checks[0].confirm(FakeQuorum("127.0.0.1:1/none", ["x:1"]), "x:1")  # one member: no store is even asked


def test_a_collective_abandoned_in_one_round_that_fails_later_does_not_fail_the_next_round():
    """comm.py, contract point 6, with real Managers, a real lighthouse and a real Gloo
    group: a waits in an all-reduce b never joins; b's heartbeat stops, so a abandons the
    wait (the watch) and starts its next round alone. The abandoned all-reduce fails only
    after that (b's group is aborted then). With torchft's ``wrap_future`` that failure was
    reported into a's new round and failed its commit (a CI run: two clusters one outer
    round apart at the end)."""
    from hier_localsgd.core.ft.comm import LevelComm
    from hier_localsgd.core.runtime.invariants import CollectiveGate
    from hier_localsgd.core.ft.peers import QuorumWatch
    from hier_localsgd.core.runtime.phases import Phase, PhaseTracker

    port = free_port()
    lh = lighthouse(port)
    addr = f"http://127.0.0.1:{port}"
    a, b = level_manager(addr, "a_r0000"), level_manager(addr, "b_r0001")
    events: list = []
    try:
        q = timedelta(seconds=15)
        views = quorum_of_both(addr, a, b, q)
        assert views["a"].size == views["b"].size == 2, views
        tracker = PhaseTracker("a")
        tracker.enter(Phase.INNER_QUORUM, timedelta(seconds=60))
        tracker.enter(Phase.INNER_REDUCE, timedelta(seconds=60))  # longer than the whole test: the abort ends the wait
        comm = LevelComm(a, a.pg, tracker, CollectiveGate(), events=lambda kind, **f: events.append((kind, f)),
                         watch=QuorumWatch(addr, timedelta(seconds=1), poll=timedelta(milliseconds=100)))
        b.manager._manager.shutdown()  # b's heartbeat stops; its process group stays open
        assert comm.allreduce_sum(torch.tensor([1.0]), "test") is False  # abandoned once b's heartbeat lapsed
        assert [k for k, _ in events] == ["peer_lapsed"], events
        assert a.errored() is not None  # that round fails its commit

        view = a.start_quorum(q)  # the next round: a alone
        assert view.size == 1 and a.errored() is None
        b.pg.abort(errored=False)  # now the abandoned all-reduce fails (its peer's group is gone)
        deadline = time.monotonic() + 60  # bounded: the all-reduce's own timeout is 60 s
        while a.errored() is None and not [k for k, _ in events if k == "stale_failure"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert a.errored() is None, a.errored()  # torchft's wrap_future: the abort's error, in this round
        assert [k for k, _ in events] == ["peer_lapsed", "stale_failure"], events
        assert a.should_commit(q) is True
    finally:
        for m in (a, b):
            m.shutdown()
        lh.shutdown()


def test_the_ranks_of_a_group_ask_again_together_or_all_stop():
    """A replica group of several ranks votes after every slice of its quorum request
    (LevelManager.start_quorum's ``agree``): torchft's ManagerServer hands a formed quorum
    only to the requests waiting at that instant, so a rank asking again alone could miss
    the quorum its sibling got (a CI run: the group restarted). Real lighthouse, Manager
    and slices; the sibling's votes are scripted. No quorum can form: another replica
    heartbeats but never asks (torchft's split-brain rule)."""
    port = free_port()
    lh = lighthouse(port)  # heartbeat timeout 1 s: the slices
    addr = f"http://127.0.0.1:{port}"
    hb = timedelta(seconds=1)
    b = level_manager(addr, "b_r0001")
    stop = threading.Event()
    beater = threading.Thread(target=_beat_until, args=(addr, "a_r0000:silent", stop), daemon=True)
    beater.start()
    health = LighthouseHealth("inner", "lighthouse.cluster_addrs[0]", addr, timedelta(seconds=2), hb, timedelta(seconds=600))
    try:
        assert await_heartbeats(addr, ["a_r0000:silent", b.full_replica_id], hb, timedelta(seconds=30)) == []

        def ask(sibling, budget_s=30.0):
            """b asks; the sibling's flags per slice vote come from ``sibling`` (missing: true)."""
            votes = []

            def agree(**flags):
                votes.append(flags)
                theirs = sibling[len(votes) - 1] if len(votes) <= len(sibling) else {}
                return {k: v and theirs.get(k, True) for k, v in flags.items()}

            t0 = time.monotonic()
            try:
                b.start_quorum(timedelta(seconds=budget_s), health, hb, agree=agree)
                raise AssertionError("b formed a quorum alone")
            except (QuorumFailed, LighthouseOutage) as e:
                return e, votes, time.monotonic() - t0

        asking = {"none_joined": True, "again": True, "no_outage": True}
        # the sibling joined at the second slice: b stops at once, not after its budget
        e, votes, took = ask([{}, {"none_joined": False}])
        assert isinstance(e, QuorumFailed) and "joined a quorum this rank missed" in str(e), e
        assert votes == [asking, asking] and took < 10, (votes, took)
        # the sibling found the lighthouse down: an outage on b too (its local progress is kept)
        e, votes, _ = ask([{"again": False, "no_outage": False}])
        assert isinstance(e, LighthouseOutage) and "another rank of this replica group" in str(e), e
        assert votes == [asking]
        # the sibling's budget ended first: b stops with it
        e, votes, _ = ask([{"again": False}])
        assert isinstance(e, QuorumFailed) and "stopped asking" in str(e) and votes == [asking], (e, votes)
        # nobody objects: b asks slice after slice until its own budget ends, and says so in its last vote
        e, votes, took = ask([], budget_s=2.5)
        assert isinstance(e, QuorumFailed) and not isinstance(e, LighthouseOutage), e
        assert len(votes) >= 2 and all(v == asking for v in votes[:-1]) and votes[-1]["again"] is False, votes
        assert took >= 2.4, took
    finally:
        stop.set()
        b.shutdown()
        lh.shutdown()
