"""``hier-localsgd tp-sweep``: which tensor-parallel operations tolerate how much loss.

Trains the TP workload (torchtitan Llama3 debugmodel with ``tp_sweep.layers`` layers and the
corpus's 128-token vocabulary, on the Markov corpus, whose entropy floor makes *excess loss* = eval loss − floor meaningful) in
one TP group of ``tp_sweep.degree`` spawned gloo processes, once per cell of

    loss rate (tp_sweep.rates) × loss model (bernoulli, gilbert_elliott) × operation
    (attn_fwd, attn_bwd, mlp_fwd, mlp_bwd, all)

plus one lossless cell. Every cell starts from the same initial weights, optimizer and
batches, so cells differ only in their losses. All cells run in sequence inside the same
pair of processes (spawning per cell would cost more than a cell). Loss models at a rate
ρ are the ones ``hier-localsgd sweep`` uses (:func:`hier_localsgd.sweep.loss_overrides`):
Bernoulli p = ρ; Gilbert–Elliott with mean bursts of ``tp_sweep.burst`` packets (k = 1,
h = 0, r = 1/burst, p = ρ·r/(1−ρ)). The final evaluation runs over reliable links, so it
measures what the lossy training did to the model.

Optionally (``tp_sweep.dp=true``) the same workload also trains data-parallel over the
same group — each rank half the batch, the gradient all-reduced every step through the
same loss models with ``tp_sweep.dp_fill`` (default ``rescale``: the average over the
contributions that arrived, i.e. unbiased aggregation) — so TP and DP are compared on
one workload.

Output (``tp_sweep.out``, default ``<run.dir>/tp_sweep``): ``tp_sweep.json`` (every cell:
final eval loss, excess loss and its ratio to the lossless cell, observed loss rate and
burst, measured TP bytes per step next to the planner's :func:`hier_localsgd.train.tp.tp_comm_volume`),
``tp_sweep.md`` (tables answering: effect on convergence, most sensitive operation,
highest tolerated rate — final excess loss within ``tp_sweep.tolerance`` (5 %) of the
lossless run's — and bursty vs uniform at the same rate) and ``tp_sweep.png`` when
matplotlib is installed.

``tp_sweep.large=true``: loss rates up to 50 %. ``tp_sweep.quick=true``: 2 rates, 2
operations, a few steps, for tests (aimed at < 60 s on an idle 2-core machine).

Failure semantics: a rank that raises ends the sweep (the other's collectives fail
within ``tp_sweep.timeout_s``); nothing partial is written as final.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hier_localsgd.experiments.sections import SWEEP_OPS, TPSweepConfig

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- grid
def model_fields(kind: str, rate: float, burst: float) -> Dict[str, Any]:
    """The loss model of ``hier-localsgd sweep`` at ``rate`` (its parameterization, reused)."""
    from hier_localsgd.experiments.sweep import loss_overrides

    out: Dict[str, Any] = {}
    for ov in loss_overrides(kind, rate, burst):
        key, _, value = ov.partition("=")
        name = key.rsplit(".", 1)[1]
        out[name] = value if name == "loss" else float(value)
    return out


LARGE_RATES = [0.0, 0.001, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5]


def effective(sw: TPSweepConfig) -> TPSweepConfig:
    """``sw`` with the quick or large preset applied."""
    if sw.large and not sw.quick:
        big = TPSweepConfig(**{**asdict(sw)})
        big.rates = list(LARGE_RATES)
        return big
    if not sw.quick:
        return sw
    q = TPSweepConfig(**{**asdict(sw)})
    q.rates, q.ops, q.steps, q.eval_batches, q.layers = [0.0, 0.1], ["mlp_fwd", "all"], 12, 2, 1
    q.batch_size, q.seq_len = 4, 32
    return q


def grid(sw: TPSweepConfig) -> List[Dict[str, Any]]:
    cells: List[Dict[str, Any]] = [{"arm": "tp", "rate": 0.0, "model": "none", "op": "none"}]
    rates = [r for r in sw.rates if r > 0]
    for rate in rates:
        for kind in sw.models:
            for op in sw.ops:
                cells.append({"arm": "tp", "rate": rate, "model": kind, "op": op})
    if sw.dp:
        cells.append({"arm": "dp", "rate": 0.0, "model": "none", "op": "grad"})
        for rate in rates:
            for kind in sw.models:
                cells.append({"arm": "dp", "rate": rate, "model": kind, "op": "grad"})
    return cells


def cell_specs(sw: TPSweepConfig, cell: Dict[str, Any]) -> Dict[str, Any]:
    from hier_localsgd.core.links.lossy import LinkSpec, LossModel

    if cell["rate"] == 0:
        return {}
    f = model_fields(cell["model"], cell["rate"], sw.burst)
    m = LossModel(f["loss"], p=f.get("p", 0.0), r=f.get("r", 1.0), k=f.get("k", 1.0), h=f.get("h", 0.0))
    if cell["arm"] == "dp":
        return {"attn_fwd": LinkSpec(model=m, fill=sw.dp_fill, where=sw.where, seed=sw.seed)}
    ops = [o for o in SWEEP_OPS[:4]] if cell["op"] == "all" else [cell["op"]]
    return {op: LinkSpec(model=m, fill=sw.fill, where=sw.where, seed=sw.seed) for op in ops}


# ----------------------------------------------------------------------------- worker
def _worker(rank: int, world: int, pg: Any, sw: TPSweepConfig, cells: List[Dict[str, Any]], progress: Optional[str]) -> List[Dict[str, Any]]:
    """Runs every cell in this rank of the group; returns rank-local results."""
    import torch

    from hier_localsgd.train.data import MarkovChain, MarkovData
    from hier_localsgd.train.model import evaluate, lm_loss
    from hier_localsgd.train.tp import TPGroup, build_llama3, build_tp_model

    chain = MarkovChain(128, 4, 1234, 0.5)
    data = MarkovData(chain, 1234, 0, sw.batch_size, sw.seq_len, sw.eval_batches)  # shard 0: TP ranks share batches
    eval_set = data.eval_batches()
    out = []
    for i, cell in enumerate(cells):
        t0 = time.time()
        specs = cell_specs(sw, cell)
        if cell["arm"] == "tp":
            tp = TPGroup(pg, rank, world, specs)
            model, _ = build_tp_model(sw.model, data.vocab_size, sw.seq_len, sw.seed, tp, sw.variant, n_layers=sw.layers, exact_vocab=True)
        else:
            tp = TPGroup(pg, rank, world, specs)  # the gradient all-reduce rides attn_fwd's link
            model = build_llama3(sw.model, data.vocab_size, sw.seq_len, sw.seed, n_layers=sw.layers, exact_vocab=True)
        opt = torch.optim.AdamW(model.parameters(), lr=sw.lr, betas=(0.9, 0.95), weight_decay=0.1)
        params = [p for p in model.parameters()]
        train_loss = float("nan")
        diverged = False
        for step in range(sw.steps):
            x, y = data.batch(step)
            if cell["arm"] == "dp":
                b = x.shape[0] // world
                x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
            loss = lm_loss(model, x, y)
            loss.backward()
            if cell["arm"] == "dp":
                flat = torch.cat([p.grad.reshape(-1) for p in params])
                tp.all_reduce(flat, "attn_fwd")
                flat /= world
                off = 0
                for p in params:
                    p.grad.copy_(flat[off : off + p.numel()].view_as(p))
                    off += p.numel()
            opt.step()
            opt.zero_grad()
            train_loss = float(loss.detach())
            if not math.isfinite(train_loss):
                diverged = True
                break
        stats = tp.stats()
        tp.emu = {}  # the final evaluation runs over reliable links
        final = float("nan") if diverged else evaluate(model, eval_set)
        res = {**cell, "final_eval_loss": final, "train_loss": train_loss, "diverged": diverged,
               "entropy_floor": data.entropy_floor, "wall_s": time.time() - t0, "stats": stats}
        out.append(res)
        if progress and rank == 0:
            with open(progress, "a") as fh:
                fh.write(json.dumps({"i": i + 1, "n": len(cells), **{k: res[k] for k in ("arm", "rate", "model", "op", "final_eval_loss", "wall_s")}}) + "\n")
    return out


# ----------------------------------------------------------------------------- report
def _loss_stats(stats: Dict[str, Any], ops: List[str]) -> Tuple[Optional[float], Optional[float], int]:
    sent = lost = 0
    burst_num = burst_den = 0.0
    for op in ops:
        st = stats.get(op, {}).get("loss")
        if not st:
            continue
        sent += st["packets_sent"]
        lost += st["packets_lost"]
        for k, v in st["burst_histogram"].items():
            burst_num += int(k) * v
            burst_den += v
    return (lost / sent if sent else None), (burst_num / burst_den if burst_den else None), sent


def summarize(sw: TPSweepConfig, ranks: List[List[Dict[str, Any]]], dims: Any) -> Dict[str, Any]:
    """Cells merged over ranks (loss statistics summed), with excess-loss ratios."""
    from hier_localsgd.train.tp import OPS, tp_comm_volume

    tokens = sw.batch_size * sw.seq_len
    pred = tp_comm_volume(dims, tokens, sw.degree, sw.variant)["per_step"]
    rows = []
    base: Dict[str, float] = {}
    for cells in zip(*ranks):
        c0 = cells[0]
        ops = list(OPS) if c0["op"] in ("all", "grad", "none") else [c0["op"]]
        merged: Dict[str, Any] = {}
        for op in OPS:
            merged[op] = {"loss": None}
            parts = [c["stats"][op].get("loss") for c in cells if c["stats"][op].get("loss")]
            if parts:
                hist: Dict[str, int] = {}
                for p in parts:
                    for k, v in p["burst_histogram"].items():
                        hist[k] = hist.get(k, 0) + v
                merged[op]["loss"] = {"packets_sent": sum(p["packets_sent"] for p in parts),
                                      "packets_lost": sum(p["packets_lost"] for p in parts), "burst_histogram": hist}
        rate, burst, packets = _loss_stats(merged, ops)
        floor = c0["entropy_floor"]
        excess = c0["final_eval_loss"] - floor if floor is not None else c0["final_eval_loss"]
        steps_run = max(1, sw.steps)
        measured = sum(c0["stats"][op]["sent_bytes"] for op in OPS) / steps_run
        row = {k: c0[k] for k in ("arm", "rate", "model", "op", "final_eval_loss", "train_loss", "diverged", "wall_s")}
        row.update(excess_loss=excess, observed_loss_rate=rate, observed_mean_burst=burst, packets=packets,
                   ranks_agree=all(c["final_eval_loss"] == c0["final_eval_loss"] or (math.isnan(c["final_eval_loss"]) and math.isnan(c0["final_eval_loss"])) for c in cells),
                   bytes_per_step_measured=measured,
                   bytes_per_step_predicted=pred["total"] if c0["arm"] == "tp" else None)
        if c0["rate"] == 0:
            base[c0["arm"]] = excess
        rows.append(row)
    for row in rows:
        b = base.get(row["arm"])
        row["excess_ratio"] = (row["excess_loss"] / b) if b and not math.isnan(row["excess_loss"]) else None
        row["tolerated"] = row["excess_ratio"] is not None and row["excess_ratio"] <= 1 + sw.tolerance
    return {"config": asdict(sw), "lossless_excess": base, "rows": rows, "predicted_bytes_per_step": pred,
            "answers": answers(sw, rows)}


def answers(sw: TPSweepConfig, rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The seed-001 questions, from the rows: per (arm, model, op) the highest rate whose
    run stayed within tolerance with every lower rate also tolerated; per op the mean excess
    ratio over rates (sensitivity); bursty vs uniform ratio per (rate, op)."""
    rates = sorted({r["rate"] for r in rows if r["rate"] > 0})
    tol: Dict[str, Dict[str, Any]] = {}
    sens: Dict[str, float] = {}
    for arm in sorted({r["arm"] for r in rows}):
        for kind in sw.models:
            for op in sorted({r["op"] for r in rows if r["arm"] == arm and r["rate"] > 0}):
                best = 0.0
                for rate in rates:
                    cell = next((r for r in rows if (r["arm"], r["model"], r["op"], r["rate"]) == (arm, kind, op, rate)), None)
                    if cell is None or not cell["tolerated"]:
                        break
                    best = rate
                tol.setdefault(f"{arm}/{op}", {})[kind] = best
    for arm in sorted({r["arm"] for r in rows}):
        for op in sorted({r["op"] for r in rows if r["arm"] == arm and r["rate"] > 0}):
            xs = [r["excess_ratio"] for r in rows if r["arm"] == arm and r["op"] == op and r["rate"] > 0 and r["excess_ratio"] is not None]
            sens[f"{arm}/{op}"] = sum(xs) / len(xs) if xs else float("nan")
    bursty: Dict[str, Optional[float]] = {}
    for r in rows:
        if r["model"] == "gilbert_elliott":
            u = next((x for x in rows if (x["arm"], x["op"], x["rate"], x["model"]) == (r["arm"], r["op"], r["rate"], "bernoulli")), None)
            if u is not None and u["excess_loss"] and r["excess_loss"] == r["excess_loss"]:
                bursty[f"{r['arm']}/{r['op']}@{r['rate']:g}"] = r["excess_loss"] / u["excess_loss"]
    return {"max_tolerated_rate": tol, "mean_excess_ratio": sens, "bursty_over_uniform_excess": bursty}


