"""Configuration: hydra-composed YAML under ``configs/``, typed and validated here.

``load_config(overrides)`` composes ``configs/config.yaml`` (plus the ``model``
and ``data`` groups) with hydra, applying command-line overrides such as
``topology.clusters=3 sync.inner.every=20 model=tiny``; every value can be
overridden. The result is merged into the dataclass schema below, so a wrong
type or an unknown key fails naming the field, and then :func:`validate` checks
meaning (ranges, list lengths, addresses) and raises :class:`ConfigError` naming
the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from hier_localsgd.dashboard import DashboardConfig
from hier_localsgd.data import check_input
from hier_localsgd.faults import Fault
from hier_localsgd.plan import PlanConfig
from hier_localsgd.simulate import SimulateConfig
from hier_localsgd.level import ALGORITHMS
from hier_localsgd.lossy import LinkSpec, check_sweep_grid, spec_from_config
from hier_localsgd.managers import parse_address
from hier_localsgd.phases import Phase
from hier_localsgd.timeouts import Timeouts
from hier_localsgd.tp_sweep import TPSweepConfig, validate_group, validate_tp_sweep

MODES = ("hier", "flat", "ddp")
TRAINING_COMMANDS = ("train", "demo", "chaos", "sweep", "bench", "tp-sweep")  # validate() checks their data input
LAUNCHING_COMMANDS = ("demo", "chaos", "sweep", "bench")  # start a LocalJob (launcher.py)
DATA_KINDS = ("markov", "text", "parquet")
LIGHTHOUSE_ROLES = ("all", "global", "cluster")


class ConfigError(ValueError):
    """A configuration value is invalid; the message starts with the field's path."""


@dataclass
class TopologyConfig:
    clusters: int = 2
    replicas_per_cluster: int = 2
    ranks_per_replica: int = 1


@dataclass
class LevelConfig:
    algorithm: str = "diloco"
    every: int = 10  # inner: local steps per round; outer: inner rounds per outer round
    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass
class SyncConfig:
    mode: str = "hier"
    inner: LevelConfig = field(default_factory=lambda: LevelConfig(every=10))
    outer: LevelConfig = field(default_factory=lambda: LevelConfig(every=3))
    flat: LevelConfig = field(default_factory=lambda: LevelConfig(every=30))
    min_replicas: int = 1
    min_clusters: int = 2
    max_quorum_failures: int = 3
    max_commit_failures: int = 5
    # A level whose lighthouse does not answer skips its rounds and trains on; past this
    # many seconds of outage the process gives up (hier mode; outage.py).
    outage_limit_s: float = 600.0


@dataclass
class LighthouseConfig:
    global_addr: str = "http://127.0.0.1:29510"
    cluster_addrs: List[str] = field(default_factory=lambda: ["http://127.0.0.1:29511", "http://127.0.0.1:29512"])
    join_timeout_ms: int = 30000
    quorum_tick_ms: int = 100
    heartbeat_timeout_ms: int = 5000
    serve: str = "all"
    cluster: int = 0
    # Exit 0 once every replica group served here has written <run.dir>/.../result.json
    # (after this lighthouse started): for launchers that wait for every role to end (TorchX).
    until_done: bool = False
    # The local launcher and launch/lighthouses.sh restart a lighthouse that exits, at its
    # own address, after restart_delay_s; replica processes ride out the outage.
    supervise: bool = True
    restart_delay_s: float = 2.0


@dataclass
class LinkConfig:
    """One level's emulated link (hier_localsgd/lossy.py). Defaults: reliable, unthrottled."""

    loss: str = "none"  # none | bernoulli | gilbert_elliott
    p: float = 0.0  # bernoulli: loss probability; gilbert_elliott: P(good -> bad)
    r: float = 1.0  # gilbert_elliott: P(bad -> good)
    k: float = 1.0  # gilbert_elliott: P(delivered | good)
    h: float = 0.0  # gilbert_elliott: P(delivered | bad)
    netem: str = ""  # alternatively netem syntax: "loss 5%" or "loss gemodel p r 1-h 1-k" (percent)
    fill: str = "zero"  # zero | stale | rescale
    where: str = "per_sender"  # per_sender | per_receiver
    payload_bytes: int = 1472
    latency_ms: float = 0.0  # one way
    bandwidth_gbps: float = 0.0  # 0: not emulated
    seed: int = 0


