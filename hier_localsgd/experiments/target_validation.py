"""The simulator's time to the target (tools/simulate/target.py) against recorded bench runs
(issue #33 §4): calibrated on each run's synchronous arm, predicting its asynchronous arm.

The runs are ``benchmarks/async_outer.py``'s (docs/benchmarks.md, "The asynchronous outer
level on the demo workload"): debugmodel, 2 x 2, H 10/3, 360 steps, steps padded to 0.5 s
(``train.min_step_time_s``, divided by the cluster's speed), int8, matched paces, a 100
Mbit/s WAN with 20 ms latency shaped by the kernel, one ``hier-localsgd bench`` invocation
per seed with a synchronous arm (``hier``) and an asynchronous one (``hier_async``); a
record's ``overrides`` change the deployment (another topology). Their figures are in
:data:`RECORDED` as the tables give them; the run directories were not kept.

Per run, two figures are **fitted on the synchronous arm** (a calibration):

* ``target_rounds``: its steps to the target over ``H_inner · H_outer``. The tables give
  seconds and cluster 0's steps per second, not steps; the synchronous arm's model is
  evaluated at its outer rounds, so its steps are ``time × rate`` rounded to the nearest
  outer round (:func:`sync_rounds`);
* ``plan.round_overhead_s``: the seconds each collective costs beyond the α–β model (the
  inner rounds' Gloo all-reduce on 2 shared cores, Python, the phases), found by bisection
  so that the simulated synchronous arm reaches ``target_rounds`` when the measured one
  reached the target (:func:`fit_overhead`). The steps themselves are the padding's.

The asynchronous arm is then a **prediction** with both (:func:`validate`): its time to the
target, and the ratio of the two arms' times (issue #33's figure). Errors are (predicted −
measured) / measured. Pure functions over the records; a record without a field raises
``KeyError`` naming it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from hier_localsgd.config import load_config
from hier_localsgd.tools.simulate import engine, params

# The bench's deployment as the simulator reads it (experiments/bench.py, sections.py
# ``bench.*``; benchmarks/async_outer.py's --extra). 6,163,712 parameters: the debugmodel.
DEPLOYMENT = [
    "topology.clusters=2", "topology.replicas_per_cluster=2", "sync.mode=hier", "sync.inner.every=10", "sync.outer.every=3",
    "links.inner.bandwidth_gbps=10", "links.inner.latency_ms=0.1", "links.outer.bandwidth_gbps=0.1", "links.outer.latency_ms=20",
    "sync.outer.compression=int8", "sync.async_outer.match_pace=true", "train.steps=360",
    "simulate.params=6163712", "plan.hardware.step_time_s=0.5", "plan.train.sync_dtype=float32", "plan.sharding=replicate",
    "simulate.failures.model=none", "simulate.sensitivity=[]", "simulate.runs=1",
]
ASYNC = ["sync.async_outer.enabled=true"]

# The recorded runs (docs/benchmarks.md): per seed, the synchronous arm's seconds to the
# target and cluster 0's steps per second, and the asynchronous arm's seconds to the target
# (the global model; live = global for these blocking pushes).
RECORDED: List[Dict[str, Any]] = [
    # "The aim from the fastest's answer": cluster 1 at half speed, 2026-11-30 16:42-17:34, code fea5703
    *({"label": f"half_s{s}", "code": "fea5703", "speeds": [1.0, 0.5], "seed": s, "sync_s": a, "sync_rate": r, "async_s": b}
      for s, a, r, b in ((0, 157.2, 0.948, 163.8), (1, 157.0, 0.946, 147.1), (2, 189.0, 0.942, 147.2))),
    # "The first push's registration moved off the critical path": equal speeds, 2026-11-30 21:04-21:40, code 7d849a2
    *({"label": f"equal_s{s}", "code": "7d849a2", "speeds": [], "seed": s, "sync_s": a, "sync_rate": r, "async_s": b}
      for s, a, r, b in ((0, 84.8, 1.735, 87.9), (1, 84.1, 1.779, 85.7), (2, 99.4, 1.786, 103.6))),
    # Three clusters of one group at 1.0 / 0.7 / 0.4, run after the rule and the records above
    # were committed (2df1039): 2026-12-01 06:30-07:22, the training path of 2bf9522 (later commits: docs, tools)
    *({"label": f"three_s{s}", "code": "2bf9522", "speeds": [1.0, 0.7, 0.4], "seed": s, "sync_s": a, "sync_rate": r, "async_s": b,
       "overrides": ["topology.clusters=3", "topology.replicas_per_cluster=1"]}
      for s, a, r, b in ((0, 235.8, 0.759, 128.5), (1, 235.3, 0.760, 142.8), (2, 393.5, 0.758, 220.5))),
]

PERIOD = 30  # H_inner · H_outer of DEPLOYMENT


def sync_rounds(rec: Dict[str, Any]) -> int:
    """The synchronous arm's outer rounds to the target: ``time × rate`` in steps, to the
    nearest outer round (its evaluations fall on them)."""
    return max(1, round(rec["sync_s"] * rec["sync_rate"] / PERIOD))


def simulated_target_s(rec: Dict[str, Any], rounds: float, overhead_s: float, asynchronous: bool) -> Optional[float]:
    """The simulator's time to ``rounds`` of merged work for the record's deployment."""
    ov = [*DEPLOYMENT, *rec.get("overrides", []), f"simulate.target_rounds={rounds}", f"plan.round_overhead_s={overhead_s}",
          *(ASYNC if asynchronous else [])]
    if rec["speeds"]:
        ov.append(f"topology.cluster_speed={rec['speeds']}".replace(" ", ""))
    p = params.resolve(load_config(ov, validate_for="simulate"))
    return engine.simulate_once(p, rec["seed"]).target_s


def fit_overhead(rec: Dict[str, Any], rounds: int, hi: float = 5.0, iters: int = 30) -> float:
    """``plan.round_overhead_s`` at which the simulated synchronous arm reaches ``rounds``
    when the measured one reached the target (bisection; 0 if even none is too slow).

    Raises:
        ValueError: even ``hi`` seconds per collective is too fast (a record that cannot be fitted).
    """
    lo = 0.0
    t0 = simulated_target_s(rec, rounds, 0.0, False)
    if t0 is None or t0 >= rec["sync_s"]:
        return 0.0
    t_hi = simulated_target_s(rec, rounds, hi, False)
    if t_hi is not None and t_hi < rec["sync_s"]:
        raise ValueError(f"{rec['label']}: even an overhead of {hi} s per collective reaches {rounds} rounds before the measured {rec['sync_s']} s")
    for _ in range(iters):
        mid = (lo + hi) / 2
        t = simulated_target_s(rec, rounds, mid, False)
        if t is not None and t < rec["sync_s"]:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def validate(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per record: the calibration (rounds, overhead, the synchronous arm's fit) and the
    prediction of the asynchronous arm against its measured time."""
    out = []
    for rec in records:
        rounds = sync_rounds(rec)
        overhead = fit_overhead(rec, rounds)
        sync_pred = simulated_target_s(rec, rounds, overhead, False)
        pred = simulated_target_s(rec, rounds, overhead, True)
        meas = rec["async_s"]
        out.append({
            "label": rec["label"], "code": rec["code"], "target_rounds": rounds, "round_overhead_s": round(overhead, 4),
            "sync_measured_s": rec["sync_s"], "sync_fitted_s": None if sync_pred is None else round(sync_pred, 2),
            "async_measured_s": meas, "async_predicted_s": None if pred is None else round(pred, 2),
            "error": None if pred is None else round((pred - meas) / meas, 4),
            "ratio_measured": round(rec["sync_s"] / meas, 3),
            "ratio_predicted": None if pred is None or sync_pred is None else round(sync_pred / pred, 3),
        })
    return out


def table(rows: List[Dict[str, Any]]) -> str:
    head = ("| run | code | rounds to target (sync) | overhead fitted, s | sync: measured / fitted s | async: measured / predicted s | error "
            "| sync/async: measured / predicted |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        err = "-" if r["error"] is None else f"{100 * r['error']:+.1f} %"
        lines.append(f"| {r['label']} | {r['code']} | {r['target_rounds']} | {r['round_overhead_s']:.3f} | {r['sync_measured_s']} / {r['sync_fitted_s']} "
                     f"| {r['async_measured_s']} / {r['async_predicted_s']} | {err} | {r['ratio_measured']} / {r['ratio_predicted']} |")
    return "\n".join(lines)
