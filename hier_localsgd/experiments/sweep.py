"""``hier-localsgd sweep``: training quality over lossy slow links.

Runs the workload once per (mode, loss model, fill, loss rate) with the lossy link on the
slow links — the outer level for ``hier``, the single level for ``flat`` and ``ddp``
(their rings span the clusters) — and writes a table (markdown and JSON) and a plot of
final excess loss over the entropy floor vs loss rate, one panel per mode.

Loss models at a target rate ρ: ``bernoulli`` with p = ρ; ``gilbert_elliott`` with bursts
of ``sweep.burst`` packets on average (r = 1/burst, k = 1, h = 0, p = ρ·r/(1−ρ), so the
stationary loss rate is exactly ρ).

Workload: with ``sweep.workload=tiny`` (default) every run uses the bigram model, batch
16 and ``sweep.steps`` steps, so the default grid finishes in well under 20 minutes on 2
cores; ``sweep.workload=config`` runs the configured workload as is (e.g. the debugmodel).
``sweep.large=true`` sweeps more rates.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List

from hier_localsgd.config import Config
from hier_localsgd.experiments.summary import summarize
from hier_localsgd.launch.local import LocalJob

LARGE_RATES = [0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3]


def loss_overrides(model: str, rate: float, burst: float) -> List[str]:
    if rate == 0:
        return ["links.outer.loss=none"]
    if model == "bernoulli":
        return ["links.outer.loss=bernoulli", f"links.outer.p={rate}"]
    r = 1.0 / burst
    p = rate * r / (1 - rate)
    return ["links.outer.loss=gilbert_elliott", f"links.outer.p={p:.8f}", f"links.outer.r={r:.8f}", "links.outer.k=1.0", "links.outer.h=0.0"]


def grid(cfg: Config) -> List[Dict[str, Any]]:
    sw = cfg.sweep
    rates = LARGE_RATES if sw.large else list(sw.rates)
    cells = []
    for mode in sw.modes:
        for rate in rates:
            combos = [("none", "zero")] if rate == 0 else [(m, f) for m in sw.models for f in sw.fills]
            for model, fill in combos:
                cells.append({"mode": mode, "rate": rate, "model": model, "fill": fill})
    return cells


def workload_overrides(cfg: Config) -> List[str]:
    if cfg.sweep.workload == "config":
        return []
    s = cfg.sweep.steps
    return ["model=tiny", "train.batch_size=16", f"train.steps={s}", "sync.inner.every=5", "sync.outer.every=2",
            f"sync.flat.every=10", "train.min_step_time_s=0", "train.eval_every=0"]


def run_cell(cfg: Config, base: List[str], cell: Dict[str, Any], run_dir: Path) -> Dict[str, Any]:
    overrides = [*base, f"sync.mode={cell['mode']}", f"links.outer.fill={cell['fill']}",
                 f"links.outer.where={cfg.sweep.where}", *loss_overrides(cell["model"], cell["rate"], cfg.sweep.burst)]
    from hier_localsgd.config import load_config

    ccfg = load_config(overrides, validate_for="demo")
    t0 = time.time()
    job = LocalJob(ccfg, overrides, free_ports=True, run_dir_override=run_dir)
    try:
        job.start_lighthouses()
        job.start_all()
        job.wait(cfg.sweep.timeout_s)
    finally:
        job.stop()
    s = summarize(ccfg, job, time.time() - t0)
    link = s["links"].get("outer") or s["links"].get(cell["mode"]) or {}
    return {
        **cell,
        "final_eval_loss": s["final_eval_loss"],
        "excess_loss": s["excess_loss"],
        "excess_loss_start": s["excess_loss_start"],
        "consistent": s["consistent"],
        "observed_loss_rate": link.get("observed_loss_rate"),
        "slow_link_payload_bytes": (s["bytes_sent"].get("outer") or s["bytes_sent"].get(cell["mode"]) or {}).get("payload"),
        "exit_codes": s["exit_codes"],
        "wall_s": s["wall_s"],
    }


def table(rows: List[Dict[str, Any]]) -> str:
    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    out = ["| mode | loss model | fill | loss rate | observed | final eval loss | excess over floor | consistent | wall s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['mode']} | {r['model']} | {r['fill']} | {r['rate']:.0%} | {f(r['observed_loss_rate'], '.2%')} | "
            f"{f(r['final_eval_loss'], '.4f')} | {f(r['excess_loss'], '.4f')} | {r['consistent']} | {r['wall_s']:.0f} |"
        )
    return "\n".join(out)


def plot(rows: List[Dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows}, key=["hier", "flat", "ddp"].index)
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        mine = [r for r in rows if r["mode"] == mode and r["excess_loss"] is not None]
        base = [r for r in mine if r["rate"] == 0]
        series = sorted({(r["model"], r["fill"]) for r in mine if r["rate"] > 0})
        for model, fill in series:
            pts = base + [r for r in mine if (r["model"], r["fill"]) == (model, fill)]
            pts.sort(key=lambda r: r["rate"])
            ax.plot([100 * r["rate"] for r in pts], [r["excess_loss"] for r in pts], marker="o",
                    linestyle="-" if model == "bernoulli" else "--", label=f"{model}, {fill}")
        ax.set_title(f"{mode}: loss on the slow links")
        ax.set_xlabel("packet loss rate (%)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final eval loss − entropy floor (nats)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_sweep(cfg: Config, overrides: List[str]) -> int:
    out = Path(cfg.sweep.out or Path(cfg.run.dir) / "sweep")
    out.mkdir(parents=True, exist_ok=True)
    base = [*overrides, *workload_overrides(cfg)]
    cells = grid(cfg)
    print(f"sweep: {len(cells)} runs -> {out}", flush=True)
    rows = []
    t0 = time.time()
    for i, cell in enumerate(cells):
        row = run_cell(cfg, base, cell, out / "runs" / f"{i:03d}_{cell['mode']}_{cell['model']}_{cell['fill']}_{cell['rate']}")
        rows.append(row)
        print(f"[{i + 1}/{len(cells)} {time.time() - t0:.0f}s] {cell['mode']:4s} {cell['model']:15s} {cell['fill']:7s} "
              f"loss {cell['rate']:.0%}: excess {row['excess_loss']}, consistent {row['consistent']}", flush=True)
    (out / "sweep.json").write_text(json.dumps({"rows": rows, "wall_s": time.time() - t0}, indent=2))
    md = table(rows)
    (out / "sweep.md").write_text(md + "\n")
    plot(rows, out / "sweep.png")
    print(md)
    print(f"sweep: table {out / 'sweep.md'}, {out / 'sweep.json'}; plot {out / 'sweep.png'}; {time.time() - t0:.0f} s")
    bad = [r for r in rows if any(c != 0 for c in r["exit_codes"].values())]
    return 1 if bad else 0