@dataclass
class LinksConfig:
    inner: LinkConfig = field(default_factory=LinkConfig)
    outer: LinkConfig = field(default_factory=LinkConfig)  # also the flat and ddp baselines' links


@dataclass
class TPLinksConfig:
    """group.parallel=tp: the emulated link of each TP operation (tp.py), as links.<level>."""

    attn_fwd: LinkConfig = field(default_factory=LinkConfig)
    attn_bwd: LinkConfig = field(default_factory=LinkConfig)
    mlp_fwd: LinkConfig = field(default_factory=LinkConfig)
    mlp_bwd: LinkConfig = field(default_factory=LinkConfig)


@dataclass
class GroupConfig:
    """Inside a replica group of topology.ranks_per_replica ranks."""

    parallel: str = "dp"  # dp: every rank a whole replica on its own data | tp: the model split over the ranks (tp.py)
    tp_variant: str = "megatron"  # megatron | naive
    tp_links: TPLinksConfig = field(default_factory=TPLinksConfig)


@dataclass
class ModelConfig:
    name: str = "llama3_debugmodel"
    dim: int = 64


@dataclass
class DataConfig:
    kind: str = "markov"
    states: int = 128
    branching: int = 4
    concentration: float = 0.5
    seed: int = 1234
    path: str = ""
    text_column: str = "text"
    eval_fraction: float = 0.05


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 4
    seq_len: int = 64
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    eval_batches: int = 8
    eval_every: int = 0
    log_every: int = 10
    threads: int = 1
    seed: int = 0
    min_step_time_s: float = 0.0  # pad each local step to this duration (emulates a bigger model)


@dataclass
class RunConfig:
    dir: str = "runs/latest"
    cluster: int = 0
    replica: int = 0
    hostname: str = ""  # address peers use to reach this process; "" = socket.gethostname()
    log_level: str = "INFO"
    start_gate: str = ""  # local jobs: wait (up to timeouts.startup) for this file before training
    tensorboard: bool = True  # scalars under <run.dir>/tensorboard/c<C>r<R>
    # Local jobs: each cluster (and its lighthouse) in its own Linux network namespace on a
    # bridge, the global lighthouse in the hub's (netns.py); needs root. Enables partitions.
    netns: bool = False


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
    roles: List[str] = field(default_factory=lambda: ["non_leader", "leader", "cluster"])
    restart_delay_s: float = 2.0
    stop_kills_at: float = 0.8  # no kills once every process has passed this fraction of the steps
    baseline: bool = True  # run a failure-free job with the same seed first
    report: str = ""  # JSON report path; "" = <run.dir>/chaos_report.json
    timeout_s: float = 1200.0
    # Fault kinds drawn by the schedule (chaos_faults.py); partition needs network namespaces.
    kinds: List[str] = field(default_factory=lambda: ["kill", "phase_kill", "multi_kill", "hang", "lighthouse", "partition"])
    phase_targets: List[str] = field(default_factory=lambda: ["leader:OUTER_REDUCE", "non_leader:BROADCAST", "leader:INNER_COMMIT"])
    phase_arm_s: float = 30.0  # a phase_kill fires in any phase after this long
    hang_s: float = 10.0  # SIGSTOP duration of a hang
    lighthouse_down_s: float = 10.0  # a killed lighthouse is restarted after this long
    partition_s: float = 10.0  # how long a partitioned cluster stays cut off
    compare_flat: bool = False  # run the same schedule against sync.mode=flat and compare
    draw: str = "random"  # random: each fault's kind drawn with the seed; cycle: kinds in order


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


@dataclass
class CheckpointConfig:
    dir: str = ""  # "" = <run.dir>/checkpoints
    every: int = 0  # outer rounds between checkpoints; 0 = off
    keep: int = 3
    resume: bool = False  # continue from the newest complete checkpoint