def _fmt(x: Any, spec: str = ".4f") -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return format(x, spec)


def markdown(summary: Dict[str, Any], command: str) -> str:
    sw = summary["config"]
    rows = summary["rows"]
    pred = summary["predicted_bytes_per_step"]
    lines = [f"# tp-sweep: {sw['variant']} tensor parallelism, degree {sw['degree']}", "",
             f"Command: `{command}`", "",
             f"Workload: {sw['model']} with {sw['layers'] or 'all'} layers, batch {sw['batch_size']} × {sw['seq_len']}, "
             f"{sw['steps']} steps, AdamW lr {sw['lr']}, Markov corpus (excess loss = eval loss − entropy floor; "
             f"final eval over reliable links). TP links: fill `{sw['fill']}`, `{sw['where']}`; Gilbert–Elliott mean burst "
             f"{sw['burst']:g} packets. Tolerated: excess loss ≤ {1 + sw['tolerance']:.2f} × lossless.", "",
             f"TP bytes per step and rank: predicted {pred['total']:.0f} (planner, "
             + ", ".join(f"{op} {pred[op]:.0f}" for op in ("attn_fwd", "attn_bwd", "mlp_fwd", "mlp_bwd")) + ")", "",
             "| arm | op | model | rate | observed rate | mean burst | final eval | excess | × lossless | tolerated | TP bytes/step measured | predicted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['arm']} | {r['op']} | {r['model']} | {r['rate']:g} | {_fmt(r['observed_loss_rate'], '.4%')} | {_fmt(r['observed_mean_burst'], '.2f')} "
            f"| {_fmt(r['final_eval_loss'])} | {_fmt(r['excess_loss'])} | {_fmt(r['excess_ratio'], '.3f')} | {'yes' if r['tolerated'] else 'no'} "
            f"| {_fmt(r['bytes_per_step_measured'], '.0f')} | {_fmt(r['bytes_per_step_predicted'], '.0f')} |")
    a = summary["answers"]
    lines += ["", "## Highest tolerated loss rate (every lower rate tolerated too)", "", "| arm/op | " + " | ".join(sw["models"]) + " |",
              "|---|" + "---|" * len(sw["models"])]
    for key, per in a["max_tolerated_rate"].items():
        lines.append(f"| {key} | " + " | ".join(f"{per.get(m, 0):g}" for m in sw["models"]) + " |")
    lines += ["", "## Sensitivity: mean excess loss over lossless, across lossy cells", "", "| arm/op | mean × lossless |", "|---|---|"]
    for key, v in sorted(a["mean_excess_ratio"].items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else 0):
        lines.append(f"| {key} | {_fmt(v, '.3f')} |")
    lines += ["", "## Bursty (Gilbert–Elliott) vs uniform (Bernoulli) at the same rate: excess-loss ratio", "", "| arm/op@rate | GE / Bernoulli |", "|---|---|"]
    for key, v in a["bursty_over_uniform_excess"].items():
        lines.append(f"| {key} | {_fmt(v, '.3f')} |")
    return "\n".join(lines) + "\n"


