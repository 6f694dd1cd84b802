"""The planner's time model against a measured bench sweep, out of sample (issue #14 §5).

What is predicted: a blocking arm's training time for its ``steps`` local steps (the
sweep's curve at the last step: seconds since training started, evaluations taken out),
as the planner models it (network.py :func:`sync_times` and :func:`sync_per_step`)::

    steps * (step_s + sync_per_step)        sync_per_step from the ring bounds of each
                                            level + round_overhead_s per sync round

- ``step_s`` is measured, not fitted: the sweep's bare loops (``bare_step_s``: one loop
  per replica group on the same cores, no sync).
- The links are the sweep's: the WAN at the kernel-shaped rate (``wan_gbps``) with the
  user-space latency ``links.outer.latency_ms``, the LAN ``links.inner``. The planner adds
  latency and transfer (α–β); on kernel links the latency is a floor the transfer runs
  under (bench.py), one of the model's errors this check measures.
- ``round_overhead_s`` is the one fitted constant: the value that makes the prediction
  exact on the **calibration point** (an arm at a WAN rate, median over its seeds). It is
  then held fixed for every other point, which are the out-of-sample predictions; the
  calibration point itself is reported as such (error 0 by construction). Or it is given
  (``overhead_s``: calibrated on another sweep, e.g. another model size), and every point
  of this sweep is out of sample.

hier arms with ``sync.outer.delay``, compression or fragments are predicted with
:func:`~hier_localsgd.tools.plan.network.hier_variant_sync_per_step` (the overlapped outer
round hides behind the compute and inner syncs of the ``D`` inner rounds it runs alongside),
from the variant each run records (``outer``; sweeps trimmed before it was recorded have
none, and their overlapped arms stay unpredicted). flat's overlap (torchft's
``fragment_sync_delay``) is not modelled (listed as not modelled, not as an error).

Input: the ``sweep.json`` of ``hier-localsgd bench bench.sweep_gbps=[...]`` trimmed by
:func:`trim` (benchmarks/validate_plan.py does both and prints the table). Failure
semantics: failed runs are left out of their point's median, and a point with no finished
run has no row; a calibration point without one, or a sweep without the fields named here,
raises KeyError naming it.
"""

from __future__ import annotations

import statistics
from typing import Any, Dict, Iterable, List, Optional, Tuple

from hier_localsgd import costs
from hier_localsgd.core.links.lossy import LinkSpec
from hier_localsgd.tools.plan.network import OuterVariant, hier_variant_sync_per_step, outer_round_s, sync_per_step, sync_times

PREDICTED_MODES = ("hier", "flat", "ddp")


def trim(sweep: Dict[str, Any], deployment: Dict[str, Any], overlapped: Iterable[str],
         variants: Optional[Dict[str, Dict[str, Any]]] = None) -> Dict[str, Any]:
    """What this check reads of a sweep.json (a few KB instead of MB of curves): the bare
    step, ``deployment`` (clusters, replicas_per_cluster, model_bytes, lan_gbps,
    lan_latency_ms, wan_latency_ms: the sweep's shared config) and per run its arm, rate,
    seed, mode, sync periods, last step and training time; ``overlapped``: the arms with
    ``sync.outer.delay``, ``sync.flat.delay``, compression or fragments; ``variants``: per
    hier arm its :class:`OuterVariant` fields (recorded as ``outer``)."""
    over = set(overlapped)
    variants = variants or {}
    runs = []
    for r in sweep["runs"]:
        if r.get("failed"):
            runs.append({k: r.get(k) for k in ("arm", "wan_gbps", "seed", "failed")})
            continue
        runs.append({
            "arm": r["arm"], "wan_gbps": r["wan_gbps"], "seed": r["seed"], "mode": r["mode"], "sync_every": r["sync_every"],
            "steps": r["curve"][-1]["step"], "train_s": r["curve"][-1]["t"], "overlapped": r["arm"] in over,
            **({"outer": variants[r["arm"]]} if r["arm"] in variants else {}),
        })
    return {"bare_step_s": sweep["bare_step_s"], "deployment": dict(deployment), "runs": runs}


