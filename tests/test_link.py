"""LinkProcessGroup's own mechanics (one process, a real Gloo group of one)."""

from datetime import timedelta

import torch
from torch.distributed import AllreduceOptions, ReduceOp, TCPStore

from hier_localsgd.core.link import LinkProcessGroup


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

    from hier_localsgd.core.addresses import StoreUnreachable

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
