"""What the encrypted WAN (security.wan=tunnel: WireGuard, wireguard-go) costs an outer round.

Times the outer level's all-reduce of one model's fp32 pseudo-gradient (the demo's
debugmodel: 6,163,712 parameters, 24.7 MB) between 2 clusters on kernel-shaped links
(tbf on each uplink, launch/netns.py), with and without the tunnel, in one run, and
prints each time, the ratio, and the bytes each uplink carried per all-reduce (WireGuard's
headers included). Both arms share this machine's 2 cores, as the bench's arms do.

    python benchmarks/tunnel_cost.py [--reps 3] [--rates 100,1000] [--mtus 1280,1420]

``--mtus``: the tunnel interfaces' MTUs to time (security.tunnel_mtu), one tunnel row each.
"""

from __future__ import annotations

import argparse
import statistics

from hier_localsgd.core.security.secret import TUNNEL_MTU
from hier_localsgd.experiments.linkcheck import measure
from hier_localsgd.launch.tunnel import wireguard_go_version

DEBUGMODEL_PARAMS = 6_163_712


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rates", default="100,1000", help="Mbit/s, comma-separated")
    ap.add_argument("--mtus", default=str(TUNNEL_MTU), help="tunnel MTUs (security.tunnel_mtu), comma-separated")
    args = ap.parse_args()
    nbytes = DEBUGMODEL_PARAMS * 4
    print(f"wireguard-go {wireguard_go_version()}")
    print("| rate | tunnel MTU | plain (s) | tunnel (s) | tunnel/plain | plain wire MB | tunnel wire MB | wire ratio | plain reps | tunnel reps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for rate in (float(r) for r in args.rates.split(",")):
        plain, = measure(clusters=2, rate_mbit=rate, nbytes=nbytes, reps=args.reps, modes=("kernel",))
        pw = statistics.median(plain.tx_bytes)
        for mtu in (int(m) for m in args.mtus.split(",")):
            tun, = measure(clusters=2, rate_mbit=rate, nbytes=nbytes, reps=args.reps, modes=("kernel",), tunnel=True, tunnel_mtu=mtu)
            tw = statistics.median(tun.tx_bytes)
            print(f"| {rate:g} Mbit/s | {mtu} | {plain.time_s:.3f} | {tun.time_s:.3f} | {tun.time_s / plain.time_s:.3f} | {pw / 1e6:.2f} | "
                  f"{tw / 1e6:.2f} | {tw / pw:.3f} | {', '.join(f'{t:.3f}' for t in plain.times_s)} | "
                  f"{', '.join(f'{t:.3f}' for t in tun.times_s)} |", flush=True)


if __name__ == "__main__":
    main()