def predict(mode: str, sync_every: List[int], steps: int, step_s: float, model_bytes: float,
            clusters: int, replicas: int, lan: LinkSpec, wan: LinkSpec, overhead_s: float,
            outer: Optional[OuterVariant] = None) -> float:
    """The planner's training time for ``steps`` steps of one arm (hier: ``outer``, the
    variant of its outer round; blocking fp32 when None)."""
    st = sync_times(model_bytes, clusters, replicas, lan, wan, overhead_s)
    h_in, h_out = (sync_every + [1])[:2] if mode == "hier" else (1, 1)
    h_flat = sync_every[0] if mode == "flat" else 1
    if mode == "hier" and outer is not None:
        o = outer_round_s(model_bytes, clusters, wan, outer, overhead_s)
        return steps * (step_s + hier_variant_sync_per_step(st, o, step_s, h_in, h_out, outer))
    return steps * (step_s + sync_per_step(st, mode, h_in, h_out, h_flat))


def transfer_over_latency(mode: str, model_bytes: float, clusters: int, replicas: int, wan: LinkSpec,
                          outer: Optional[OuterVariant] = None) -> float:
    """The WAN collective's transfer term over its latency term (α–β, costs.py): how
    bandwidth-bound the arm's WAN sync is (hier: the leaders' ring, or its ``outer``
    variant's collective; flat, ddp: the ring over every group, on WAN hops). inf without latency."""
    n = clusters if mode == "hier" else clusters * replicas
    lat = costs.allreduce_time(model_bytes, n, wan.latency_s, 0.0)
    if mode == "hier" and outer is not None:
        xfer = outer_round_s(model_bytes, clusters, LinkSpec(latency_s=0.0, bandwidth_Bps=wan.bandwidth_Bps), outer, 0.0)
    else:
        xfer = costs.allreduce_time(model_bytes, n, 0.0, wan.bandwidth_Bps)
    return xfer / lat if lat > 0 else float("inf")


def _links(sweep: Dict[str, Any], gbps: float) -> Tuple[LinkSpec, LinkSpec]:
    d = sweep["deployment"]
    lan = LinkSpec(latency_s=d["lan_latency_ms"] / 1e3, bandwidth_Bps=costs.gbps_to_Bps(d["lan_gbps"]))
    wan = LinkSpec(latency_s=d["wan_latency_ms"] / 1e3, bandwidth_Bps=costs.gbps_to_Bps(gbps))
    return lan, wan


def _points(sweep: Dict[str, Any]) -> Dict[Tuple[str, float], Dict[str, Any]]:
    pts: Dict[Tuple[str, float], Dict[str, Any]] = {}
    for r in sweep["runs"]:
        if r.get("failed"):
            continue
        p = pts.setdefault((r["arm"], r["wan_gbps"]), {**r, "train_s_all": []})
        p["train_s_all"].append(r["train_s"])
    for p in pts.values():
        p["measured_s"] = statistics.median(p["train_s_all"])
    return pts


