"""``hier-localsgd bench bench.sweep_gbps=[...]``: the fair sweep of issue #14 §3.

WAN bandwidth (``bench.sweep_gbps``) x arms (``bench.arms``) x seeds (``bench.seeds``), every
run with bench.py's :func:`~hier_localsgd.experiments.bench.run_arm` on the same workload and
token budget (``train.steps`` x ``train.batch_size`` per replica group). What makes it fair:

* **Seeds.** A seed ``s`` sets the model's initialisation (``train.seed``) and the order of
  training samples (``data.stream``); the corpus and its eval set stay the same, so the losses
  of all runs are on one scale. Per point: median and [min, max] over the seeds.
* **Eval at each arm's sync points** (bench.py ``sync_eval``): after every outer round (hier),
  every flat sync, on the hier period's grid for ddp; an overlapped hier arm at its merge
  steps. The curve's ``spread`` (max - min of the groups' losses on the shared eval set) shows
  whether the groups held one model there. Evaluation time is taken out of the time axis.
* **Target from a pilot independent of the arms**: one process, no sync, the job's tokens per
  step (C·R x the batch) for the same steps, seed ``bench.pilot_seed`` (not one of the arms'
  seeds); target = its final eval loss + ``bench.target_margin``, or ``bench.target_loss`` (then no pilot runs).
* **Compute bound per arm**: bare loops, one per replica group run concurrently on the same
  cores (bare_loops.py ``run_bare``), mean step time x the steps the arm needed to reach the
  target; and x the fewest steps any arm needed (the bound no arm can beat here).

``bench.links=kernel`` runs every point on kernel-shaped links (bench.py's docstring says
which part is the kernel's and which user space's) and reports the wire bytes. Outputs in
``bench.out`` (default ``<run.dir>/bench``): ``sweep.md``, ``sweep.json`` and two plots
(time to target vs WAN bandwidth with the compute bounds; eval loss vs WAN bytes).

Failure semantics: a run that fails (a process exited non-zero or the arm timed out after
``bench.timeout_s``) is kept in the JSON as failed and counted in its point; the command
exits 1 if any run failed, 2 if kernel links were asked for and are unavailable.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from hier_localsgd.config import Config, load_config
from hier_localsgd.experiments.bare_loops import run_bare
from hier_localsgd.experiments.bench import KERNEL_NOTE, prepare, run_arm
from hier_localsgd.experiments.bench_chaos import run_chaos_arm
from hier_localsgd.experiments.bench_chaos import table as chaos_table
from hier_localsgd.launch.local import child_env


def run_pilot(base: List[str], cfg: Config, out: Path) -> Dict[str, Any]:
    """The pilot (train/bare.py ``pilot_loop``) in a process of its own; raises RuntimeError if it fails."""
    f = out / "pilot.json"
    groups = cfg.topology.clusters * cfg.topology.replicas_per_cluster
    argv = [sys.executable, "-m", "hier_localsgd.experiments.bare", *base, f"train.seed={cfg.bench.pilot_seed}",
            f"data.stream={cfg.bench.pilot_seed}", f"bare.out={f}", f"bare.pilot={groups}"]
    p = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=cfg.bench.timeout_s)
    if p.returncode != 0 or not f.exists():
        raise RuntimeError(f"pilot exited {p.returncode}: {p.stderr.strip()[-1500:]}")
    return json.loads(f.read_text())


def reach(curve: List[Dict[str, float]], target: float) -> Optional[Dict[str, float]]:
    """The first eval point at or below ``target`` (step, seconds, slow-link bytes), or None."""
    return next((p for p in curve if p["loss"] <= target), None)


def stats(xs: List[Optional[float]]) -> Optional[Dict[str, Any]]:
    """Median, min, max over the values that exist, and how many of how many exist."""
    v = [x for x in xs if x is not None]
    if not v:
        return None
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v), "of": len(xs)}


def _global(runs: List[Dict[str, Any]], key: str) -> Optional[Dict[str, Any]]:
    """Statistics of ``key`` where the global model first reached the target (None without a global curve)."""
    return stats([r["reached_global"][key] if r.get("reached_global") else None for r in runs]) if runs else None


def summarize(runs: List[Dict[str, Any]], target: float, bare_s: Optional[float]) -> List[Dict[str, Any]]:
    """One entry per (WAN rate, arm): statistics over its seeds, and its compute bound."""
    points: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in runs:
        points.setdefault((r["wan_gbps"], r["arm"]), []).append(r)
    fewest = min((r["reached"]["step"] for r in runs if r.get("reached")), default=None)
    out = []
    for (gbps, arm), rs in points.items():
        ok = [r for r in rs if not r.get("failed")]
        hit = [r.get("reached") for r in ok]
        steps = stats([h["step"] if h else None for h in hit])
        global_model = [r for r in ok if r.get("curve_global")]
        out.append({
            "wan_gbps": gbps, "arm": arm, "runs": len(rs), "failed": len(rs) - len(ok),
            "steps_to_target": steps,
            # overlapped arms: the first merge where the global model (not the groups' live ones) reached it
            "steps_to_target_global": _global(global_model, "step"),
            "time_to_target_global_s": _global(global_model, "t"),
            "slow_bytes_to_target_global": _global(global_model, "slow_bytes"),
            "time_to_target_s": stats([h["t"] if h else None for h in hit]),
            "slow_bytes_to_target": stats([h["slow_bytes"] if h else None for h in hit]),
            "final_eval_loss": stats([r["final_eval_loss"] for r in ok]),
            "wall_s": stats([r["wall_s"] for r in ok]),
            "max_spread_at_evals": max((p.get("spread", 0.0) for r in ok for p in r["curve"][1:-1]), default=None),
            "wire_vs_accounted": stats([r["wire"]["wire_vs_accounted"] if r.get("wire") else None for r in ok]),
            "compute_bound_s": None if bare_s is None or steps is None else bare_s * steps["median"],
            "compute_bound_fewest_s": None if bare_s is None or fewest is None else bare_s * fewest,
        })
    return out


def _s(st: Optional[Dict[str, Any]], spec: str, scale: float = 1.0) -> str:
    if st is None:
        return "not reached"
    txt = f"{st['median'] / scale:{spec}} [{st['min'] / scale:{spec}}, {st['max'] / scale:{spec}}]"
    return txt + ("" if st["n"] == st["of"] else f" ({st['n']}/{st['of']} reached)")


def table(points: List[Dict[str, Any]], target: float) -> str:
    lines = [f"| WAN | arm | steps to target {target:.4f} | s to target | compute bound s (x arm's steps) | arm / bound | WAN MB to target | final eval loss | group spread at evals | wire / accounted | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: (-p["wan_gbps"], p["arm"])):
        t, b = p["time_to_target_s"], p["compute_bound_s"]
        ratio = "-" if not t or not b else f"{t['median'] / b:.2f}"
        spread = "-" if p["max_spread_at_evals"] is None else f"{p['max_spread_at_evals']:.2g}"
        wire = "-" if p["wire_vs_accounted"] is None else f"{p['wire_vs_accounted']['median']:.3f}"
        def glob(key: str, spec: str, scale: float = 1.0) -> str:  # overlapped arms: where the global model reached it
            return "" if not p.get(key) else f"; global model {_s(p[key], spec, scale)}"

        steps = _s(p["steps_to_target"], ".0f") + glob("steps_to_target_global", ".0f")
        secs = _s(t, ".1f") + glob("time_to_target_global_s", ".1f")
        wan = _s(p["slow_bytes_to_target"], ".2f", 1e6) + glob("slow_bytes_to_target_global", ".2f", 1e6)
        lines.append(f"| {p['wan_gbps'] * 1e3:g} Mbit/s | {p['arm']} | {steps} | {secs} | "
                     f"{'-' if b is None else f'{b:.1f}'} | {ratio} | {wan} | "
                     f"{_s(p['final_eval_loss'], '.4f')} | {spread} | {wire} | {p['failed']}/{p['runs']} |")
    return "\n".join(lines)


def plots(points: List[Dict[str, Any]], runs: List[Dict[str, Any]], out: Path) -> List[str]:
    """Time to target vs WAN rate (median, min-max bars, compute bounds dashed); loss vs WAN bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = sorted({p["arm"] for p in points})
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for arm in arms:
        ps = sorted((p for p in points if p["arm"] == arm and p["time_to_target_s"]), key=lambda p: p["wan_gbps"])
        if not ps:
            continue
        x = [p["wan_gbps"] * 1e3 for p in ps]
        med = [p["time_to_target_s"]["median"] for p in ps]
        err = [[m - p["time_to_target_s"]["min"] for m, p in zip(med, ps)], [p["time_to_target_s"]["max"] - m for m, p in zip(med, ps)]]
        line = ax.errorbar(x, med, yerr=err, marker="o", ms=4, capsize=3, label=arm)
        ax.plot(x, [p["compute_bound_s"] for p in ps], ls=":", color=line[0].get_color(), lw=1)
    fewest = next((p["compute_bound_fewest_s"] for p in points if p["compute_bound_fewest_s"]), None)
    if fewest:
        ax.axhline(fewest, color="k", ls="--", lw=1, label="compute bound, fewest steps of any arm")
    ax.set_xscale("log")
    ax.set_xlabel("WAN bandwidth (Mbit/s)")
    ax.set_ylabel("seconds to target (median, min-max)")
    ax.set_title("dotted: bare-loop compute x the arm's own steps", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths = [str(out / "sweep_time_to_target.png")]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    rates = sorted({r["wan_gbps"] for r in runs}, reverse=True)
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 4.0), squeeze=False, sharey=True)
    colors = {a: f"C{i}" for i, a in enumerate(arms)}
    for ax, g in zip(axes[0], rates):
        for r in runs:
            if r["wan_gbps"] != g or r.get("failed") or r["entropy_floor"] is None:
                continue
            pts = [p for p in r["curve"] if p["slow_bytes"] > 0]
            ax.plot([p["slow_bytes"] for p in pts], [p["loss"] - r["entropy_floor"] for p in pts], color=colors[r["arm"]], lw=1, alpha=0.8,
                    label=r["arm"] if r["seed"] == r["seeds"][0] else None)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"WAN {g * 1e3:g} Mbit/s", fontsize=9)
        ax.set_xlabel("WAN bytes, all groups (accounted)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("eval loss - entropy floor (each seed a line)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    paths.append(str(out / "sweep_loss_vs_wan_bytes.png"))
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def run_sweep(cfg: Config, overrides: List[str]) -> int:
    b = cfg.bench
    prepared = prepare(cfg, overrides)
    if prepared is None:
        return 2
    out, arms, steps, base = prepared
    no_net = [o for o in base if o != "run.netns=true"]  # pilot and bare loops: no network
    t0 = time.time()
    print(f"bench sweep ({b.mode}, {b.links} links): WAN {b.sweep_gbps} Gbit/s x {list(arms)} x seeds {b.seeds}, {steps} steps -> {out}", flush=True)
    # A given target needs no pilot (on the debugmodel workload the pilot alone takes minutes).
    pilot = None if b.target_loss else run_pilot(no_net, cfg, out)
    target = b.target_loss or pilot["final_eval_loss"] + b.target_margin
    source = "given (bench.target_loss)" if pilot is None else f"pilot (seed {b.pilot_seed}): final eval loss {pilot['final_eval_loss']:.4f} + margin"
    print(f"[{time.time() - t0:.0f}s] target {target:.4f}: {source}", flush=True)
    bare_s = run_bare([*no_net, "sync.mode=hier"], load_config([*no_net, "sync.mode=hier"], validate_for="demo"), out)
    print(f"[{time.time() - t0:.0f}s] bare loops: {bare_s} s/step", flush=True)
    runs = []
    for gbps in b.sweep_gbps:
        rate = [f"links.outer.bandwidth_gbps={0 if b.links == 'kernel' else gbps}"]
        for name, extra in arms.items():
            for seed in b.seeds:
                label = f"{name}_{gbps * 1e3:g}mbit_s{seed}"
                print(f"[{time.time() - t0:.0f}s] {label} ...", flush=True)
                r = run_arm(label, [*base, *rate, *extra, f"train.seed={seed}", f"data.stream={seed}"], out, b.timeout_s,
                            gbps * 1e9 if b.links == "kernel" else 0.0)
                r.update(arm=name, wan_gbps=gbps, seed=seed, seeds=list(b.seeds), reached=None if r.get("failed") else reach(r["curve"], target),
                         reached_global=None if r.get("failed") or not r.get("curve_global") else reach(r["curve_global"], target))
                runs.append(r)
    points = summarize(runs, target, bare_s)
    chaos = None
    if b.chaos:  # at the slowest WAN rate given last; bandwidth in user space (bench_chaos.py)
        g = b.sweep_gbps[-1]
        print(f"[{time.time() - t0:.0f}s] chaos under load, hier vs flat, WAN {g * 1e3:g} Mbit/s ...", flush=True)
        try:
            chaos = run_chaos_arm([*base, f"links.outer.bandwidth_gbps={g}"], out, target, b.chaos_steps)
        except Exception as e:  # the sweep's figures are kept; the chaos arm reports why it has none
            chaos = {"error": f"{type(e).__name__}: {e}"}
        chaos["wan_gbps"] = g
    report = {"overrides": list(overrides), "mode": b.mode, "links": b.links, "what_is_kernel": KERNEL_NOTE if b.links == "kernel" else None, "steps": steps,
              "seeds": b.seeds, "pilot": pilot, "pilot_seed": b.pilot_seed, "target_loss": target, "bare_step_s": bare_s,
              "fewest_steps_to_target": min((r["reached"]["step"] for r in runs if r.get("reached")), default=None),
              "points": points, "runs": runs, "chaos": chaos, "wall_s": time.time() - t0}
    try:
        report["plots"] = plots(points, runs, out)
    except ImportError as e:  # matplotlib is an optional dependency: the plot data is in sweep.json
        report["plots"] = []
        print(f"bench: no plots ({e}); their data is in sweep.json (points, runs[].curve)")
    md = table(points, target)
    head = (f"target {target:.4f} ({source}); bare loop {bare_s} s/step; "
            f"fewest steps any arm needed: {report['fewest_steps_to_target']}; seeds {b.seeds}; {b.links} links")
    (out / "sweep.json").write_text(json.dumps(report, indent=2))
    if chaos is not None:
        md += "\n\n" + (f"chaos under load: failed: {chaos['error']}" if "error" in chaos else chaos_table(chaos, chaos["wan_gbps"]))
    (out / "sweep.md").write_text(head + "\n\n" + md + "\n")
    print(head)
    print(md)
    print(f"bench sweep: {out / 'sweep.md'}, {out / 'sweep.json'}, plots {report['plots']}; {report['wall_s']:.0f} s")
    bad_chaos = chaos is not None and not all((chaos.get(m) or {}).get("ok") for m in ("hier", "flat"))
    return 1 if any(r.get("failed") for r in runs) or bad_chaos else 0
