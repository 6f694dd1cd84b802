"""Where this process sits in a job, and the process's one exit path.

A replica-group process learns who it is from its launcher, as a torchrun worker reads
``RANK``: the launch scripts (``launch/replica.sh``, the local launcher behind ``demo`` and
``chaos``) hand it its hydra overrides — ``run.cluster``, ``run.replica``, the lighthouse
addresses and whatever the job shares — in ``HIER_LOCALSGD_OVERRIDES`` (a JSON list), and
torchrun adds ``RANK``/``WORLD_SIZE`` for a group of several ranks.
:func:`config_from_env` composes them (then the program's own command-line overrides), and
:class:`Topology` turns the result into this process's place: identity, device, and the
replica group's own process group.

:func:`run` is how a program runs under the same supervision as ``hier-localsgd train``
(which is one such program): signals are taken on a thread of their own, a watchdog ends a
process stuck past a phase deadline, and every way out — return, exception, signal,
watchdog — stops the heartbeats first and ends the process with ``os._exit``
(core/runtime/runtime.py). Exit codes: 0 done (or the job finished without this group), 1 an
error (the launcher restarts the group, which heals from a live peer), 2 a configuration
error or a group that gave up for good (never restarted), 3 the watchdog, 128+N signal N.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

import torch

from hier_localsgd.core.runtime.choices import resolve_backend
from hier_localsgd.core.runtime.device import resolve_device
from hier_localsgd.core.runtime.logs import debug, setup_logging
from hier_localsgd.core.runtime.runtime import EXIT_CONFIG, OVERRIDES_ENV, Runtime
from hier_localsgd.core.runtime.status import read_json, replica_dir, stop_path
from hier_localsgd.sync.build import GroupPlace, job_done_check
from hier_localsgd.sync.common import Identity, JobFinished

if TYPE_CHECKING:
    from hier_localsgd.config import Config

logger = logging.getLogger(__name__)


def config_from_env(overrides: Optional[Sequence[str]] = None) -> "Config":
    """The job's configuration: the launcher's overrides (``HIER_LOCALSGD_OVERRIDES``), then
    ``overrides`` (default: this program's command-line arguments, ``key=value`` each).

    Raises:
        ConfigError: naming the bad field (or the malformed variable).
    """
    from hier_localsgd.config import ConfigError, load_config

    raw = os.environ.get(OVERRIDES_ENV, "[]")
    try:
        env = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{OVERRIDES_ENV}: not a JSON list of overrides ({e})") from e
    if not isinstance(env, list) or not all(isinstance(o, str) for o in env):
        raise ConfigError(f"{OVERRIDES_ENV}: not a JSON list of strings: {raw[:80]!r}")
    args = list(sys.argv[1:] if overrides is None else overrides)
    return load_config(env + args, validate_for="train")


def process_device(cfg: "Config") -> torch.device:
    """``train.device`` for this process: rank k of a replica group (torchrun's LOCAL_RANK)
    takes GPU ``train.gpu_slot``·G + k (GPU k without a slot); the CUDA device becomes the
    current one. Too few GPUs for the slot: a ConfigError naming ``train.gpu_slot``."""
    from hier_localsgd.config import ConfigError

    t = cfg.train
    try:
        # ranks on this host: a group spanning N hosts runs G/N here (torchrun's LOCAL_WORLD_SIZE)
        here = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.topology.ranks_per_replica))
        device = resolve_device(t.device, int(os.environ.get("LOCAL_RANK", "0")), t.gpu_slot, here, t.share_gpus)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def group_place(cfg: "Config", device: torch.device) -> GroupPlace:
    """The replica group's own process group (``train.backends.group`` on ``device``)."""
    g = cfg.topology.ranks_per_replica
    if g == 1:
        return GroupPlace()
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != g:
        raise ValueError(
            f"topology.ranks_per_replica={g} but this process was launched with WORLD_SIZE={world or 'unset'}: "
            f"launch the replica group with torchrun --nproc-per-node {g} (launch/replica.sh --ranks {g})"
        )
    t = cfg.timeouts_obj()
    timeout = max(t.inner_reduce, t.local_step)
    rank = int(os.environ["RANK"])
    # torch sets "False" only where its agent hosts no store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE);
    # another launcher (srun, mpirun) leaves it unset: env://, as before
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False" and int(os.environ.get("LOCAL_WORLD_SIZE", g)) == g:
        # Launched by launch/rendezvous.py's arguments (one host, no agent store): rank 0
        # hosts the group's store on this process's address only, not every interface.
        from hier_localsgd.core.ft.managers import bound_store

        host, port = cfg.run.hostname or socket.gethostname(), int(os.environ["MASTER_PORT"])
        store = (bound_store(host, port, timeout, cfg.run.bind) if rank == 0
                 else dist.TCPStore(host, port, is_master=False, timeout=timeout))
    else:  # torchrun's own store (its agent's, or a group spanning hosts)
        store, rank, _ = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun's shared store outlives a restart of the group's workers, and the default
    # process group's keys are not per attempt: a restarted rank would read the previous
    # attempt's (dead) peers' addresses. Every attempt gets a key space of its own, named
    # after the group too: a rank that reached another group's store on a reused port
    # times out instead of joining that group's process group.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"hier/c{cfg.run.cluster}r{cfg.run.replica}/attempt{attempt}", store)
    backend = resolve_backend("group", cfg.train.backends.group, device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=g, timeout=timeout,
                            **({"device_id": device} if backend == "nccl" else {}))
    return GroupPlace(rank=rank, size=g, pg=dist.group.WORLD, store=store)


def trained_before(cfg: "Config", identity: Identity, rank: int = 0) -> bool:
    """Whether an earlier process of this replica group trained in this run directory: its
    last status (read before this process overwrites it) shows a step above 0, so it had
    joined a quorum — its lighthouse answered then."""
    prev = read_json(replica_dir(cfg.run.dir, identity.cluster, identity.replica, rank) / "status.json")
    return bool(prev) and int(prev.get("step") or 0) > 0


@dataclass
class Topology:
    """This process's place in the job: its replica group (cluster, replica), its rank in
    the group and the group's own process group, its device, the job's configuration and
    the runtime that owns its exit path. Build it with :meth:`from_env`."""

    config: "Config"
    identity: Identity
    device: torch.device
    group: GroupPlace
    runtime: Runtime
    ran_before: bool = False  # an earlier process of this group trained here (a restart)

    @property
    def cluster(self) -> int:
        return self.identity.cluster

    @property
    def replica(self) -> int:
        return self.identity.replica

    @property
    def rank(self) -> int:
        """This rank in its replica group (0 with one rank per group)."""
        return self.group.rank

    @property
    def data_shard(self) -> int:
        """This rank's data shard, distinct for every rank of the job, in [0, :attr:`num_shards`)."""
        return self.config.shard(self.group.rank)

    @property
    def num_shards(self) -> int:
        return self.config.num_shards

    @classmethod
    def from_env(cls, config: Optional["Config"] = None, runtime: Optional[Runtime] = None) -> "Topology":
        """Reads the place from the configuration (default :func:`config_from_env`) and the
        environment; makes the group's process group (blocks until every rank of the group
        arrives, at most the inner reduce timeout). Without ``runtime`` (:func:`run` passes
        its own) installs one: call it before starting threads of your own.

        Raises:
            ConfigError: a bad configuration, naming the field.
            ValueError: a group launched with a different number of ranks than configured.
        """
        cfg = config if config is not None else config_from_env()
        if runtime is None:
            t = cfg.timeouts_obj()
            runtime = Runtime(f"c{cfg.run.cluster}r{cfg.run.replica}", shutdown_timeout=t.shutdown, watchdog_grace=t.watchdog_grace)
            runtime.install(watch_parent="TORCHELASTIC_RUN_ID" in os.environ)
        identity = Identity(cfg.run.cluster, cfg.run.replica)
        device = process_device(cfg)
        group = group_place(cfg, device)
        return cls(cfg, identity, device, group, runtime, ran_before=trained_before(cfg, identity, group.rank))


def _mark_stopped(cfg: "Config", code: int, reason: str) -> None:
    if code == EXIT_CONFIG:
        stop = stop_path(cfg.run.dir, cfg.run.cluster, cfg.run.replica)
        stop.parent.mkdir(parents=True, exist_ok=True)
        stop.write_text(reason.splitlines()[0] + "\n" if reason else "exit 2\n")


def run(main: Callable[[Topology], Any], config: Optional["Config"] = None, program: str = "") -> None:
    """Runs ``main(topology)`` as one replica-group process (or one rank of it) and ends the
    process: never returns (see the module docstring for the exit codes).

    ``config``: default :func:`config_from_env` (a bad one: one line naming the field, exit
    2). A group that finds the job already finished without it — at start-up, or when its
    quorums keep failing (:class:`JobFinished`) — says so in one line and exits 0. Logs go
    to stderr and ``<run.dir>/logs/<tag>.log`` (cli.setup_logging).
    """
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust logger reads it at import
    # Before any other thread exists: signals go to the runtime's signal thread.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    name = program or os.path.basename(sys.argv[0] or "program")
    if config is None:
        from hier_localsgd.config import ConfigError

        try:
            config = config_from_env()
        except ConfigError as e:
            if debug():
                raise
            print(f"{name}: configuration error: {e}", file=sys.stderr)
            os._exit(EXIT_CONFIG)
    cfg = config
    os.makedirs(cfg.run.dir, exist_ok=True)
    t = cfg.timeouts_obj()
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    rank = os.environ.get("RANK", "0") if cfg.topology.ranks_per_replica > 1 else None
    tag = f"c{cfg.run.cluster}r{cfg.run.replica}" + (f"g{rank}" if rank is not None else "")
    setup_logging(cfg.run.log_level, tag, log_file=os.path.join(cfg.run.dir, "logs", f"{tag}.log"))
    stop = stop_path(cfg.run.dir, cfg.run.cluster, cfg.run.replica)
    if under_torchrun and stop.exists():
        # torchrun restarts a group after any exit; one that stopped for good stays stopped.
        logger.error("%s stopped earlier in this launch, not rejoining: %s", tag, stop.read_text().strip())
        os._exit(EXIT_CONFIG)
    rt = Runtime(tag, shutdown_timeout=t.shutdown, watchdog_grace=t.watchdog_grace)
    rt.install(watch_parent=under_torchrun)
    if under_torchrun:
        rt.on_exit(lambda code, reason: _mark_stopped(cfg, code, reason))

    def body() -> None:
        identity = Identity(cfg.run.cluster, cfg.run.replica)
        done = job_done_check(cfg, identity)()
        if done:
            logger.warning("%s: %s; exiting", identity, done)
            return
        try:
            main(Topology.from_env(cfg, rt))
        except JobFinished as e:
            logger.warning("%s: %s; exiting", identity, e)

    rt.run(body)


def wait_for_lighthouse(cfg: "Config", identity: Identity, ran_before: bool) -> None:
    """A restarted replica group rides out its lighthouse's outage at start-up.

    A replica group that never trained checks its lighthouse once (a wrong address is one
    clear line at once, and a launcher that restarts it gets the same line each time). One
    whose earlier process trained (``ran_before``, :func:`trained_before`) has seen the
    lighthouse answer, so a lighthouse that does not answer now is down or cut off: the
    process waits for it, up to ``sync.outage_limit_s``, as a running process would
    (outage.py), instead of exiting and being restarted again.
    """
    from hier_localsgd.core.runtime.addresses import LighthouseUnreachable, probe_lighthouse

    if not ran_before:
        return
    if cfg.sync.mode == "hier":
        field, addr = f"lighthouse.cluster_addrs[{identity.cluster}]", cfg.lighthouse.cluster_addrs[identity.cluster]
    else:
        field, addr = "lighthouse.global_addr", cfg.lighthouse.global_addr
    connect = cfg.timeouts_obj().connect
    deadline = time.monotonic() + cfg.sync.outage_limit_s
    waited = False
    while True:
        try:
            probe_lighthouse(field, addr, connect)
            if waited:
                logger.warning("%s: %s=%s answers again; starting", identity, field, addr)
            return
        except LighthouseUnreachable:
            if time.monotonic() >= deadline:
                raise
            if not waited:
                logger.warning("%s: restarted while %s=%s does not answer; waiting for it (up to sync.outage_limit_s=%gs)",
                               identity, field, addr, cfg.sync.outage_limit_s)
                waited = True
            time.sleep(1.0)


def wait_for_gate(path: str, timeout_s: float) -> None:
    """Local jobs start every replica group together: the launcher creates ``path``
    once all are ready (Managers heartbeating). Bounded by ``timeouts.startup``."""
    if not path:
        return
    deadline = time.time() + timeout_s
    while not os.path.exists(path):
        if time.time() > deadline:
            logger.warning("start gate %s not opened after %.0fs; starting anyway", path, timeout_s)
            return
        time.sleep(0.1)


__all__: List[str] = ["OVERRIDES_ENV", "Topology", "config_from_env", "run"]
