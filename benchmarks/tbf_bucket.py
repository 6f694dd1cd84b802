"""The tbf bucket experiment behind ``netns.TBF_MIN_BURST_BYTES`` (docs/benchmarks.md, "Why the
bucket changed"): the fp32 ring all-reduce between 2 cluster namespaces, kernel-shaped, for
several bucket sizes per rate; prints time / (bound less the bucket) and wire / analytic.

    python benchmarks/tbf_bucket.py OUT.json
"""

import json
import sys

from hier_localsgd.experiments import linkcheck
from hier_localsgd.launch.netns import tbf_transfer_s

PLAN = [(1000, 24653000, [32 * 1024, 96 * 1024, 256 * 1024, 512 * 1024]),  # debugmodel's fp32 payload
        (100, 8 * 2**20, [32 * 1024, 96 * 1024, 256 * 1024]),
        (20, 8 * 2**20, [32 * 1024, 96 * 1024, 256 * 1024])]


def main() -> None:
    out = []
    for rate, nbytes, bursts in PLAN:
        for burst in bursts:
            (m,) = linkcheck.measure(clusters=2, rate_mbit=rate, nbytes=nbytes, reps=3, modes=("kernel",), burst_bytes=burst)
            assert m.bound_s == tbf_transfer_s(m.analytic_bytes, rate * 1e6, burst)
            out.append(m.as_dict())
            print(f"{rate} Mbit/s, bucket {burst // 1024} KiB: times {[round(t, 3) for t in m.times_s]} s, "
                  f"bound {m.bound_s:.3f} s, time/bound {m.time_vs_bound:.3f}, wire/analytic {m.wire_vs_analytic:.3f}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
