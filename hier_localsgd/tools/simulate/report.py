"""Many runs of the simulator, their report (text, JSON, plot) and the validation set-ups; ``hier-localsgd simulate``."""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from hier_localsgd.core.runtime.faults import ROLES
from hier_localsgd.tools.plan.planner import deployment_of
from hier_localsgd.tools.plan.report import fmt_bytes, fmt_time, table
from hier_localsgd.tools.simulate.engine import RunResult, simulate_once
from hier_localsgd.tools.simulate.params import SimParams, resolve, scale_failures

if TYPE_CHECKING:
    from hier_localsgd.config import Config


# ----------------------------------------------------------------------------- runs and report
def summarize_runs(results: Sequence[RunResult]) -> Dict[str, Any]:
    """Means (and min/max) over runs of the headline figures."""

    def stats(xs: Sequence[float]) -> Dict[str, float]:
        return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "stdev": statistics.pstdev(xs) if len(xs) > 1 else 0.0}

    cap = [r.capacity for r in results]
    out: Dict[str, Any] = {
        "runs": len(results),
        "goodput": stats([r.goodput for r in results]),
        "expected_no_failure_goodput": results[0].expected_no_failure_goodput,
        "failures": stats([len(r.failures) for r in results]),
        "end_s": stats([r.end_s for r in results]),
        "shares": {
            "committed": statistics.fmean(r.committed / c for r, c in zip(results, cap)),
            "lost_compute": statistics.fmean(sum(r.lost.values()) / c for r, c in zip(results, cap)),
            "uncommitted_at_end": statistics.fmean(r.uncommitted_at_end / c for r, c in zip(results, cap)),
            "sync": statistics.fmean(r.sync / c for r, c in zip(results, cap)),
            "wait": statistics.fmean(r.wait / c for r, c in zip(results, cap)),
            "down": statistics.fmean(r.down / c for r, c in zip(results, cap)),
        },
        "lost_by_reason": {k: statistics.fmean(r.lost.get(k, 0.0) / c for r, c in zip(results, cap)) for k in ("own_work", "rollback", "discarded")},
        "slow_link_bytes_per_hour": statistics.fmean(r.slow_link_bytes / r.end_s * 3600 for r in results if r.end_s > 0),
        "slow_link_bytes": statistics.fmean(r.slow_link_bytes for r in results),
        "balance_error": max(r.balance_error for r in results),
        "outer_rounds": statistics.fmean(r.outer_rounds for r in results),
        "truncated": sum(1 for r in results if r.truncated),
        "failed_outer_rounds": statistics.fmean(r.failed_outer_rounds for r in results),
    }
    if results[0].target_rounds > 0:  # simulate.target_rounds (target.py): runs that did not get there count as None
        reached = [r.target_s for r in results if r.target_s is not None]
        out["target"] = {"rounds": results[0].target_rounds, "reached": len(reached),
                         "s": stats(reached) if reached else None, "progress_rounds": stats([r.progress_rounds for r in results])}
    effs = [r.efficiency for r in results if r.efficiency is not None]
    if effs:
        out["efficiency"] = stats(effs)
        out["steps_run"] = statistics.fmean(r.steps_run for r in results)
        out["steps_discarded"] = statistics.fmean(r.steps_discarded for r in results)
    roles: Dict[str, Dict[str, float]] = {}
    for role in ROLES:
        agg: Dict[str, float] = defaultdict(float)
        for r in results:
            for f in r.failures:
                if f["role"] != role:
                    continue
                agg["count"] += 1
                for k, v in f["lost_replica_s"].items():
                    agg[k] += v
                agg["total"] += f["lost_replica_s_total"]
        if agg["count"]:
            n = agg["count"]
            roles[role] = {"failures": n / len(results), **{k: v / n for k, v in agg.items() if k != "count"}}
    out["lost_per_failure_by_role"] = roles
    return out


def simulate_many(p: SimParams, seed: int, runs: int) -> List[RunResult]:
    return [simulate_once(p, seed + i) for i in range(runs)]


def job_failure_interval(p: SimParams) -> Optional[float]:
    """Mean seconds between failures over the whole job (for the tables)."""
    if p.failure_model == "chaos":
        return p.kill_every_s
    if p.failure_model != "independent":
        return None
    rate = 0.0
    n = p.clusters * p.replicas
    if p.mtbf_s > 0:
        rate += n / p.mtbf_s
    if p.cluster_mtbf_s > 0:
        rate += p.clusters / p.cluster_mtbf_s
    return 1.0 / rate if rate > 0 else None


def _fmt_s(x: Optional[float]) -> str:
    return "-" if x is None else fmt_time(x)


