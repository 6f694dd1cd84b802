"""Issue #33's figures: the asynchronous outer level against the synchronous one on the demo
workload (debugmodel, 2 x 2), clusters of equal or different speeds, kernel-shaped WAN.

For each speed setting and seed it runs ``hier-localsgd bench`` with the arms ``hier`` and
``hier_async`` (``--arm hier_async_overlap``: pushes behind training) (the same seed,
workload, target and network in one invocation), then prints
per arm: the wall time to the target loss (the first evaluation at or under it, in training
time: bench.py), cluster 0's steps per second over its loop (the status field
``loop_steps / loop_s``), the final eval loss, the loss each arm had reached at the same
wall time (the earlier arm's end), and whether every group ended on one model. The time to
the target and the loss at equal wall time are given twice: on the live models' curve and
on the global model's (the asynchronous arm's ``curve_global``: the version each group last
adopted; the synchronous arm's live model at its outer rounds is the global model).

    python benchmarks/async_outer.py [--speeds "[1.0,0.5]|[]"] [--seeds 0,1,2] [--wan-gbps 0.1] [--target 0.9375] \
        [--arm hier_async|hier_async_overlap] [--no-sync] [--extra sync.async_outer.match_pace=true ...]

``--extra``: more overrides for every arm of the bench (the synchronous arm ignores
``sync.async_outer.*``).

Each bench runs with ``bench.links=kernel`` (network namespaces, tbf; root) unless
``--emulated``. About 15 minutes per seed at half speed on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional

from hier_localsgd.experiments.bench import to_target


def loss_at(curve: List[Dict[str, float]], t: float) -> Optional[float]:
    """The last evaluated loss at or before training time ``t``."""
    pts = [p for p in curve if p["t"] <= t]
    return pts[-1]["loss"] if pts else None


def ratios(rows: List[Dict[str, Any]], key: str, num: str, den: str) -> List[float]:
    """Per seed, arm ``num``'s ``key`` over arm ``den``'s (2 decimals), where both were measured."""
    return [round(r["arms"][num][key] / r["arms"][den][key], 2) for r in rows if r["arms"][num][key] and r["arms"][den][key]]


def cluster_rate(run_dir: str, cluster: int) -> Optional[float]:
    rs = [json.loads(p.read_text()) for p in sorted(Path(run_dir).glob(f"replicas/c{cluster}r*/result.json"))]
    rates = [r["loop_steps"] / r["loop_s"] for r in rs if r.get("loop_s")]
    return statistics.mean(rates) if rates else None


def run(args: argparse.Namespace, speeds: str, seed: int, out: Path) -> Dict[str, Any]:
    tag = speeds.strip("[]").replace(",", "_") or "even"
    d = out / f"{tag}_s{seed}"
    argv = [sys.executable, "-m", "hier_localsgd", "bench", "bench.mode=full", f"bench.links={'emulated' if args.emulated else 'kernel'}",
            f"bench.wan_gbps={args.wan_gbps}", f"bench.arms=[{args.arm}]" if args.no_sync else f"bench.arms=[hier,{args.arm}]", f"bench.target_loss={args.target}",
            # a seed sets the init and the sample order, as bench_sweep.py does
            f"train.seed={seed}", f"data.stream={seed}", f"run.dir={d}", *([f"topology.cluster_speed={speeds}"] if speeds != "[]" else []), *args.extra]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout_s)
    if p.returncode != 0:
        raise SystemExit(f"bench exited {p.returncode}: {(p.stdout + p.stderr).strip()[-1500:]}")
    rep = json.loads((d / "bench" / "bench.json").read_text())
    arms = {a["arm"]: a for a in rep["arms"]}
    for a in arms.values():
        if a.get("failed"):
            raise SystemExit(f"{speeds} seed {seed}: arm {a['arm']} failed: {a}")
    t_eq = min(a["wall_s"] for a in arms.values())
    # The global model's curve: the asynchronous arm's evaluations of the version each group
    # last adopted (bench.py curve_global); the synchronous arm's live model at its outer
    # rounds is the global model.
    glob = {name: a.get("curve_global") or a["curve"] for name, a in arms.items()}
    return {"speeds": speeds, "seed": seed, "run": str(d), "arms": {
        name: {"to_target_s": a["time_to_target_s"], "rate0": cluster_rate(a["run_dir"], 0), "final": a["final_eval_loss"],
               "wall_s": a["wall_s"], "at_equal_wall": loss_at(a["curve"], t_eq), "t_equal": t_eq, "consistent": a["consistent"],
               "slow_mb": a["slow_link_bytes"] / 1e6, "global_to_target_s": to_target(glob[name], args.target)[0],
               "global_at_equal_wall": loss_at(glob[name], t_eq)}
        for name, a in arms.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speeds", default="[1.0,0.5]|[]", help="speed lists separated by | ([]: every cluster at 1.0)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--wan-gbps", type=float, default=0.1)
    ap.add_argument("--target", type=float, default=0.9375)
    ap.add_argument("--emulated", action="store_true", help="user-space WAN emulation instead of kernel-shaped links")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--arm", default="hier_async", choices=["hier_async", "hier_async_overlap"],
                    help="the asynchronous arm (hier_async_overlap: each push behind training)")
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every arm (key=value)")
    ap.add_argument("--no-sync", action="store_true",
                    help="run the asynchronous arm alone (compare with a synchronous arm run before: say so where you report it)")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="async_outer_"))
    print(f"debugmodel (2 x 2 unless --extra sets topology.*), WAN {args.wan_gbps} Gbit/s ({'emulated' if args.emulated else 'kernel tbf'}), target {args.target}, "
          f"extra {args.extra}, runs in {out}", flush=True)
    print("| speeds | seed | arm | s to target | global model: s to target | cluster 0 steps/s | final eval loss | loss at equal wall time (s) "
          "| global model's loss then | wall s | slow MB | consistent |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for speeds in args.speeds.split("|"):
        for seed in (int(s) for s in args.seeds.split(",")):
            r = run(args, speeds, seed, out)
            rows.append(r)
            for name, a in r["arms"].items():
                tt = "-" if a["to_target_s"] is None else f"{a['to_target_s']:.1f}"
                rate = "-" if a["rate0"] is None else f"{a['rate0']:.3f}"
                eq = "-" if a["at_equal_wall"] is None else f"{a['at_equal_wall']:.4f} ({a['t_equal']:.0f})"
                gt = "-" if a["global_to_target_s"] is None else f"{a['global_to_target_s']:.1f}"
                geq = "-" if a["global_at_equal_wall"] is None else f"{a['global_at_equal_wall']:.4f}"
                print(f"| {speeds} | {seed} | {name} | {tt} | {gt} | {rate} | {a['final']:.4f} | {eq} | {geq} | {a['wall_s']:.1f} | {a['slow_mb']:.1f} "
                      f"| {a['consistent']} |", flush=True)
    print()
    for speeds in ([] if args.no_sync else args.speeds.split("|")):
        rs = [r for r in rows if r["speeds"] == speeds]
        sooner, gsooner = (ratios(rs, key, "hier", args.arm) for key in ("to_target_s", "global_to_target_s"))
        rate = ratios(rs, "rate0", args.arm, "hier")
        print(f"{speeds}: time to target, hier / {args.arm} per seed {sooner} (the global model's: {gsooner}); "
              f"cluster 0's rate, {args.arm} / hier per seed {rate}")
    even = {r["seed"]: r for r in rows if r["speeds"] == "[]"}
    for speeds in [x for x in args.speeds.split("|") if x != "[]" and not args.no_sync]:
        for r in rows:
            e = even.get(r["seed"])
            if r["speeds"] == speeds and e is not None:
                a = r["arms"]
                print(f"{speeds} seed {r['seed']}: cluster 0's rate / its rate with every cluster at 1.0 (same arm): "
                      f"{args.arm} {a[args.arm]['rate0'] / e['arms'][args.arm]['rate0']:.2f}, hier {a['hier']['rate0'] / e['arms']['hier']['rate0']:.2f}")
    (out / "async_outer.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
