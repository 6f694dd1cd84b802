"""``hier-localsgd chaos``: kill processes on a seeded schedule and measure the recovery.

Runs the configured topology on this machine (as the demo does), and while it trains
SIGKILLs processes by role — a ``non_leader`` replica group, a cluster's ``leader``, or a
whole ``cluster`` — at exponentially distributed intervals with mean
``chaos.kill_every_s`` (seeded by ``chaos.seed``); ``chaos.kinds`` adds phase-targeted and
simultaneous kills, hangs (SIGSTOP), lighthouse kills and network partitions
(chaos_faults.py, which also holds their evidence). Killed processes are restarted after
``chaos.restart_delay_s``, as the launch script or torchelastic would; they rejoin and
heal. No kills happen once every running process has passed ``chaos.stop_kills_at`` of the
steps, so the run can end consistent, and none that would leave no *continuous* process
(below): killing a cluster while the only other one is a fresh restart that has not healed
yet would end the job's trained state, which no restart can recover. With
``chaos.baseline``, a failure-free run with the same seed goes first.

Every figure in the report (``chaos.report``, default ``<run.dir>/chaos_report.json``, plus
a human summary) is computed from evidence: what the processes published (events.jsonl,
status.json, result.json) and the launcher's own record of starts, kills, exits (each
with the process's last status) and restarts. A figure without evidence is ``None``, not
a guess.

Terms and the rules of every figure: chaos_evidence.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hier_localsgd.config import Config, load_config
from hier_localsgd.experiments.chaos_evidence import evidence
from hier_localsgd.experiments.chaos_faults import fault_evidence
from hier_localsgd.experiments.chaos_monkey import ChaosMonkey
from hier_localsgd.experiments.chaos_plan import describe_match, schedule_match
from hier_localsgd.experiments.summary import summarize
from hier_localsgd.launch.local import LocalJob
from hier_localsgd.core.runtime.status import read_events, replica_dir
from hier_localsgd.sync.compression import NONE as NO_COMPRESSION

def analyse(cfg: Config, job: LocalJob, monkey: ChaosMonkey, wall_s: float, baseline: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    keys = job.keys()
    events = {k: read_events(replica_dir(job.run_dir, *k) / "events.jsonl") for k in keys}
    summary = summarize(cfg, job, wall_s)
    tr = cfg.train
    ev = evidence(
        job.history, events, monkey.kills,
        results={k: job.result(k) for k in keys},
        consistent=bool(summary["consistent"]),
        t0=monkey.t0,
        final_status={k: job.last_status(k) for k in keys},
        work_at_kill=monkey.work_at_kill,
        tokens_per_step=tr.batch_size * tr.seq_len * cfg.topology.ranks_per_replica,
    )
    monkey.stall.finish()
    hd = dict(ev.pop("hangs_detail"), stalls=list(monkey.stall.stalls))
    ev["faults"] = fault_evidence(monkey.faults, events, job.history, cfg.topology.clusters)
    finished = summary["steps"] >= tr.steps
    retained = None
    if baseline and finished and baseline.get("steps", 0) >= tr.steps and wall_s > 0:
        retained = baseline["wall_s"] / wall_s
    return {
        "topology": summary["topology"],
        "model": summary["model"],
        "steps_target": tr.steps,
        "steps_reached": summary["steps"],
        "chaos": {"seed": cfg.chaos.seed, "kill_every_s": cfg.chaos.kill_every_s, "roles": list(cfg.chaos.roles), "restart_delay_s": cfg.chaos.restart_delay_s,
                  "kinds": list(monkey.kinds), "draw": cfg.chaos.draw, "hang_s": cfg.chaos.hang_s, "lighthouse_down_s": cfg.chaos.lighthouse_down_s, "partition_s": cfg.chaos.partition_s},
        "mode": cfg.sync.mode,
        **ev,
        **({"plan": [f.as_dict() for f in monkey.plan],
            "planned_fired": sum(1 for r in [*monkey.kills, *monkey.faults] if "planned" in r), "skipped": monkey.skipped}
           if monkey.plan is not None else {}),
        "hangs": sum(len(v) for v in hd.values()),
        "hangs_detail": hd,
        "throughput_retained": retained,
        "consistent": summary["consistent"],
        "not_finite": summary["not_finite"],
        "excluded": summary["excluded"],  # contributions the poison screen kept out (summary.py)
        "final_eval_loss": summary["final_eval_loss"],
        "entropy_floor": summary["entropy_floor"],
        "exit_codes": summary["exit_codes"],
        "wall_s": wall_s,
    }


def _run(cfg: Config, overrides: List[str], subdir: str, chaos: bool) -> Tuple[LocalJob, Optional[ChaosMonkey], float]:
    job = LocalJob(cfg, overrides, free_ports=True, run_dir_override=Path(cfg.run.dir) / subdir, warm_spares=cfg.chaos.warm_spare)
    monkey = ChaosMonkey(job, cfg) if chaos else None
    t0 = time.time()
    try:
        job.start_lighthouses()
        job.start_all()
        if monkey is not None:
            monkey.t0 = monkey.stall.t0 = monkey.stall.last_progress = time.time()
            monkey.schedule_next(monkey.t0)
        job.wait(cfg.chaos.timeout_s, tick=monkey, tick_every_s=0.2, restart=chaos, restart_delay_s=cfg.chaos.restart_delay_s)
    finally:
        if monkey is not None:
            monkey.finish()
        job.stop()
    return job, monkey, time.time() - t0


def human(report: Dict[str, Any]) -> str:
    def f(x: Any, n: int = 2) -> str:
        return "-" if x is None else f"{x:.{n}f}"

    hd = report["hangs_detail"]
    lost = report["steps_lost"]
    lines = [
        f"chaos: {len(report['kills'])} kills ({', '.join(k['role'] for k in report['kills'])}), "
        f"{report['recovered']} recovered, {report['hangs']} hangs "
        f"({len(hd['timeouts'])} timeouts, {len(hd['watchdog_exits'])} watchdog exits, {len(hd['stalls'])} stalls), "
        f"{len(report['self_exits'])} non-zero exits on their own, consistent: {report['consistent']}",
        f"  time to survivors' next commit (s; outer commit when a cluster was lost): {[f(x) for x in report['time_to_next_commit_s']]}",
        f"  time to heal per restart (s): {[f(x) for x in report['time_to_heal_s']]}",
        f"  steps run {report['steps_run']}, kept {report['steps_kept']}; lost: "
        + ", ".join(f"{k} {v}" for k, v in lost.items()),
        "  discarded by the processes, by reason: " + (", ".join(f"{k} {v}" for k, v in report.get("discarded_by", {}).items()) or "none"),
        f"  contributions excluded by the poison screen: {len(report.get('excluded', []))}"
        + "".join(f"; {x['member']} ({x['level']}) at step {x['step']}: {x['reason']}" for x in report.get("excluded", [])[:6])
        + (f"; NOT FINITE at the end: {report['not_finite']}" if report.get("not_finite") else ""),
        f"  goodput (tokens in the final model / tokens computed) {f(report['goodput'], 3)}; "
        f"processes' own count {f(report['process_efficiency'], 3)}",
        f"  throughput retained (failure-free wall / chaos wall, {report['steps_target']} steps) {f(report['throughput_retained'], 3)}",
        f"  final eval loss {f(report['final_eval_loss'], 4)}"
        + (f" vs failure-free {f(report['baseline']['final_eval_loss'], 4)}" if report.get("baseline") else ""),
        f"  wall {report['wall_s']:.1f} s" + (f" vs failure-free {report['baseline']['wall_s']:.1f} s" if report.get("baseline") else ""),
    ]
    for k in report["kills"]:
        if k.get("kind", "kill") != "kill":
            lines.append(f"  {k['kind']} {'+'.join(k['targets'])} in {k['phase']}" + (f" (armed for {k['armed_phase']}, hit: {k['phase_hit']})" if k.get("armed_phase") else "")
                         + f": recovered {k['recovered']}")
    for fl in report.get("faults", []):
        ev = {x: fl.get(x) for x in ("abandoned_after_s", "rejoined_after_s", "exited", "back_after_s", "commits_resumed_s", "round_begun_s",
                                     "first_round_s", "replica_restarts", "fired_step", "excluded_after_s", "healthy_nonfinite", "gone_before_round") if x in fl}
        lines.append(f"  {fl['kind']} {fl['target']} at {fl['t']:.0f}s for {fl['duration_s']:g}s: recovered {fl['recovered']} "
                     + ", ".join(f"{x} {f(v) if isinstance(v, float) else v}" for x, v in ev.items()))
    return "\n".join(lines)


def _chaos_report(cfg: Config, overrides: List[str], label: str) -> Dict[str, Any]:
    """A failure-free run (with chaos.baseline) and a chaos run of one configuration."""
    baseline = None
    sub = "" if label == "hier" or cfg.sync.mode == "hier" else f"{label}_"
    if cfg.chaos.baseline:
        print(f"chaos [{label}]: failure-free run with the same seed first", flush=True)
        bjob, _, bwall = _run(cfg, overrides, f"{sub}baseline", chaos=False)
        bs = summarize(cfg, bjob, bwall)
        baseline = {"final_eval_loss": bs["final_eval_loss"], "consistent": bs["consistent"], "wall_s": bwall, "steps": bs["steps"]}
        print(f"chaos [{label}]: failure-free final eval loss {baseline['final_eval_loss']}", flush=True)
    print(f"chaos [{label}]: run with faults", flush=True)
    job, monkey, wall = _run(cfg, overrides, f"{sub}chaos", chaos=True)
    assert monkey is not None
    report = analyse(cfg, job, monkey, wall, baseline)
    report["baseline"] = baseline
    if baseline and report["final_eval_loss"] is not None and baseline["final_eval_loss"]:
        report["final_loss_vs_baseline"] = report["final_eval_loss"] / baseline["final_eval_loss"] - 1.0
    return report


def _prepare(cfg: Config) -> Config:
    """The chaos run's own settings: a killed lighthouse stays down chaos.lighthouse_down_s;
    partitions need network namespaces (said once, then left out)."""
    cfg.lighthouse.supervise = True
    cfg.lighthouse.restart_delay_s = cfg.chaos.lighthouse_down_s
    if "partition" in cfg.chaos.kinds and not getattr(cfg.run, "netns", False):
        why = "they need run.netns=true (each cluster in its own network namespace)"
        try:
            from hier_localsgd.launch import netns

            reason = netns.available()
            if reason is None:
                cfg.run.netns = True  # type: ignore[attr-defined]
                return cfg
            why = reason
        except ImportError:
            why = "network namespaces are not supported by this version"
        print(f"chaos: partition faults skipped: {why}", flush=True)
        cfg.chaos.kinds = [k for k in cfg.chaos.kinds if k != "partition"]
    return cfg


def flat_counterpart(overrides: List[str], extra: Sequence[str] = ()) -> List[str]:
    """The flat run's overrides for ``chaos.compare_flat``: the same with ``sync.mode=flat``,
    less hier's outer compression, streaming fragments and global-model evaluation (``sync.outer.*``
    is hier's; those three are what a flat config refuses). Flat torchft DiLoCo sends fp32, whole, every
    ``sync.flat.every`` steps (its own streaming: ``sync.flat.fragments``). ``extra``: the
    caller's settings for the flat side only (the bench: flat's own evaluation points)."""
    return [*overrides, "sync.mode=flat", f"sync.outer.compression={NO_COMPRESSION}", "sync.outer.fragments=1",
            "train.eval_global=false", *extra]


def run_chaos(cfg: Config, overrides: List[str], flat_extra: Sequence[str] = ()) -> int:
    if "poison" in cfg.chaos.kinds or "phase_kill" in cfg.chaos.kinds:
        # the processes take the monkey's poisons and phase stops (core/runtime/faults.py)
        overrides = [*overrides, "run.fault_inbox=true"]
        cfg.run.fault_inbox = True  # (the monkey's copy: it hands phase stops only where they are taken)
    compare = cfg.chaos.compare_flat and cfg.sync.mode == "hier"
    flat_over = flat_counterpart(overrides, flat_extra)
    # The flat side's configuration is checked before anything runs (one line, exit 2).
    fcfg = load_config(flat_over, validate_for="chaos") if compare else None
    cfg = _prepare(cfg)
    report = _chaos_report(cfg, overrides, cfg.sync.mode)
    path = Path(cfg.chaos.report or Path(cfg.run.dir) / "chaos_report.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))  # kept even if the flat part fails
    if fcfg is not None:
        from dataclasses import replace

        fcfg = _prepare(fcfg)
        fcfg.chaos = replace(fcfg.chaos, kinds=[k for k in cfg.chaos.kinds])
        flat = _chaos_report(fcfg, flat_over, "flat")
        report["flat"] = flat
        report["vs_flat"] = {"goodput": (report["goodput"], flat["goodput"]),
                             "throughput_retained": (report["throughput_retained"], flat["throughput_retained"])}
        if cfg.chaos.draw == "plan":
            report["vs_flat"]["schedule"] = schedule_match(report, flat)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(human(report))
    if "flat" in report:
        print("same schedule, flat torchft DiLoCo:")
        print(human(report["flat"]))
        if "schedule" in report["vs_flat"]:
            print(describe_match(report["vs_flat"]["schedule"]))
        print(f"goodput hier {report['vs_flat']['goodput'][0]} vs flat {report['vs_flat']['goodput'][1]}; "
              f"throughput retained hier {report['vs_flat']['throughput_retained'][0]} vs flat {report['vs_flat']['throughput_retained'][1]}")
    print(f"report written to {path}")
    reports = [report] + ([report["flat"]] if "flat" in report else [])
    ok = all(r["consistent"] and all(c == 0 for c in r["exit_codes"].values()) for r in reports)
    return 0 if ok else 1
