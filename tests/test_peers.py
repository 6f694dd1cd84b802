"""The stopped-peer watch (peers.py) against a real torchft lighthouse and real Managers:
the status page is parsed as torchft 0.2.0 serves it, a member whose heartbeat stops is
reported once it is older than the heartbeat timeout, and a newer quorum is reported too."""

import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torchft import Manager
from torchft.coordination import LighthouseServer
from torchft.process_group import ProcessGroupGloo

from torchft.coordination import LighthouseClient

from hier_localsgd.core.ft.peers import QuorumWatch, await_heartbeats, fetch_status, parse_status

HB_MS = 1000


def manager(lh: LighthouseServer, rid: str) -> Manager:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    m = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), load_state_dict=None, state_dict=None, min_replica_size=1,
                use_async_quorum=False, timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=10),
                connect_timeout=timedelta(seconds=5), rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
                lighthouse_addr=lh.address(), replica_id=rid, hostname="127.0.0.1", heartbeat_interval=timedelta(milliseconds=100),
                init_sync=False)
    m._test_store = store  # keep the store alive with the Manager
    return m


def full_id(m: Manager) -> str:
    return m._store.get("replica_id").decode()


@pytest.fixture
def lighthouse():
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200, quorum_tick_ms=20, heartbeat_timeout_ms=HB_MS)
    yield lh
    lh.shutdown()


@pytest.fixture
def pair_lighthouse():
    """A lighthouse whose quorum needs both members: with min_replicas=1 and a 200 ms join
    timeout, a member whose request came later than that under load was left out (seen in a
    CI run: a quorum of 1)."""
    lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=200, quorum_tick_ms=20, heartbeat_timeout_ms=HB_MS)
    yield lh
    lh.shutdown()


def test_status_page_and_a_member_whose_heartbeat_stops(pair_lighthouse):
    import threading

    lighthouse = pair_lighthouse
    a, b = manager(lighthouse, "a0"), manager(lighthouse, "b1")
    try:
        ths = [threading.Thread(target=m.start_quorum, kwargs={"timeout": timedelta(seconds=10)}) for m in (a, b)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(30)
        assert a.num_participants() == 2
        view = parse_status(fetch_status(lighthouse.address(), timedelta(seconds=2)))
        assert view.quorum_id == a._quorum_id
        assert sorted(view.members) == sorted([full_id(a), full_id(b)])
        assert view.max_step == 0  # the step the members announced (no commit yet)
        assert all(view.heartbeat_age_s[m] < HB_MS / 1000 for m in view.members)
        watch = QuorumWatch(lighthouse.address(), timedelta(milliseconds=HB_MS), poll=timedelta(milliseconds=50))
        assert watch.lapsed(a._quorum_id, full_id(a)) is None  # both heartbeating
        b.shutdown(wait=False)  # b's heartbeat stops, as a stopped process's would
        t0 = time.time()
        # b's last heartbeat as the lighthouse saw it (it came before t0: measuring from t0
        # would make "never before the timeout" fail when the watch is prompt)
        last_beat = t0 - parse_status(fetch_status(lighthouse.address(), timedelta(seconds=5))).heartbeat_age_s[full_id(b)]
        why = None
        while why is None and time.time() - t0 < 10:
            time.sleep(0.1)
            why = watch.lapsed(a._quorum_id, full_id(a))
        assert why == f"member {full_id(b)} stopped heartbeating"
        assert HB_MS / 1000 <= time.time() - last_beat  # never before the heartbeat timeout (how much later depends on load)
        # a quorum id other than ours: a newer one is reported, an older (a restarted
        # lighthouse counts from 1 again) is not
        time.sleep(0.06)
        assert watch.lapsed(a._quorum_id - 1, full_id(a)) == f"the lighthouse formed quorum {a._quorum_id} since"
        time.sleep(0.06)
        assert watch.lapsed(a._quorum_id + 5, full_id(a)) is None
    finally:
        a.shutdown(wait=False)
        b.shutdown(wait=False)


def test_an_unreadable_page_reports_nothing():
    watch = QuorumWatch("http://127.0.0.1:1", timedelta(seconds=1), poll=timedelta(milliseconds=1), fetch=lambda addr, t: None)
    assert watch.lapsed(3, "x") is None
    assert parse_status("<html>not a lighthouse</html>").quorum_id is None


def test_await_heartbeats_ends_when_every_id_is_heard_or_at_its_bound(lighthouse):
    """The rejoin wait (managers.LevelManager._rejoin) against a real lighthouse: ids it
    has not heard are returned at the bound; the caller's own heartbeat (``beat``) is sent
    before each read, so an id beating through it ends the wait, with nothing missing."""
    client = LighthouseClient(lighthouse.address(), connect_timeout=timedelta(seconds=5))
    hb = timedelta(milliseconds=HB_MS)
    t0 = time.monotonic()
    assert await_heartbeats(lighthouse.address(), ["x:1", "y:2"], hb, timedelta(seconds=0.5)) == ["x:1", "y:2"]
    assert time.monotonic() - t0 >= 0.5
    assert await_heartbeats(lighthouse.address(), ["x:1", "y:2"], hb, timedelta(seconds=0.3),
                            beat=lambda: client.heartbeat("x:1")) == ["y:2"]
    beats = []

    def beat():  # x is the caller; y is heard from the third read on: the wait ends there
        beats.append(1)
        client.heartbeat("x:1")
        if len(beats) >= 3:
            client.heartbeat("y:2")

    assert await_heartbeats(lighthouse.address(), ["x:1", "y:2"], hb, timedelta(seconds=60), beat=beat) == []
    assert len(beats) == 3
    assert await_heartbeats(lighthouse.address(), [], hb, timedelta(seconds=60), beat=beat) == [] and len(beats) == 4
    # A lighthouse that does not answer: nobody is heard, and it still ends at its bound.
    assert await_heartbeats("http://127.0.0.1:1", ["x:1"], hb, timedelta(seconds=0.3)) == ["x:1"]
