"""Runs a whole job on this machine: lighthouses and one process per replica group.

Used by ``hier-localsgd demo``, the tests, and experiments. It does what the shell
scripts in ``launch/`` do on real hosts: start the lighthouses, then start
``hier-localsgd train run.cluster=C run.replica=R`` per replica group, with the
same overrides for everyone. Each process logs to ``<run.dir>/logs/c<C>r<R>.log``
(appending across restarts) and publishes its status files (status.py).

With ``run.netns`` each cluster's lighthouse and replica processes run in the
cluster's own network namespace and the global lighthouse in the hub's
(:mod:`hier_localsgd.launch.netns`); the launcher stays in the root namespace, probes the
lighthouses from inside their namespaces, can cut a cluster off
(:meth:`LocalJob.partition`, :meth:`LocalJob.heal`) and removes the network in
:meth:`LocalJob.stop`.

Every wait here is bounded: lighthouse start-up by ``timeouts.connect``-scaled
probing, the job by the caller's timeout; :meth:`LocalJob.stop` sends SIGTERM
and, after a grace period, SIGKILL.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple, Union

from hier_localsgd.core.runtime.addresses import LighthouseUnreachable, parse_address, probe_lighthouse
from hier_localsgd.core.runtime.runtime import OVERRIDES_ENV
from hier_localsgd.core.runtime.status import AUTO_FILE, JOB_EVENTS_FILE, read_json, replica_dir, stop_path
from hier_localsgd.launch.lighthouse import port_in_use
from hier_localsgd.launch.rendezvous import ENV as RENDEZVOUS_ENV, one_host_args
from hier_localsgd.launch.spares import WarmSpares
from hier_localsgd.errors import fail

if TYPE_CHECKING:
    from hier_localsgd.config import Config
    from hier_localsgd.launch.netns import ClusterNetwork

Key = Tuple[int, int]

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range: a port that bind(0) hands
    out (every store, heal server, ManagerServer and Gloo pair of every job on the host)
    could be taken between this pick and the lighthouse's bind, or while a killed
    lighthouse waits to restart at its port; one below the range never is."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(200 if low > 11000 else 0):
        port = random.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> Dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "warn")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    started: float
    log: Path
    extra: Sequence[str] = ()
    restarts: int = 0
    spare: str = ""  # a restart run in a spare: "ready" (it had finished its imports) or "started"


RUN_OUTPUTS = ("replicas", "logs", "tensorboard", JOB_EVENTS_FILE, "summary.json", AUTO_FILE, "auto_probe")


def archive_previous_run(run_dir: Path) -> Optional[Path]:
    """Moves an earlier job's outputs in ``run_dir`` to ``run_dir/previous/<time>/``.

    Status and event files are appended to, so a new job in a used directory would mix
    its timeline with the old one's; nothing is deleted. Checkpoints stay where they are
    (``checkpoint.resume`` continues a job in place and archives nothing).
    """
    found = [n for n in RUN_OUTPUTS if (run_dir / n).exists()]
    if not found:
        return None
    dest = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
    while dest.exists():
        dest = dest.with_name(dest.name + "_")
    dest.mkdir(parents=True)
    for n in found:
        os.replace(run_dir / n, dest / n)
    logger.info("%s: an earlier run's outputs (%s) moved to %s", run_dir, ", ".join(found), dest)
    return dest


@dataclass
class LocalJob:
    """One job's processes on this host.

    Args:
        cfg: the validated config (topology, run.dir, timeouts).
        overrides: the user's hydra overrides, passed to every child unchanged.
        free_ports: pick free loopback ports for the lighthouses (else use
            ``lighthouse.*`` as configured). With ``run.netns`` the lighthouses listen
            on their namespaces' addresses at the configured ports (every port is
            free in a fresh namespace).
        warm_spares: run restarts in a warm spare (``hier_localsgd/spare.py``): a process
            started ahead with the training stack imported, so a restarted group joins in
            well under a second instead of after its imports. Single-rank groups outside
            network namespaces only; the history's ``restart`` records say ``spare`` (one was
            used) and ``warm`` (it had finished its imports by then).
    """

    cfg: Config
    overrides: Sequence[str]
    free_ports: bool = True
    run_dir_override: Optional[Path] = None  # default: cfg.run.dir
    torchrun_restarts: int = 3  # multi-rank groups: torchrun restarts the whole group this often
    python: str = sys.executable
    lighthouses: Dict[str, Proc] = field(default_factory=dict)  # role ("global", "cluster<i>") -> process
    replicas: Dict[Key, Proc] = field(default_factory=dict)
    addr_overrides: List[str] = field(default_factory=list)
    history: List[dict] = field(default_factory=list)  # starts, exits (with the last status), restarts, kills, with times
    netns: Optional["ClusterNetwork"] = None  # run.netns: the clusters' namespaces (made in __post_init__)
    # Restarts run in a warm spare (hier_localsgd/spare.py: a process with the training
    # stack imported) where one can: single-rank groups outside network namespaces.
    warm_spares: bool = False
    spares: WarmSpares = field(init=False)  # made in __post_init__ (spares.py)

    def __post_init__(self) -> None:
        self._check_gpus()
        self.run_dir = Path(self.run_dir_override or self.cfg.run.dir)
        if not self.cfg.checkpoint.resume:
            archive_previous_run(self.run_dir)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.events_path = self.run_dir / JOB_EVENTS_FILE
        self.gate_path.unlink(missing_ok=True)
        self.secret_overrides = self._job_secret()
        if self.cfg.run.netns or self.cfg.security.wan == "tunnel":  # the demo's tunnel joins namespaces
            self._make_network()
        elif self.free_ports:
            g = f"http://127.0.0.1:{free_port()}"
            cs = [f"http://127.0.0.1:{free_port()}" for _ in range(self.cfg.topology.clusters)]
            self.addr_overrides = [f"lighthouse.global_addr='{g}'", "lighthouse.cluster_addrs=[" + ",".join(f"'{a}'" for a in cs) + "]"]
            self.global_addr, self.cluster_addrs = g, cs
            if self.cfg.sync.async_outer.enabled:  # the global model server, in the global lighthouse's process
                self.addr_overrides.append(f"sync.async_outer.addr='http://127.0.0.1:{free_port()}'")
        else:
            self.global_addr, self.cluster_addrs = self.cfg.lighthouse.global_addr, list(self.cfg.lighthouse.cluster_addrs)
        spare_ok = self.warm_spares and self.netns is None and self.cfg.topology.ranks_per_replica == 1 and not self.cfg.run.program
        self.spares = WarmSpares(self.python, self.run_dir / "logs", enabled=spare_ok)

    def _make_network(self) -> None:
        """run.netns: one namespace per cluster and a hub; lighthouses at their addresses."""
        from hier_localsgd.launch.netns import ClusterNetwork

        lh = self.cfg.lighthouse
        _, gport = parse_address("lighthouse.global_addr", lh.global_addr)
        ports = [parse_address(f"lighthouse.cluster_addrs[{i}]", a)[1] for i, a in enumerate(lh.cluster_addrs)]
        secret = None
        if self.cfg.security.wan == "tunnel":
            from hier_localsgd.core.security.secret import SecurityConfig, load_secret

            secret = load_secret(SecurityConfig(secret_file=self._secret_path()))
        self.netns = ClusterNetwork(self.cfg.topology.clusters, tunnel_secret=secret, tunnel_mtu=self.cfg.security.tunnel_mtu)
        g = f"http://{self.netns.service_address('hub')}:{gport}"
        cs = [f"http://{self.netns.service_address(i)}:{ports[i] if i < len(ports) else 29511}" for i in range(self.cfg.topology.clusters)]
        self.addr_overrides = [f"lighthouse.global_addr='{g}'", "lighthouse.cluster_addrs=[" + ",".join(f"'{a}'" for a in cs) + "]"]
        self.global_addr, self.cluster_addrs = g, cs
        if self.cfg.sync.async_outer.enabled:  # the global model server, in the hub with the global lighthouse
            _, mport = parse_address("sync.async_outer.addr", self.cfg.sync.async_outer.addr)
            self.addr_overrides.append(f"sync.async_outer.addr='http://{self.netns.service_address('hub')}:{mport}'")

    def _job_secret(self) -> List[str]:
        """A local job without a secret of its own gets one (``<run.dir>/job.secret``, mode
        0600, kept across resumes): its heals are authenticated like a deployment's."""
        from hier_localsgd.core.security.secret import SECRET_ENV, keygen

        if self.cfg.security.secret_file or os.environ.get(SECRET_ENV):
            return []
        path = self.run_dir / "job.secret"
        if not path.exists():
            keygen(str(path))
        return [f"security.secret_file={path}"]

    def _secret_path(self) -> str:
        """The job secret's file ("" when it comes in the environment)."""
        return self.cfg.security.secret_file or (str(self.run_dir / "job.secret") if self.secret_overrides else "")

    @staticmethod
    def _where(role: str) -> Union[int, str]:
        """The namespace of a lighthouse role: the hub's, or its cluster's."""
        return "hub" if role == "global" else int(role[len("cluster"):])

    # -- processes -------------------------------------------------------------
    def _args(self) -> List[str]:
        return (list(self.overrides) + self.addr_overrides + self._backend_overrides() + self.secret_overrides
                + [f"run.dir={self.run_dir}"])

    def _backend_overrides(self) -> List[str]:
        """Every group on this host: Gloo for the ``auto`` levels that groups sharing a GPU
        cannot run over NCCL (core/runtime/device.py one_host_backends)."""
        from hier_localsgd.core.runtime.device import one_host_backends

        b, t = self.cfg.train.backends, self.cfg.topology
        chosen = one_host_backends(self.cfg.train.device, {"group": b.group, "inner": b.inner, "outer": b.outer},
                                   t.ranks_per_replica, t.clusters * t.replicas_per_cluster)
        return [f"train.backends.{lv}={name}" for lv, name in sorted(chosen.items())]

    def _check_gpus(self) -> None:
        """On CUDA, every process of this host gets a GPU of its own; a host with fewer GPUs
        than the job's processes is refused here, in one line, before anything starts,
        unless train.share_gpus is set."""
        from hier_localsgd.core.runtime.device import gpu_count, resolve_device
        from hier_localsgd.errors import ConfigError

        t, tr = self.cfg.topology, self.cfg.train
        if tr.gpu_slot >= 0 and t.clusters * t.replicas_per_cluster > 1:
            raise ConfigError(f"train.gpu_slot: {tr.gpu_slot} — a local job places each of its groups itself; leave it at -1")
        if tr.gpu_slot >= 0 or tr.share_gpus or resolve_device(tr.device).type != "cuda":
            return
        need, have = t.clusters * t.replicas_per_cluster * t.ranks_per_replica, gpu_count()
        if need > have:
            raise ConfigError(f"train.share_gpus: false — this host has {have} GPU(s) and the job's {need} processes "
                              f"({t.clusters} x {t.replicas_per_cluster} groups x {t.ranks_per_replica} ranks) need one each; "
                              "set train.share_gpus=true to share them (levels between processes sharing a GPU then use Gloo)")

    def _gpu_slot(self, cluster: int, replica: int) -> List[str]:
        """Every group of this host its own GPUs (core/runtime/device.py group_gpus), unless
        the user placed them (train.gpu_slot set) or the job trains on the CPU."""
        from hier_localsgd.core.runtime.device import resolve_device

        if self.cfg.train.gpu_slot >= 0 or resolve_device(self.cfg.train.device).type != "cuda":
            return []
        return [f"train.gpu_slot={cluster * self.cfg.topology.replicas_per_cluster + replica}"]

    def _spawn(self, name: str, argv: List[str], where: Union[int, str, None] = None, env: Optional[Dict[str, str]] = None) -> Proc:
        if self.netns is not None and where is not None:
            argv = self.netns.wrap(argv, where)  # same pid: `ip netns exec` and the wrapper exec
        log = self.run_dir / "logs" / f"{name}.log"
        f = open(log, "ab")
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env={**child_env(), **(env or {})}, start_new_session=True)
        f.close()
        return Proc(name=name, popen=p, started=time.time(), log=log)

    def lighthouse_roles(self) -> List[Tuple[str, str, str]]:
        """(role, config field, address) of every lighthouse this job runs: ``global``,
        then ``cluster<i>`` in hier mode (the baselines use only the global one)."""
        out = [("global", "lighthouse.global_addr", self.global_addr)]
        if self.cfg.sync.mode == "hier":
            out += [(f"cluster{i}", f"lighthouse.cluster_addrs[{i}]", a) for i, a in enumerate(self.cluster_addrs)]
        return out

    def start_lighthouse(self, role: str, timeout_s: float = 60.0) -> Proc:
        """Starts one lighthouse (its own process, so it can fail and return alone) at its
        configured address and waits until it accepts connections."""
        proc = self._spawn_lighthouse(role)
        self._await_lighthouse(role, proc, time.time() + timeout_s)
        return proc

    def start_lighthouses(self, timeout_s: float = 60.0) -> None:
        """Starts every lighthouse, one process each, all at once (each spends seconds on its
        imports), and waits until each accepts connections."""
        procs = [(role, self._spawn_lighthouse(role)) for role, _, _ in self.lighthouse_roles()]
        deadline = time.time() + timeout_s
        for role, proc in procs:
            self._await_lighthouse(role, proc, deadline)

    def _spawn_lighthouse(self, role: str) -> Proc:
        fieldname, addr = next((f, a) for r, f, a in self.lighthouse_roles() if r == role)
        serve = ["lighthouse.serve=global"] if role == "global" else ["lighthouse.serve=cluster", f"lighthouse.cluster={self._where(role)}"]
        prev = self.lighthouses.get(role)
        if prev is None and self.netns is None and port_in_use(fieldname, addr, self.cfg.lighthouse.bind):
            # A foreign listener would answer the probe below as if it were ours.
            fail(fieldname, f"{addr}: port {parse_address(fieldname, addr)[1]} is already in use (another process listens there); "
                 "free it, or let the launcher pick free ports (demo.free_ports=true)")
        proc = self._spawn(f"lighthouse_{role}", [self.python, "-m", "hier_localsgd", "lighthouse", *self._args(), *serve], self._where(role))
        if prev is not None:
            proc.restarts = prev.restarts + 1
        self.lighthouses[role] = proc
        self._record({"t": proc.started, "event": "restart" if prev else "start", "key": role, "pid": proc.popen.pid})
        return proc

    def _await_lighthouse(self, role: str, proc: Proc, deadline: float) -> None:
        """Probes ``role``'s address until it answers; raises if its process exits first or
        ``deadline`` passes."""
        from datetime import timedelta

        fieldname, addr = next((f, a) for r, f, a in self.lighthouse_roles() if r == role)
        while True:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{fieldname}: lighthouse process exited with {proc.popen.returncode}; see {proc.log}")
            try:
                if self.netns is not None:  # from inside its namespace (the launcher is outside)
                    self.netns.run_in(self._where(role), lambda: probe_lighthouse(fieldname, addr, timedelta(seconds=1)))
                else:
                    probe_lighthouse(fieldname, addr, timedelta(seconds=1))
                self._record({"t": time.time(), "event": "up", "key": role, "pid": proc.popen.pid})
                return
            except LighthouseUnreachable:
                if time.time() > deadline:
                    raise
                time.sleep(0.1)

    def kill_lighthouse(self, role: str, sig: int = signal.SIGKILL) -> None:
        """Signals one lighthouse (SIGKILL: it dies; SIGSTOP: it goes silent) and records it."""
        p = self.lighthouses[role].popen
        if p.poll() is None:
            self._record({"t": time.time(), "event": "kill", "key": role, "signal": signal.Signals(sig).name, "pid": p.pid})
            os.kill(p.pid, sig)

    def start_replica(self, cluster: int, replica: int, extra: Sequence[str] = ()) -> Proc:
        prev = self.replicas.get((cluster, replica))
        if prev is not None and not extra:
            extra = prev.extra  # a restart keeps the original arguments
        host = [f"run.hostname={self.netns.service_address(cluster)}"] if self.netns is not None else []  # its namespace's address
        train = ["-m", "hier_localsgd", "train", *self._args(), f"run.cluster={cluster}", f"run.replica={replica}", *host,
                 *self._gpu_slot(cluster, replica), *extra]
        env: Dict[str, str] = {}
        if self.cfg.run.program:  # a user's program (job.py): its overrides come in the environment
            env[OVERRIDES_ENV] = json.dumps(train[3:])
            # ... and it imports this launcher's hier_localsgd, installed or not
            here = str(Path(__file__).resolve().parents[2])
            env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])
            train = [str(Path(self.cfg.run.program).resolve())]
        g = self.cfg.topology.ranks_per_replica
        if g > 1:
            # One replica group = one torchrun: a dying rank takes the group down and
            # torchrun restarts all of it (it then heals as one). One log file per rank;
            # the group's log shows rank 0. No listener on every interface (rendezvous.py):
            # the rendezvous in a file of this launch's own.
            ranks_dir = self.run_dir / "logs" / f"c{cluster}r{replica}.ranks"
            ranks_dir.mkdir(parents=True, exist_ok=True)
            store_file = ranks_dir / f"rendezvous.{(prev.restarts + 1) if prev is not None else 0}"
            store_file.unlink(missing_ok=True)  # one left by an earlier launch of this run directory
            train = [
                "-m", "torch.distributed.run", *one_host_args(str(store_file)), f"--nproc-per-node={g}",
                f"--max-restarts={self.torchrun_restarts}", "--tee=3", "--local-ranks-filter=0",
                f"--log-dir={ranks_dir}", *train,
            ]
            env.update(RENDEZVOUS_ENV)
        name = f"c{cluster}r{replica}"
        if prev is None:
            stop_path(self.run_dir, cluster, replica).unlink(missing_ok=True)  # one left by an earlier launch
        log = self.run_dir / "logs" / f"{name}.log"
        taken = self.spares.take(train[2:], log) if prev is not None and self.spares.enabled else None
        if taken is not None:
            proc = Proc(name=name, popen=taken[0], started=time.time(), log=log, spare=taken[1])
        else:
            proc = self._spawn(name, [self.python, *train], cluster, env)
        proc.extra = tuple(extra)
        if prev is not None:
            proc.restarts = prev.restarts + 1
        self.replicas[(cluster, replica)] = proc
        how = {}
        if prev is not None:
            # warm: the spare had finished its imports when it got the restart
            how = {"spare": bool(proc.spare), "warm": proc.spare == "ready"}
        self._record({"t": proc.started, "event": "restart" if prev else "start", "key": (cluster, replica), "pid": proc.popen.pid, **how})
        return proc

    def _record(self, entry: dict) -> None:
        """Keeps the entry and appends it to ``<run_dir>/job_events.jsonl`` (the dashboard reads it).

        ``key`` is a replica group's (cluster, replica), a lighthouse's role, or a
        cluster (an int: its network, run.netns)."""
        self.history.append(entry)
        line = {k: v for k, v in entry.items() if k not in ("key", "last_status")}
        if isinstance(entry["key"], str):
            line.update(kind=entry["event"], lighthouse=entry["key"])
        elif isinstance(entry["key"], int):
            line.update(kind=entry["event"], cluster=entry["key"])
        else:
            c, r = entry["key"]
            line.update(kind=entry["event"], cluster=c, replica=r)
        with open(self.events_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def start_all(self, order: Optional[Sequence[Key]] = None, stagger_s: float = 0.0, gate: bool = True) -> None:
        """Starts every replica group (in ``order``, ``stagger_s`` apart).

        With ``gate``, they all wait at a start gate that opens once every one of
        them reports ``ready`` (model built, Managers heartbeating), so a fast
        starter does not train alone while the others are still importing.
        """
        keys = list(order) if order is not None else self.keys()
        extra = [f"run.start_gate={self.gate_path}"] if gate else []
        self.gate_path.unlink(missing_ok=True)  # one opened by an earlier start_all (a restart of every group)
        for i, (c, r) in enumerate(keys):
            if i and stagger_s:
                time.sleep(stagger_s)
            self.start_replica(c, r, extra)
        if gate:
            self.open_gate_when_ready(self.cfg.timeouts.startup)

    @property
    def gate_path(self) -> Path:
        return self.run_dir / "start_gate"

    def open_gate_when_ready(self, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            states = [(self.last_status(k) or {}).get("state") for k in self.replicas]  # this start's, not a stopped one's
            exited = [p.popen.poll() is not None for p in self.replicas.values()]
            if all(s in ("ready", "running", "finished") or e for s, e in zip(states, exited)):
                break
            time.sleep(0.1)
        self.gate_path.touch()

    def keys(self) -> List[Key]:
        t = self.cfg.topology
        return [(c, r) for c in range(t.clusters) for r in range(t.replicas_per_cluster)]

    # -- observation -----------------------------------------------------------
    def status(self, key: Key) -> Optional[dict]:
        return read_json(replica_dir(self.run_dir, *key) / "status.json")

    def result(self, key: Key) -> Optional[dict]:
        """The replica group's result, or None if there is none from the process this job started
        last for ``key`` (a file older than that start is an earlier run's, e.g. before a resume)."""
        path = replica_dir(self.run_dir, *key) / "result.json"
        proc = self.replicas.get(key)
        try:
            if proc is not None and path.stat().st_mtime < proc.started:
                return None
        except FileNotFoundError:
            return None
        return read_json(path)

    def last_status(self, key: Key) -> Optional[dict]:
        """``status.json`` if the process this job started last for ``key`` wrote it, else None."""
        st = self.status(key)
        proc = self.replicas.get(key)
        if st is None or proc is None or float(st.get("started_at") or 0) < proc.started:
            return None
        return st

    def exit_codes(self) -> Dict[Key, Optional[int]]:
        return {k: self._exit_code(k, p.popen.poll()) for k, p in self.replicas.items()}

    def _exit_code(self, key: Key, code: Optional[int]) -> Optional[int]:
        """A group that stopped for good under torchrun (core/runtime/status.stop_path) counts as
        exit 2 whatever torchrun returned after its restarts."""
        if code not in (None, 0, 2) and stop_path(self.run_dir, *key).exists():
            return 2
        return code

    def wait(
        self,
        timeout_s: float,
        tick: Optional[Callable[[], Optional[bool]]] = None,
        tick_every_s: float = 1.0,
        restart: bool = False,
        restart_delay_s: float = 2.0,
        max_restarts: int = 100,
    ) -> Dict[Key, Optional[int]]:
        """Waits until every replica process has exited for good or ``timeout_s`` passes.

        With ``restart``, a replica group that exits non-zero (other than 2, a
        configuration error) is started again after ``restart_delay_s``, as the
        launch script or torchelastic would; it rejoins and heals. A lighthouse
        that exits is started again at its address after
        ``lighthouse.restart_delay_s`` unless ``lighthouse.supervise`` is false.
        ``tick`` runs about every ``tick_every_s``; one that returns ``True`` ends the wait at
        once (``sync.outer.auto``'s link watch: experiments/auto_watch.py).
        Returns the replica groups' exit codes (None: still running).
        """
        deadline = time.time() + timeout_s
        if restart:
            self.spares.ensure(child_env())
        seen_exit: Dict[Key, int] = {}
        due: Dict[Key, float] = {}
        lh = self.cfg.lighthouse
        lh_due: Dict[str, float] = {}
        while time.time() < deadline:
            now = time.time()
            # Lighthouses are supervised like replica groups: a dead one comes back at its
            # own address; the replica processes ride out the outage (sync.outage_limit_s).
            for role, proc in self.lighthouses.items():
                code = proc.popen.poll()
                if code is None or seen_exit.get(role) == proc.popen.pid:  # type: ignore[call-overload]
                    continue
                seen_exit[role] = proc.popen.pid  # type: ignore[index]
                self._record({"t": now, "event": "exit", "key": role, "code": code, "pid": proc.popen.pid})
                if lh.supervise:
                    lh_due[role] = now + lh.restart_delay_s
            for role in [r for r, t in lh_due.items() if t <= now]:
                del lh_due[role]
                self.start_lighthouse(role)
            for key, proc in self.replicas.items():
                code = self._exit_code(key, proc.popen.poll())
                if code is None or seen_exit.get(key) == proc.popen.pid:
                    continue
                seen_exit[key] = proc.popen.pid
                # What the process published last (its work counters): kept in memory, not in job_events.jsonl.
                self._record({"t": now, "event": "exit", "key": key, "code": code, "pid": proc.popen.pid, "last_status": self.last_status(key)})
                if restart and code not in (0, 2) and proc.restarts < max_restarts:
                    due[key] = now + restart_delay_s
            for key in [k for k, t in due.items() if t <= now]:
                del due[key]
                self.start_replica(*key)
            if restart and not due:
                self.spares.ensure(child_env())
            # Every exit recorded first: one that lands between the poll above and this check
            # would otherwise end the wait without its "exit" event.
            if not due and all(seen_exit.get(k) == p.popen.pid for k, p in self.replicas.items()):
                break
            if tick is not None and tick() is True:
                return self.exit_codes()
            time.sleep(min(tick_every_s, 0.2) if due else tick_every_s)
        if tick is not None:
            tick()
        return self.exit_codes()

    # -- network faults (run.netns) ----------------------------------------------
    def partition(self, cluster: int) -> None:
        """Cuts cluster ``cluster`` (its lighthouse and replica groups) off the global
        lighthouse and the other clusters; inside the cluster nothing changes. Records it."""
        if self.netns is None:
            raise RuntimeError("partition: needs run.netns=true (each cluster in its own network namespace)")
        self.netns.partition(cluster)
        self._record({"t": time.time(), "event": "partition", "key": cluster})

    def heal(self, cluster: int) -> None:
        """Reconnects a partitioned cluster. Records it."""
        if self.netns is None:
            raise RuntimeError("heal: needs run.netns=true (each cluster in its own network namespace)")
        self.netns.heal(cluster)
        self._record({"t": time.time(), "event": "heal", "key": cluster})

    # -- teardown --------------------------------------------------------------
    def kill(self, key: Key, sig: int = signal.SIGKILL) -> None:
        p = self.replicas[key].popen
        if p.poll() is None:
            self._record({"t": time.time(), "event": "kill", "key": key, "signal": signal.Signals(sig).name, "pid": p.pid})
            os.killpg(p.pid, sig) if sig == signal.SIGKILL else p.send_signal(sig)

    def stop(self, grace_s: float = 10.0) -> None:
        self.spares.drop()
        self._terminate([p for p in self.replicas.values()] + list(self.lighthouses.values()), grace_s)
        if self.netns is not None:
            self.netns.close()  # never raises; kills whatever is still inside first

    def stop_replicas(self, reason: str, grace_s: float = 10.0) -> None:
        """Stops every replica group (SIGTERM, SIGKILL after ``grace_s``) and records it with
        ``reason``; the lighthouses and the network stay up (the whole job's groups restart)."""
        self.spares.drop()
        for key, p in self.replicas.items():
            if p.popen.poll() is None:
                self._record({"t": time.time(), "event": "stop", "key": key, "reason": reason, "pid": p.popen.pid})
        self._terminate(list(self.replicas.values()), grace_s)

    @staticmethod
    def _terminate(procs: Sequence[Proc], grace_s: float) -> None:
        for p in procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.time() + grace_s
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.popen.wait(timeout=10)

    def __enter__(self) -> "LocalJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
