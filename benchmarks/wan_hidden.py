"""Modelled (the planner's model, not a measurement): the share of the outer round's WAN time
that runs behind compute, per payload, for Llama-7B and Llama-1B on 4 clusters x 8 groups
(issue #29's "at scale" figures).

    python benchmarks/wan_hidden.py

For each model x WAN rate x payload (fp32, int8, topk2) it takes the planner's least exposed
variant without fragments (the overlap delay D that hides the most, tools/plan/pick.py) and
prints its outer round, D and the hidden share ``min(round, D·(H_inner·step + inner)) / round``.
"""

from __future__ import annotations

from hier_localsgd.config import load_config
from hier_localsgd.tools.plan.planner import make_plan

MODELS = ("llama_7b", "llama_1b")
WANS = (1.0, 0.1)  # Gbit/s
COMMON = ["train.seq_len=4096", "train.batch_size=1", "plan.train.activation_dtype=bfloat16", "topology.clusters=4",
          "topology.replicas_per_cluster=8", "links.outer.latency_ms=20", "links.inner.bandwidth_gbps=10"]


def main() -> None:
    print("| model | WAN | step (modelled) | payload | outer round | best D | WAN time hidden behind compute |")
    print("|---|---|---|---|---|---|---|")
    for model in MODELS:
        for gbps in WANS:
            plan = make_plan(load_config([f"plan.model.flavor={model}", f"links.outer.bandwidth_gbps={gbps}", *COMMON], validate_for="plan"))
            rows = plan["outer_pick"]["rows"]
            step = plan["step_time_s"]
            for comp in ("none", "int8", "topk2"):
                mine = [r for r in rows if r["compression"] == comp and r["fragments"] == 1]
                best = max(mine, key=lambda r: (r["wan_hidden_fraction"], -r["delay"]))
                name = {"none": "fp32", "int8": "int8", "topk2": "topk2 (4/256)"}[comp]
                step_cell = f"{step:.3f} s" if isinstance(step, float) else "-"
                print(f"| {model} | {gbps * 1000:g} Mbit/s | {step_cell} | {name} | {best['outer_round_s']:.1f} s | {best['delay']} | "
                      f"{best['wan_hidden_fraction']:.1%} |")


if __name__ == "__main__":
    main()
