"""What a real Gloo all-reduce costs on this machine, next to an emulated link's bound.

    python benchmarks/allreduce_floor.py [--sizes-mb 1,6,24.65] [--gbps 10] [--latency-ms 0.1] [--busy 2]

The link emulation (hier_localsgd/core/links/lossy.py) can only add time: a collective lasts at
least its ring bound 2(n-1)/n * S/B + 2(n-1)*alpha, but never less than the real
transfer. When the real transfer between two processes over loopback is slower than the
bound (a fast emulated LAN on a small VM), the measured sync time exceeds the bound no
matter what the emulation does. This script measures that floor: two processes, one
ProcessGroupGloo (torchft's, as the trainer uses), a SUM all-reduce of each size, the
median of ``--repeats``. ``--busy K`` runs K extra processes doing matmuls meanwhile, as
the other replica groups of a job compute on the same cores during an inner sync.

Prints, per size: the measured median, the emulated bound for ``--gbps``/``--latency-ms``,
their ratio, and the effective bandwidth of the real transfer.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from datetime import timedelta

os.environ.setdefault("RUST_LOG", "warn")


def rank_main(rank: int, port: int, sizes: list, repeats: int, out) -> None:  # type: ignore[no-untyped-def]
    import torch
    from torch.distributed import ReduceOp, TCPStore
    from torch.distributed.distributed_c10d import AllreduceOptions
    from torchft.process_group import ProcessGroupGloo

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    pg.configure(f"127.0.0.1:{port}/floor", f"r{rank}", rank, 2)
    del store
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    res = {}
    for numel in sizes:
        t = torch.randn(numel)
        times = []
        for i in range(repeats + 1):  # the first call warms up
            pg.allreduce([torch.zeros(1)], opts).wait()  # line the ranks up
            t0 = time.perf_counter()
            pg.allreduce([t], opts).wait()
            if i:
                times.append(time.perf_counter() - t0)
        res[numel] = times
    out.put((rank, res))


def busy_main(stop) -> None:  # type: ignore[no-untyped-def]
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", default="1,6,24.65")
    ap.add_argument("--gbps", type=float, default=10.0)
    ap.add_argument("--latency-ms", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--busy", type=int, default=0, help="extra processes computing meanwhile")
    a = ap.parse_args()
    from torch.distributed import TCPStore

    from hier_localsgd.core.links.lossy import LinkSpec

    sizes = [int(float(s) * 1e6 / 4) for s in a.sizes_mb.split(",")]
    spec = LinkSpec(latency_s=a.latency_ms / 1e3, bandwidth_Bps=a.gbps * 1e9 / 8)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    busy = [ctx.Process(target=busy_main, args=(stop,)) for _ in range(a.busy)]
    for p in busy:
        p.start()
    out = ctx.Queue()
    ranks = [ctx.Process(target=rank_main, args=(r, store.port, sizes, a.repeats, out)) for r in (0, 1)]
    for p in ranks:
        p.start()
    got = dict(out.get(timeout=600) for _ in ranks)
    for p in ranks:
        p.join()
    stop.set()
    for p in busy:
        p.join()
    print(f"2 processes, torchft ProcessGroupGloo over loopback, {a.busy} busy process(es) beside them, "
          f"{os.cpu_count()} cores; bound = ring all-reduce on a {a.gbps:g} Gbit/s, {a.latency_ms:g} ms link")
    print(f"{'size MB':>8} {'measured ms':>12} {'bound ms':>9} {'ratio':>6} {'real Gbit/s (2(n-1)/n S / t)':>30}")
    for numel in sizes:
        t = statistics.median(max(x, y) for x, y in zip(got[0][numel], got[1][numel]))
        nbytes = numel * 4
        bound = spec.allreduce_time(nbytes, 2)
        print(f"{nbytes / 1e6:8.2f} {t * 1e3:12.1f} {bound * 1e3:9.1f} {t / bound:6.2f} {nbytes * 8 / t / 1e9:30.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
