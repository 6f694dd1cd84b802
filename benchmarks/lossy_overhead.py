"""How much the lossy-link emulation adds to a collective, for a model-sized tensor.

    python benchmarks/lossy_overhead.py [--numel 6163712] [--repeats 5]

Measures, on two ranks (threads) sharing a real Gloo group on this machine:

* the plain SUM all-reduce of the tensor (reliable link);
* the same all-reduce through the lossy link (per sender, rescale fill) for Bernoulli
  and Gilbert–Elliott loss — the real all-reduce plus mask generation, zeroing, the
  per-packet arrival-count all-reduce and the fill;
* the mask work alone (sampling the fates of every packet and applying them), timed
  outside any collective.

Prints medians and the ratios "lossy / plain" and "mask work / plain all-reduce". The
default size is the Llama3 debugmodel (6,163,712 fp32 values, 24.7 MB, 16,748 packets).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from datetime import timedelta

os.environ.setdefault("RUST_LOG", "warn")

import torch  # noqa: E402
from torch.distributed import ReduceOp, TCPStore  # noqa: E402
from torch.distributed.distributed_c10d import AllreduceOptions  # noqa: E402

from hier_localsgd.core.links.stats import PAYLOAD  # noqa: E402
from hier_localsgd.core.links.link import LinkProcessGroup  # noqa: E402
from hier_localsgd.core.links.lossy import LinkEmulation, LinkSpec, LossModel  # noqa: E402


def timed_allreduces(spec, numel: int, repeats: int) -> list[float]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    times: dict[int, list[float]] = {0: [], 1: []}
    barrier = threading.Barrier(2)

    def rank(r: int) -> None:
        link = LinkProcessGroup("outer", timedelta(seconds=60), emulation=spec)
        link.configure(f"127.0.0.1:{store.port}/b", f"m{r}", r, 2, 1, 0, 1, [0, 1])
        t = torch.randn(numel)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        for _ in range(repeats + 1):  # first call warms up
            barrier.wait()
            t0 = time.perf_counter()
            with link.kind(PAYLOAD):
                link.allreduce([t], opts).wait()
            times[r].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    return [max(a, b) for a, b in zip(times[0][1:], times[1][1:])]


def mask_work(spec: LinkSpec, numel: int, repeats: int) -> list[float]:
    emu = LinkEmulation(spec, "outer")
    t = torch.randn(numel)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        per, npk = emu.packets(numel, 4)
        lost = torch.from_numpy(emu.stream(0).sample(npk))
        other = torch.from_numpy(emu.stream(1).sample(npk))
        arrived = (~lost).to(torch.int32) + (~other).to(torch.int32)  # what 2 senders' counts sum to
        saved = emu.save_rows(t, arrived, 2, per)
        emu.zero_packets(t, lost, per)
        emu.fill_per_sender(t, arrived, 2, per, saved)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=6_163_712)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    mb = a.numel * 4 / 1e6
    print(f"tensor: {a.numel} fp32 values = {mb:.1f} MB, {(a.numel + 367) // 368} packets of 1472 bytes; 2 ranks, Gloo over loopback")
    plain = statistics.median(timed_allreduces(None, a.numel, a.repeats))
    print(f"plain all-reduce:                 {plain * 1e3:8.1f} ms")
    for name, model in [("bernoulli 5%", LossModel("bernoulli", p=0.05)), ("gilbert-elliott", LossModel("gilbert_elliott", p=0.01, r=0.3))]:
        spec = LinkSpec(model=model, fill="rescale")
        lossy = statistics.median(timed_allreduces(spec, a.numel, a.repeats))
        work = statistics.median(mask_work(spec, a.numel, a.repeats))
        print(
            f"lossy all-reduce, {name:16s} {lossy * 1e3:8.1f} ms  (x{lossy / plain:.2f} of plain);  "
            f"mask work alone {work * 1e3:6.1f} ms  ({work / plain:.1%} of the plain all-reduce)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
