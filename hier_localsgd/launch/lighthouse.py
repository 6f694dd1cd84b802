"""Lighthouses: one global (cluster Managers) and one per cluster (replica-group Managers).

Quorum "rooms" inside one lighthouse were removed from torchft as split-brain
prone, so each level of each cluster gets its own lighthouse.

``min_replicas``: a cluster lighthouse forms a quorum from ``sync.min_replicas``
replica groups; the global one from ``sync.min_clusters`` leaders. Both wait up
to ``lighthouse.join_timeout_ms`` for heartbeating stragglers and count a replica
dead after ``lighthouse.heartbeat_timeout_ms`` without a heartbeat.

``hier-localsgd lighthouse`` serves ``lighthouse.serve``: ``all`` (single host:
global + every cluster in one process), ``global``, or ``cluster`` (with
``lighthouse.cluster``). Each binds its configured address (the host resolved to an IP
address), never every interface unless ``lighthouse.bind`` says so (a host behind NAT,
whose advertised address is not one of its own; docs/security.md). It prints one line per
lighthouse and runs until SIGTERM/SIGINT, or, with ``lighthouse.until_done``,
until every replica group it serves has written its ``result.json`` under
``run.dir`` (a shared directory; results older than the lighthouse do not count).
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, List

from hier_localsgd.core.runtime.addresses import parse_address
from hier_localsgd.core.runtime.runtime import EXIT_CONFIG
from hier_localsgd.errors import fail

if TYPE_CHECKING:
    from hier_localsgd.config import Config

logger = logging.getLogger(__name__)

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}
SERVE = ("all", "global", "cluster")


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
    # The address the lighthouses bind: "" = the host of each one's configured address.
    # "0.0.0.0" or "::" (every interface) only where that address is not local (NAT).
    bind: str = ""

    def check(self, clusters: int, count_addresses: bool, serving: bool) -> None:
        """``count_addresses``: one cluster address per cluster (the launchers of a local
        job fill them in themselves); ``serving``: this process serves ``serve``."""
        if self.restart_delay_s < 0:
            fail("lighthouse.restart_delay_s", f"{self.restart_delay_s} — must be at least 0")
        for name in ("join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"):
            if getattr(self, name) < 1:
                fail(f"lighthouse.{name}", f"{getattr(self, name)} — must be positive")
        if self.serve not in SERVE:
            fail("lighthouse.serve", f"{self.serve!r} — expected one of {SERVE}")
        _check_address("lighthouse.global_addr", self.global_addr)
        for i, a in enumerate(self.cluster_addrs):
            _check_address(f"lighthouse.cluster_addrs[{i}]", a)
        if count_addresses and len(self.cluster_addrs) != clusters:
            fail("lighthouse.cluster_addrs", f"has {len(self.cluster_addrs)} address(es) but topology.clusters={clusters}: one lighthouse per cluster")
        if serving and self.serve == "cluster" and not 0 <= self.cluster < len(self.cluster_addrs):
            fail("lighthouse.cluster", f"{self.cluster} — must index lighthouse.cluster_addrs (0..{len(self.cluster_addrs) - 1})")


def _check_address(path: str, addr: str) -> None:
    try:
        parse_address(path, addr)
    except ValueError as e:
        fail(path, str(e).split(": ", 1)[1])


@dataclass(frozen=True)
class LighthouseSpec:
    role: str  # "global" or "cluster<i>"
    field: str  # the config field holding its address
    addr: str
    min_replicas: int


def specs(cfg: Config) -> List[LighthouseSpec]:
    lh, s = cfg.lighthouse, cfg.sync
    out = []
    if lh.serve in ("all", "global"):
        out.append(LighthouseSpec("global", "lighthouse.global_addr", lh.global_addr, s.min_clusters))
    clusters = range(len(lh.cluster_addrs)) if lh.serve == "all" else ([lh.cluster] if lh.serve == "cluster" else [])
    for c in clusters:
        out.append(LighthouseSpec(f"cluster{c}", f"lighthouse.cluster_addrs[{c}]", lh.cluster_addrs[c], s.min_replicas))
    if cfg.sync.mode in ("flat", "ddp"):
        # The baselines use the global lighthouse for every replica group.
        out = [LighthouseSpec("global", "lighthouse.global_addr", lh.global_addr, 1)] if lh.serve in ("all", "global") else []
    return out


def bind_address(field: str, addr: str, bind: str = "") -> str:
    """``ip:port`` (``[ip6]:port``) for a lighthouse at ``addr``: the host of ``addr``
    (or ``bind``, the ``lighthouse.bind`` override) resolved to one IP address.

    Raises:
        LighthouseStartFailed: naming ``field`` when the host does not resolve.
    """
    import socket

    host, port = parse_address(field, addr)
    host = (bind or host).strip("[]")
    if host == "localhost":
        host = "127.0.0.1"
    try:
        fam, _, _, _, sa = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, IndexError) as e:
        where = f"lighthouse.bind={bind}" if bind else f"{field}={addr}"
        raise LighthouseStartFailed(f"{where}: cannot resolve {host!r} to an address to bind: {e}", field, False) from None
    return f"[{sa[0]}]:{port}" if fam == socket.AF_INET6 else f"{sa[0]}:{port}"


def result_paths(cfg: Config) -> List[Path]:
    """The result files of the replica groups this process's lighthouses serve."""
    from hier_localsgd.core.runtime.status import replica_dir

    t, lh = cfg.topology, cfg.lighthouse
    clusters = [lh.cluster] if lh.serve == "cluster" and cfg.sync.mode == "hier" else range(t.clusters)
    return [replica_dir(cfg.run.dir, c, r) / "result.json" for c in clusters for r in range(t.replicas_per_cluster)]


