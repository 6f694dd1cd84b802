"""The summary of a finished local job, shared by demo, chaos, sweep and the tests.

Computed only from what each process wrote (its result.json, status and events): in
particular ``consistent`` is true only if every replica group reported the same checksum
of its final parameters, taken after the last outer sync (with group.parallel=tp: every
group's rank k the same, per k — the ranks of a group hold different shards), and every
one of those models is finite (one checksum of all-NaN parameters is no success).
``excluded`` lists the contributions the poison screen kept out (core/tensors/guard.py), each
(level, step, member) once. :func:`human` renders it.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from hier_localsgd.config import Config
from hier_localsgd.costs import ring_allreduce_bytes
from hier_localsgd.sync.compression import NONE as NO_COMPRESSION, payload_bytes
from hier_localsgd.core.runtime.status import RESULT_FILE, read_events, read_json, replica_dir
from hier_localsgd.launch.local import LocalJob
from hier_localsgd.train.tp import consistent_checksums

Key = Tuple[int, int]  # (cluster, replica group)


def summarize(cfg: Config, job: LocalJob, wall_s: float) -> Dict[str, Any]:
    keys = job.keys()
    results = {k: job.result(k) for k in keys}
    got = {k: r for k, r in results.items() if r is not None}
    codes = job.exit_codes()
    # A user's program (run.program) publishes what it evaluates, if anything.
    floor = next((r.get("entropy_floor") for r in got.values()), None)
    losses = [r["eval_loss"] for r in got.values() if r.get("eval_loss") is not None]
    starts = [r["eval_loss_start"] for r in got.values() if r.get("eval_loss_start") is not None]
    final = sum(losses) / len(losses) if losses else None
    start = sum(starts) / len(starts) if starts else None
    model_bytes = next((r["model_bytes"] for r in got.values()), None)

    # every rank of a multi-rank group syncs (and reports) its own slice
    every_rank = list(got.values()) + [
        res for (c, r_) in keys for g in range(1, cfg.topology.ranks_per_replica)
        if (res := read_json(replica_dir(job.run_dir, c, r_, g) / RESULT_FILE)) is not None
    ]
    levels = _bytes_by_level(every_rank)
    links = _link_stats(every_rank)
    inner_rounds: Dict[str, int] = {}
    for (c, _), r in got.items():
        inner_rounds[str(c)] = max(inner_rounds.get(str(c), 0), r["inner_rounds"])
    outer_rounds = max((r["outer_rounds"] for r in got.values()), default=0)
    checksums, ranks_missing = _checksums(job, keys, got, cfg.topology.ranks_per_replica)
    not_finite = _not_finite(job, keys, got, cfg.topology.ranks_per_replica)
    C = cfg.topology.clusters
    expected_outer = ring_allreduce_bytes(model_bytes, C) * C if model_bytes else None
    comp = cfg.sync.outer.compression
    if model_bytes and comp != NO_COMPRESSION:
        # the compressed outer reduce: packed codes and scales (topk2: positions too)
        expected_outer = payload_bytes(model_bytes // 4, C, comp, cfg.sync.outer.compression_block, cfg.sync.outer.topk) * C
    if cfg.sync.async_outer.enabled:
        expected_outer = None  # pushes to the global model server, not a ring: no per-round figure
    if expected_outer and cfg.sync.outer.fragments > 1:
        expected_outer = None  # streaming fragments: one fragment per round (the last the whole model), no single figure
    outer_payload = levels.get("outer", {}).get("payload")

    return {
        "topology": {
            "clusters": C,
            "replicas_per_cluster": cfg.topology.replicas_per_cluster,
            "ranks_per_replica": cfg.topology.ranks_per_replica,
            "mode": cfg.sync.mode,
            "inner": {"algorithm": cfg.sync.inner.algorithm, "every": cfg.sync.inner.every},
            "outer": {"algorithm": cfg.sync.outer.algorithm, "every": cfg.sync.outer.every, "compression": cfg.sync.outer.compression,
                      "asynchronous": cfg.sync.async_outer.enabled},
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
        "consistent": (len(got) == len(keys) and not ranks_missing and not not_finite
                       and consistent_checksums(checksums, cfg.group.rank_shards(cfg.topology.ranks_per_replica))),
        "checksums": checksums,
        "not_finite": not_finite,
        "excluded": excluded_contributions(job.run_dir, keys),
        "exit_codes": {f"c{c}r{r}": code for (c, r), code in codes.items()},
        "missing_results": [f"c{c}r{r}" for (c, r) in keys if (c, r) not in got] + ranks_missing,
        "wall_s": wall_s,
        "run_dir": str(job.run_dir),
    }


def _bytes_by_level(every_rank: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    """Bytes sent per level and kind (payload, control, total), summed over every rank's result."""
    levels: Dict[str, Dict[str, float]] = {}
    for r in every_rank:
        for level, st in r["link"].items():
            agg = levels.setdefault(level, {"payload": 0.0, "control": 0.0, "total": 0.0})
            for kind, b in st["sent_bytes"].items():
                agg[kind] = agg.get(kind, 0.0) + b
                agg["total"] += b
    return levels