def human(report: Dict[str, Any]) -> str:
    par, s = report["params"], report["summary"]
    topo, sync, sim = report["config"]["topology"], report["config"]["sync"], report["config"]["simulate"]
    lines = [
        f"hier-localsgd simulate: {par['mode']} on {topo['clusters']} clusters x {topo['replicas_per_cluster']} replica groups "
        f"x {topo['ranks_per_replica']} ranks; step {fmt_time(par['step_s'])}"
        + (f" / speed {list(topo['cluster_speed'])} per cluster" if topo.get("cluster_speed") else "")
        + f", H_inner {sync['inner']['every']}, "
        f"H_outer {sync['outer']['every']}; {s['runs']} run(s) of "
        + (f"{fmt_time(sim['duration_s'])}" if sim["duration_s"] > 0 else f"{report['config']['train']['steps']} steps (train.steps)"),
        f"  failures: {par['failure_model']}" + (f", one every {fmt_time(report['job_failure_interval_s'])} over the job" if report["job_failure_interval_s"] else "")
        + f"; restart {fmt_time(par['restart_s'])}, heal {fmt_time(par['heal_s'])}"
        + (f", outer heal {fmt_time(par['outer_heal_s'])}" if par["mode"] == "hier" else "")
        + f", heartbeat {fmt_time(par['heartbeat_s'])}",
        "",
        f"goodput {s['goodput']['mean']:.4f} (min {s['goodput']['min']:.4f}, max {s['goodput']['max']:.4f}); "
        f"without failures {s['expected_no_failure_goodput']:.4f} (1 - sync overhead"
        + (", every cluster at the slowest's pace)" if topo.get("cluster_speed") else ")"),
    ]
    lk = report["config"]["links"]
    unlimited = [f"links.{k}" for k in ("inner", "outer") if lk[k]["bandwidth_gbps"] <= 0]
    if unlimited:
        lines.append(f"NOTE: {' and '.join(unlimited)} set no bandwidth_gbps (0 = unlimited, as every command's default): syncs and heals cost latency only")
    if "efficiency" in s:
        lines.append(
            f"steps kept / steps run (chaos.py's efficiency) {s['efficiency']['mean']:.4f} (min {s['efficiency']['min']:.4f}, max {s['efficiency']['max']:.4f}); "
            f"steps run {s['steps_run']:.0f}, discarded {s['steps_discarded']:.0f}"
        )
    tg = s.get("target")
    if tg:
        lines.append(
            f"time to the target (modelled: {tg['rounds']:g} synchronous rounds' worth of merged work, a calibration; target.py): "
            + (f"{fmt_time(tg['s']['mean'])} (min {fmt_time(tg['s']['min'])}, max {fmt_time(tg['s']['max'])}), reached in {tg['reached']} of {s['runs']} run(s)"
               if tg["s"] else f"not reached in any run (merged work at the end: {tg['progress_rounds']['mean']:.2f} rounds)")
        )
    if s["truncated"]:
        lines.append(
            f"WARNING: {s['truncated']} of {s['runs']} run(s) never reached an outer commit after the horizon and were "
            "stopped at 3x its length: the outer level stopped committing (docs/planner.md, 'out of step')"
        )
    lines += ["", "Where the replica groups' time went (share of C R T)"]
    sh, lr = s["shares"], s["lost_by_reason"]
    rows = [
        ["compute, committed", f"{sh['committed']:.2%}"],
        ["compute, lost: own steps of failed groups", f"{lr['own_work']:.2%}"],
        ["compute, lost: rolled-back rounds", f"{lr['rollback']:.2%}"],
        ["compute, lost: discarded at weight 0 / lost clusters", f"{lr['discarded']:.2%}"],
        ["compute, not yet committed at the end", f"{sh['uncommitted_at_end']:.2%}"],
        ["sync (collectives, heals)", f"{sh['sync']:.2%}"],
        ["waiting (quorums, global barrier, rejoin)", f"{sh['wait']:.2%}"],
        ["down (restarting)", f"{sh['down']:.2%}"],
    ]
    lines.append(table(["", "share"], rows))
    roles = s["lost_per_failure_by_role"]
    if roles:
        lines += ["", "Time lost per failure, by role (replica-group-seconds; job-seconds = / C R)"]
        n = topo["clusters"] * topo["replicas_per_cluster"]
        rows = []
        for role, v in roles.items():
            rows.append([
                role, f"{v['failures']:.1f}", f"{v.get('total', 0):.1f}", f"{v.get('total', 0) / n:.2f}",
                f"{v.get('own_work', 0):.1f}", f"{v.get('rollback', 0):.1f}", f"{v.get('discarded', 0):.1f}",
                f"{v.get('stall', 0):.1f}", f"{v.get('down', 0):.1f}",
            ])
        lines.append(table(["role", "failures/run", "total", "job-s", "own work", "rollback", "discarded", "stall", "down"], rows))
    lines += [
        "",
        f"slow-link traffic: {fmt_bytes(s['slow_link_bytes'])} per run, {fmt_bytes(s['slow_link_bytes_per_hour'])}/h; "
        f"outer rounds {s['outer_rounds']:.1f} (failed {s['failed_outer_rounds']:.1f})",
    ]
    if report.get("sensitivity"):
        lines += ["", "Sensitivity to the failure rate"]
        rows = []
        for row in report["sensitivity"]:
            rows.append([
                f"x{row['factor']:g}", _fmt_s(row["job_failure_interval_s"]), f"{row['failures']:.1f}",
                f"{row['goodput']:.4f}", f"{row['goodput_min']:.4f}-{row['goodput_max']:.4f}",
                "-" if row.get("efficiency") is None else f"{row['efficiency']:.4f}",
                str(row["truncated"]),
            ])
        lines.append(table(["rate", "one failure every", "failures/run", "goodput", "range", "steps kept/run", "truncated"], rows))
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: str) -> bool:
    """Goodput against the failure rate, and where the time went at each rate. False
    if matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    sens = report.get("sensitivity", [])
    rated = [r for r in sens if r["job_failure_interval_s"]]
    ax = axes[0]
    if rated:
        xs = [3600.0 / r["job_failure_interval_s"] for r in rated]
        ax.plot(xs, [r["goodput"] for r in rated], "o-", label="goodput")
        ax.fill_between(xs, [r["goodput_min"] for r in rated], [r["goodput_max"] for r in rated], alpha=0.2)
        if any(r.get("efficiency") is not None for r in rated):
            ax.plot(xs, [r["efficiency"] for r in rated], "s--", label="steps kept / steps run")
        ax.set_xscale("log")
    ax.axhline(report["summary"]["expected_no_failure_goodput"], ls=":", c="gray", label="no failures")
    ax.set_xlabel("failures per hour (whole job)")
    ax.set_ylabel("share")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower left")
    ax.set_title("Goodput vs failure rate")

    ax = axes[1]
    rows = sens or [{"factor": 1.0, "shares": report["summary"]["shares"], "lost_by_reason": report["summary"]["lost_by_reason"]}]
    parts = [
        ("committed", lambda r: r["shares"]["committed"]),
        ("lost: own steps", lambda r: r["lost_by_reason"]["own_work"]),
        ("lost: rollback", lambda r: r["lost_by_reason"]["rollback"]),
        ("lost: discarded", lambda r: r["lost_by_reason"]["discarded"]),
        ("not committed at end", lambda r: r["shares"]["uncommitted_at_end"]),
        ("sync", lambda r: r["shares"]["sync"]),
        ("waiting", lambda r: r["shares"]["wait"]),
        ("down", lambda r: r["shares"]["down"]),
    ]
    labels = [f"x{r['factor']:g}" for r in rows]
    bottom = [0.0] * len(rows)
    for name, get in parts:
        vals = [get(r) for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlabel("failure rate (x configured)")
    ax.set_ylabel("share of replica-group time")
    ax.set_ylim(0, 1.0)
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title("Where the time went")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def make_report(cfg: "Config") -> Dict[str, Any]:
    """Runs the configured simulations (and the sensitivity sweep) and gathers the figures."""
    p = resolve(cfg)
    sim = cfg.simulate
    results = simulate_many(p, sim.seed, sim.runs)
    summary = summarize_runs(results)
    sens = []
    for factor in sim.sensitivity:
        if factor == 1.0:
            rs, pf = results, p
        else:
            pf = scale_failures(p, factor)
            rs = simulate_many(pf, sim.seed, sim.runs)
        sm = summarize_runs(rs)
        sens.append({
            "factor": factor,
            "job_failure_interval_s": job_failure_interval(pf) if factor else None,
            "failures": sm["failures"]["mean"],
            "goodput": sm["goodput"]["mean"], "goodput_min": sm["goodput"]["min"], "goodput_max": sm["goodput"]["max"],
            "efficiency": sm.get("efficiency", {}).get("mean"),
            "truncated": sm["truncated"],
            "shares": sm["shares"],
            "lost_by_reason": sm["lost_by_reason"],
        })
    params = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v) for k, v in asdict(p).items()}
    return {
        "config": {**deployment_of(cfg), "simulate": asdict(sim)},
        "params": params,
        "job_failure_interval_s": job_failure_interval(p),
        "summary": summary,
        "sensitivity": sens,
        "runs": [{k: v for k, v in asdict(r).items() if k != "failures"} | {"failures": r.failures[:200]} for r in results],
    }


def run_simulate(cfg: "Config", out_dir: str) -> int:
    """Prints the simulation report, writes ``<out_dir>/<simulate.json_name>`` and, if matplotlib is
    importable, ``<out_dir>/<simulate.plot_name>``. Returns 0.

    Raises:
        ValueError: a bad field; the message starts with its path (``sync.inner.every: ...``).
    """
    report = make_report(cfg)
    print(human(report))
    sim = cfg.simulate
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, sim.json_name)
    with open(path, "w") as fh:
        json.dump(report, fh, indent=2, default=str)
    print(f"\nreport written to {path}")
    if sim.plot:
        png = os.path.join(out_dir, sim.plot_name)
        if plot(report, png):
            print(f"plot written to {png}")
        else:
            print("plot skipped: matplotlib is not installed")
    return 0


# ----------------------------------------------------------------------------- validation set-ups
# As command-line overrides (docs/planner.md prints them): load with
# ``load_config(OVERRIDES + more, validate_for="simulate")``, or pass them to ``hier-localsgd simulate``.

# The issue #6 networks (LAN 10 Gbit/s 0.1 ms, WAN 1 Gbit/s 20 ms) as the links sections.
ISSUE6_LINKS: List[str] = ["links.inner.bandwidth_gbps=10", "links.inner.latency_ms=0.1", "links.outer.bandwidth_gbps=1", "links.outer.latency_ms=20"]

# The large deployment of docs/planner.md: 64 clusters x 16 replica groups x 8 ranks (fsdp),
# Llama3 8B at 8192 tokens per rank and step on H100-class ranks, H 100/20 (plan's
# recommendation for ~5 % here), bf16 syncs, the issue #6 networks, 24 simulated hours.
LARGE_DEPLOYMENT: List[str] = [
    "topology.clusters=64", "topology.replicas_per_cluster=16", "topology.ranks_per_replica=8", "plan.sharding=fsdp",
    "plan.model.flavor=8B", "train.batch_size=1", "train.seq_len=8192", "plan.train.sync_dtype=bfloat16",
    "sync.inner.every=100", "sync.outer.every=20", "sync.min_clusters=1", *ISSUE6_LINKS, "simulate.duration_s=86400",
]

# The chaos command's measured run (docs/benchmarks.md) as a simulation:
# ``hier-localsgd chaos train.steps=600 sync.min_clusters=1 chaos.kill_every_s=30``:
# 2 clusters x 2 replica groups, debugmodel, 600 steps, H_inner 10, H_outer 3, kills of
# any role every 30 s on average over the first 80 % of the steps, restart after 2 s
# plus ~4 s process start, heartbeat timeout 5 s. The step time (0.34 s compute plus the
# issue #6 networks' syncs) reproduces the ~0.35 s wall per step measured.
CHAOS_VALIDATION: List[str] = [
    "topology.clusters=2", "topology.replicas_per_cluster=2", "topology.ranks_per_replica=1",
    "sync.mode=hier", "sync.inner.every=10", "sync.outer.every=3", "sync.min_clusters=1",
    *ISSUE6_LINKS, "train.batch_size=4", "train.seq_len=64",
    "plan.sharding=replicate", "plan.hardware.step_time_s=0.34", "plan.train.sync_dtype=float32",
    "simulate.params=6163712",  # torchtitan's Llama3 debugmodel
    "simulate.failures.model=chaos", "simulate.failures.kill_every_s=30", "simulate.failures.stop_kills_at=0.8",
    "simulate.failures.restart_s=6", "train.steps=600", "simulate.runs=200", "simulate.sensitivity=[]",
]


def torchft_per_step(failure_every_s: float = 60.0) -> List[str]:
    """torchft's per-step (HSDP, ddp-like) fault-tolerance run as a simulation (overrides).

    30 replica groups (one cluster: a single level, so ``sync.mode=ddp``, H = 1), one failure
    every ``failure_every_s`` over the job (per-group MTBF = 30 x that), torchft's default
    heartbeat timeout (5 s). The step time, restart, heal and reconfiguration figures of
    that run are not published; the values here are assumptions (docs/planner.md).
    """
    return [
        "topology.clusters=1", "topology.replicas_per_cluster=30", "topology.ranks_per_replica=1",
        "sync.mode=ddp", "sync.min_clusters=1",
        "links.inner.bandwidth_gbps=400", "links.inner.latency_ms=0.01", "links.outer.bandwidth_gbps=400", "links.outer.latency_ms=0.01",
        "plan.sharding=replicate", "plan.hardware.step_time_s=1.0", "plan.train.sync_dtype=bfloat16",
        "simulate.params=1500000000",
        "simulate.failures.model=independent", f"simulate.failures.mtbf_s={30 * failure_every_s}", "simulate.failures.restart_s=30",
        "simulate.failures.heal_s=2", "simulate.failures.reconfigure_s=3",
        "simulate.duration_s=3600", "simulate.runs=5", "simulate.sensitivity=[]",
    ]
