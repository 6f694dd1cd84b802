"""The simulator against measured chaos runs, out of sample (issue #14 §5).

Each measured run is a ``hier-localsgd chaos chaos.kinds=[kill]`` run, replayed in the
simulator: its kills at the local steps its report gives (``sK:c`` for a whole cluster,
``sK:c:r`` for one replica group, K the step the status showed at the kill), and its own
topology, H values, steps, heartbeat, join and phase timeouts (the run's overrides; the
simulator reads the same shared sections). Compute per step is the run's failure-free
baseline, measured (the ``step_s`` of the record). One parameter is fitted:
``simulate.failures.restart_s`` (kill to the restarted process taking part), on **one**
run — the calibration, reported as such. Every other run is a prediction with that value.

Compared per run: steps discarded (work rolled back, contributed at weight 0, or
uncommitted when its process died: what chaos.py's ``process_efficiency`` counts, the
simulator's ``steps_discarded``) and steps run (chaos.py's ``steps_run``, every
local step any process took). Errors are (predicted − measured) / measured.

Failure semantics: every function here is pure over the records; a record without a
field it needs raises ``KeyError`` naming it (benchmarks/validate_simulate.py turns that
into one line and exit 2).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hier_localsgd.config import load_config
from hier_localsgd.core.runtime.status import read_events
from hier_localsgd.experiments.chaos_evidence import parse_name
from hier_localsgd.tools.simulate import engine, params
from hier_localsgd.tools.simulate.params import KILL_PHASES

# What the replay fixes besides the run's own overrides: no failure process of its own
# (the kills list only), no sensitivity sweep, one run (the replay is deterministic).
REPLAY = ["simulate.failures.model=none", "simulate.sensitivity=[]", "simulate.runs=1",
          "plan.sharding=replicate", "plan.train.sync_dtype=float32"]
# The restart times tried when calibrating (seconds).
RESTART_GRID = [x / 2 for x in range(2, 61)]


def _at(phase: Optional[str]) -> str:
    """The ``@PHASE`` suffix of a replayed kill: a sync phase the process was in (the
    report's ``phase``); none for a local step, a start-up or an unknown phase."""
    return f"@{phase}" if phase in KILL_PHASES and phase != "LOCAL" else ""


def kills_of(report: Dict[str, Any], replicas: int) -> List[str]:
    """The report's kills as the simulator's ``sK:c[:r][@PHASE]`` list, in the order they fell.

    A whole-cluster kill (every replica group of one cluster among its targets) becomes
    ``sK:c`` with K the lowest step its groups showed (and that group's phase); any other
    target ``sK:c:r``. A kill in a sync phase names it, so the replay places it in the round
    it hit rather than in the next local step (older reports without phases: local steps)."""
    out: List[str] = []
    for k in report["kills"]:
        by_cluster: Dict[int, List[int]] = {}
        for t in k["targets"]:  # "c<C>r<R>"
            c, r = parse_name(t)
            by_cluster.setdefault(c, []).append(r)
        phases = k.get("phase") or {}
        for c, rs in sorted(by_cluster.items()):
            steps = [int(k["step"][f"c{c}r{r}"] or 0) for r in rs]
            at = [_at(phases.get(f"c{c}r{r}")) for r in rs]
            if len(set(rs)) == replicas:
                i = steps.index(min(steps))
                out.append(f"s{steps[i]}:{c}{at[i]}")
            else:
                out.extend(f"s{s}:{c}:{r}{a}" for r, s, a in zip(rs, steps, at))
    return out


def baseline_step_s(run_dir: Path, speeds: Sequence[float] = ()) -> float:
    """Wall seconds per local step of a failure-free run, syncs included: per replica group,
    from its first commit (the join round, step 0) to its last, then the mean over groups.
    (The simulator's syncs cost nothing on links that are not emulated, so this is its
    compute per step.) With clusters of different speeds (``speeds``:
    ``topology.cluster_speed``) only the slowest cluster's groups, their seconds times its
    speed: the simulator's ``step_s`` is a speed-1 step, and the slowest cluster is the one
    that never waits for another (a faster one does under the synchronous outer level).
    ValueError naming the directory when it holds no commits."""
    slowest = min(speeds, default=1.0)
    rates = []
    for ev in sorted((run_dir / "replicas").glob("*/events.jsonl")):
        if speeds and speeds[parse_name(ev.parent.name)[0]] != slowest:
            continue
        commits = [e for e in read_events(ev) if e.get("kind") == "commit"]
        if len(commits) >= 2 and commits[-1]["step"] > commits[0]["step"]:
            rates.append(slowest * (commits[-1]["t"] - commits[0]["t"]) / (commits[-1]["step"] - commits[0]["step"]))
    if not rates:
        raise ValueError(f"{run_dir}: no replica group with two commits at different steps (a failure-free run's directory?)")
    return sum(rates) / len(rates)


def record(label: str, overrides: Sequence[str], report: Dict[str, Any], step_s: float, params_count: int) -> Dict[str, Any]:
    """The trimmed measurement of one run (what benchmarks/measured keeps)."""
    cfg = load_config(list(overrides), validate_for="demo")
    return {
        "label": label,
        "overrides": list(overrides),
        "step_s": step_s,
        "params": params_count,
        "kills": kills_of(report, cfg.topology.replicas_per_cluster),
        "roles": [k["role"] for k in report["kills"]],
        # The simulator counts steps as the processes do (chaos.py's process_efficiency):
        # rolled back or at weight 0, and uncommitted at a death; not the work a lost
        # cluster or an outer round at weight 0 takes with it (the report's goodput counts those).
        # where the processes' discarded steps came from (chaos_evidence.py ``discarded_by``)
        "discarded_by": report.get("discarded_by"),
        "measured": {"steps_run": report["steps_run"],
                     "steps_discarded": report["steps_lost"]["rolled_back_or_weight0"] + report["steps_lost"]["uncommitted_at_death"],
                     "process_efficiency": report["process_efficiency"], "consistent": report["consistent"],
                     "wall_s": report["wall_s"]},
    }


def replay_params(rec: Dict[str, Any]) -> params.SimParams:
    """The simulation of one record (its restart time is set per call of :func:`simulate`)."""
    cfg = load_config([*rec["overrides"], *REPLAY, f"simulate.params={rec['params']}",
                       f"plan.hardware.step_time_s={rec['step_s']}"], validate_for="simulate")
    cfg.simulate.failures.kills = list(rec["kills"])
    return params.resolve(cfg)


def simulate(rec: Dict[str, Any], restart_s: float, p: Optional[params.SimParams] = None) -> engine.RunResult:
    """The replay of one record with the given restart time (``p``: its :func:`replay_params`)."""
    return engine.simulate_once(replace(p or replay_params(rec), restart_s=restart_s), 0)


def _err(pred: float, meas: float) -> Optional[float]:
    return None if not meas else (pred - meas) / meas


def calibrate(rec: Dict[str, Any]) -> float:
    """The restart time whose replay runs the measured number of steps (the first best on
    :data:`RESTART_GRID`)."""
    meas, p = rec["measured"]["steps_run"], replay_params(rec)
    return min(RESTART_GRID, key=lambda r: abs(simulate(rec, r, p).steps_run - meas))


def validate(records: Sequence[Dict[str, Any]], calibrate_on: str) -> Dict[str, Any]:
    """Calibrates on the record labelled ``calibrate_on`` and predicts every record."""
    cal = next((r for r in records if r["label"] == calibrate_on), None)
    if cal is None:
        raise KeyError(f"calibration run {calibrate_on!r}: not among {[r['label'] for r in records]}")
    restart_s = calibrate(cal)
    rows = []
    for r in records:
        sim = simulate(r, restart_s)
        m = r["measured"]
        rows.append({
            "label": r["label"], "calibration": r is cal, "kills": len(r["kills"]), "roles": r["roles"],
            "steps_run": {"measured": m["steps_run"], "predicted": sim.steps_run, "error": _err(sim.steps_run, m["steps_run"])},
            "steps_discarded": {"measured": m["steps_discarded"], "predicted": sim.steps_discarded,
                                "error": _err(sim.steps_discarded, m["steps_discarded"])},
            "efficiency": {"measured": m["process_efficiency"], "predicted": sim.efficiency},
        })
    return {"restart_s": restart_s, "calibrate_on": calibrate_on, "rows": rows}


def worst_out_of_sample(v: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """The largest |error| per figure over the runs that were not the calibration."""
    out: Dict[str, Optional[float]] = {}
    for fig in ("steps_run", "steps_discarded"):
        errs = [abs(r[fig]["error"]) for r in v["rows"] if not r["calibration"] and r[fig]["error"] is not None]
        out[fig] = max(errs) if errs else None
    return out


def table(v: Dict[str, Any]) -> str:
    pct = lambda e: "-" if e is None else f"{100 * e:+.1f} %"  # noqa: E731
    lines = [f"restart_s = {v['restart_s']:g} s, fitted on {v['calibrate_on']} (calibration)", "",
             "| run | kills | steps run: measured / predicted (error) | steps discarded: measured / predicted (error) | efficiency: measured / predicted |",
             "|---|---|---|---|---|"]
    for r in v["rows"]:
        sr, sd, ef = r["steps_run"], r["steps_discarded"], r["efficiency"]
        lines.append(f"| {r['label']}{' (calibration)' if r['calibration'] else ''} | {r['kills']} | "
                     f"{sr['measured']} / {sr['predicted']} ({pct(sr['error'])}) | {sd['measured']} / {sd['predicted']} ({pct(sd['error'])}) | "
                     f"{ef['measured']:.3f} / {ef['predicted']:.3f} |")
    return "\n".join(lines)
