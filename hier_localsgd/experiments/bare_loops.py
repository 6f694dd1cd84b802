"""Bare training loops, one per replica group, run concurrently (the loop:
hier_localsgd/train/bare.py; each a ``python -m hier_localsgd.experiments.bare`` process).
The bench's compute bound and ``sync.outer.auto``'s step probe (experiments/auto.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from hier_localsgd.config import Config
from hier_localsgd.launch.local import child_env


def run_bare(overrides: List[str], cfg: Config, out: Path) -> Optional[float]:
    """Mean step time of bare loops, one per replica group, run concurrently (no network:
    ``run.netns=true`` in ``overrides`` is dropped)."""
    overrides = [o for o in overrides if o != "run.netns=true"]
    procs, files = [], []
    (out / "bare").mkdir(parents=True, exist_ok=True)
    for c in range(cfg.topology.clusters):
        for r in range(cfg.topology.replicas_per_cluster):
            f = out / "bare" / f"c{c}r{r}.json"
            files.append(f)
            procs.append(subprocess.Popen([sys.executable, "-m", "hier_localsgd.experiments.bare", *overrides, f"run.cluster={c}", f"run.replica={r}", f"bare.out={f}"],
                                          env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for p in procs:
        p.wait(timeout=cfg.bench.timeout_s)
    times = [json.loads(f.read_text())["step_s"] for f in files if f.exists()]
    return sum(times) / len(times) if times else None
