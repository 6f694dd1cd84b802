"""``simulate.*``: the simulator's own config sections (the model of the deployment is in
engine.py's docstring), and the fields that moved to the shared sections (:data:`MOVED`).

The deployment it simulates is the one every command reads (tools/deployment.py):
``topology``, ``sync``, ``links``, ``train`` (batch, sequence length), ``timeouts`` and the
lighthouse's ``heartbeat_timeout_ms``/``join_timeout_ms``; the model, precision and
hardware are ``plan.*``, as for ``hier-localsgd plan``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List


FAILURE_MODELS = ("independent", "chaos", "none")
INF = math.inf


# ----------------------------------------------------------------------------- config
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


@dataclass
class SimulateConfig:
    """``simulate.*``: failures and the run's horizon; everything else is the shared deployment."""

    params: int = 0  # >0: the model's parameter count (plan.model is then ignored; needs plan.hardware.step_time_s)
    step_jitter: float = 0.0  # relative standard deviation of a round's compute time, per cluster and round
    failures: FailureConfig = field(default_factory=FailureConfig)
    duration_s: float = 0.0  # >0: simulated wall time (the run ends at the first outer commit after it); 0: train.steps steps
    # >0: the synchronous rounds' worth of merged work at which the global model reaches its
    # target loss (target.py: a calibration from a synchronous run of the workload); 0: none
    target_rounds: float = 0.0
    seed: int = 0
    runs: int = 1  # seeds seed .. seed+runs-1; figures are means over runs
    sensitivity: List[float] = field(default_factory=lambda: [0.0, 1.0, 10.0, 100.0, 1000.0])  # failure-rate factors
    plot: bool = True
    json_name: str = "simulate.json"
    plot_name: str = "simulate.png"


# Fields that moved out of ``simulate.*`` (issue #12); see tools/plan/config.py's MOVED.
MOVED: Dict[str, str] = {
    "simulate.topology": "topology",
    "simulate.topology.sharding": "plan.sharding",
    "simulate.model": "plan.model",
    "simulate.train": "plan.train",
    "simulate.train.batch_size": "train.batch_size",
    "simulate.train.seq_len": "train.seq_len",
    "simulate.hardware": "plan.hardware",
    "simulate.network": "links.inner / links.outer (bandwidth_gbps, latency_ms) and plan.round_overhead_s",
    "simulate.network.lan": "links.inner",
    "simulate.network.wan": "links.outer",
    "simulate.network.round_overhead_s": "plan.round_overhead_s",
    "simulate.sync": "sync (mode, H values, min_replicas, min_clusters) and plan.train.sync_dtype",
    "simulate.sync.mode": "sync.mode",
    "simulate.sync.h_inner": "sync.inner.every",
    "simulate.sync.h_outer": "sync.outer.every",
    "simulate.sync.h_flat": "sync.flat.every",
    "simulate.sync.dtype": "plan.train.sync_dtype",
    "simulate.sync.min_replicas": "sync.min_replicas",
    "simulate.sync.min_clusters": "sync.min_clusters",
    "simulate.steps": "train.steps (with simulate.duration_s=0, the default)",
    "simulate.timeouts": "timeouts (seconds) and lighthouse.heartbeat_timeout_ms / join_timeout_ms",
    "simulate.timeouts.heartbeat_s": "lighthouse.heartbeat_timeout_ms (milliseconds)",
    "simulate.timeouts.join_s": "lighthouse.join_timeout_ms (milliseconds)",
    "simulate.timeouts.inner_quorum_s": "timeouts.inner_quorum",
    "simulate.timeouts.outer_quorum_s": "timeouts.outer_quorum",
    "simulate.timeouts.inner_reduce_s": "timeouts.inner_reduce",
    "simulate.timeouts.outer_reduce_s": "timeouts.outer_reduce",
    "simulate.timeouts.local_step_s": "timeouts.local_step",
    "simulate.timeouts.watchdog_grace_s": "timeouts.watchdog_grace",
    "simulate.timeouts.startup_s": "timeouts.startup",
}