@dataclass
class TimeoutsConfig:
    connect: float = 10
    inner_quorum: float = 60
    inner_reduce: float = 60
    inner_commit: float = 30
    outer_quorum: float = 120
    outer_reduce: float = 120
    outer_commit: float = 30
    broadcast: float = 60
    local_step: float = 120
    startup: float = 60
    watchdog_grace: float = 30
    shutdown: float = 10


@dataclass
class Config:
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    lighthouse: LighthouseConfig = field(default_factory=LighthouseConfig)
    links: LinksConfig = field(default_factory=LinksConfig)
    group: GroupConfig = field(default_factory=GroupConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)  # `hier-localsgd plan` (plan.py)
    tp_sweep: TPSweepConfig = field(default_factory=TPSweepConfig)  # `hier-localsgd tp-sweep` (tp_sweep.py)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)  # `hier-localsgd simulate` (simulate.py)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    faults: List[Dict[str, Any]] = field(default_factory=list)

    # -- derived ---------------------------------------------------------------
    def timeouts_obj(self) -> Timeouts:
        return Timeouts.from_seconds(OmegaConf.to_container(OmegaConf.structured(self.timeouts)))  # type: ignore[arg-type]

    def link_spec(self, level: str) -> LinkSpec:
        return _link_spec(f"links.{level}", getattr(self.links, level))

    def tp_link_specs(self) -> Dict[str, LinkSpec]:
        """group.tp_links as validated link specs, by TP operation."""
        return {op: _link_spec(f"group.tp_links.{op}", getattr(self.group.tp_links, op))
                for op in ("attn_fwd", "attn_bwd", "mlp_fwd", "mlp_bwd")}

    def fault_list(self) -> List[Fault]:
        return [Fault.from_mapping(i, f) for i, f in enumerate(self.faults)]

    def shard(self, rank: int = 0) -> int:
        """The data shard of (run.cluster, run.replica, rank): distinct for every rank of the job."""
        return (self.run.cluster * self.topology.replicas_per_cluster + self.run.replica) * self.topology.ranks_per_replica + rank

    @property
    def num_shards(self) -> int:
        t = self.topology
        return t.clusters * t.replicas_per_cluster * t.ranks_per_replica


def _link_spec(path: str, lc: LinkConfig) -> LinkSpec:
    return spec_from_config(
        path, lc.loss, lc.p, lc.r, lc.k, lc.h, lc.netem, lc.fill, lc.where,
        lc.payload_bytes, lc.latency_ms, lc.bandwidth_gbps, lc.seed,
    )


def config_dir() -> Path:
    """The configs/ directory (the repository's, or the installed copy)."""
    repo = Path(__file__).resolve().parent.parent / "configs"
    if (repo / "config.yaml").is_file():
        return repo
    return Path(str(resources.files("hier_localsgd.configs")))