def validate(sweep: Dict[str, Any], calibrate_on: Optional[Tuple[str, float]] = None, overhead_s: Optional[float] = None,
             calibrated_elsewhere: str = "") -> Dict[str, Any]:
    """Calibrates ``round_overhead_s`` on ``calibrate_on`` = (arm, WAN Gbit/s), or takes the
    given ``overhead_s`` (then ``calibrated_elsewhere`` says where it was fitted), and
    predicts every other modelled (arm, rate) point. Returns the overhead and one row per
    point: measured and predicted seconds, the relative error, and whether it is the calibration."""
    if (calibrate_on is None) == (overhead_s is None):
        raise ValueError("validate: give either calibrate_on or overhead_s")
    d = sweep["deployment"]
    C, R, S, step_s = d["clusters"], d["replicas_per_cluster"], d["model_bytes"], sweep["bare_step_s"]
    pts = _points(sweep)
    if calibrate_on is not None and calibrate_on not in pts:
        raise KeyError(f"calibration point {calibrate_on} has no finished run in the sweep")

    def rounds_per_step(p: Dict[str, Any]) -> float:  # sync rounds (each pays the overhead once) per step
        lan, wan = _links(sweep, p["wan_gbps"])
        return (predict(p["mode"], p["sync_every"], 1, 0.0, S, C, R, lan, wan, 1.0)
                - predict(p["mode"], p["sync_every"], 1, 0.0, S, C, R, lan, wan, 0.0))

    if overhead_s is not None:
        overhead = overhead_s
    else:
        cal = pts[calibrate_on]
        lan, wan = _links(sweep, cal["wan_gbps"])
        zero = predict(cal["mode"], cal["sync_every"], cal["steps"], step_s, S, C, R, lan, wan, 0.0)
        overhead = (cal["measured_s"] - zero) / (cal["steps"] * rounds_per_step(cal))
    rows: List[Dict[str, Any]] = []
    for key in sorted(pts, key=lambda k: (-k[1], k[0])):
        p = pts[key]
        row: Dict[str, Any] = {"arm": p["arm"], "wan_gbps": p["wan_gbps"], "measured_s": p["measured_s"],
                               "seeds": len(p["train_s_all"]), "calibration": key == calibrate_on}
        outer = OuterVariant(**p["outer"]) if p.get("outer") else None
        if p["mode"] not in PREDICTED_MODES or (p.get("overlapped") and outer is None):
            row["not_modelled"] = "flat's overlap" if p["mode"] == "flat" else "overlap or compression (no variant recorded)"
        else:
            lan, wan = _links(sweep, p["wan_gbps"])
            pred = predict(p["mode"], p["sync_every"], p["steps"], step_s, S, C, R, lan, wan, overhead, outer)
            row.update(predicted_s=pred, error=(pred - p["measured_s"]) / p["measured_s"],
                       transfer_over_latency=transfer_over_latency(p["mode"], S, C, R, wan, outer),
                       variant=bool(p.get("overlapped")))
        rows.append(row)
    return {"calibrate_on": list(calibrate_on) if calibrate_on else None, "calibrated_elsewhere": calibrated_elsewhere or None,
            "round_overhead_s": overhead, "bare_step_s": step_s, "rows": rows}


def table(v: Dict[str, Any]) -> str:
    """Markdown table of :func:`validate`'s rows."""
    where = (f"{v['calibrate_on'][0]} at {v['calibrate_on'][1] * 1e3:g} Mbit/s" if v.get("calibrate_on")
             else f"another sweep ({v.get('calibrated_elsewhere') or 'given'}): every row here is out of sample")
    lines = [f"round_overhead_s = {v['round_overhead_s']:.4f} s, calibrated on {where}; bare step {v['bare_step_s']:.4f} s (measured)", "",
             "| WAN | arm | measured s (median) | predicted s | error | |", "|---|---|---|---|---|---|"]
    for r in v["rows"]:
        rate = f"{r['wan_gbps'] * 1e3:g} Mbit/s"
        if "not_modelled" in r:
            lines.append(f"| {rate} | {r['arm']} | {r['measured_s']:.2f} | — | — | not modelled ({r['not_modelled']}) |")
        else:
            what = "calibration" if r["calibration"] else "out of sample" + (" (overlap/compression model)" if r.get("variant") else "")
            lines.append(f"| {rate} | {r['arm']} | {r['measured_s']:.2f} | {r['predicted_s']:.2f} | {r['error'] * 100:+.1f} % | {what} |")
    return "\n".join(lines)


def worst_out_of_sample(v: Dict[str, Any]) -> Optional[float]:
    """The largest |error| over the out-of-sample rows (None if there are none)."""
    errs = [abs(r["error"]) for r in v["rows"] if "error" in r and not r["calibration"]]
    return max(errs) if errs else None