def plot(summary: Dict[str, Any], path: Path) -> bool:
    """Excess loss ratio vs loss rate, one panel per loss model, a line per operation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sw = summary["config"]
    rows = summary["rows"]
    fig, axes = plt.subplots(1, len(sw["models"]), figsize=(6 * len(sw["models"]), 4), squeeze=False)
    for ax, kind in zip(axes[0], sw["models"]):
        for arm, op in sorted({(r["arm"], r["op"]) for r in rows if r["rate"] > 0}):
            pts = sorted((r["rate"], r["excess_ratio"]) for r in rows
                         if (r["arm"], r["op"], r["model"]) == (arm, op, kind) and r["excess_ratio"] is not None)
            if pts:
                ax.plot([p[0] * 100 for p in pts], [p[1] for p in pts], marker="o", label=f"{arm}/{op}")
        ax.axhline(1 + sw["tolerance"], color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("loss rate (%)")
        ax.set_ylabel("final excess loss / lossless")
        ax.set_title(kind)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_tp_sweep(cfg: Any, overrides: List[str]) -> int:
    """Runs the sweep of ``cfg.tp_sweep`` and writes its report; returns an exit code."""
    from hier_localsgd.tools.plan.config import PlanModelConfig
    from hier_localsgd.tools.plan.model import resolve_model
    from hier_localsgd.train.tp import spawn_group

    sw = effective(cfg.tp_sweep)
    out = Path(sw.out or os.path.join(cfg.run.dir, "tp_sweep"))
    out.mkdir(parents=True, exist_ok=True)
    cells = grid(sw)
    progress = out / "progress.jsonl"
    progress.unlink(missing_ok=True)
    logger.info("tp-sweep: %d cells, %s, degree %d, %d steps each; progress in %s", len(cells), sw.variant, sw.degree, sw.steps, progress)
    t0 = time.time()
    ranks = spawn_group(_worker, sw.degree, str(out / "work"), args=(sw, cells, str(progress)), timeout=timedelta(seconds=sw.timeout_s))
    dims = resolve_model(PlanModelConfig(flavor=sw.model, n_layers=sw.layers, vocab_size=128), "tp_sweep.model")
    summary = summarize(sw, ranks, dims)
    summary["wall_s"] = time.time() - t0
    command = "hier-localsgd tp-sweep " + " ".join(overrides)
    summary["command"] = command.strip()
    (out / "tp_sweep.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "tp_sweep.md").write_text(markdown(summary, command.strip()))
    plotted = plot(summary, out / "tp_sweep.png")
    print((out / "tp_sweep.md").read_text())
    print(f"tp-sweep: {len(cells)} cells in {summary['wall_s']:.0f} s; wrote {out / 'tp_sweep.json'}, {out / 'tp_sweep.md'}"
          + (f", {out / 'tp_sweep.png'}" if plotted else " (no plot: matplotlib is not installed)"))
    return 0
