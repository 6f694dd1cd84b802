"""LinkProcessGroup's own mechanics (one process, a real Gloo group of one)."""

from datetime import timedelta

import torch
from torch.distributed import AllreduceOptions, ReduceOp, TCPStore

from hier_localsgd.core.links.link import LinkProcessGroup


def test_a_retired_group_is_set_aside_and_the_next_configure_builds_a_working_one():
    """After an abandoned collective (peers.py) the group is retired; the next quorum's
    configure must still build a group (it once raised NotImplementedError there, from
    torchft's wrapper, failing every later quorum of the level until the process exited)."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = LinkProcessGroup("outer", timedelta(seconds=10))
    pg.configure(f"127.0.0.1:{store.port}/q1", "r0", 0, 1, quorum_id=1)
    first = pg._pg
    pg.retire()
    pg.configure(f"127.0.0.1:{store.port}/q2", "r0", 0, 1, quorum_id=2)
    assert pg._pg is not None and pg._pg is not first and pg._retired == [first]
    t = torch.ones(3)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    pg.allreduce([t], opts).wait()
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_a_quorum_store_whose_host_is_gone_fails_configure_at_once_not_after_c10d_retries():
    """A quorum formed just before its store host died names a store that refuses
    connections; c10d's client would retry for its whole timeout, twice (about 55 s at
    30 s, seen in a chaos run, far past the phase deadline). The probe fails it at once."""
    import time

    import pytest

    from hier_localsgd.core.runtime.addresses import StoreUnreachable

    dead = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = dead.port
    del dead  # its host is gone: nothing listens on the port any more
    pg = LinkProcessGroup("outer", timedelta(seconds=30))
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match=f"127.0.0.1:{port}"):
        pg.configure(f"127.0.0.1:{port}/torchft/3/0", "r0", 0, 2, quorum_id=3)
    # the probe's retry window (STORE_PROBE_S), far inside c10d's 30 s timeout: half of it is a safe line
    assert time.monotonic() - t0 < 15.0
    live = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg.configure(f"127.0.0.1:{live.port}/torchft/4/0", "r0", 0, 1, quorum_id=4)  # a live store passes the probe


def _listener():
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    return srv, srv.getsockname()[1]


def test_a_store_host_that_dies_mid_connect_fails_configure_within_seconds_not_c10d_minutes():
    """Seen in CI: the probe reached the store, then its host was killed during c10d's
    connect handshake; c10d retried for twice its 30 s timeout plus a backoff, and the
    leader's phase watchdog ended the process. Here a host accepts the probe, accepts the
    store client's connection, then dies. Without the bounded connect this takes ~60-70 s
    (measured 69.6 s); with it a few seconds."""
    import threading
    import time

    import pytest

    from hier_localsgd.core.runtime.addresses import StoreUnreachable

    srv, port = _listener()

    def host_dies_mid_handshake():
        a, _ = srv.accept()
        a.close()  # the probe
        b, _ = srv.accept()  # the store client's connection
        time.sleep(0.3)
        b.close()
        srv.close()

    threading.Thread(target=host_dies_mid_handshake, daemon=True).start()
    pg = LinkProcessGroup("outer", timedelta(seconds=30))
    t0 = time.monotonic()
    with pytest.raises(StoreUnreachable, match=f"127.0.0.1:{port}"):
        pg.configure(f"127.0.0.1:{port}/torchft/3/0", "r0", 0, 2, quorum_id=3)
    assert time.monotonic() - t0 < 20.0  # c10d alone: > 60 s (twice its 30 s timeout)


def test_a_store_host_that_accepts_but_never_answers_fails_configure_by_the_phase_deadline():
    """A hung store host (the kernel accepts, the process never answers the handshake):
    configure gives up by the deadline its caller set (LevelManager._quorum_once sets the
    phase's), plus at most one short attempt, not after c10d's 2 x 30 s."""
    import time

    import pytest

    from hier_localsgd.core.runtime.addresses import StoreUnreachable

    srv, port = _listener()  # never accepts: connections complete in the kernel's backlog
    try:
        pg = LinkProcessGroup("outer", timedelta(seconds=30))
        pg.configure_deadline = time.monotonic() + 3.0
        t0 = time.monotonic()
        # the time left of the deadline when configure starts: 3 s, or a hair under on a busy machine
        with pytest.raises(StoreUnreachable, match=r"did not complete a connection within (3|2\.9\d*)s"):
            pg.configure(f"127.0.0.1:{port}/torchft/3/0", "r0", 0, 2, quorum_id=3)
        assert time.monotonic() - t0 < 20.0  # 3 s and one attempt (≤ 2 x 2 s plus a backoff)
    finally:
        srv.close()


def test_alltoall_and_allgather_are_point_to_point_exchanges_with_the_collectives_results():
    """The level group's all-to-all and all-gather (concurrent sends and receives, link.py
    ``_exchange``) give what the collectives give, on a real Gloo group of two and of
    three, with options that set a timeout and with c10d's defaults (timeout unset, -1 ms)."""
    import threading

    from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

    for world in (2, 3):
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        got, errors = {}, []

        def member(rank, world=world, store=store):
            try:
                pg = LinkProcessGroup("outer", timedelta(seconds=30))
                pg.configure(f"127.0.0.1:{store.port}/x", f"r{rank}", rank, world)
                for set_timeout in (True, False):
                    send = torch.tensor([[10.0 * rank + j] * 2 for j in range(world)])  # row j goes to rank j
                    recv = torch.empty_like(send)
                    a2a = AllToAllOptions()
                    ag = AllgatherOptions()
                    if set_timeout:
                        a2a.timeout = ag.timeout = timedelta(seconds=20)
                    pg.alltoall_base(recv, send, [], [], a2a).get_future().wait()
                    outs = [torch.empty(3) for _ in range(world)]
                    pg.allgather([outs], [torch.full((3,), float(rank))], ag).wait()
                    got[(rank, set_timeout)] = (recv.tolist(), [o.tolist() for o in outs])
                got[rank] = pg.stats.as_dict()
            except Exception as e:  # reported below
                errors.append((rank, repr(e)))

        ths = [threading.Thread(target=member, args=(r,)) for r in range(world)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(60)
        assert not errors, errors
        for rank in range(world):
            for set_timeout in (True, False):
                recv, outs = got[(rank, set_timeout)]
                assert recv == [[10.0 * s + rank] * 2 for s in range(world)], (world, rank)
                assert outs == [[float(s)] * 3 for s in range(world)], (world, rank)
            # Timed without emulation too (link.py _timed_work: the auto watch reads these), through
            # the future (the all-to-all) and through wait (the all-gather); totals, no spans.
            stats = got[rank]
            for op in ("alltoall", "allgather"):
                key = f"{op}/payload"
                assert stats["calls"][key] == 2 and stats["seconds"][key] > 0 and stats["bound_seconds"][key] == 0, stats
                assert not stats["spans"].get(key), stats