def _written_since(path: Path, t: float) -> bool:
    try:
        return path.stat().st_mtime >= t
    except FileNotFoundError:
        return False


def lighthouse_server_type() -> type:
    """torchft's ``LighthouseServer``, without importing torch where it is not imported yet.

    ``torchft.coordination`` imports the ``torchft`` package, whose ``__init__`` imports torch
    (3.5 s of CPU on the 2-core VM, 5 to 20 s while jobs train beside it); the server itself is
    the Rust extension ``torchft._torchft``, which links no torch. A lighthouse process loads
    just the extension, so it serves within a fraction of a second; a process that has
    imported torchft gets the same class from torchft itself."""
    if "torchft" in sys.modules:
        from torchft.coordination import LighthouseServer

        return LighthouseServer
    import importlib.machinery
    import importlib.util
    import os

    name = "torchft._torchft"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.find_spec("torchft")  # finds the package without running its __init__
        dirs = list(spec.submodule_search_locations or []) if spec is not None else []
        found = [f"{d}/_torchft{sfx}" for d in dirs for sfx in importlib.machinery.EXTENSION_SUFFIXES
                 if os.path.isfile(f"{d}/_torchft{sfx}")]
        if not found:  # not a wheel with the extension beside it: the ordinary import says why
            from torchft.coordination import LighthouseServer

            return LighthouseServer
        loader = importlib.machinery.ExtensionFileLoader(name, found[0])
        mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, found[0], loader=loader))
        # torchft imported later in this process (the async global model server) reuses it
        sys.modules[name] = mod
        try:
            loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    return mod.LighthouseServer


def start(cfg: Config) -> list:
    """Starts the configured lighthouses in this process; returns the server objects."""
    LighthouseServer = lighthouse_server_type()

    servers = []
    for sp in specs(cfg):
        try:
            bind = bind_address(sp.field, sp.addr, cfg.lighthouse.bind)
        except LighthouseStartFailed:
            for s in servers:
                s.shutdown()
            raise
        try:
            server = LighthouseServer(
                bind=bind,
                min_replicas=sp.min_replicas,
                join_timeout_ms=cfg.lighthouse.join_timeout_ms,
                quorum_tick_ms=cfg.lighthouse.quorum_tick_ms,
                heartbeat_timeout_ms=cfg.lighthouse.heartbeat_timeout_ms,
            )
        except Exception as e:
            for s in servers:
                s.shutdown()
            in_use = port_in_use(sp.field, sp.addr, cfg.lighthouse.bind)
            why = (f"port {parse_address(sp.field, sp.addr)[1]} is already in use (another process listens there)" if in_use
                   else f"cannot bind {bind}: {e}")
            raise LighthouseStartFailed(f"{sp.field}={sp.addr}: cannot start the {sp.role} lighthouse: {why}", sp.field, in_use) from e
        servers.append(server)
        print(f"lighthouse {sp.role} serving {sp.addr} (min_replicas={sp.min_replicas})", flush=True)
    a = cfg.sync.async_outer
    if a.enabled and cfg.sync.mode == "hier" and cfg.lighthouse.serve in ("all", "global"):
        try:
            servers.append(_global_model_server(cfg))
        except Exception:
            for s in servers:
                s.shutdown()
            raise
        print(f"global model server serving {a.addr} (grace {a.grace_s:g} s, max staleness {a.max_staleness})", flush=True)
    return servers


