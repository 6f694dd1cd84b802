"""The sweep's chaos-under-load arm (issue #14 §4): hier and flat torchft DiLoCo under one
seeded fault schedule, with goodput and time to the sweep's target for both.

It drives ``hier-localsgd chaos`` with ``chaos.compare_flat`` (experiments/chaos.py, through
its public :func:`~hier_localsgd.experiments.chaos.run_chaos`; the fault schedule, the
evidence rules and the goodput figure are chaos.py's), on the sweep's workload and links,
the flat arm syncing as often as hier's outer rounds (``sync.flat.every`` = the hier period)
and each evaluated at its own sync points (bench.sync_eval; hier's are offset with a delayed
outer merge). The flat run is hier's settings less its outer compression and fragments
(chaos.flat_counterpart). Then it reads the eval events of both chaos runs
for the time to the target (bench.py's curve: seconds since each group's first start, less
evaluation time; a restarted group keeps its first start, so time lost to faults counts).

Settings: every ``chaos.*`` override given to the sweep applies (seed, kinds, rate of
faults: give ``chaos.kill_every_steps`` so hier and flat meet faults at the same training
steps — a wall-clock schedule hits the faster run less — and ``chaos.draw=plan`` so they meet
the same faults on the same groups, drawn before either run: chaos_plan.py); ``bench.chaos_steps`` sets the run's length (faults need a run longer than the
quick workload's seconds). The WAN's bandwidth is the user-space emulation's even with
``bench.links=kernel`` (chaos.py builds its own jobs, which bench.py does not shape); with
namespaces available chaos.py runs the clusters in them for its partition faults. ``chaos.baseline`` is off (goodput needs none). WAN bytes are not
reported here: a restarted process's byte counters start again from 0.

Failure semantics: whatever run_chaos raises propagates; a chaos run whose processes did not
all end at 0 or whose groups ended inconsistent is reported with ``ok: false``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from hier_localsgd.config import load_config
from hier_localsgd.core.runtime.status import read_events, replica_dir
from hier_localsgd.experiments.bench import _curve, sync_eval
from hier_localsgd.experiments.chaos import flat_counterpart, run_chaos
from hier_localsgd.experiments.chaos_plan import describe_match


def run_chaos_arm(base: List[str], out: Path, target: float, steps: int) -> Dict[str, Any]:
    """Runs hier and flat under one fault schedule (``base``: the sweep's overrides for one
    WAN rate, its bandwidth emulated in user space: chaos.py's jobs are not tbf-shaped);
    returns per mode goodput, time and steps to ``target``, final loss, consistency."""
    run_dir, report_path = out / "chaos", out / "chaos" / "chaos_report.json"
    probe = load_config([*base, "sync.mode=hier"], validate_for="demo")
    period = probe.sync.outer_period
    over = [*base, f"train.steps={steps}", "sync.mode=hier", f"sync.flat.every={period}", *sync_eval(probe),
            "chaos.compare_flat=true", "chaos.baseline=false", f"chaos.report={report_path}", f"run.dir={run_dir}"]
    cfg = load_config(over, validate_for="chaos")
    # each mode evaluated at its own sync points (bench.sync_eval): hier's with a delayed
    # outer merge are offset from flat's
    code = run_chaos(cfg, over, flat_extra=sync_eval(load_config(flat_counterpart(over), validate_for="chaos")))
    report = json.loads(report_path.read_text())
    C, R = cfg.topology.clusters, cfg.topology.replicas_per_cluster
    out_modes: Dict[str, Any] = {}
    for mode, rep, sub in (("hier", report, "chaos"), ("flat", report.get("flat"), "flat_chaos")):
        if rep is None:
            out_modes[mode] = {"ok": False, "why": "no report (the hier part failed before the flat run)"}
            continue
        events = {(c, r): read_events(replica_dir(run_dir / sub, c, r) / "events.jsonl") for c in range(C) for r in range(R)}
        curve = _curve(mode, events, C, R)
        hit = next((p for p in curve if p["loss"] <= target), None)
        out_modes[mode] = {
            "ok": bool(rep["consistent"]) and all(v == 0 for v in rep["exit_codes"].values()),
            "goodput": rep["goodput"], "faults": len(rep["kills"]) + len(rep.get("faults", [])),
            "kinds": rep["chaos"]["kinds"], "steps_reached": rep["steps_reached"],
            "time_to_target_s": hit["t"] if hit else None, "steps_to_target": hit["step"] if hit else None,
            "final_eval_loss": rep["final_eval_loss"], "consistent": rep["consistent"], "wall_s": rep["wall_s"],
            "curve": [{k: p[k] for k in ("step", "loss", "t")} for p in curve],
        }
    return {"exit_code": code, "seed": cfg.chaos.seed, "steps": steps, "target_loss": target, "report": str(report_path),
            "draw": cfg.chaos.draw, "schedule": (report.get("vs_flat") or {}).get("schedule"), **out_modes}


def table(res: Dict[str, Any], gbps: float) -> str:
    """A markdown line per mode."""
    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = [f"chaos under load (WAN {gbps * 1e3:g} Mbit/s, chaos seed {res['seed']}, {res['steps']} steps, target {res['target_loss']:.4f}):", "",
             "| mode | faults | goodput | steps to target | s to target | final eval loss | consistent | wall s |", "|---|---|---|---|---|---|---|---|"]
    for mode in ("hier", "flat"):
        m = res.get(mode) or {}
        if "goodput" not in m:
            lines.append(f"| {mode} | {m.get('why', 'missing')} |")
            continue
        lines.append(f"| {mode} | {m['faults']} | {f(m['goodput'], '.3f')} | {f(m['steps_to_target'], 'd')} | {f(m['time_to_target_s'], '.1f')} | "
                     f"{f(m['final_eval_loss'], '.4f')} | {m['consistent']} | {m['wall_s']:.1f} |")
    if res.get("schedule") is not None:
        lines += ["", describe_match(res["schedule"])]
    return "\n".join(lines)