def load_config(overrides: Sequence[str] = (), config_name: str = "config", validate_for: str = "train") -> Config:
    """Composes, types and validates the configuration.

    Args:
        overrides: hydra overrides, e.g. ``["topology.clusters=3", "model=tiny"]``.
        validate_for: which command's checks to run (see :func:`validate`).

    Raises:
        ConfigError: naming the offending field.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from hydra.core.config_store import ConfigStore

    # The dataclass schema is config.yaml's base: hydra knows every key and type, so
    # overrides of sections config.yaml leaves to their defaults (plan, simulate) work.
    ConfigStore.instance().store(name="hier_localsgd_schema", node=Config)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base=None):
            raw = compose(config_name=config_name, overrides=list(overrides))
        schema = OmegaConf.structured(Config)
        merged = OmegaConf.merge(schema, raw)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_hydra_message(e)) from e
    validate(cfg, validate_for)
    return cfg


def _hydra_message(e: BaseException) -> str:
    """The innermost OmegaConf error, led by the field it names (hydra wraps it)."""
    while e.__cause__ is not None and not getattr(e, "full_key", None):
        e = e.__cause__
    msg = str(e).strip().splitlines()[0]
    key = getattr(e, "full_key", None)
    if key and not msg.startswith(key):
        msg = f"{key}: {msg}"
    return msg


def to_overrides(cfg: Config, keys: Sequence[str]) -> List[str]:
    """Renders selected fields of ``cfg`` as hydra overrides (for launching children)."""
    c = OmegaConf.structured(cfg)
    out = []
    for k in keys:
        v = OmegaConf.select(c, k)
        if isinstance(v, (DictConfig,)):
            raise ValueError(f"{k} is a section, not a value")
        out.append(f"{k}={_render(v)}")
    return out


def _render(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if OmegaConf.is_list(v) or isinstance(v, list):
        return "[" + ",".join(_render(x) for x in v) + "]"
    return str(v)


def validate(cfg: Config, command: str = "train") -> None:
    """Semantic checks; raises :class:`ConfigError` whose message starts with the field path.

    ``command``: "train" checks the identity of this process too; "demo", "chaos"
    and "lighthouse" skip the lighthouse address list checks that they fill in. The
    commands that train (:data:`TRAINING_COMMANDS`) also check a text or parquet
    ``data.path`` itself (:func:`hier_localsgd.data.check_input`).
    """

    def err(path: str, msg: str) -> None:
        raise ConfigError(f"{path}: {msg}")

    t, s = cfg.topology, cfg.sync
    if t.clusters < 1:
        err("topology.clusters", f"{t.clusters} — need at least one cluster (empty topology)")
    if t.replicas_per_cluster < 1:
        err("topology.replicas_per_cluster", f"{t.replicas_per_cluster} — need at least one replica group per cluster (empty topology)")
    if t.ranks_per_replica < 1:
        err("topology.ranks_per_replica", f"{t.ranks_per_replica} — need at least one rank per replica group")
    if t.ranks_per_replica > 1 and s.mode != "hier":
        err("topology.ranks_per_replica", f"{t.ranks_per_replica} — several ranks per replica group need sync.mode=hier (got {s.mode!r})")
    if s.mode not in MODES:
        err("sync.mode", f"unknown mode {s.mode!r} (expected one of {MODES})")
    for name in ("inner", "outer", "flat"):
        lv: LevelConfig = getattr(s, name)
        if lv.algorithm not in ALGORITHMS:
            err(f"sync.{name}.algorithm", f"unknown algorithm {lv.algorithm!r} (expected one of {ALGORITHMS})")
        if lv.every < 1:
            err(f"sync.{name}.every", f"{lv.every} — H must be at least 1")
        if lv.lr <= 0:
            err(f"sync.{name}.lr", f"{lv.lr} — must be positive")
        if not 0 <= lv.momentum < 1:
            err(f"sync.{name}.momentum", f"{lv.momentum} — must be in [0, 1)")
    if not 1 <= s.min_replicas <= t.replicas_per_cluster:
        err("sync.min_replicas", f"{s.min_replicas} — must be in [1, topology.replicas_per_cluster={t.replicas_per_cluster}]")
    if not 1 <= s.min_clusters <= t.clusters:
        err("sync.min_clusters", f"{s.min_clusters} — must be in [1, topology.clusters={t.clusters}]")
    if s.max_quorum_failures < 1:
        err("sync.max_quorum_failures", f"{s.max_quorum_failures} — must be at least 1")
    if s.max_commit_failures < 0:
        err("sync.max_commit_failures", f"{s.max_commit_failures} — must be at least 0")
    if s.outage_limit_s <= 0:
        err("sync.outage_limit_s", f"{s.outage_limit_s} — must be positive (seconds)")
    if cfg.lighthouse.restart_delay_s < 0:
        err("lighthouse.restart_delay_s", f"{cfg.lighthouse.restart_delay_s} — must be at least 0")

    tr = cfg.train
    for name in ("steps", "batch_size", "eval_batches", "log_every", "threads"):
        if getattr(tr, name) < 1:
            err(f"train.{name}", f"{getattr(tr, name)} — must be at least 1")
    if tr.seq_len < 2:
        err("train.seq_len", f"{tr.seq_len} — must be at least 2")
    if tr.lr <= 0:
        err("train.lr", f"{tr.lr} — must be positive")
    if tr.eval_every < 0:
        err("train.eval_every", f"{tr.eval_every} — must be 0 (start and end only) or positive")
    if s.mode == "hier":
        period = s.inner.every * s.outer.every
        if tr.steps % period:
            err("train.steps", f"{tr.steps} must be a multiple of sync.inner.every*sync.outer.every={period} so the run ends on an outer sync")
    elif s.mode == "flat" and tr.steps % s.flat.every:
        err("train.steps", f"{tr.steps} must be a multiple of sync.flat.every={s.flat.every} so the run ends on a sync")

    d = cfg.data
    if d.kind not in DATA_KINDS:
        err("data.kind", f"unknown data kind {d.kind!r} (expected one of {DATA_KINDS})")
    if d.kind == "markov":
        if d.states < 2:
            err("data.states", f"{d.states} — need at least 2")
        if not 1 <= d.branching <= d.states:
            err("data.branching", f"{d.branching} — must be in [1, data.states={d.states}]")
        if d.concentration <= 0:
            err("data.concentration", f"{d.concentration} — must be positive")
    else:
        if not 0 < d.eval_fraction < 1:
            err("data.eval_fraction", f"{d.eval_fraction} — must be in (0, 1)")
        if command in TRAINING_COMMANDS:
            # The file itself, once, here: before a launcher starts processes that would
            # each fail on it (a lighthouse or the dashboard never reads it).
            try:
                check_input(d, tr.seq_len, cfg.num_shards)
            except ValueError as e:
                raise ConfigError(str(e)) from e

    if cfg.model.name != "tiny" and not cfg.model.name.startswith("llama3_"):
        err("model.name", f"unknown model {cfg.model.name!r} (expected 'tiny' or 'llama3_<flavor>', e.g. llama3_debugmodel)")
    if cfg.model.dim < 1:
        err("model.dim", f"{cfg.model.dim} — must be positive")

    lh = cfg.lighthouse
    for name in ("join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"):
        if getattr(lh, name) < 1:
            err(f"lighthouse.{name}", f"{getattr(lh, name)} — must be positive")
    if lh.serve not in LIGHTHOUSE_ROLES:
        err("lighthouse.serve", f"{lh.serve!r} — expected one of {LIGHTHOUSE_ROLES}")
    _check_address("lighthouse.global_addr", lh.global_addr, err)
    for i, a in enumerate(lh.cluster_addrs):
        _check_address(f"lighthouse.cluster_addrs[{i}]", a, err)
    if s.mode == "hier" and command in ("train", "lighthouse") and len(lh.cluster_addrs) != t.clusters:
        err("lighthouse.cluster_addrs", f"has {len(lh.cluster_addrs)} address(es) but topology.clusters={t.clusters}: one lighthouse per cluster")
    if command == "lighthouse" and lh.serve == "cluster" and not 0 <= lh.cluster < len(lh.cluster_addrs):
        err("lighthouse.cluster", f"{lh.cluster} — must index lighthouse.cluster_addrs (0..{len(lh.cluster_addrs) - 1})")

    ch = cfg.chaos
    from hier_localsgd.chaos import ROLES

    for i, role in enumerate(ch.roles):
        if role not in ROLES:
            err(f"chaos.roles[{i}]", f"unknown role {role!r} (expected one of {ROLES})")
    if not ch.roles:
        err("chaos.roles", "needs at least one role")
    if ch.kill_every_s <= 0:
        err("chaos.kill_every_s", f"{ch.kill_every_s} — must be positive")
    if not 0 < ch.stop_kills_at <= 1:
        err("chaos.stop_kills_at", f"{ch.stop_kills_at} — must be in (0, 1]")
    if ch.restart_delay_s < 0:
        err("chaos.restart_delay_s", f"{ch.restart_delay_s} — must be at least 0")
    from hier_localsgd.chaos_faults import KINDS as CHAOS_KINDS

    for i, k in enumerate(ch.kinds):
        if k not in CHAOS_KINDS:
            err(f"chaos.kinds[{i}]", f"{k!r} — expected one of {CHAOS_KINDS}")
    if not ch.kinds:
        err("chaos.kinds", "empty — name at least one fault kind")
    if ch.draw not in ("random", "cycle"):
        err("chaos.draw", f"{ch.draw!r} — expected random or cycle")
    for i, pt in enumerate(ch.phase_targets):
        role, _, phase = str(pt).partition(":")
        if role not in ("leader", "non_leader") or phase not in Phase.__members__:
            err(f"chaos.phase_targets[{i}]", f"{pt!r} — expected ROLE:PHASE with ROLE leader|non_leader and PHASE one of {sorted(Phase.__members__)}")
    for fname in ("phase_arm_s", "hang_s", "lighthouse_down_s", "partition_s"):
        if getattr(ch, fname) <= 0:
            err(f"chaos.{fname}", f"{getattr(ch, fname)} — must be positive (seconds)")
    sw = cfg.sweep
    try:
        check_sweep_grid("sweep", sw.rates, sw.models)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    for i, f in enumerate(sw.fills):
        if f not in ("zero", "stale", "rescale"):
            err(f"sweep.fills[{i}]", f"unknown fill {f!r} (expected zero, stale or rescale)")
    for i, m in enumerate(sw.modes):
        if m not in MODES:
            err(f"sweep.modes[{i}]", f"unknown mode {m!r} (expected one of {MODES})")
    if sw.burst < 1:
        err("sweep.burst", f"{sw.burst} — a mean burst is at least 1 packet")
    if sw.workload not in ("tiny", "config"):
        err("sweep.workload", f"{sw.workload!r} — expected tiny or config")
    if sw.workload == "tiny" and (sw.steps < 10 or sw.steps % 10):
        err("sweep.steps", f"{sw.steps} — must be a positive multiple of 10 (the tiny workload syncs every 5 and 10 steps)")

    ck = cfg.checkpoint
    if ck.every < 0:
        err("checkpoint.every", f"{ck.every} — outer rounds between checkpoints, 0 to turn them off")
    if ck.keep < 1:
        err("checkpoint.keep", f"{ck.keep} — keep at least one checkpoint")
    if (ck.every or ck.resume) and s.mode != "hier":
        err("checkpoint.every", f"checkpoints need sync.mode=hier (got {s.mode!r})")

    b = cfg.bench
    if b.mode not in ("quick", "full"):
        err("bench.mode", f"{b.mode!r} — expected quick or full")
    from hier_localsgd.bench import ARMS

    for i, a in enumerate(b.arms):
        if a not in ARMS:
            err(f"bench.arms[{i}]", f"unknown arm {a!r} (expected one of {ARMS})")
    for name in ("lan_gbps", "wan_gbps"):
        if getattr(b, name) <= 0:
            err(f"bench.{name}", f"{getattr(b, name)} — a bandwidth must be positive")
    for name in ("lan_latency_ms", "wan_latency_ms", "target_margin", "target_loss", "h_inner", "h_outer"):
        if getattr(b, name) < 0:
            err(f"bench.{name}", f"{getattr(b, name)} — must be at least 0")

    if command == "chaos" and s.mode not in ("hier", "flat"):
        err("sync.mode", f"{s.mode!r} — chaos runs measure hier, or flat torchft DiLoCo (chaos.compare_flat)")

    if cfg.run.netns and command in LAUNCHING_COMMANDS:
        from hier_localsgd.netns import available

        reason = available()
        if reason is not None:
            err("run.netns", f"network namespaces are unavailable here: {reason}")

    if command == "train":
        if not 0 <= cfg.run.cluster < t.clusters:
            err("run.cluster", f"{cfg.run.cluster} — must be in [0, topology.clusters={t.clusters})")
        if not 0 <= cfg.run.replica < t.replicas_per_cluster:
            err("run.replica", f"{cfg.run.replica} — must be in [0, topology.replicas_per_cluster={t.replicas_per_cluster})")

    for level in ("inner", "outer"):
        try:
            cfg.link_spec(level)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    try:
        validate_group(cfg, command)
        validate_tp_sweep(cfg.tp_sweep)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    try:
        cfg.timeouts_obj()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    try:
        cfg.fault_list()
    except ValueError as e:
        raise ConfigError(str(e)) from e


def _check_address(path: str, addr: str, err: Any) -> None:
    try:
        parse_address(path, addr)
    except ValueError as e:
        err(path, str(e).split(": ", 1)[1])


def dump(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def cluster_addr(cfg: Config, cluster: int) -> str:
    return cfg.lighthouse.cluster_addrs[cluster]


def optional_str(v: str) -> Optional[str]:
    return v or None
