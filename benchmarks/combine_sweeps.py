"""Several ``hier-localsgd bench bench.sweep_gbps=[...]`` invocations with the same target,
as one sweep: each point keeps its own invocation's bare loops as its compute bound.

    python benchmarks/combine_sweeps.py OUT_DIR SWEEP_DIR [SWEEP_DIR ...] [--hier ARM] [--vs ARM ...]

Writes OUT_DIR/sweep.md, sweep.json and the two plots of bench_sweep.py, and prints per WAN
rate and seed the ``--hier`` arm's time to target against its compute bound and against
each ``--vs`` arm (time and WAN bytes to target). Exit 2, with one line, if a directory has
no sweep.json or the targets differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

from hier_localsgd.experiments.bench import late_cell, sync_ratio
from hier_localsgd.experiments.bench_sweep import plots, summarize, table
from hier_localsgd.launch.netns import tbf_transfer_s


def wan_sync(run: Dict[str, Any]) -> str:
    """The run's WAN collective per round against its bound through tbf at the run's rate
    (bench.sync_ratio, recomputed from its replicas' result.json: sweeps run before the
    compressed round was counted have none for it), as "measured / bound s (ratio)", and the
    same from the last member's arrival where the run recorded spans (bench.after_last_arrival)."""
    d = Path(run["run_dir"])
    files = sorted(d.glob("replicas/c*r*/result.json"))
    if not files or not run.get("wan_gbps"):
        return "-"
    clusters = {f.parent.name.split("r")[0] for f in files}
    level, world = ("outer", len(clusters)) if run["mode"] == "hier" else (run["mode"], len(files))
    r = sync_ratio([json.loads(f.read_text()) for f in files], level, world, lambda sent: tbf_transfer_s(sent, run["wan_gbps"] * 1e9))
    return "-" if r is None else f"{r['measured_s']:.2f} / {r['bound_s']:.2f} s ({r['ratio']:.2f}x)" + late_cell(r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("sweeps", type=Path, nargs="+")
    ap.add_argument("--hier", default="hier_overlap_int8_frag3")
    ap.add_argument("--vs", nargs="*", default=["flat_count", "ddp"])
    a = ap.parse_args()
    reports = []
    for d in a.sweeps:
        f = d / "sweep.json" if (d / "sweep.json").is_file() else d / "bench" / "sweep.json"
        if not f.is_file():
            print(f"combine_sweeps: {d}: no sweep.json (nor bench/sweep.json)", file=sys.stderr)
            return 2
        reports.append(json.loads(f.read_text()))
    targets = {r["target_loss"] for r in reports}
    if len(targets) != 1:
        print(f"combine_sweeps: the sweeps' targets differ: {sorted(targets)}", file=sys.stderr)
        return 2
    target = targets.pop()
    points: List[Dict[str, Any]] = []
    runs: List[Dict[str, Any]] = []
    for r in reports:
        for run in r["runs"]:
            run["bare_step_s"] = r["bare_step_s"]
        points += summarize(r["runs"], target, r["bare_step_s"])
        runs += r["runs"]
    a.out.mkdir(parents=True, exist_ok=True)
    lines = [f"target {target:.4f}; sweeps: {', '.join(str(d) for d in a.sweeps)}; bare loops "
             f"{', '.join(format(r['bare_step_s'], '.4f') for r in reports)} s/step", "", table(points, target), "",
             f"Per seed: {a.hier} against its compute bound (its invocation's bare step x its steps) and each of {a.vs}", "",
             "| WAN | seed | hier steps, s to target | x bound | hier WAN round: measured / bound | "
             + " | ".join(f"{v}: s to target, time ratio, WAN MB ratio, WAN round" for v in a.vs) + " |",
             "|---|---|---|---|---|" + "---|" * len(a.vs)]
    by = {(run["arm"], run["wan_gbps"], run["seed"]): run for run in runs if not run.get("failed")}
    for (arm, g, seed), run in sorted(by.items(), key=lambda kv: (-kv[0][1], kv[0][2])):
        if arm != a.hier or not run.get("reached"):
            continue
        h = run["reached"]
        cells = []
        for v in a.vs:
            # An arm not run at this rate (ddp: 1 Gbit/s only) still gives its bytes, which no rate changes.
            o = by.get((v, g, seed)) or next((r for (arm_, _, s), r in by.items() if arm_ == v and s == seed), None)
            if o is None or not o.get("reached"):
                cells.append("-" if o is None else "not reached")
                continue
            r = o["reached"]
            src = "" if o["wan_gbps"] == g else f" (bytes from {o['wan_gbps'] * 1e3:g} Mbit/s)"
            time_ratio = f"{r['t'] / h['t']:.2f}x" if o["wan_gbps"] == g else "-"
            round_ = wan_sync(o) if o["wan_gbps"] == g else "-"
            cells.append(f"{r['t']:.1f} ({r['step']} steps), {time_ratio}, {r['slow_bytes'] / h['slow_bytes']:.1f}x{src}, {round_}")
        lines.append(f"| {g * 1e3:g} Mbit/s | {seed} | {h['step']}, {h['t']:.1f} | {h['t'] / (run['bare_step_s'] * h['step']):.2f} | {wan_sync(run)} | "
                     + " | ".join(cells) + " |")
    md = "\n".join(lines)
    (a.out / "sweep.md").write_text(md + "\n")
    (a.out / "sweep.json").write_text(json.dumps({"target_loss": target, "sweeps": [str(d) for d in a.sweeps], "points": points,
                                                  "runs": runs}, indent=1))
    try:
        print("plots:", plots(points, runs, a.out))
    except ImportError as e:
        print(f"combine_sweeps: no plots ({e})")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
