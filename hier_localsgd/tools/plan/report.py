"""The plan as text and JSON: ``hier-localsgd plan``."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Dict, List, Sequence

from hier_localsgd.tools.plan.config import HEADER, REPORT_ORDER
from hier_localsgd.tools.plan.planner import make_plan

if TYPE_CHECKING:
    from hier_localsgd.config import Config


# ----------------------------------------------------------------------------- report
def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table, columns right-aligned except the first."""
    cells = [[str(h) for h in headers]] + [[str(x) for x in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for j, row in enumerate(cells):
        lines.append("  ".join(row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]) for i in range(len(row))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt_count(x: float) -> str:
    for unit, k in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= k:
            return f"{x / k:.3f} {unit}"
    return f"{x:.0f}"


def fmt_bytes(x: float) -> str:
    for unit, k in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= k:
            return f"{x / k:.2f} {unit}"
    return f"{x:.0f} B"


def fmt_time(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 1:
        return f"{x:.3f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.2f} ms"
    return f"{x * 1e6:.1f} us"


def human(p: Dict[str, Any]) -> str:
    """The plan as text: one block per part of :func:`~hier_localsgd.tools.plan.planner.make_plan`'s dict."""
    out = _model_lines(p) + _memory_lines(p) + _sync_lines(p) + _recommendation_lines(p)
    return "\n".join(out)


def _model_lines(p: Dict[str, Any]) -> List[str]:
    m, cfg = p["model"], p["config"]
    tp = cfg["topology"]
    out = [
        f"{HEADER}: {m['name']} (dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads, {m['n_kv_heads']} kv heads, "
        f"FFN {m['ffn_dim']}, vocab {m['vocab_size']}) on {tp['clusters']} clusters x {tp['replicas_per_cluster']} replica groups "
        f"x {tp['ranks_per_replica']} ranks ({cfg['plan']['sharding']})",
        "",
        "Parameters",
    ]
    par = p["parameters"]
    out.append(table(["part", "parameters", "share"], [[k, f"{v:,}", f"{v / par['total']:.1%}"] for k, v in par.items()]))
    f = p["flops"]
    out += [
        "",
        f"FLOPs (training, per token, seq_len {cfg['train']['seq_len']}): {fmt_count(f['per_token']['total'])} "
        f"= 6(N-N_emb) {fmt_count(f['per_token']['dense'])} + attention {fmt_count(f['per_token']['attention'])}   (6N = {fmt_count(f['six_n_per_token'])})",
        f"per rank step ({f['tokens_per_rank_step']} tokens): {fmt_count(f['per_rank_step'])}FLOP; "
        f"compute time per step {fmt_time(p['step_time_s'])} ({p['step_time_source']})",
    ]
    return out


def _memory_lines(p: Dict[str, Any]) -> List[str]:
    out = ["", "Peak memory per rank (device; host_*: host memory the sync holds, pinned on CUDA)"]
    keys = ["parameters", "gradients", "optimizer", "sync_backups", "rollback_snapshot", "sync_scratch", "activations", "activations_checkpointed", "peak", "peak_checkpointed",
            "host_sync_state", "host_rollback_snapshot", "host_scratch", "host_peak"]
    rows = [[k] + [fmt_bytes(p["modes"][mode]["memory"][k]) for mode in REPORT_ORDER] for k in keys]
    out.append(table(["", *REPORT_ORDER], rows))
    fits = p["fits_memory"]
    out.append(
        f"fits in plan.hardware.memory_gib={p['config']['plan']['hardware']['memory_gib']:g} GiB: "
        + ", ".join(f"{m} {'yes' if fits[m]['no_checkpointing'] else ('with checkpointing' if fits[m]['checkpointing'] else 'no')}" for m in REPORT_ORDER)
    )
    return out


def _link_text(link: Dict[str, float]) -> str:
    bw = f"{link['bandwidth_gbps']:g} Gbit/s" if link["bandwidth_gbps"] > 0 else "unlimited bandwidth"
    return f"{bw} {link['latency_ms']:g} ms"


def _sync_lines(p: Dict[str, Any]) -> List[str]:
    cfg, st, h = p["config"], p["sync"], p["h"]
    tp = cfg["topology"]
    c, r = tp["clusters"], tp["replicas_per_cluster"]
    lk = cfg["links"]
    out = [
        "",
        f"Syncs (ring bound; LAN = links.inner {_link_text(lk['inner'])}, WAN = links.outer {_link_text(lk['outer'])}; "
        f"{fmt_bytes(st['sync_bytes'])} per rank in {cfg['plan']['train']['sync_dtype']})",
    ]
    if p["unlimited_links"]:
        out.append(f"NOTE: {' and '.join(p['unlimited_links'])} set no bandwidth_gbps (0 = unlimited, as every command's default): "
                   "their syncs cost latency only. Give the deployment's links, e.g. links.outer.bandwidth_gbps=1 links.outer.latency_ms=20")
    out += [
        table(
            ["sync", "ranks", "link", "bytes sent per rank", "time", "every (steps)"],
            [
                ["inner all-reduce", r, "lan", fmt_bytes(st["inner_bytes"]), fmt_time(st["inner_s"]), h["inner"]],
                ["outer push + model back (asynchronous)" if p["outer_round"].get("asynchronous") else
                 "outer all-reduce" if p["outer_round"]["compression"] == "none" else f"outer reduce ({p['outer_round']['compression']})",
                 c, "wan", fmt_bytes(p["outer_round"]["bytes"]), fmt_time(p["outer_round"]["s"]),
                 h["inner"] * h["outer"] // p["outer_round"]["fragments"]],
                ["broadcast in cluster" + ("" if p["outer_round"]["compression"] == "none" else " (x2: and the residual)"), r, "lan",
                 fmt_bytes(st["broadcast_bytes"]), fmt_time(st["broadcast_s"]), h["inner"] * h["outer"] // p["outer_round"]["fragments"]],
                ["flat all-reduce", c * r, st["wide_link"], fmt_bytes(st["flat_bytes"]), fmt_time(st["flat_s"]), h["flat"]],
                ["ddp all-reduce", c * r, st["wide_link"], fmt_bytes(st["ddp_bytes"]), fmt_time(st["ddp_s"]), 1],
            ],
        ),
        "",
        "Time per step",
        table(
            ["mode", "compute", "sync (avg)", "comm fraction", "tokens/s (all)", "slow-link bytes/step"],
            [
                [mode, fmt_time(p["step_time_s"]), fmt_time(v["sync_per_step_s"]), f"{v['comm_fraction']:.1%}", fmt_count(v["tokens_per_s"]), fmt_bytes(v["slow_link_bytes_per_step"])]
                for mode, v in p["modes"].items()
            ],
        ),
    ]
    cl = p.get("clusters")
    if cl:
        rate = lambda v: f"{v:.3g}"  # noqa: E731
        out += ["", f"Clusters of different speeds (topology.cluster_speed; configured: the {cl['configured']} outer level; steady state, "
                "no grace window, no failures: `simulate` models those)",
                table(["cluster", "speed", "compute/step", "steps/s synchronous", "of its own rate", "steps/s asynchronous", "of its own rate"],
                      [[k, f"{sp:g}", fmt_time(cs), rate(cl["synchronous"]["steps_per_s"][k]), f"{cl['synchronous']['of_own_rate'][k]:.1%}",
                        rate(cl["asynchronous"]["steps_per_s"][k]), f"{cl['asynchronous']['of_own_rate'][k]:.1%}"]
                       for k, (sp, cs) in enumerate(zip(cl["speeds"], cl["compute_s"]))]),
                f"goodput without failures: synchronous {cl['synchronous']['goodput_no_failures']:.3f}, "
                f"asynchronous {cl['asynchronous']['goodput_no_failures']:.3f}"]
    for variant, vol in p.get("tensor_parallel", {}).items():
        out.append(f"tensor parallel over the group's {tp['ranks_per_replica']} ranks ({variant}): {fmt_bytes(vol['per_step']['total'])} per rank "
                   f"and step, {fmt_bytes(sum(vol['per_layer'].values()))} per layer ("
                   + ", ".join(f"{op} {fmt_bytes(b)}" for op, b in vol["per_layer"].items()) + ")")
    return out


def _recommendation_lines(p: Dict[str, Any]) -> List[str]:
    out: List[str] = []
    rec = p["recommendation"]
    if rec.get("h_inner"):
        out += [
            "",
            f"For a communication fraction <= {rec['target_comm_fraction']:.1%}: hier sync.inner.every={rec['h_inner']}, sync.outer.every={rec['h_outer']} "
            f"(outer every {rec['outer_period_steps']} steps, {rec['hier_fraction']:.2%}); flat sync.flat.every={rec['h_flat']} ({rec['flat_fraction']:.2%}); "
            f"ddp {'meets' if rec['ddp_meets_target'] else 'cannot meet'} it ({p['modes']['ddp']['comm_fraction']:.1%})",
        ]
    pk = p.get("outer_pick")
    if pk:
        b = pk["pick"]
        hides = "hides behind compute" if b["hides"] else "does not hide"
        out += [
            "",
            f"Outer configuration for this link at sync.inner.every={p['h']['inner']}, sync.outer.every={p['h']['outer']} "
            f"({len(pk['rows'])} variants costed: payload x delay x fragments; tools/plan/pick.py): {' '.join(pk['overrides'])} "
            f"— {fmt_bytes(b['bytes_per_round'])} per outer round in {fmt_time(b['outer_round_s'])}, {hides} "
            f"({fmt_time(b['outer_exposed_per_step_s'])} exposed per step); modelled time to the target {b['time_factor']:.3f}x an outer level "
            f"that costs nothing (payload step cost {b['payload_step_cost']:g}, lag {b['lag_steps']} of {pk['steps']} steps)",
        ]
    sc = p["scaling"]
    k = sc["constants"]
    out += [
        "",
        f"Compute-optimal (L = {k['E']} + {k['A']}/N^{k['alpha']} + {k['B']}/D^{k['beta']}, C = {k['flops_per_param_token']:g} N D) "
        f"for C = {sc['budget_flops']:.3g} FLOPs:",
        f"  N_opt = {fmt_count(sc['N_opt'])} parameters, D_opt = {fmt_count(sc['D_opt'])} tokens, "
        f"{sc['tokens_per_param']:.1f} tokens/parameter, loss {sc['loss']:.4f}",
    ]
    return out


def run_plan(cfg: "Config", out_dir: str) -> int:
    """Prints the plan and writes ``<out_dir>/<plan.json_name>``. Returns 0.

    Raises:
        ValueError: a bad field; the message starts with its path (``plan.model.dim: ...``).
    """
    p = make_plan(cfg)
    print(human(p))
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, cfg.plan.json_name)
    with open(path, "w") as fh:
        json.dump(p, fh, indent=2)
    print(f"\nplan written to {path}")
    return 0
