"""What ``sync.outer.auto``'s re-choice is worth when the WAN drops mid-run (issue #29 §3).

The demo workload (debugmodel, 2 x 2, H 10/3) on kernel-shaped links (network namespaces,
every cluster uplink under tbf, 20 ms added in user space as the bench does), started with
``sync.outer.auto=true`` at ``--start-mbit``; at ``--drop-step`` the uplinks drop to
``--drop-mbit``. Two runs, one after the other, both with a durable checkpoint every outer
round: ``watch`` (``sync.outer.auto_rechoose=2``: the launcher re-probes and re-chooses,
experiments/auto_watch.py) and ``fixed`` (``auto_rechoose=0``: the start's pick to the end).
Prints per run: the picks, when the drop and the re-choice came, the wall time of the whole
job and of its training (from the start gate to the last result), the final eval loss, and
whether the groups ended on one model. Needs root (namespaces, tc).

    python benchmarks/auto_rechoose.py [--start-mbit 1000] [--drop-mbit 10] [--drop-step 150] [--steps 720] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict

from hier_localsgd.config import load_config
from hier_localsgd.experiments.auto import resolve
from hier_localsgd.experiments.auto_watch import wait_rechoosing, watch_for
from hier_localsgd.experiments.bench import WORKLOADS
from hier_localsgd.experiments.summary import summarize
from hier_localsgd.launch.local import LocalJob


def run(name: str, args: argparse.Namespace, out: Path) -> Dict[str, Any]:
    run_dir = out / name
    overrides = [*WORKLOADS["full"]["over"], f"train.steps={args.steps}", "sync.inner.every=10", "sync.outer.every=3",
                 "links.inner.bandwidth_gbps=10", "links.inner.latency_ms=0.1", "links.outer.bandwidth_gbps=0",
                 "links.outer.latency_ms=20", "run.netns=true", "sync.outer.auto=true", "checkpoint.every=1",
                 f"sync.outer.auto_rechoose={2.0 if name == 'watch' else 0}", f"run.dir={run_dir}"]
    cfg = load_config(overrides, validate_for="demo")
    job = LocalJob(cfg, overrides)
    t0 = time.time()
    marks: Dict[str, float] = {}

    def drop() -> None:
        if "drop" not in marks and int((job.status((0, 0)) or {}).get("step", 0)) >= args.drop_step:
            for c in range(cfg.topology.clusters):
                job.netns.shape(c, args.drop_mbit * 1e6)
            marks["drop"] = time.time()

    with job:
        for c in range(cfg.topology.clusters):
            job.netns.shape(c, args.start_mbit * 1e6)
        base = list(job.overrides)
        job.overrides = [*base, *resolve(cfg, job)]
        watch = watch_for(cfg, job)
        job.start_lighthouses()
        marks["train"] = time.time()
        job.start_all()
        codes = wait_rechoosing(job, cfg, watch, lambda picked: [*base, *picked], 3600, tick=drop)
    end = time.time()
    summary = summarize(cfg, job, end - t0)
    rec = json.loads((run_dir / "auto.json").read_text())
    results = [job.result(k) for k in job.keys()]
    hist = rec.get("history") or []
    link = [h for h in hist if h["reason"] == "link"]
    return {
        "run": name, "codes": {f"c{c}r{r}": v for (c, r), v in codes.items()}, "consistent": summary["consistent"],
        "start_pick": (hist[0] if hist else rec)["overrides"][:3],
        "rechoices": [{"after_drop_s": round(h["t"] - marks.get("drop", h["t"]), 1), "at_step": h["step"],
                       "read_mbit": round(h["seen"]["rate_Bps"] * 8e-6, 2), "probed_mbit": round(h["wan_probe"]["bandwidth_Bps"] * 8e-6, 2),
                       "pick": h["overrides"][:3]} for h in link],
        "job_s": round(end - t0, 1), "training_s": round(end - marks["train"], 1),
        "after_drop_s": round(end - marks["drop"], 1) if "drop" in marks else None,
        "final_eval_loss": statistics.mean(r["eval_loss"] for r in results if r and r.get("eval_loss") is not None) if all(results) else None,
        "steps": [r["steps"] if r else None for r in results],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start-mbit", type=float, default=1000.0)
    ap.add_argument("--drop-mbit", type=float, default=10.0)
    ap.add_argument("--drop-step", type=int, default=150)
    ap.add_argument("--steps", type=int, default=720)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="auto_rechoose_"))
    rows = [run(name, args, out) for name in ("watch", "fixed")]
    for r in rows:
        print(json.dumps(r), flush=True)
    w, f = rows
    print(f"after the drop: watch {w['after_drop_s']} s, fixed {f['after_drop_s']} s; whole job: watch {w['job_s']} s, fixed {f['job_s']} s "
          f"(fixed / watch: {f['job_s'] / w['job_s']:.2f}x)")
    return 0 if all(r["consistent"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
