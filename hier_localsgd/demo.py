"""``hier-localsgd demo``: a whole hierarchical job on one machine, with a summary.

Starts the global and per-cluster lighthouses (one process) and every replica
group (one process each, ``topology.clusters x topology.replicas_per_cluster``),
shows progress while they train, then prints a human summary and writes a JSON
one (``demo.summary``, default ``<run.dir>/summary.json``).

The summary is computed only from what each process wrote (its result.json): in
particular ``consistent`` is true only if every replica group reported the same
checksum of its final parameters, taken after the last outer sync (with group.parallel=tp:
every group's rank k the same, per k — the ranks of a group hold different shards).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from hier_localsgd.config import Config
from hier_localsgd.launcher import Key, LocalJob
from hier_localsgd.link import ring_allreduce_bytes
from hier_localsgd.status import read_json, replica_dir
from hier_localsgd.tp import consistent_checksums


def summarize(cfg: Config, job: LocalJob, wall_s: float) -> Dict[str, Any]:
    keys = job.keys()
    results = {k: job.result(k) for k in keys}
    got = {k: r for k, r in results.items() if r is not None}
    codes = job.exit_codes()
    floor = next((r["entropy_floor"] for r in got.values()), None)
    losses = [r["eval_loss"] for r in got.values()]
    starts = [r["eval_loss_start"] for r in got.values()]
    final = sum(losses) / len(losses) if losses else None
    start = sum(starts) / len(starts) if starts else None
    model_bytes = next((r["model_bytes"] for r in got.values()), None)

    # every rank of a multi-rank group syncs (and reports) its own slice
    every_rank = list(got.values()) + [
        res for (c, r_) in keys for g in range(1, cfg.topology.ranks_per_replica)
        if (res := read_json(replica_dir(job.run_dir, c, r_, g) / "result.json")) is not None
    ]
    levels: Dict[str, Dict[str, float]] = {}
    for r in every_rank:
        for level, st in r["link"].items():
            agg = levels.setdefault(level, {"payload": 0.0, "control": 0.0, "total": 0.0})
            for kind, b in st["sent_bytes"].items():
                agg[kind] = agg.get(kind, 0.0) + b
                agg["total"] += b

    links: Dict[str, Dict[str, Any]] = {}
    for r in every_rank:
        for level, st in r["link"].items():
            loss = st.get("loss")
            if not loss:
                continue
            agg = links.setdefault(level, {k: loss[k] for k in ("model", "fill", "where", "expected_loss_rate", "expected_mean_burst")})
            for k in ("packets_sent", "packets_lost", "emulated_delay_s", "emulated_time_s"):
                agg[k] = agg.get(k, 0) + loss[k]
    for agg in links.values():
        agg["observed_loss_rate"] = agg["packets_lost"] / agg["packets_sent"] if agg["packets_sent"] else None

    inner_rounds: Dict[str, int] = {}
    for (c, _), r in got.items():
        inner_rounds[str(c)] = max(inner_rounds.get(str(c), 0), r["inner_rounds"])
    outer_rounds = max((r["outer_rounds"] for r in got.values()), default=0)
    checksums = {f"c{c}r{r_}": res["checksum"] for (c, r_), res in got.items()}
    ranks_missing = []
    for (c, r_) in keys:  # every rank of a multi-rank group reports its own checksum
        for g in range(1, cfg.topology.ranks_per_replica):
            res = read_json(replica_dir(job.run_dir, c, r_, g) / "result.json")
            if res is None:
                ranks_missing.append(f"c{c}r{r_}g{g}")
            else:
                checksums[f"c{c}r{r_}g{g}"] = res["checksum"]
    C = cfg.topology.clusters
    expected_outer = ring_allreduce_bytes(model_bytes, C) * C if model_bytes else None
    outer_payload = levels.get("outer", {}).get("payload")

    return {
        "topology": {
            "clusters": C,
            "replicas_per_cluster": cfg.topology.replicas_per_cluster,
            "ranks_per_replica": cfg.topology.ranks_per_replica,
            "mode": cfg.sync.mode,
            "inner": {"algorithm": cfg.sync.inner.algorithm, "every": cfg.sync.inner.every},
            "outer": {"algorithm": cfg.sync.outer.algorithm, "every": cfg.sync.outer.every},
        },
        "model": cfg.model.name,
        "model_params": next((r["model_params"] for r in got.values()), None),
        "model_bytes": model_bytes,
        "steps": min((r["steps"] for r in got.values()), default=0),
        "steps_target": cfg.train.steps,
        "inner_rounds_committed": {"per_cluster": inner_rounds, "total": sum(inner_rounds.values())},
        "outer_rounds_committed": outer_rounds,
        "eval_loss_start": start,
        "final_eval_loss": final,
        "entropy_floor": floor,
        "excess_loss_start": None if floor is None or start is None else start - floor,
        "excess_loss": None if floor is None or final is None else final - floor,
        "bytes_sent": levels,
        "links": links,
        "slow_link_payload_bytes_per_outer_round": (outer_payload / outer_rounds) if outer_payload and outer_rounds else None,
        "slow_link_payload_bytes_per_outer_round_expected": expected_outer,
        "consistent": len(got) == len(keys) and not ranks_missing and consistent_checksums(checksums, cfg.group.parallel == "tp"),
        "checksums": checksums,
        "exit_codes": {f"c{c}r{r}": code for (c, r), code in codes.items()},
        "missing_results": [f"c{c}r{r}" for (c, r) in keys if (c, r) not in got] + ranks_missing,
        "wall_s": wall_s,
        "run_dir": str(job.run_dir),
    }


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


def human(summary: Dict[str, Any]) -> str:
    t = summary["topology"]
    b = summary["bytes_sent"]

    def mb(x: Optional[float]) -> str:
        return "-" if x is None else f"{x / 1e6:.2f} MB"

    def f(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.4f}"

    lines = [
        f"hier_localsgd {t['mode']}: {t['clusters']} clusters x {t['replicas_per_cluster']} replica groups, "
        f"{summary['model']} ({summary['model_params']} params), {summary['steps']}/{summary['steps_target']} steps in {summary['wall_s']:.1f} s",
        (
            f"  rounds committed: inner {summary['inner_rounds_committed']['per_cluster']} per cluster, outer {summary['outer_rounds_committed']}"
            if t["mode"] == "hier"
            else f"  syncs committed per replica group ({t['mode']}): {summary['inner_rounds_committed']['per_cluster']} (max per cluster)"
        ),
        f"  eval loss {f(summary['eval_loss_start'])} -> {f(summary['final_eval_loss'])}; entropy floor {f(summary['entropy_floor'])}; "
        f"excess {f(summary['excess_loss_start'])} -> {f(summary['excess_loss'])}",
    ]
    for level, agg in b.items():
        lines.append(f"  bytes sent, {level}: payload {mb(agg.get('payload'))}, control {mb(agg.get('control'))}")
    for level, agg in summary.get("links", {}).items():
        rate = agg["observed_loss_rate"]
        lines.append(
            f"  {level} link: {agg['model']} loss expected {agg['expected_loss_rate']:.2%}, observed "
            f"{'-' if rate is None else f'{rate:.2%}'} of {agg['packets_sent']} packets (fill {agg['fill']}, {agg['where']}); "
            f"emulated delay {agg['emulated_delay_s']:.1f} s"
        )
    if summary.get("slow_link_payload_bytes_per_outer_round"):
        lines.append(
            f"  slow-link payload per outer round: {mb(summary['slow_link_payload_bytes_per_outer_round'])} "
            f"(one model per cluster x ring factor = {mb(summary['slow_link_payload_bytes_per_outer_round_expected'])})"
        )
    lines.append(f"  consistent: {summary['consistent']} ({len(set(summary['checksums'].values()))} distinct checksum(s) over {len(summary['checksums'])} processes)")
    bad = {k: v for k, v in summary["exit_codes"].items() if v != 0}
    if bad or summary["missing_results"]:
        lines.append(f"  PROBLEMS: exit codes {bad}, missing results {summary['missing_results']}")
    return "\n".join(lines)


def start_dashboard(cfg: Config, job: LocalJob):  # type: ignore[no-untyped-def]
    """Serves the dashboard of this run (on a free port if the configured one is taken)."""
    from dataclasses import replace

    from hier_localsgd.config import ConfigError
    from hier_localsgd.dashboard import start_in_thread

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
        job.start_lighthouses()
        job.start_all()
        # With kill buttons on, a killed replica group is restarted and heals, as it would be under launch/replica.sh.
        codes = job.wait(cfg.demo.timeout_s, tick=progress, restart=cfg.dashboard.allow_kill)
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
