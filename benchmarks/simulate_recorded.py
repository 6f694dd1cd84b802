"""The simulator against the heterogeneous runs recorded in docs/benchmarks.md, without
running them again: each recorded setting's measured loop time, per-cluster rates and
pushes, next to the simulator's prediction with the server's grace window
(``sync.async_outer.grace_s``, its default 2 s; tools/simulate/batches.py) and without it
(``grace_s=0``: a version per push, the simulator before the window was modelled).

As benchmarks/heterogeneous.py does: ``plan.round_overhead_s`` is fitted on each recorded
run's all-1.0 seed-0 loop time (a calibration; the recorded loop times are rounded to
0.1 s, so a fit can differ from the recorded one by about 1 ms), and every other setting is
a prediction. The grace window's rule has no fitted parameter.

    python benchmarks/simulate_recorded.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import heterogeneous as H  # noqa: E402

from hier_localsgd.config import load_config  # noqa: E402
from hier_localsgd.train.model import build_model  # noqa: E402

ASYNC = ["sync.async_outer.enabled=true"]
PACED = [*ASYNC, "sync.async_outer.match_pace=true"]
# docs/benchmarks.md, "Clusters of different speeds" (2 x 2, tiny model, 200 steps, H 5/4,
# 0.05 s steps / speed): (extra, the all-1.0 seed-0 loop s, {speeds: (loop s median,
# steps/s per cluster median, pushes merged per cluster median or None)})
Measured = Dict[str, Tuple[float, List[float], Optional[List[str]]]]
RECORDED: List[Tuple[str, List[str], float, Measured]] = [
    ("asynchronous", ASYNC, 11.2, {"[1.0,0.5]": (21.7, [17.72, 9.21], None), "[1.0,0.7,0.4]": (26.6, [17.24, 12.41, 7.51], None)}),
    ("matched paces, first run", PACED, 12.9, {"[1.0,0.5]": (21.9, [17.30, 9.15], ["10", "13-14"]),
                                              "[1.0,0.7,0.4]": (26.8, [16.88, 12.50, 7.47], ["10", "13", "18-19"])}),
    ("matched paces, second run", PACED, 11.3, {"[1.0,0.5]": (22.2, [17.16, 9.00], ["10", "13"]),
                                               "[1.0,0.7,0.4]": (29.5, [13.48, 10.40, 6.79], ["10", "13", "17"])}),
]


def main() -> None:
    cfg = load_config(["model=tiny"], validate_for="demo")  # the runs' model (heterogeneous.py's demo: model=tiny)
    params = sum(p.numel() for p in build_model(cfg.model.name, 256, cfg.train.seq_len, cfg.model.dim, 0).parameters())
    print("| recorded runs | speeds | grace | fitted overhead ms | loop s: measured, simulated | steps/s per cluster: measured, simulated | pushes per cluster: measured, simulated |")
    print("|---|---|---|---|---|---|---|")
    for name, extra, calib_loop, measured in RECORDED:
        for grace in (0.0, 2.0):
            args = argparse.Namespace(clusters=2, steps=200, h_inner=5, h_outer=4, step_s=0.05, extra=[*extra, f"sync.async_outer.grace_s={grace}"])
            overhead = H.calibrate(args, "[]", params, calib_loop)
            for speeds, (loop, rates, pushes) in measured.items():
                sim, pushes_at = H.simulate(args, speeds, params, overhead)
                n = len(rates)
                sim_rates = [args.steps / sim.cluster_end_s[c] if sim.cluster_end_s[c] < float("inf") else sim.final_step / sim.end_s for c in range(n)]
                print(f"| {name} | {speeds} | {grace:g} s | {overhead * 1e3:.1f} | {loop}, {sim.end_s:.1f} | "
                      f"{' / '.join(f'{x:.2f}' for x in rates)}, {' / '.join(f'{x:.2f}' for x in sim_rates)} | "
                      f"{' / '.join(pushes) if pushes else '–'}, {' / '.join(str(len(pushes_at.get(c, []))) for c in range(n))} |")


if __name__ == "__main__":
    main()
