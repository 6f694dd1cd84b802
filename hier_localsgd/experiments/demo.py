"""``hier-localsgd demo``: a whole hierarchical job on one machine, with a summary.

Starts the global and per-cluster lighthouses (one process) and every replica
group (one process each, ``topology.clusters x topology.replicas_per_cluster``),
shows progress while they train, then prints a human summary and writes a JSON
one (``demo.summary``, default ``<run.dir>/summary.json``).

The summary is computed only from what each process wrote (its result.json): in
particular ``consistent`` is true only if every replica group reported the same
checksum of its final parameters, taken after the last outer sync.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List

from hier_localsgd.config import Config
from hier_localsgd.experiments.auto_watch import wait_rechoosing, watch_for
from hier_localsgd.experiments.summary import human, summarize
from hier_localsgd.launch.local import LocalJob


class Progress:
    """Live progress: a tqdm bar on a terminal, a line every 10 s otherwise."""

    def __init__(self, job: LocalJob, total_steps: int, enabled: bool) -> None:
        self.job, self.total, self.enabled = job, total_steps, enabled
        self.tty = sys.stdout.isatty()
        self._last_line = 0.0
        self._bar = None
        if enabled and self.tty:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps * len(job.keys()), unit="step", desc="training")

    def __call__(self) -> None:
        if not self.enabled:
            return
        sts = {k: self.job.status(k) or {} for k in self.job.keys()}
        done = sum(int(s.get("step", 0)) for s in sts.values())
        inner = max((int(s.get("inner_round", 0)) for s in sts.values()), default=0)
        outer = max((int(s.get("outer_round", 0)) for s in sts.values()), default=0)
        phases = " ".join(f"c{c}r{r}{'*' if s.get('leader') else ''}:{s.get('phase', '-')}" for (c, r), s in sorted(sts.items()))
        losses = [s["loss"] for s in sts.values() if isinstance(s.get("loss"), (int, float))]
        loss = f"{sum(losses) / len(losses):.3f}" if losses else "-"
        if self._bar is not None:
            self._bar.n = done
            self._bar.set_postfix_str(f"inner {inner} outer {outer} loss {loss}", refresh=False)
            self._bar.refresh()
        elif time.time() - self._last_line >= 10:
            self._last_line = time.time()
            print(f"[{time.strftime('%H:%M:%S')}] steps {done}/{self.total * len(sts)} inner {inner} outer {outer} loss {loss} | {phases}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def start_dashboard(cfg: Config, job: LocalJob):  # type: ignore[no-untyped-def]
    """Serves the dashboard of this run (on a free port if the configured one is taken)."""
    from dataclasses import replace

    from hier_localsgd.config import ConfigError
    from hier_localsgd.tools.dashboard.server import start_in_thread

    dcfg = replace(cfg.dashboard, run_dir=str(job.run_dir))
    try:
        url, stop = start_in_thread(dcfg)
    except ConfigError as e:
        if dcfg.port == 0:
            print(f"demo: no dashboard: {e}", flush=True)
            return None
        url, stop = start_in_thread(replace(dcfg, port=0))
    print(f"demo: dashboard {url}", flush=True)
    return stop


def run_demo(cfg: Config, overrides: List[str]) -> int:
    summary_path = Path(cfg.demo.summary or Path(cfg.run.dir) / "summary.json")
    t0 = time.time()
    job = LocalJob(cfg, overrides, free_ports=cfg.demo.free_ports)
    print(f"demo: run directory {job.run_dir}; lighthouses global {job.global_addr}, clusters {job.cluster_addrs}", flush=True)
    progress = Progress(job, cfg.train.steps, cfg.demo.progress)
    stop_dashboard = start_dashboard(cfg, job) if cfg.demo.dashboard else None
    try:
        watch, base = None, list(job.overrides)
        if cfg.sync.outer.auto:  # measure the WAN and the step, pick the outer configuration (auto.py)
            from hier_localsgd.experiments.auto import resolve

            job.overrides = [*base, *resolve(cfg, job)]
            watch = watch_for(cfg, job)  # re-chooses if the link changes (auto_watch.py)
        job.start_lighthouses()
        job.start_all()
        # With kill buttons on, a killed replica group is restarted and heals, as it would be under launch/replica.sh.
        codes = wait_rechoosing(job, cfg, watch, lambda picked: [*base, *picked], cfg.demo.timeout_s, tick=progress,
                                restart=cfg.dashboard.allow_kill)
    finally:
        progress.close()
        job.stop()
        if stop_dashboard is not None:
            stop_dashboard()
    summary = summarize(cfg, job, time.time() - t0)
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2))
    print(human(summary))
    print(f"summary written to {summary_path}")
    ok = all(c == 0 for c in codes.values()) and not summary["missing_results"] and summary["consistent"]
    return 0 if ok else 1
