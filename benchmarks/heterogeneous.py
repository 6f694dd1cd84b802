"""Clusters of different speeds under today's synchronous outer level (issue #33's baseline),
and the simulator's prediction of it.

Runs ``hier-localsgd demo`` (model=tiny, 2 x 2 by default, steps padded to
``train.min_step_time_s``) once per speed setting and seed, e.g. all clusters at 1.0 and
``topology.cluster_speed=[1.0,0.5]``, and prints per cluster: steps per second over the
training loop, the share of that time inside sync rounds (waiting and communicating; the
status fields ``loop_steps``, ``loop_s``, ``sync_s``), and the fast cluster's rate against
its rate when every cluster is fast.

Then ``hier-localsgd simulate`` on the same deployment. One parameter,
``plan.round_overhead_s`` (a round's fixed cost on this machine), is fitted on the first
setting's first seed so the simulated loop time matches the measured one: that point is a
**calibration**. Every other setting is a **prediction** with that value, printed next to
what was measured.

    python benchmarks/heterogeneous.py [--speeds "[],[1.0,0.5]"] [--seeds 0,1,2] [--steps 200] [--extra OVERRIDE ...]

``--extra`` adds overrides to every run, e.g. ``sync.async_outer.enabled=true`` for the
asynchronous outer level (and ``sync.async_outer.match_pace=true``), which the simulator
models too (tools/simulate/engine.py; its grace window: batches.py); ``--no-simulate`` skips it.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

from hier_localsgd.config import load_config
from hier_localsgd.tools.simulate import engine, params


def common(args: argparse.Namespace, speeds: str) -> List[str]:
    clusters = len(json.loads(speeds)) or args.clusters
    return [f"topology.clusters={clusters}", "topology.replicas_per_cluster=2", f"topology.cluster_speed={speeds}",
            f"train.steps={args.steps}", f"sync.inner.every={args.h_inner}", f"sync.outer.every={args.h_outer}",
            f"train.min_step_time_s={args.step_s}", *args.extra]


def run(args: argparse.Namespace, speeds: str, seed: int, out: Path) -> Dict[str, Any]:
    tag = speeds.strip("[]").replace(",", "_") or "even"
    d = out / f"speeds_{tag}_s{seed}"
    argv = [sys.executable, "-m", "hier_localsgd", "demo", "model=tiny", "train.batch_size=16", "demo.dashboard=false",
            "run.tensorboard=false", f"train.seed={seed}", f"run.dir={d}", *common(args, speeds)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout_s)
    if p.returncode != 0:
        raise SystemExit(f"demo exited {p.returncode}: {p.stderr.strip()[-800:]}")
    results = [json.loads(f.read_text()) for f in sorted(d.glob("replicas/*/result.json"))]
    clusters: Dict[int, List[Dict[str, Any]]] = {}
    for r in results:
        clusters.setdefault(r["cluster"], []).append(r)
    per = {c: {"rate": statistics.mean(r["loop_steps"] / r["loop_s"] for r in rs),
               "sync_share": statistics.mean(r["sync_s"] / r["loop_s"] for r in rs),
               "loop_s": max(r["loop_s"] for r in rs)} for c, rs in sorted(clusters.items())}
    # the asynchronous level: each cluster's pushes merged into a version (the server's log lines)
    log = d / "logs" / "lighthouse_global.log"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = re.search(r"global model server: version \d+ from clusters \[([\d, ]+)\]", line)
        for k in (int(x) for x in m.group(1).split(",")) if m else ():
            per[k]["pushes"] = per[k].get("pushes", 0) + 1
    return {"speeds": speeds, "seed": seed, "clusters": per, "loop_s": max(v["loop_s"] for v in per.values()),
            "sync_share": sum(r["sync_s"] for r in results) / sum(r["loop_s"] for r in results),
            "consistent": len({r["checksum"] for r in results}) == 1, "model_params": results[0]["model_params"]}


def simulate(args: argparse.Namespace, speeds: str, model_params: int, overhead_s: float) -> Tuple[engine.RunResult, Dict[int, List[float]]]:
    """One simulated run of the deployment: its result, and when each cluster pushed (the asynchronous level)."""
    free = ["links.inner.bandwidth_gbps=1e6", "links.inner.latency_ms=0", "links.outer.bandwidth_gbps=1e6", "links.outer.latency_ms=0"]
    cfg = load_config([*common(args, speeds), *free, f"simulate.params={model_params}", f"plan.hardware.step_time_s={args.step_s}",
                       f"plan.round_overhead_s={overhead_s}", "plan.train.sync_dtype=float32", "plan.sharding=replicate",
                       "simulate.failures.model=none", "simulate.sensitivity=[]", "simulate.runs=1", "sync.min_clusters=2"],
                      validate_for="simulate")
    sim = engine.Simulation(params.resolve(cfg), 0)
    return sim.run(), dict(sim.pushes_at)


def calibrate(args: argparse.Namespace, speeds: str, model_params: int, loop_s: float) -> float:
    lo, hi = 0.0, 2.0
    for _ in range(40):  # the simulated time grows with the overhead: bisection
        mid = (lo + hi) / 2
        if simulate(args, speeds, model_params, mid)[0].end_s < loop_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speeds", default="[],[1.0,0.5]", help="speed lists, e.g. '[],[1.0,0.5]' ([]: every cluster at 1.0)")
    ap.add_argument("--clusters", type=int, default=2, help="clusters for a speed list []")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--h-inner", type=int, default=5)
    ap.add_argument("--h-outer", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.05)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every run (e.g. sync.async_outer.enabled=true)")
    ap.add_argument("--no-simulate", action="store_true", help="skip the simulator's calibration and predictions")
    args = ap.parse_args()
    settings = [s if s.endswith("]") else s + "]" for s in args.speeds.replace("],", "]|").split("|")]
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(tempfile.mkdtemp(prefix="hetero_"))
    runs = {s: [run(args, s, seed, out) for seed in seeds] for s in settings}
    base = statistics.median(r["clusters"][0]["rate"] for r in runs[settings[0]])
    print(f"{args.steps} steps, H {args.h_inner}/{args.h_outer}, steps padded to {args.step_s} s / speed, seeds {seeds}, "
          f"extra {args.extra}; run dirs {out}")
    print("| speeds | seed | loop s | steps/s per cluster | in sync per cluster | cluster 0 rate / its rate in the first setting | consistent |")
    print("|---|---|---|---|---|---|---|")
    for s in settings:
        for r in runs[s]:
            cl = r["clusters"]
            rates = " / ".join(format(v["rate"], ".2f") for v in cl.values())
            shares = " / ".join(format(100 * v["sync_share"], ".0f") + " %" for v in cl.values())
            print(f"| {s} | {r['seed']} | {r['loop_s']:.1f} | {rates} | {shares} | {cl[0]['rate'] / base:.2f} | {r['consistent']} |")
    if args.no_simulate:
        return
    first = runs[settings[0]][0]
    overhead = calibrate(args, settings[0], first["model_params"], first["loop_s"])
    print(f"\nsimulator: plan.round_overhead_s = {overhead * 1e3:.1f} ms, fitted on {settings[0]} seed {first['seed']} (calibration)")
    pushes: List[str] = []
    print("| speeds | what | loop s, measured (median) | simulated | steps/s per cluster, measured (median) | simulated | share in sync, all groups, measured | simulated |")
    print("|---|---|---|---|---|---|---|---|")
    for s in settings:
        sim, pushes_at = simulate(args, s, first["model_params"], overhead)
        m_loop = statistics.median(r["loop_s"] for r in runs[s])
        clusters = sorted(runs[s][0]["clusters"])
        m_rates = [statistics.median(r["clusters"][c]["rate"] for r in runs[s]) for c in clusters]
        m_share = statistics.median(r["sync_share"] for r in runs[s])
        what = "calibration" if s == settings[0] else "prediction"
        # each cluster's own pace: until it finished its steps (the asynchronous level lets a fast one finish first)
        sim_rates = [args.steps / sim.cluster_end_s[c] if c < len(sim.cluster_end_s) and sim.cluster_end_s[c] < float("inf")
                     else sim.final_step / sim.end_s for c in clusters]
        print(f"| {s} | {what} | {m_loop:.1f} | {sim.end_s:.1f} | {' / '.join(format(x, '.2f') for x in m_rates)} | "
              f"{' / '.join(format(x, '.2f') for x in sim_rates)} | {100 * m_share:.0f} % | {100 * (sim.sync + sim.wait) / sim.capacity:.0f} % |")
        if pushes_at:  # the asynchronous level
            pushes.append(f"| {s} | {' / '.join(str(int(statistics.median(r['clusters'][c].get('pushes', 0) for r in runs[s]))) for c in clusters)} | "
                          f"{' / '.join(str(len(pushes_at.get(c, []))) for c in clusters)} |")
    if pushes:
        print("\n| speeds | pushes merged per cluster, measured (median) | pushes per cluster, simulated |\n|---|---|---|")
        print("\n".join(pushes))


if __name__ == "__main__":
    main()
