"""The config sections of the experiment drivers (demo, chaos, sweep, bench, tp-sweep), with their checks.

Only dataclasses and the names they are checked against, so that the root config
(hier_localsgd/config.py) can compose them although the drivers themselves sit above
it (they load configurations of their own: a baseline, a flat comparison, each arm).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from hier_localsgd.core.runtime.faults import ROLES
from hier_localsgd.core.runtime.phases import Phase
from hier_localsgd.experiments.chaos_faults import KINDS
from hier_localsgd.errors import fail
from hier_localsgd.sync.sections import MODES

# bench.py; hier_int8 / hier_overlap_int8: hier / hier_overlap with sync.outer.compression=int8;
# *_fragF: with F streaming fragments (sync.outer.fragments=F; bench.h_outer a multiple of F, overlapped >= 2F)
# hier_overlap_eager: hier_overlap with eager updates (sync.outer.eager=true); hier_auto: sync.outer.auto=true
ARMS = ("ddp", "flat_budget", "flat_count", "flat_overlap", "flat_overlap_frag3", "flat_3x", "flat_half", "flat_overlap_3x", "flat_overlap_half", "hier", "hier_overlap", "hier_overlap_eager", "hier_auto", "hier_async", "hier_async_overlap", "hier_int8", "hier_overlap_int8",
        "hier_frag2", "hier_overlap_int8_frag2", "hier_overlap_int8_frag3")


@dataclass
class DemoConfig:
    summary: str = ""  # default: <run.dir>/summary.json
    timeout_s: float = 600.0
    progress: bool = True
    free_ports: bool = True
    dashboard: bool = True  # serve the live dashboard alongside and print its URL


@dataclass
class ChaosConfig:
    seed: int = 0
    kill_every_s: float = 30.0  # mean time between kills (exponential intervals)
    kill_every_steps: int = 0  # > 0: faults on training progress instead (mean local steps between them)
    roles: List[str] = field(default_factory=lambda: ["non_leader", "leader", "cluster"])
    restart_delay_s: float = 2.0
    stop_kills_at: float = 0.8  # no kills once every process has passed this fraction of the steps
    baseline: bool = True  # run a failure-free job with the same seed first
    report: str = ""  # JSON report path; "" = <run.dir>/chaos_report.json
    timeout_s: float = 1200.0
    # Fault kinds drawn by the schedule (chaos_faults.py); partition needs network namespaces.
    kinds: List[str] = field(default_factory=lambda: ["kill", "phase_kill", "multi_kill", "hang", "lighthouse", "partition", "poison"])
    phase_targets: List[str] = field(default_factory=lambda: ["leader:OUTER_REDUCE", "non_leader:BROADCAST", "leader:INNER_COMMIT"])
    phase_arm_s: float = 30.0  # a phase_kill fires in any phase after this long
    hang_s: float = 10.0  # SIGSTOP duration of a hang
    lighthouse_down_s: float = 10.0  # a killed lighthouse is restarted after this long
    partition_s: float = 10.0  # how long a partitioned cluster stays cut off
    compare_flat: bool = False  # run the same schedule against sync.mode=flat and compare
    # random: each fault drawn with the seed from the job's state; cycle: kinds in order;
    # plan: the whole schedule (steps, kinds, replica groups) drawn before the run (chaos_plan.py)
    draw: str = "random"
    warm_spare: bool = True  # restarts run in a process with the training stack already imported (spare.py)

    def check(self) -> None:
        for i, role in enumerate(self.roles):
            if role not in ROLES:
                fail(f"chaos.roles[{i}]", f"unknown role {role!r} (expected one of {ROLES})")
        if not self.roles:
            fail("chaos.roles", "needs at least one role")
        if self.kill_every_s <= 0:
            fail("chaos.kill_every_s", f"{self.kill_every_s} — must be positive")
        if isinstance(self.kill_every_steps, bool) or self.kill_every_steps < 0:
            fail("chaos.kill_every_steps", f"{self.kill_every_steps} — must be 0 (wall-clock schedule) or a number of steps")
        if not 0 < self.stop_kills_at <= 1:
            fail("chaos.stop_kills_at", f"{self.stop_kills_at} — must be in (0, 1]")
        if self.restart_delay_s < 0:
            fail("chaos.restart_delay_s", f"{self.restart_delay_s} — must be at least 0")
        for i, k in enumerate(self.kinds):
            if k not in KINDS:
                fail(f"chaos.kinds[{i}]", f"{k!r} — expected one of {KINDS}")
        if not self.kinds:
            fail("chaos.kinds", "empty — name at least one fault kind")
        if self.draw not in ("random", "cycle", "plan"):
            fail("chaos.draw", f"{self.draw!r} — expected random, cycle or plan")
        for i, pt in enumerate(self.phase_targets):
            role, _, phase = str(pt).partition(":")
            if role not in ("leader", "non_leader") or phase not in Phase.__members__:
                fail(f"chaos.phase_targets[{i}]", f"{pt!r} — expected ROLE:PHASE with ROLE leader|non_leader and PHASE one of {sorted(Phase.__members__)}")
        for fname in ("phase_arm_s", "hang_s", "lighthouse_down_s", "partition_s"):
            if getattr(self, fname) <= 0:
                fail(f"chaos.{fname}", f"{getattr(self, fname)} — must be positive (seconds)")


@dataclass
class SweepConfig:
    rates: List[float] = field(default_factory=lambda: [0.0, 0.05, 0.2])
    models: List[str] = field(default_factory=lambda: ["bernoulli", "gilbert_elliott"])
    fills: List[str] = field(default_factory=lambda: ["zero", "stale", "rescale"])
    modes: List[str] = field(default_factory=lambda: ["hier", "flat", "ddp"])
    burst: float = 4.0  # gilbert_elliott mean burst length in packets
    where: str = "per_sender"
    workload: str = "tiny"  # tiny | config
    steps: int = 120  # with workload=tiny
    large: bool = False  # more loss rates
    out: str = ""  # "" = <run.dir>/sweep
    timeout_s: float = 600.0  # per run

    def check(self) -> None:
        for i, r in enumerate(self.rates):
            if not 0 <= r < 1:
                fail(f"sweep.rates[{i}]", f"{r} — a loss rate must be in [0, 1)")
        for i, m in enumerate(self.models):
            if m not in ("bernoulli", "gilbert_elliott"):
                fail(f"sweep.models[{i}]", f"unknown loss model {m!r} (expected bernoulli or gilbert_elliott)")
        for i, f in enumerate(self.fills):
            if f not in ("zero", "stale", "rescale"):
                fail(f"sweep.fills[{i}]", f"unknown fill {f!r} (expected zero, stale or rescale)")
        for i, m in enumerate(self.modes):
            if m not in MODES:
                fail(f"sweep.modes[{i}]", f"unknown mode {m!r} (expected one of {MODES})")
        if self.burst < 1:
            fail("sweep.burst", f"{self.burst} — a mean burst is at least 1 packet")
        if self.workload not in ("tiny", "config"):
            fail("sweep.workload", f"{self.workload!r} — expected tiny or config")
        if self.workload == "tiny" and (self.steps < 10 or self.steps % 10):
            fail("sweep.steps", f"{self.steps} — must be a positive multiple of 10 (the tiny workload syncs every 5 and 10 steps)")


@dataclass
class BenchConfig:
    mode: str = "quick"  # quick (tiny model, minutes) | full (debugmodel, < 30 min on 2 cores)
    arms: List[str] = field(default_factory=lambda: ["ddp", "flat_budget", "flat_count", "hier"])
    lan_gbps: float = 10.0
    lan_latency_ms: float = 0.1
    wan_gbps: float = 1.0
    wan_latency_ms: float = 20.0
    target_margin: float = 0.02  # target loss = the ddp arm's final eval loss + this
    target_loss: float = 0.0  # > 0: use this target instead
    h_inner: int = 0  # 0 = the mode's preset (quick 5, full 10); the workload's H overrides sync.*.every
    h_outer: int = 0  # 0 = the mode's preset (quick 2, full 3)
    out: str = ""  # "" = <run.dir>/bench
    timeout_s: float = 1800.0  # per arm
    # kernel: each cluster in its own network namespace, the WAN shaped by tbf, no user-space bandwidth (bench.py)
    links: str = "emulated"  # emulated | kernel
    seeds: List[int] = field(default_factory=lambda: [0])  # bench_sweep.py: >= 3 for medians and spread
    sweep_gbps: List[float] = field(default_factory=list)  # non-empty: the sweep over WAN rates (bench_sweep.py)
    pilot_seed: int = 1000  # the pilot run that fixes the sweep's target loss
    chaos: bool = False  # the sweep also runs hier and flat under one chaos.* fault schedule (bench_chaos.py)
    chaos_steps: int = 600  # that run's steps per replica group

    def check(self) -> None:
        if self.mode not in ("quick", "full"):
            fail("bench.mode", f"{self.mode!r} — expected quick or full")
        for i, a in enumerate(self.arms):
            if a not in ARMS:
                fail(f"bench.arms[{i}]", f"unknown arm {a!r} (expected one of {ARMS})")
        for name in ("lan_gbps", "wan_gbps"):
            if getattr(self, name) <= 0:
                fail(f"bench.{name}", f"{getattr(self, name)} — a bandwidth must be positive")
        for name in ("lan_latency_ms", "wan_latency_ms", "target_margin", "target_loss", "h_inner", "h_outer"):
            if getattr(self, name) < 0:
                fail(f"bench.{name}", f"{getattr(self, name)} — must be at least 0")
        if self.links not in ("emulated", "kernel"):
            fail("bench.links", f"{self.links!r} — expected emulated or kernel")
        for i, g in enumerate(self.sweep_gbps):
            if g <= 0:
                fail(f"bench.sweep_gbps[{i}]", f"{g} — a bandwidth must be positive")
        if self.chaos_steps < 1:
            fail("bench.chaos_steps", f"{self.chaos_steps} — must be at least 1")
        if not self.seeds or self.pilot_seed in self.seeds:
            fail("bench.seeds" if not self.seeds else "bench.pilot_seed", "needs a seed, and a pilot seed outside bench.seeds")


SWEEP_OPS = ("attn_fwd", "attn_bwd", "mlp_fwd", "mlp_bwd", "all")


@dataclass
class TPSweepConfig:
    rates: List[float] = field(default_factory=lambda: [0.0, 0.001, 0.01, 0.05, 0.1])
    models: List[str] = field(default_factory=lambda: ["bernoulli", "gilbert_elliott"])
    ops: List[str] = field(default_factory=lambda: list(SWEEP_OPS))
    burst: float = 4.0  # gilbert_elliott mean burst (packets)
    variant: str = "megatron"  # megatron | naive
    fill: str = "zero"  # the TP links' fill: zero | stale | rescale (rescale: all-reduces only)
    where: str = "per_sender"  # per_sender (ranks stay identical) | per_receiver
    degree: int = 2  # TP degree (processes)
    model: str = "llama3_debugmodel"
    layers: int = 2  # transformer layers (0: the flavor's)
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 3e-3
    eval_batches: int = 8
    seed: int = 0  # weights and loss streams
    tolerance: float = 0.05  # tolerated: excess loss <= (1 + tolerance) x lossless excess
    dp: bool = False  # also train data-parallel with a lossy gradient all-reduce (same rates/models)
    dp_fill: str = "rescale"
    large: bool = False  # a larger grid: loss rates up to 50 % (LARGE_RATES)
    quick: bool = False  # tests: a small grid and a few steps (aimed at < 60 s)
    out: str = ""  # "" = <run.dir>/tp_sweep
    timeout_s: float = 120.0  # per collective


def check_tp_sweep(sw: "TPSweepConfig") -> None:
    """Checks ``tp_sweep.*``; raises ValueError naming the field."""
    from hier_localsgd.core.links.lossy import FILLS, WHERE, check_sweep_grid
    from hier_localsgd.train.sections import VARIANTS

    def err(name: str, msg: str) -> None:
        raise ValueError(f"tp_sweep.{name}: {msg}")

    check_sweep_grid("tp_sweep", sw.rates, sw.models)
    for i, op in enumerate(sw.ops):
        if op not in SWEEP_OPS:
            err(f"ops[{i}]", f"unknown operation {op!r} (expected one of {SWEEP_OPS})")
    if sw.burst < 1:
        err("burst", f"{sw.burst} — a mean burst is at least 1 packet")
    if sw.variant not in VARIANTS:
        err("variant", f"{sw.variant!r} — expected one of {VARIANTS}")
    for name in ("fill", "dp_fill"):
        if getattr(sw, name) not in FILLS:
            err(name, f"{getattr(sw, name)!r} — expected one of {FILLS}")
    if sw.variant == "naive" and sw.fill == "rescale":
        err("fill", "rescale applies to all-reduces only; the naive variant all-gathers in the forward")
    if sw.where not in WHERE:
        err("where", f"{sw.where!r} — expected one of {WHERE}")
    for name in ("degree", "steps", "batch_size", "eval_batches"):
        if getattr(sw, name) < 1:
            err(name, f"{getattr(sw, name)} — must be at least 1")
    if sw.degree < 2:
        err("degree", f"{sw.degree} — tensor parallelism needs at least 2 ranks")
    if sw.dp and sw.batch_size % sw.degree:
        err("batch_size", f"{sw.batch_size} — tp_sweep.dp splits the batch over {sw.degree} ranks")
    if sw.seq_len < 2:
        err("seq_len", f"{sw.seq_len} — must be at least 2")
    if sw.layers < 0:
        err("layers", f"{sw.layers} — 0 (the flavor's) or more")
    if sw.lr <= 0 or sw.timeout_s <= 0 or sw.tolerance < 0:
        err("lr" if sw.lr <= 0 else "timeout_s" if sw.timeout_s <= 0 else "tolerance", "must be positive")
    if not sw.model.startswith("llama3_"):
        err("model", f"{sw.model!r} — tensor parallelism shards a llama3_<flavor> model")
