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
