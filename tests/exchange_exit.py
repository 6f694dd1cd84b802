"""Processes that run the outer level's exchange and then leave the interpreter normally.

Issue #30: a linkcheck worker exited -6 with "terminate called without an active
exception". gdb on a reproduction showed the cause: the helper thread that completes an
all-to-all/all-gather exchange (core/links/link.py, ``PeerWork``) was still inside the torch
future's completion, which releases the GIL and wakes the waiter, when the main thread
went on to finalize the interpreter; the helper, a daemon, asked for the GIL back during
finalization and was ended by ``pthread_exit``, whose unwinding through that C++ frame
calls ``std::terminate``.

``python tests/exchange_exit.py pairs N``: N pairs of fresh interpreters, one pair after
another, each rank running ``compressed_allreduce`` (int8: an all-to-all, then an
all-gather) twice over loopback and leaving as a script does. The switch interval is
raised before the second so the woken main thread keeps the GIL. Prints one JSON line:
every rank's exit code. On the old code about one pair in ten aborted.

``python tests/exchange_exit.py finalizing``: the same race made certain. The exchange's
future gets a callback that wakes the main thread, then sleeps, so the helper thread is
still inside the completion while the interpreter finalizes. Finalization is kept busy
for a moment by objects for the collector to walk. Exits 0 when the helper is joined
before finalization; it aborted (-6) every time on the old code.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch


def _rank(rank: int, port: int) -> None:
    from torch.distributed import TCPStore

    from hier_localsgd.core.tensors.compressed_allreduce import compressed_allreduce
    from hier_localsgd.core.links.link import LinkProcessGroup

    timeout = timedelta(seconds=30)
    store = TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    pg = LinkProcessGroup("outer", timeout)
    pg.configure(f"127.0.0.1:{port}/x", f"x_{rank}", rank, 2)
    t = torch.randn(1 << 16, generator=torch.Generator().manual_seed(rank))
    compressed_allreduce(t.clone(), pg, "int8", timeout=timeout, rank=rank, world=2)
    sys.setswitchinterval(30.0)
    compressed_allreduce(t.clone(), pg, "int8", timeout=timeout, rank=rank, world=2)
    del store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pairs(n: int) -> list:
    codes = []
    for _ in range(n):
        port = str(_free_port())
        procs = [subprocess.Popen([sys.executable, __file__, "rank", str(r), port], stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        for p in procs:
            _, err = p.communicate(timeout=120)
            codes.append(p.returncode)
            if p.returncode != 0:
                print(err.strip()[-500:], file=sys.stderr)
    return codes


def finalizing() -> None:
    from hier_localsgd.core.links.works import PeerWork

    ballast = [[i] for i in range(2_000_000)]  # noqa: F841  (walked by the collector at exit)
    go, woken = threading.Event(), threading.Event()

    class Sent:  # a point-to-point work that completes when told
        def wait(self, timeout: object = None) -> bool:
            go.wait()
            return True

    def slow_callback(_fut: object) -> None:
        woken.set()  # the main thread runs on and leaves the interpreter ...
        time.sleep(0.1)  # ... while this thread is still inside the future's completion

    work = PeerWork([Sent()], [torch.zeros(1)], timedelta(seconds=10))
    work.get_future().add_done_callback(slow_callback)
    go.set()
    if not woken.wait(10):
        sys.exit(3)
    globals()["BALLAST"] = ballast  # kept alive into finalization


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "rank":
        _rank(int(sys.argv[2]), int(sys.argv[3]))
    elif what == "pairs":
        print(json.dumps(pairs(int(sys.argv[2]))))
    elif what == "finalizing":
        finalizing()
    else:
        sys.exit(f"unknown mode {what!r}")
