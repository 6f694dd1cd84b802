"""``simulate.*``: the simulator's own config sections (the model of the deployment is in engine.py's docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List

from hier_localsgd.core.timeouts import Timeouts
from hier_localsgd.launch.lighthouse import LighthouseConfig
from hier_localsgd.tools.plan.config import HardwareConfig, NetworkConfig, PlanModelConfig, PlanTopologyConfig, PlanTrainConfig


FAILURE_MODELS = ("independent", "chaos", "none")
INF = math.inf


# ----------------------------------------------------------------------------- config
@dataclass
class SimSyncConfig:
    mode: str = "hier"  # hier | flat | ddp
    h_inner: int = 100  # the defaults suit the default deployment (plan's recommendation for ~5 %)
    h_outer: int = 20
    h_flat: int = 0  # flat: steps per sync; 0 = h_inner * h_outer. ddp always syncs every step.
    dtype: str = "bfloat16"  # of the synced tensors
    min_replicas: int = 1
    min_clusters: int = 1


@dataclass
class FailureConfig:
    model: str = "independent"  # independent | chaos | none (the kills list applies with any)
    mtbf_s: float = 2.28e7  # per replica group (independent); default: one 8-GPU node in Llama 3's 54-day run (~6,300 h)
    cluster_mtbf_s: float = 0.0  # per cluster, whole-cluster outages (independent); 0 = none
    kill_every_s: float = 30.0  # chaos: mean seconds between kills, whole job
    roles: List[str] = field(default_factory=lambda: ["non_leader", "leader", "cluster"])  # chaos
    stop_kills_at: float = 1.0  # chaos/independent: no failures after this fraction of the run
    kills: List[str] = field(default_factory=list)  # explicit: "t:c" (cluster c), "t:c:r"; "sK:c[:r]" at local step K
    hang_fraction: float = 0.0  # share of failures that are hangs instead of crashes
    restart_s: float = 60.0  # failure -> process back (scheduler restart delay + start-up)
    heal_s: float = -1.0  # a restarted replica group's heal from a peer; <0: its state bytes over the LAN
    outer_heal_s: float = -1.0  # a new or stale cluster manager's heal from another cluster; <0: over the WAN
    reconfigure_s: float = 0.0  # process-group reconfiguration when a quorum's membership changes


_DEFAULT_TIMEOUTS = Timeouts()

@dataclass
class SimTimeoutsConfig:
    """Seconds; the project's defaults (phase timeouts from :class:`Timeouts`, the lighthouse's from its section)."""

    heartbeat_s: float = LighthouseConfig.heartbeat_timeout_ms / 1000  # lighthouse.heartbeat_timeout_ms
    join_s: float = LighthouseConfig.join_timeout_ms / 1000  # lighthouse.join_timeout_ms
    inner_quorum_s: float = _DEFAULT_TIMEOUTS.inner_quorum.total_seconds()
    outer_quorum_s: float = _DEFAULT_TIMEOUTS.outer_quorum.total_seconds()
    inner_reduce_s: float = _DEFAULT_TIMEOUTS.inner_reduce.total_seconds()
    outer_reduce_s: float = _DEFAULT_TIMEOUTS.outer_reduce.total_seconds()
    local_step_s: float = _DEFAULT_TIMEOUTS.local_step.total_seconds()
    watchdog_grace_s: float = _DEFAULT_TIMEOUTS.watchdog_grace.total_seconds()
    startup_s: float = _DEFAULT_TIMEOUTS.startup.total_seconds()


@dataclass
class SimulateConfig:
    topology: PlanTopologyConfig = field(default_factory=lambda: PlanTopologyConfig(clusters=64, replicas_per_cluster=16, ranks_per_replica=8, sharding="fsdp"))
    model: PlanModelConfig = field(default_factory=lambda: PlanModelConfig(flavor="8B"))
    params: int = 0  # >0: the model's parameter count (model is then ignored; needs hardware.step_time_s)
    step_jitter: float = 0.0  # relative standard deviation of a round's compute time, per cluster and round
    train: PlanTrainConfig = field(default_factory=lambda: PlanTrainConfig(batch_size=1, seq_len=8192, param_dtype="float32"))
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    sync: SimSyncConfig = field(default_factory=SimSyncConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    timeouts: SimTimeoutsConfig = field(default_factory=SimTimeoutsConfig)
    duration_s: float = 24 * 3600.0  # simulated wall time (the run ends at the first outer commit after it)
    steps: int = 0  # >0: instead, run until every replica group has done this many steps
    seed: int = 0
    runs: int = 1  # seeds seed .. seed+runs-1; figures are means over runs
    sensitivity: List[float] = field(default_factory=lambda: [0.0, 1.0, 10.0, 100.0, 1000.0])  # failure-rate factors
    plot: bool = True
    json_name: str = "simulate.json"
    plot_name: str = "simulate.png"


