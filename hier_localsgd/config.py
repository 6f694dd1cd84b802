"""Configuration: hydra-composed YAML under ``configs/``, typed and validated here.

``load_config(overrides)`` composes ``configs/config.yaml`` (plus the ``model``
and ``data`` groups) with hydra, applying command-line overrides such as
``topology.clusters=3 sync.inner.every=20 model=tiny``; every value can be
overridden. The result is merged into the dataclass schema below, so a wrong
type or an unknown key fails naming the field, and then :func:`validate` checks
meaning (ranges, list lengths, addresses) and raises :class:`ConfigError` naming
the field.

Each section is a dataclass that lives with the module owning it and checks itself
(``check``); this module only composes them into :class:`Config` and runs the checks
that relate sections or depend on the command.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, List, Sequence

from omegaconf import DictConfig, OmegaConf

from hier_localsgd.core.runtime.checkpoint import CheckpointConfig
from hier_localsgd.core.runtime.faults import Fault
from hier_localsgd.core.runtime.runtime import RunConfig
from hier_localsgd.core.runtime.timeouts import Timeouts, TimeoutsConfig
from hier_localsgd.core.security.secret import SecurityConfig
from hier_localsgd.core.links.lossy import LinkSpec, LinksConfig
from hier_localsgd.experiments.sections import BenchConfig, ChaosConfig, DemoConfig, SweepConfig, TPSweepConfig, check_tp_sweep
from hier_localsgd.launch.lighthouse import LighthouseConfig
from hier_localsgd.launch.tunnel import TunnelConfig
from hier_localsgd.errors import ConfigError, fail
from hier_localsgd.core.runtime.choices import TOPK2
from hier_localsgd.sync.sections import NONE as NO_COMPRESSION
from hier_localsgd.sync.sections import SyncConfig, TopologyConfig
from hier_localsgd.tools.dashboard.config import DashboardConfig
from hier_localsgd.tools.deployment import MODEL_COMMANDS, moved_to
from hier_localsgd.tools.plan.config import MOVED as PLAN_MOVED, PlanConfig
from hier_localsgd.tools.simulate.config import MOVED as SIMULATE_MOVED, SimulateConfig
from hier_localsgd.train.sections import DataConfig, GroupConfig, ModelConfig, TrainConfig

__all__ = ["Config", "ConfigError", "load_config", "validate", "to_overrides", "dump"]

TRAINING_COMMANDS = ("train", "demo", "chaos", "sweep", "bench", "tp-sweep")  # validate() checks their data input
LAUNCHING_COMMANDS = ("demo", "chaos", "sweep", "bench")  # start a LocalJob (launch/local.py)


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
    plan: PlanConfig = field(default_factory=PlanConfig)  # `hier-localsgd plan`'s own (tools/plan/); the deployment is the shared sections
    simulate: SimulateConfig = field(default_factory=SimulateConfig)  # `hier-localsgd simulate`'s own (tools/simulate/)
    tp_sweep: TPSweepConfig = field(default_factory=TPSweepConfig)  # `hier-localsgd tp-sweep` (experiments/tp_sweep.py)
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    tunnel: TunnelConfig = field(default_factory=TunnelConfig)  # `hier-localsgd tunnel` (launch/tunnel.py)
    faults: List[Dict[str, Any]] = field(default_factory=list)

    # -- derived ---------------------------------------------------------------
    def timeouts_obj(self) -> Timeouts:
        return self.timeouts.timeouts()

    def link_spec(self, level: str) -> LinkSpec:
        return getattr(self.links, level).spec(f"links.{level}")

    def tp_link_specs(self) -> Dict[str, LinkSpec]:
        """group.tp_links as validated link specs, by TP operation."""
        return self.group.tp_links.specs()

    def fault_list(self) -> List[Fault]:
        return [Fault.from_mapping(i, f) for i, f in enumerate(self.faults)]

    def shard(self, rank: int = 0) -> int:
        """The data shard of (run.cluster, run.replica, rank): distinct for every rank of the job."""
        return (self.run.cluster * self.topology.replicas_per_cluster + self.run.replica) * self.topology.ranks_per_replica + rank

    @property
    def num_shards(self) -> int:
        t = self.topology
        return t.clusters * t.replicas_per_cluster * t.ranks_per_replica


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
    check_moved(overrides)
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


def check_moved(overrides: Sequence[str]) -> None:
    """An override of a ``plan.*``/``simulate.*`` field that moved to a shared section
    (issue #12) fails in one line naming the new field, not hydra's unknown-key error."""
    for o in overrides:
        key = o.split("=", 1)[0].lstrip("+~")
        new = moved_to(key, PLAN_MOVED) or moved_to(key, SIMULATE_MOVED)
        if new is not None:
            raise ConfigError(f"{key}: moved to {new} (plan and simulate read the shared sections; docs/planner.md)")


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


def _check_fragments(cfg: Config, splits: bool, path: str = "sync.outer.fragments") -> None:
    """``sync.outer.fragments`` > 1: hier only; ``sync.flat.fragments`` > 1: flat only; and no
    more fragments than the model has layer units (core/tensors/fragments.py; the model is built on
    the meta device: no memory), checked where ``splits`` (the commands that train here)."""
    s = cfg.sync
    F = s.flat.fragments if path == "sync.flat.fragments" else s.outer.fragments
    mode = "flat" if path == "sync.flat.fragments" else "hier"
    if s.mode != mode:
        what = "torchft's flat DiLoCo" if mode == "flat" else "the hierarchy's outer level"
        fail(path, f"{F} — streams {what}; needs sync.mode={mode} (got {s.mode!r})")
    if cfg.group.rank_shards(cfg.topology.ranks_per_replica) and cfg.group.sharding == "fsdp":
        fail(path, f"{F} — not supported with group.sharding=fsdp yet (its parameters are DTensor shards)")
    if not splits:
        return
    import torch

    from hier_localsgd.core.tensors.fragments import split_fragments
    from hier_localsgd.train.model import build_model

    with torch.device("meta"):
        model = build_model(cfg.model.name, 256, cfg.train.seq_len, cfg.model.dim, 0)
    try:
        split_fragments(model, F)
    except ValueError as e:
        fail(path, f"{F} — {e}")


def _check_hostname(cfg: Config) -> None:
    """Listeners bind the address ``run.hostname`` resolves to (docs/security.md): a name
    that resolves to loopback (Debian maps the machine's name to 127.0.1.1) while a
    lighthouse is on another host would leave peers on other hosts unable to connect."""
    import socket
    from urllib.parse import urlsplit

    lh = cfg.lighthouse
    remote = [a for a in [lh.global_addr, *lh.cluster_addrs] if (urlsplit(a).hostname or "") not in ("127.0.0.1", "localhost", "::1")]
    if not remote or cfg.run.bind:
        return
    name = cfg.run.hostname or socket.gethostname()
    try:
        addr = socket.getaddrinfo(name, 0, type=socket.SOCK_STREAM)[0][4][0]
    except (socket.gaierror, IndexError) as e:
        fail("run.hostname", f"{name!r} does not resolve: {e}")
    if addr.startswith("127.") or addr == "::1":
        fail("run.hostname", f"{name!r} resolves to {addr} (loopback) but {remote[0]} is on another host: its peers could not "
             "reach this process; set run.hostname to this host's address (or run.bind behind NAT)")


def validate(cfg: Config, command: str = "train") -> None:
    """Semantic checks; raises :class:`ConfigError` whose message starts with the field path.

    Each section checks itself; what is left here relates sections or depends on the
    command. ``command``: "train" checks the identity of this process too; "demo",
    "chaos" and "lighthouse" skip the lighthouse address list checks that they fill in.
    The commands that train (:data:`TRAINING_COMMANDS`) also check a text or parquet
    ``data.path`` itself (:func:`hier_localsgd.train.data.check_input`). The commands that
    only model a deployment (``plan``, ``simulate``) skip what only a real run needs.
    """
    t, s = cfg.topology, cfg.sync
    runs = command not in MODEL_COMMANDS  # plan/simulate model a deployment: tools/deployment.py
    t.check(s.mode, runs=runs)
    s.check(t)
    cfg.train.check(s, runs=runs)
    cfg.train.check_device(trains=command in TRAINING_COMMANDS)
    cfg.data.check(cfg.train.seq_len, cfg.num_shards, read_input=command in TRAINING_COMMANDS)
    cfg.model.check()
    cfg.lighthouse.check(
        t.clusters,
        count_addresses=s.mode == "hier" and command in ("train", "lighthouse"),
        serving=command == "lighthouse",
    )
    cfg.chaos.check()
    cfg.sweep.check()
    cfg.checkpoint.check(s.mode)
    cfg.bench.check()
    cfg.security.check()
    if command == "tunnel":
        cfg.tunnel.check()
    cfg.group.check(t.ranks_per_replica, cfg.model.name, command, s.mode)
    try:
        check_tp_sweep(cfg.tp_sweep)
    except ValueError as e:
        raise ConfigError(str(e)) from e

    if cfg.group.rank_shards(t.ranks_per_replica) and cfg.group.sharding == "fsdp" and (cfg.checkpoint.every or cfg.checkpoint.resume):
        fail("group.sharding", "fsdp with durable checkpoints is not supported yet (the optimizer state is DTensor shards); set checkpoint.every=0")

    # Proving a format and splitting the model build torch objects: the commands that train
    # here do it, a lighthouse (or plan) does not import torch for it.
    trains = command in TRAINING_COMMANDS
    if trains:
        s.outer.prove_compression("sync.outer")
    if s.outer.fragments > 1:
        _check_fragments(cfg, trains)
    if s.flat.fragments > 1:
        _check_fragments(cfg, trains, "sync.flat.fragments")

    if command == "chaos" and s.mode not in ("hier", "flat"):
        fail("sync.mode", f"{s.mode!r} — chaos runs measure hier, or flat torchft DiLoCo (chaos.compare_flat)")

    if cfg.run.program and command in LAUNCHING_COMMANDS and not Path(cfg.run.program).is_file():
        fail("run.program", f"{cfg.run.program!r} is not a file (a Python script on hier_localsgd's API; docs/api.md)")

    if cfg.run.netns and command in LAUNCHING_COMMANDS:
        from hier_localsgd.launch.netns import available

        reason = available()
        if reason is not None:
            fail("run.netns", f"network namespaces are unavailable here: {reason}")

    if cfg.security.wan == "tunnel" and command in LAUNCHING_COMMANDS:
        from hier_localsgd.launch.netns import available
        from hier_localsgd.launch.tunnel import missing_tools

        reason = available() or missing_tools()
        if reason is not None:
            fail("security.wan", f"tunnel: a local job builds its WireGuard mesh between network namespaces: {reason}")

    if command == "train":
        _check_hostname(cfg)
        if not 0 <= cfg.run.cluster < t.clusters:
            fail("run.cluster", f"{cfg.run.cluster} — must be in [0, topology.clusters={t.clusters})")
        if not 0 <= cfg.run.replica < t.replicas_per_cluster:
            fail("run.replica", f"{cfg.run.replica} — must be in [0, topology.replicas_per_cluster={t.replicas_per_cluster})")

    # These sections' own builders check them; they raise ValueError naming the field.
    for build in (lambda: cfg.link_spec("inner"), lambda: cfg.link_spec("outer"), cfg.timeouts_obj, cfg.fault_list):
        try:
            build()
        except ValueError as e:
            raise ConfigError(str(e)) from e

    # The compressed outer reduce moves packed bytes (codes and block scales): a lost
    # packet can only arrive as zeros (core/links/link.py), so no stale or rescale fill.
    lossy_outer = s.mode == "hier" and cfg.link_spec("outer").model.enabled
    # topk2's payload is positions, codes and scales in separate arrays: a zeroed code
    # decodes to -s (not 0) and zeroed positions collide, so no lost packet is harmless.
    if lossy_outer and s.outer.compression == TOPK2:
        fail("links.outer.loss", f"{cfg.links.outer.loss!r} — sync.outer.compression=topk2 needs a loss-free outer link "
             "(a lost packet of its sparse payload decodes to wrong values); use int8 or fp8 over a lossy link")
    if lossy_outer and s.outer.compression != NO_COMPRESSION and cfg.links.outer.fill != "zero":
        fail("links.outer.fill", f"{cfg.links.outer.fill!r} — with sync.outer.compression={s.outer.compression} lost packets of the compressed payload can only be zero-filled (links.outer.fill=zero)")


def dump(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
