"""Lighthouses: one global (cluster Managers) and one per cluster (replica-group Managers).

Quorum "rooms" inside one lighthouse were removed from torchft as split-brain
prone, so each level of each cluster gets its own lighthouse.

``min_replicas``: a cluster lighthouse forms a quorum from ``sync.min_replicas``
replica groups; the global one from ``sync.min_clusters`` leaders. Both wait up
to ``lighthouse.join_timeout_ms`` for heartbeating stragglers and count a replica
dead after ``lighthouse.heartbeat_timeout_ms`` without a heartbeat.

``hier-localsgd lighthouse`` serves ``lighthouse.serve``: ``all`` (single host:
global + every cluster in one process), ``global``, or ``cluster`` (with
``lighthouse.cluster``). Each binds the port of its configured address on all
interfaces, or on loopback when the address is loopback. It prints one line per
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


def bind_address(field: str, addr: str) -> str:
    host, port = parse_address(field, addr)
    return f"127.0.0.1:{port}" if host in _LOOPBACK else f"[::]:{port}"


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


def start(cfg: Config) -> list:
    """Starts the configured lighthouses in this process; returns the server objects."""
    from torchft.coordination import LighthouseServer

    servers = []
    for sp in specs(cfg):
        try:
            server = LighthouseServer(
                bind=bind_address(sp.field, sp.addr),
                min_replicas=sp.min_replicas,
                join_timeout_ms=cfg.lighthouse.join_timeout_ms,
                quorum_tick_ms=cfg.lighthouse.quorum_tick_ms,
                heartbeat_timeout_ms=cfg.lighthouse.heartbeat_timeout_ms,
            )
        except Exception as e:
            for s in servers:
                s.shutdown()
            in_use = port_in_use(sp.field, sp.addr)
            why = f"port {parse_address(sp.field, sp.addr)[1]} is already in use (another process listens there)" if in_use else str(e)
            raise LighthouseStartFailed(f"{sp.field}={sp.addr}: cannot start the {sp.role} lighthouse: {why}", sp.field, in_use) from e
        servers.append(server)
        print(f"lighthouse {sp.role} serving {sp.addr} (min_replicas={sp.min_replicas})", flush=True)
    return servers


class LighthouseStartFailed(RuntimeError):
    """A lighthouse could not start at its configured address; ``field`` names the config
    field, ``in_use``: the port is taken (a configuration conflict no restart fixes)."""

    def __init__(self, msg: str, field: str, in_use: bool) -> None:
        super().__init__(msg)
        self.field, self.in_use = field, in_use


def port_in_use(field: str, addr: str) -> bool:
    """Whether something already listens at (or holds) the port ``addr`` binds (bind_address)."""
    import socket

    host, port = bind_address(field, addr).rsplit(":", 1)
    fam = socket.AF_INET6 if host.startswith("[") else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the lighthouse's own listener
        try:
            s.bind((host.strip("[]"), int(port)))
        except OSError:
            return True
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
