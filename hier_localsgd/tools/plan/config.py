"""``plan.*``: the planner's config sections and the tables it reads (dtypes, presets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

from hier_localsgd import costs
from hier_localsgd.sync.types import MODES


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
}

HEADER = "hier-localsgd plan"


# ----------------------------------------------------------------------------- config
@dataclass
class PlanModelConfig:
    """The model. ``flavor`` names a torchtitan Llama3 flavor (``debugmodel``, ``8B``,
    ``70B``, ``405B``; a ``llama3_`` prefix is accepted) or a preset (``llama_7b``);
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
class PlanTopologyConfig:
    clusters: int = 2
    replicas_per_cluster: int = 2
    ranks_per_replica: int = 1  # G
    sharding: str = "replicate"  # replicate: every rank holds and syncs the whole model; fsdp: 1/G each


@dataclass
class NetworkLink:
    """A physical link's figures (not the emulated ``links.<level>`` of emulation/)."""

    bandwidth_gbps: float = 10.0  # Gbit/s available to one rank
    latency_ms: float = 0.1  # one way

    def alpha_beta(self) -> Tuple[float, float]:
        """(latency in s, bandwidth in bytes/s): the arguments of :mod:`hier_localsgd.costs`."""
        return self.latency_ms / 1e3, costs.gbps_to_Bps(self.bandwidth_gbps)


@dataclass
class NetworkConfig:
    """Default figures of issue #6: LAN 10 Gbit/s, 0.1 ms; WAN 1 Gbit/s, 20 ms."""

    lan: NetworkLink = field(default_factory=lambda: NetworkLink(10.0, 0.1))
    wan: NetworkLink = field(default_factory=lambda: NetworkLink(1.0, 20.0))
    round_overhead_s: float = 0.0  # fixed cost per sync round and level (quorum, commit vote); calibrate from a benchmark


@dataclass
class PlanTrainConfig:
    batch_size: int = 4  # sequences per rank per step
    seq_len: int = 64
    param_dtype: str = "float32"
    grad_dtype: str = "float32"
    optimizer_dtype: str = "float32"
    optimizer_states: int = 2  # AdamW: exp_avg, exp_avg_sq
    activation_dtype: str = "float32"
    rollback_snapshot: bool = True  # this project keeps a copy of the inner optimizer state for rollback


@dataclass
class PlanSyncConfig:
    h_inner: int = 10
    h_outer: int = 3
    h_flat: int = 0  # 0: h_inner * h_outer (the flat baseline syncs as often as the outer level)
    inner_algorithm: str = "localsgd"
    outer_algorithm: str = "diloco"
    flat_algorithm: str = "diloco"
    dtype: str = "float32"  # of the synced tensors (pseudo-gradients, gradients, broadcast model)
    target_comm_fraction: float = 0.05
    inner_share: float = 0.5  # share of the sync budget given to the inner level in the recommendation


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
    model: PlanModelConfig = field(default_factory=PlanModelConfig)
    topology: PlanTopologyConfig = field(default_factory=PlanTopologyConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    train: PlanTrainConfig = field(default_factory=PlanTrainConfig)
    sync: PlanSyncConfig = field(default_factory=PlanSyncConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    json_name: str = "plan.json"