def _link_stats(every_rank: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """The emulated links' loss statistics per level (levels without loss emulation left out)."""
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
    return links


def _checksums(job: LocalJob, keys: Sequence[Key], got: Dict[Key, Dict[str, Any]], ranks: int) -> Tuple[Dict[str, str], List[str]]:
    """Every rank's final checksum by name (``c0r1``, ``c0r1g1``), and the ranks > 0 without a result."""
    checksums = {f"c{c}r{r_}": res["checksum"] for (c, r_), res in got.items()}
    ranks_missing = []
    for (c, r_) in keys:  # every rank of a multi-rank group reports its own checksum
        for g in range(1, ranks):
            res = read_json(replica_dir(job.run_dir, c, r_, g) / RESULT_FILE)
            if res is None:
                ranks_missing.append(f"c{c}r{r_}g{g}")
            else:
                checksums[f"c{c}r{r_}g{g}"] = res["checksum"]
    return checksums, ranks_missing


def _not_finite(job: LocalJob, keys: Sequence[Key], got: Dict[Key, Dict[str, Any]], ranks: int) -> List[str]:
    """The processes whose final model holds a NaN or an infinity (``c0r1``, ``c0r1g1``)."""
    bad = [f"c{c}r{r_}" for (c, r_), res in got.items() if res.get("finite") is False]
    for (c, r_) in keys:
        for g in range(1, ranks):
            res = read_json(replica_dir(job.run_dir, c, r_, g) / RESULT_FILE)
            if res is not None and res.get("finite") is False:
                bad.append(f"c{c}r{r_}g{g}")
    return bad


def excluded_contributions(run_dir: Any, keys: Sequence[Key]) -> List[Dict[str, Any]]:
    """Every contribution the poison screen excluded (sync/poison.py), once per (level, step,
    member) however many members recorded it, in time order."""
    seen: Dict[Tuple[str, int, str], Dict[str, Any]] = {}
    for k in keys:
        for e in read_events(replica_dir(run_dir, *k) / "events.jsonl"):
            if e["kind"] == "excluded":
                key = (e["level"], e["step"], e["member"])
                if key not in seen or e["t"] < seen[key]["t"]:
                    seen[key] = {"t": e["t"], "level": e["level"], "step": e["step"], "member": e["member"], "reason": e["reason"]}
    return sorted(seen.values(), key=lambda x: x["t"])


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
        expected = summary["slow_link_payload_bytes_per_outer_round_expected"]
        what = "one model" if summary["topology"]["outer"].get("compression", "none") == "none" else summary["topology"]["outer"]["compression"] + "-compressed model"
        lines.append(
            f"  slow-link payload per outer round: {mb(summary['slow_link_payload_bytes_per_outer_round'])} "
            + (f"({what} per cluster x ring factor = {mb(expected)})" if expected is not None
               else "(asynchronous: each push's pseudo-gradient up and the model back)" if summary["topology"]["outer"].get("asynchronous")
               else "(streaming fragments: one fragment per round, the last round the whole model)")
        )
    lines.append(f"  consistent: {summary['consistent']} ({len(set(summary['checksums'].values()))} distinct checksum(s) over {len(summary['checksums'])} processes"
                 + (f"; NOT FINITE: {summary['not_finite']}" if summary.get("not_finite") else "") + ")")
    for x in summary.get("excluded", []):
        lines.append(f"  excluded: {x['level']} contribution of {x['member']} at step {x['step']} ({x['reason']})")
    bad = {k: v for k, v in summary["exit_codes"].items() if v != 0}
    if bad or summary["missing_results"]:
        lines.append(f"  PROBLEMS: exit codes {bad}, missing results {summary['missing_results']}")
    return "\n".join(lines)
