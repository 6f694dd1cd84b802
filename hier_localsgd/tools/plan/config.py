"""``plan.*``: the planner's own config sections, the tables it reads (dtypes, presets), and
the fields that moved to the shared sections (:data:`MOVED`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

from hier_localsgd.core.runtime.choices import TOPK2_STEP_COST
from hier_localsgd.sync.sections import MODES


DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "fp16": 2,
    "float8": 1, "fp8": 1,
}
SHARDINGS = ("replicate", "fsdp")
# The report's columns: the modes from the least to the most machinery.
REPORT_ORDER = tuple(reversed(MODES))

# Models that are not torchtitan Llama3 flavors. Llama-7B (Llama 1 and Llama 2 7B share
# the shapes): published count 6,738,415,616 parameters.
PRESETS: Dict[str, Dict[str, Any]] = {
    "llama_7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000),
    # Llama-3.2-1B's shapes (published 1.24 B parameters with the output tied to the
    # embeddings; counted untied here, as the planner counts every model: 1.50 B).
    "llama_1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256),
}

HEADER = "hier-localsgd plan"


# ----------------------------------------------------------------------------- config
@dataclass
class PlanModelConfig:
    """The model. ``flavor`` names a torchtitan Llama3 flavor (``debugmodel``, ``8B``,
    ``70B``, ``405B``; a ``llama3_`` prefix is accepted) or a preset (``llama_7b``, ``llama_1b``);
    "" means explicit dims only. Any non-zero field overrides the flavor's value."""

    flavor: str = "debugmodel"
    dim: int = 0
    n_layers: int = 0
    n_heads: int = 0
    n_kv_heads: int = 0  # 0: the flavor's, else n_heads
    ffn_dim: int = 0  # 0: torchtitan's rule from dim, ffn_dim_multiplier and multiple_of
    multiple_of: int = 0  # 0: the flavor's, else 256
    ffn_dim_multiplier: float = 0.0  # 0: the flavor's (none for most)
    vocab_size: int = 0
    tied_embeddings: bool = False


@dataclass
class PlanTrainConfig:
    """The precision and optimizer of the planned deployment (its batch and sequence length
    are ``train.batch_size`` and ``train.seq_len``, as for every command)."""

    param_dtype: str = "float32"
    grad_dtype: str = "float32"
    optimizer_dtype: str = "float32"
    optimizer_states: int = 2  # AdamW: exp_avg, exp_avg_sq
    activation_dtype: str = "float32"
    rollback_snapshot: bool = True  # this project keeps a copy of the inner optimizer state for rollback
    sync_dtype: str = "float32"  # of the synced tensors (pseudo-gradients, gradients, broadcast model); this project syncs float32


@dataclass
class HardwareConfig:
    """Per rank. Default: an H100 SXM (989 dense bf16 TFLOP/s) at 40 % MFU, 80 GiB."""

    peak_tflops: float = 989.0
    mfu: float = 0.4
    memory_gib: float = 80.0
    step_time_s: float = 0.0  # >0: use this measured compute time per step instead of FLOPs / (peak x MFU)
    ddp_overlap: float = 0.0  # fraction of the ddp all-reduce hidden behind the backward pass


@dataclass
class ScalingConfig:
    """Chinchilla parametric fit (Hoffmann et al. 2022, approach 3); C = flops_per_param_token x N x D."""

    budget_flops: float = 1.23e22
    E: float = 1.69
    A: float = 406.4
    B: float = 410.7
    alpha: float = 0.34
    beta: float = 0.28
    flops_per_param_token: float = 6.0


@dataclass
class PlanConfig:
    """``plan.*``: only what is the planner's own. The deployment (C x R x G, H values and
    algorithms, links, batch) is the shared ``topology``, ``sync``, ``links`` and ``train``
    sections that every command reads (tools/deployment.py); ``simulate`` reads this
    section's model, precision and hardware too."""

    model: PlanModelConfig = field(default_factory=PlanModelConfig)
    train: PlanTrainConfig = field(default_factory=PlanTrainConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    sharding: str = "replicate"  # replicate: every rank holds and syncs the whole model; fsdp: 1/G each
    round_overhead_s: float = 0.0  # fixed cost per sync round and level (quorum, commit vote); calibrate from a benchmark
    target_comm_fraction: float = 0.05  # the recommendation's goal
    inner_share: float = 0.5  # share of the sync budget given to the inner level in the recommendation
    # Steps topk2 needs to the same loss as a multiple of fp32's: the outer pick's loss cost
    # (tools/plan/pick.py; 2.0 is a calibration on the demo workload, docs/benchmarks.md).
    topk2_step_cost: float = TOPK2_STEP_COST
    json_name: str = "plan.json"


# Fields that moved out of ``plan.*`` (issue #12): plan reads the shared sections. An override
# of one fails naming its new home (config.py, ``check_moved``); longest prefix wins, the rest
# of the key is kept (plan.network.wan.latency_ms -> links.outer.latency_ms).
MOVED: Dict[str, str] = {
    "plan.topology": "topology",
    "plan.topology.sharding": "plan.sharding",
    "plan.network": "links.inner / links.outer (bandwidth_gbps, latency_ms) and plan.round_overhead_s",
    "plan.network.lan": "links.inner",
    "plan.network.wan": "links.outer",
    "plan.network.round_overhead_s": "plan.round_overhead_s",
    "plan.train.batch_size": "train.batch_size",
    "plan.train.seq_len": "train.seq_len",
    "plan.sync": "sync (H values and algorithms), plan.train.sync_dtype, plan.target_comm_fraction, plan.inner_share",
    "plan.sync.h_inner": "sync.inner.every",
    "plan.sync.h_outer": "sync.outer.every",
    "plan.sync.h_flat": "sync.flat.every",
    "plan.sync.inner_algorithm": "sync.inner.algorithm",
    "plan.sync.outer_algorithm": "sync.outer.algorithm",
    "plan.sync.flat_algorithm": "sync.flat.algorithm",
    "plan.sync.dtype": "plan.train.sync_dtype",
    "plan.sync.target_comm_fraction": "plan.target_comm_fraction",
    "plan.sync.inner_share": "plan.inner_share",
}
