"""A compressed all-reduce next to a plain fp32 one, on a debugmodel-sized tensor.

    python benchmarks/compressed_allreduce.py [--worlds 2,3] [--numel 6163712] [--block 256]
        [--repeats 5] [--no-netns]

For each world size W, W processes join one torchft ``ProcessGroupGloo`` (as the
trainer uses) over loopback and time, median of ``--repeats`` (the slowest rank of
each repeat): Gloo's fp32 SUM all-reduce, and :func:`compressed_allreduce` with int8
and fp8 (AVG). It prints:

* round-trip error of the debugmodel's own initial weights (a real value distribution),
  per format: max |x − x̂| / bound and relative L2 error;
* payload bytes per rank: analytic, counted by the collective, fp32 ring, and their ratio;
* wire bytes per rank measured from the kernel: the whole benchmark runs in a network
  namespace of its own (``unshare -n``) where nothing else talks, so the loopback
  counter of /proc/net/dev is this benchmark's traffic alone — TCP/IP headers and
  Gloo's framing included — less the barriers around each operation (measured alone).
  ``--no-netns`` skips this part;
* the times. The machine has 2 cores shared with other work: rough figures.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import timedelta

os.environ.setdefault("RUST_LOG", "warn")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def lo_tx_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            if line.strip().startswith("lo:"):
                return int(line.split(":", 1)[1].split()[8])
    raise RuntimeError("no lo in /proc/net/dev")


def rank_main(rank: int, world: int, port: int, numel: int, block: int, repeats: int, count_wire: bool, out) -> None:  # type: ignore[no-untyped-def]
    import torch
    from torch.distributed import ReduceOp, TCPStore
    from torch.distributed.distributed_c10d import AllreduceOptions
    from torchft.process_group import ProcessGroupGloo

    from hier_localsgd.core.tensors.compressed_allreduce import compressed_allreduce

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    pg = ProcessGroupGloo(timeout=timedelta(seconds=120))
    pg.configure(f"127.0.0.1:{port}/bench{world}", f"r{rank}", rank, world)
    del store
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM

    def barrier() -> None:
        pg.allreduce([torch.zeros(1)], opts).wait()

    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=gen)
    ops = {
        "fp32 allreduce": lambda t: pg.allreduce([t], opts).wait(),
        "int8 compressed": lambda t: compressed_allreduce(t, pg, "int8", block, timeout=timedelta(seconds=120)),
        "fp8 compressed": lambda t: compressed_allreduce(t, pg, "fp8", block, timeout=timedelta(seconds=120)),
        "barriers only": lambda t: None,
    }
    res = {}
    for name, fn in ops.items():
        times, wire, counted, comm = [], [], None, []
        for i in range(repeats + 1):  # the first call warms up
            t = x.clone()
            barrier()
            b0 = lo_tx_bytes() if count_wire else 0
            t0 = time.perf_counter()
            r = fn(t)
            dt = time.perf_counter() - t0
            barrier()
            b1 = lo_tx_bytes() if count_wire else 0
            if i:
                times.append(dt)
                wire.append(b1 - b0)
            if r is not None and hasattr(r, "bytes_sent"):
                counted = r.bytes_sent
                if i:
                    comm.append(r.alltoall_s + r.allgather_s)
        res[name] = (times, wire, counted, comm)
        if rank == 0 and counted is not None:
            # accuracy of the last call against the true mean (every rank's input is
            # seeded by its rank, so rank 0 can rebuild them)
            from hier_localsgd.core.tensors.compressed_allreduce import mean_error_bound

            inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)]
            true = torch.stack(inputs).mean(0)
            err = (t - true).abs()
            fmt = name.split()[0]
            res[name + " accuracy"] = (
                float(err.norm() / true.norm()),
                float((err / mean_error_bound(inputs, fmt, block, world)).max()),
            )
    out.put((rank, res))


def run_world(world: int, numel: int, block: int, repeats: int, count_wire: bool) -> dict:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(r, world, store.port, numel, block, repeats, count_wire, out))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return got


def round_trip(block: int) -> None:
    import torch

    from hier_localsgd.core.tensors.compress import FORMATS, dequantize, error_bound, quantize
    from hier_localsgd.train.model import build_model

    model = build_model("llama3_debugmodel", 2048, 64, 0, seed=0)
    x = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(f"round trip of the debugmodel's initial weights ({x.numel():,} elements, block {block}):")
    for fmt in FORMATS:
        q = quantize(x, fmt, block)
        d = dequantize(q)
        err = (x - d).abs()
        print(
            f"  {fmt}: max err/bound {float((err / error_bound(x, q)).max()):.4f}, "
            f"relative L2 error {float(err.norm() / x.norm()):.2e}, {q.nbytes / (x.numel() * 4):.4f} of fp32 bytes"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,3")
    ap.add_argument("--numel", type=int, default=6_163_712, help="elements (default: llama3_debugmodel's parameters)")
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-netns", action="store_true", help="do not count wire bytes in a network namespace")
    ap.add_argument("--in-netns", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.no_netns and not a.in_netns:
        if shutil.which("unshare") and shutil.which("ip"):
            cmd = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", sys.executable, *sys.argv, "--in-netns"]
            return subprocess.call(cmd)
        print("unshare/ip not found: wire bytes not measured")
    count_wire = a.in_netns

    from hier_localsgd.core.tensors.compressed_allreduce import compressed_allreduce_bytes, fp32_ring_allreduce_bytes

    round_trip(a.block)
    print(f"\n{os.cpu_count()} cores shared with other work; median of {a.repeats} (slowest rank of each); "
          f"{a.numel:,} fp32 elements = {a.numel * 4 / 1e6:.2f} MB; block {a.block}")
    for world in [int(w) for w in a.worlds.split(",")]:
        got = run_world(world, a.numel, a.block, a.repeats, count_wire)
        fp32_bytes = fp32_ring_allreduce_bytes(a.numel, world)
        barrier_wire = statistics.median(got[0]["barriers only"][1])
        print(f"\nW={world}:")
        print(f"  {'op':<16} {'time ms':>8} {'payload B/rank (analytic)':>26} {'counted':>10} "
              f"{'wire B/rank (lo, netns)':>24} {'fp32/this bytes':>16} {'in collectives ms':>18}")
        for name in ("fp32 allreduce", "int8 compressed", "fp8 compressed"):
            t = statistics.median(max(got[r][name][0][i] for r in range(world)) for i in range(a.repeats))
            analytic = fp32_bytes if name.startswith("fp32") else compressed_allreduce_bytes(a.numel, world, name[:4].strip(), a.block)
            counted = got[0][name][2]
            wire = (statistics.median(got[0][name][1]) - barrier_wire) / world if count_wire else float("nan")
            # rank 0's time inside the all-to-all and the all-gather (waits included); the
            # rest of a compressed call is quantize / dequantize / reduce on one thread
            comm = f"{statistics.median(got[0][name][3]) * 1e3:.1f}" if got[0][name][3] else "-"
            print(f"  {name:<16} {t * 1e3:8.1f} {analytic:26,d} {counted if counted is not None else '-':>10} "
                  f"{wire:24,.0f} {fp32_bytes / analytic:16.2f} {comm:>18}")
        for name in ("int8 compressed", "fp8 compressed"):
            rel, ratio = got[0][name + " accuracy"]
            print(f"  {name}: result vs true mean: relative L2 error {rel:.2e}, max err / double-quantization bound {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
