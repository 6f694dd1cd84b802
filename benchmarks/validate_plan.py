"""The planner's time model against a measured bench sweep, out of sample (issue #14 §5).

    python benchmarks/validate_plan.py RUN_DIR/bench [--calibrate hier@1 | --calibrated-on FILE] [--save FILE] [overrides ...]

RUN_DIR/bench holds the sweep.json of ``hier-localsgd bench bench.sweep_gbps=[...]``.
``overrides``: the sweep's own overrides (e.g. ``model.dim=512``), when its sweep.json does
not record them (sweeps before they were recorded). ``--calibrated-on FILE``: take the
round overhead from another sweep's saved validation (``--save`` output) instead of
fitting it here, so that every point of this sweep is out of sample. Prints the table of
hier_localsgd/tools/plan/validate.py and, with ``--save``, writes the trimmed sweep and the
result as JSON (tests/data/ keeps one for the suite). Exit 0, or 2 with one line naming
what is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from hier_localsgd.config import load_config
from hier_localsgd.experiments.bench import plan_arms
from hier_localsgd.tools.plan.network import OuterVariant
from hier_localsgd.tools.plan.validate import table, trim, validate, worst_out_of_sample


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_dir", type=Path)
    ap.add_argument("--calibrate", default="hier@1", help="ARM@GBPS: the calibration point (default hier@1)")
    ap.add_argument("--calibrated-on", type=Path, help="a saved validation JSON whose round_overhead_s to use")
    ap.add_argument("--save", type=Path)
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_intermixed_args()
    path = a.bench_dir / "sweep.json"
    if not path.is_file():
        print(f"validate_plan: {path}: no sweep.json (run hier-localsgd bench bench.sweep_gbps=[...] first)", file=sys.stderr)
        return 2
    sweep = json.loads(path.read_text())
    overrides = sweep.get("overrides") or a.overrides
    cfg = load_config(overrides, validate_for="bench")
    common, arms, _ = plan_arms(cfg)
    overlapped, variants = [], {}
    ran = {r["arm"] for r in sweep["runs"]}
    for name, extra in arms.items():
        if name not in ran:  # an arm the sweep did not run may not even be valid with its overrides
            continue
        c = load_config([*overrides, *common, *extra], validate_for="demo")  # as bench runs the arm
        v = OuterVariant.of(c.sync)
        if c.sync.flat.delay > 0 or (c.sync.mode == "hier" and v != OuterVariant()):
            overlapped.append(name)
        if c.sync.mode == "hier":
            variants[name] = asdict(v)
    done = next((r for r in sweep["runs"] if not r.get("failed")), None)
    if done is None:
        print(f"validate_plan: {path}: no finished run", file=sys.stderr)
        return 2
    run_dir = Path(done["run_dir"])  # as the sweep wrote it: relative to where it ran, or absolute
    if not run_dir.is_dir():
        run_dir = a.bench_dir / "runs" / run_dir.name
    result = run_dir / "replicas" / "c0r0" / "result.json"
    if not result.is_file():
        print(f"validate_plan: {result}: missing (model_bytes is read from a finished run)", file=sys.stderr)
        return 2
    model_bytes = json.loads(result.read_text())["model_bytes"]
    b = cfg.bench
    deployment = {"clusters": cfg.topology.clusters, "replicas_per_cluster": cfg.topology.replicas_per_cluster,
                  "model_bytes": model_bytes, "lan_gbps": b.lan_gbps, "lan_latency_ms": b.lan_latency_ms, "wan_latency_ms": b.wan_latency_ms}
    data = trim(sweep, deployment, overlapped, variants)
    if a.calibrated_on is not None:
        try:
            other = json.loads(a.calibrated_on.read_text())["validation"]
            overhead = float(other["round_overhead_s"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"validate_plan: --calibrated-on {a.calibrated_on}: no validation.round_overhead_s ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        where = f"{a.calibrated_on.name}: {other.get('calibrate_on')}"
        v = validate(data, overhead_s=overhead, calibrated_elsewhere=where)
    else:
        arm, _, gbps = a.calibrate.partition("@")
        try:
            v = validate(data, (arm, float(gbps)))
        except (ValueError, KeyError) as e:
            print(f"validate_plan: --calibrate {a.calibrate!r}: {e} (expected ARM@GBPS, e.g. hier@1, of a finished point)", file=sys.stderr)
            return 2
    print(table(v))
    worst = worst_out_of_sample(v)
    print(f"worst out-of-sample error: {'none predicted' if worst is None else f'{worst * 100:.1f} %'}")
    if a.save:
        a.save.write_text(json.dumps({"overrides": overrides, "sweep": data, "validation": v}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