def _global_model_server(cfg: Config):
    """The asynchronous outer level's server (sync/global_server.py), next to the global
    lighthouse: supervised and restarted with it."""
    from hier_localsgd.core.security.secret import global_model_key
    from hier_localsgd.core.tensors.level import LevelAlgorithm
    from hier_localsgd.sync.compression import down_format
    from hier_localsgd.sync.global_server import GlobalModelServer

    s, a, field = cfg.sync, cfg.sync.async_outer, "sync.async_outer.addr"
    host, port = bind_address(field, a.addr, cfg.lighthouse.bind).rsplit(":", 1)
    key = global_model_key(cfg.security)
    import ipaddress

    if key is None and not ipaddress.ip_address(host.strip("[]")).is_loopback:
        # Heals without a secret only read; a push writes the global model: never open to anyone.
        raise LighthouseStartFailed(f"{field}={a.addr}: the global model server on a non-loopback address needs a job secret "
                                    "(security.secret_file or HIER_LOCALSGD_SECRET; `hier-localsgd keygen`)", field, False)
    try:
        return GlobalModelServer(
            host.strip("[]"), int(port), LevelAlgorithm.build(s.outer.algorithm, s.outer.lr, s.outer.momentum, s.outer.nesterov),
            full_tokens=cfg.topology.replicas_per_cluster * s.outer_period, max_staleness=a.max_staleness,
            clusters=cfg.topology.clusters, grace_s=a.grace_s, min_clusters=a.min_clusters, final_wait_s=s.final_wait_s,
            key=None if key is None else key.bytes(),
            down=down_format(s.outer.compression, a.compress_down, s.outer.compression_block))
    except OSError as e:
        in_use = port_in_use(field, a.addr, cfg.lighthouse.bind)
        why = f"port {port} is already in use (another process listens there)" if in_use else f"cannot bind {host}:{port}: {e}"
        raise LighthouseStartFailed(f"{field}={a.addr}: cannot start the global model server: {why}", field, in_use) from e


class LighthouseStartFailed(RuntimeError):
    """A lighthouse could not start at its configured address; ``field`` names the config
    field, ``in_use``: the port is taken (a configuration conflict no restart fixes)."""

    def __init__(self, msg: str, field: str, in_use: bool) -> None:
        super().__init__(msg)
        self.field, self.in_use = field, in_use


def port_in_use(field: str, addr: str, bind: str = "") -> bool:
    """Whether something already listens at (or holds) the port ``addr`` binds (bind_address);
    False for any other bind error (an address that is not this host's, say)."""
    import errno
    import socket

    try:
        host, port = bind_address(field, addr, bind).rsplit(":", 1)
    except LighthouseStartFailed:
        return False
    fam = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the lighthouse's own listener
        try:
            s.bind((host.strip("[]"), int(port)))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def serve(cfg: Config) -> int:
    """The ``lighthouse`` command: serve until a signal arrives. A lighthouse that cannot
    start says so in one line naming the field and address: exit 2 when its port is in use
    (launch/lighthouses.sh does not retry that), 1 otherwise."""
    stop = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # before the servers start their threads
    try:
        servers = start(cfg)
    except LighthouseStartFailed as e:
        print(f"hier-localsgd lighthouse: {e}", file=sys.stderr)
        return EXIT_CONFIG if e.in_use else 1
    if not servers:
        print("lighthouse: nothing to serve for this configuration", file=sys.stderr)
        return EXIT_CONFIG
    if cfg.lighthouse.until_done:
        started, waiting = time.time(), result_paths(cfg)
        sig = None
        while waiting and sig is None:
            sig = signal.sigtimedwait(stop, 1.0)
            waiting = [p for p in waiting if not _written_since(p, started)]
        if sig is None:
            print(f"lighthouse: every replica group served here finished ({len(result_paths(cfg))} results); stopping", flush=True)
    else:
        sig = signal.sigwait(stop)
    if sig is not None:
        logger.info("lighthouses stopping on %s", signal.Signals(sig).name)
    for s in servers:
        s.shutdown()
    return 0
