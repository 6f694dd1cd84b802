"""Test harnesses with real lighthouses, real torchft Managers and real Gloo groups.

``ThreadedHier`` runs every replica group of a small topology as a thread of the
test process (torchft's own integration tests do the same): lighthouses are real
``LighthouseServer`` objects, each replica group has its own Managers, stores,
checkpoint servers and Gloo process groups. It is for algorithm-level checks that
need control over the local updates; whole-process behaviour (signals, exits,
restarts) is tested with real processes through ``hier_localsgd.launch.local``.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torchft.coordination import LighthouseServer

from hier_localsgd.core.runtime.faults import Fault, FaultPlan
from hier_localsgd.core.tensors.flat_params import FlatParams
from hier_localsgd.core.tensors.level import LevelAlgorithm
from hier_localsgd.core.links.lossy import LinkSpec
from hier_localsgd.core.runtime.phases import PhaseTracker
from hier_localsgd.config import Config, load_config
from hier_localsgd.sync.build import hier_settings
from hier_localsgd.sync.hier import HierarchicalSync, Identity
from hier_localsgd.sync.sections import PoisonConfig
from hier_localsgd.core.runtime.timeouts import Timeouts

FAST_TIMEOUTS = Timeouts.from_seconds(
    dict(connect=5, inner_quorum=30, inner_reduce=30, inner_commit=15, outer_quorum=30, outer_reduce=30, outer_commit=15, broadcast=30)
)


class Vec(nn.Module):
    """A 'model' that is one parameter vector; tests move it by hand."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n))


@dataclass
class Replica:
    key: Tuple[int, int]
    sync: HierarchicalSync
    flat: FlatParams
    opt: torch.optim.Optimizer
    events: List[Tuple[str, Dict[str, Any]]] = field(default_factory=list)

    def kinds(self, kind: str, **match: Any) -> List[Dict[str, Any]]:
        return [e for k, e in self.events if k == kind and all(e.get(a) == b for a, b in match.items())]


class ThreadedHier:
    """C clusters x R replica groups as threads over real lighthouses."""

    def __init__(
        self,
        clusters: int,
        replicas: int,
        h_inner: int,
        h_outer: int,
        inner: LevelAlgorithm = LevelAlgorithm.build("diloco"),
        outer: LevelAlgorithm = LevelAlgorithm.build("diloco"),
        numel: int = 3,
        faults: Sequence[Fault] = (),
        min_clusters: Optional[int] = None,
        timeouts: Timeouts = FAST_TIMEOUTS,
        heartbeat_timeout_ms: int = 2000,
        inner_link: Optional[LinkSpec] = None,
        outer_link: Optional[LinkSpec] = None,
        outer_delay: int = 0,
        outer_eager: bool = False,
        final_step: int = 0,
        outer_compression: str = "none",
        compression_block: int = 256,
        outer_fragments: tuple = (),
        early_quorum: bool = False,
        keep_local: bool = False,
        outer_max_staleness: int = 0,
        inner_max_staleness: int = 0,
        join_timeout_ms: int = 20000,
        quorum_slice: Optional[timedelta] = None,
        poison: Optional[PoisonConfig] = None,
    ) -> None:
        self.outer_fragments, self.early_quorum, self.keep_local = outer_fragments, early_quorum, keep_local
        self.outer_max_staleness, self.inner_max_staleness = outer_max_staleness, inner_max_staleness
        self.C, self.R = clusters, replicas
        self.outer_compression, self.compression_block = outer_compression, compression_block
        self.outer_delay, self.outer_eager, self.final_step = outer_delay, outer_eager, final_step
        kw = dict(join_timeout_ms=join_timeout_ms, quorum_tick_ms=20, heartbeat_timeout_ms=heartbeat_timeout_ms)
        self.global_lh = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_clusters or clusters, **kw)
        self.cluster_lh = [LighthouseServer(bind="127.0.0.1:0", min_replicas=1, **kw) for _ in range(clusters)]
        self.h_inner, self.h_outer = h_inner, h_outer
        self.inner, self.outer = inner, outer
        self.numel, self.faults, self.t = numel, list(faults), timeouts
        self.min_clusters = min_clusters or clusters
        self.inner_link, self.outer_link = inner_link, outer_link
        self.replicas: Dict[Tuple[int, int], Replica] = {}
        self.cfg = self.config(heartbeat_timeout_ms)
        self.direct: Dict[str, Any] = dict(
            inner_link=inner_link, outer_link=outer_link, final_step=final_step, outer_fragments=tuple(outer_fragments),
            quorum_slice=quorum_slice or timedelta(seconds=5), **({"poison": poison} if poison is not None else {}),
        )

    def config(self, heartbeat_timeout_ms: int) -> Config:
        """The job's config for these threads (built once: hydra's compose is not thread-safe)."""
        def level(name: str, a: LevelAlgorithm) -> List[str]:
            return [f"sync.{name}.algorithm={a.name}", f"sync.{name}.lr={a.lr}", f"sync.{name}.momentum={a.momentum}",
                    f"sync.{name}.nesterov={a.nesterov}"]

        return load_config([
            f"topology.clusters={self.C}", f"topology.replicas_per_cluster={self.R}",
            f"sync.inner.every={self.h_inner}", f"sync.outer.every={self.h_outer}", *level("inner", self.inner), *level("outer", self.outer),
            f"lighthouse.global_addr='{self.global_lh.address()}'",
            "lighthouse.cluster_addrs=[" + ",".join(f"'{lh.address()}'" for lh in self.cluster_lh) + "]",
            f"lighthouse.heartbeat_timeout_ms={heartbeat_timeout_ms}", "run.hostname=127.0.0.1",
            "sync.min_replicas=1", f"sync.min_clusters={self.min_clusters}", "sync.max_quorum_failures=3", "sync.max_commit_failures=5",
            f"sync.outer.delay={self.outer_delay}", f"sync.outer.eager={self.outer_eager}", f"sync.outer.compression={self.outer_compression}",
            f"sync.outer.compression_block={self.compression_block}", f"sync.inner.early_quorum={self.early_quorum}",
            f"sync.failed_round={'keep_local' if self.keep_local else 'rollback'}",
            f"sync.outer.max_staleness={self.outer_max_staleness}", f"sync.inner.max_staleness={self.inner_max_staleness}",
        ], validate_for="demo")

    def make(self, c: int, r: int) -> Replica:
        model = Vec(self.numel)
        flat = FlatParams(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # The hierarchy's settings come from the one function that maps the config
        # (sync/build.py); only what a config cannot name is set directly: emulated links
        # as objects, explicit fragment ranges, no final step (0), a quorum slice apart from
        # the heartbeat timeout, and a poison screen object.
        settings = replace(hier_settings(self.cfg, Identity(c, r), flat, model), **self.direct)
        events: List[Tuple[str, Dict[str, Any]]] = []
        sync = HierarchicalSync(
            settings, Identity(c, r), self.t, flat, opt, PhaseTracker(describe=f"c{c}r{r}"),
            lambda kind, **kw: events.append((kind, kw)), FaultPlan(self.faults, c, r),
        )
        rep = Replica((c, r), sync, flat, opt, events)
        self.replicas[(c, r)] = rep
        return rep

    def run(self, body: Callable[[Replica], None], timeout_s: float = 120.0) -> None:
        """Runs ``body(replica)`` in one thread per replica group; re-raises the first failure.

        Every replica group's Managers are up (heartbeating) before any body starts,
        so the first quorum includes everyone (otherwise the first arrival forms a
        quorum alone and the others heal from it: correct, but not what a test of
        exact arithmetic wants).
        """
        errors: List[str] = []
        ready = threading.Barrier(self.C * self.R, timeout=timeout_s)

        def target(c: int, r: int) -> None:
            try:
                rep = self.make(c, r)
                ready.wait()
                try:
                    body(rep)
                finally:
                    rep.sync.close()
            except BaseException:
                errors.append(f"c{c}r{r}:\n{traceback.format_exc()}")

        threads = [threading.Thread(target=target, args=(c, r), name=f"c{c}r{r}") for c in range(self.C) for r in range(self.R)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout_s)
        alive = [th.name for th in threads if th.is_alive()]
        if alive:
            raise AssertionError(f"replica threads still running after {timeout_s}s: {alive}")
        if errors:
            raise AssertionError("\n".join(errors))

    def close(self) -> None:
        self.global_lh.shutdown()
        for lh in self.cluster_lh:
            lh.shutdown()


_PARTICIPANTS = re.compile(r"\[(\d+)/(\d+) participants healthy\]")


def await_pending_requests(lighthouse_addr: str, n: int, bound_s: float = 60.0) -> bool:
    """Waits until ``n`` quorum requests are pending at the lighthouse (its status page's
    participant count), for at most ``bound_s``: a test orders who asks first by this,
    not by a sleep."""
    from hier_localsgd.core.ft.peers import fetch_status

    end = time.monotonic() + bound_s
    while time.monotonic() < end:
        html = fetch_status(lighthouse_addr, timedelta(seconds=2)) or ""
        m = _PARTICIPANTS.search(html)
        if m and int(m.group(2)) >= n:
            return True
        time.sleep(0.05)
    return False


def local_steps(rep: Replica, updates: Callable[[int, int, int], torch.Tensor], steps: int, record: Optional[Callable[[Replica], None]] = None) -> None:
    """Drives a replica: join, then per step add ``updates(c, r, step)`` to the model and let the sync run."""
    rep.sync.start()
    c, r = rep.key
    for _ in range(steps):
        rep.sync.before_forward()  # as the training loop does (an early inner quorum starts here)
        with torch.no_grad():
            rep.flat.data.add_(updates(c, r, rep.sync.counters.step))
        rep.sync.counters.step += 1
        rep.sync.after_optimizer_step()
        if record is not None:
            record(rep)


# ---------------------------------------------------------------------------
# Whole jobs as real processes (lighthouses + one `hier-localsgd train` each).

import time as _time  # noqa: E402
from pathlib import Path  # noqa: E402

from hier_localsgd.experiments.summary import summarize  # noqa: E402
from hier_localsgd.launch.local import LocalJob  # noqa: E402
from hier_localsgd.core.runtime.status import read_events, replica_dir  # noqa: E402

# Small topologies on 2 cores: short but bounded timeouts, fast lighthouses.
FAST_JOB = [
    "model=tiny",
    "train.batch_size=16",
    "lighthouse.quorum_tick_ms=50",
    "lighthouse.heartbeat_timeout_ms=2000",
    "lighthouse.join_timeout_ms=10000",
    "timeouts.connect=10",
    "timeouts.inner_quorum=30",
    "timeouts.inner_reduce=30",
    "timeouts.inner_commit=15",
    "timeouts.outer_quorum=30",
    "timeouts.outer_reduce=30",
    "timeouts.outer_commit=15",
    "timeouts.broadcast=30",
    "timeouts.local_step=30",
    "timeouts.watchdog_grace=10",
]


# A restarted replica group must find the job still running, or it finds it done, exits 0
# without a result and the run counts as inconsistent. A race against the others' remaining
# steps lost in CI (two cold torchrun workers took 47 s to come back under load, stop 40),
# so the others wait for it instead: each cluster's inner quorum needs both its groups
# (sync.min_replicas), the outer quorum both clusters (sync.min_clusters, the default), and
# the quorum deadlines outlast any cold restart.
WAIT_FOR_RESTART = ["sync.min_replicas=2", "timeouts.inner_quorum=240", "timeouts.outer_quorum=240"]


@dataclass
class JobRun:
    job: LocalJob
    codes: Dict[Tuple[int, int], Optional[int]]
    summary: Dict[str, Any]
    events: Dict[Tuple[int, int], List[Dict[str, Any]]]

    def kinds(self, key: Tuple[int, int], kind: str, **match: Any) -> List[Dict[str, Any]]:
        return [e for e in self.events[key] if e["kind"] == kind and all(e.get(a) == b for a, b in match.items())]


def run_job(
    run_dir: Path,
    overrides: Sequence[str],
    timeout_s: float = 240.0,
    during: Optional[Callable[[LocalJob], None]] = None,
    restart: bool = False,
    restart_delay_s: float = 1.0,
    order: Optional[Sequence[Tuple[int, int]]] = None,
    stagger_s: float = 0.0,
    gate: bool = True,
    warm_spares: bool = False,
) -> JobRun:
    """Runs a whole job to completion as real processes and collects what they published.

    ``during(job)`` is called about every 0.2 s while the job runs (to kill or
    signal processes); ``restart`` restarts replica groups that exit non-zero.
    """
    overrides = [*FAST_JOB, *overrides, f"run.dir={run_dir}"]
    cfg = load_config(overrides, validate_for="demo")
    t0 = _time.time()
    job = LocalJob(cfg, overrides, warm_spares=warm_spares)
    with job:
        job.start_lighthouses()
        job.start_all(order=order, stagger_s=stagger_s, gate=gate)
        tick = (lambda: during(job)) if during is not None else None
        codes = job.wait(timeout_s, tick=tick, tick_every_s=0.2, restart=restart, restart_delay_s=restart_delay_s)
    summary = summarize(cfg, job, _time.time() - t0)
    events = {k: read_events(replica_dir(run_dir, *k) / "events.jsonl") for k in job.keys()}
    return JobRun(job, codes, summary, events)


def when_step(key: Tuple[int, int], step: int, action: Callable[[LocalJob], None]) -> Callable[[LocalJob], None]:
    """A ``during`` callback that runs ``action`` once, when ``key`` reports ``step``."""
    fired = {"done": False}

    def cb(job: LocalJob) -> None:
        if fired["done"]:
            return
        st = job.status(key) or {}
        if int(st.get("step", 0)) >= step and st.get("state") == "running":
            fired["done"] = True
            fired["t"] = _time.time()
            fired["phase"] = st.get("phase")
            action(job)

    cb.fired = fired  # type: ignore[attr-defined]
    return cb


def first_commit_after(run: JobRun, keys: Sequence[Tuple[int, int]], t: float, level: str = "inner") -> Optional[float]:
    """Seconds from ``t`` to the first commit (at ``level``) by any of ``keys`` after ``t``."""
    times = [e["t"] for k in keys for e in run.kinds(k, "commit", level=level) if e["t"] > t]
    return min(times) - t if times else None


def logs_tail(run: JobRun, n: int = 3000) -> str:
    out = []
    for p in sorted((run.job.run_dir / "logs").glob("*.log")):
        out.append(f"==== {p.name}\n{p.read_text(errors='replace')[-n:]}")
    return "\n".join(out)


def listeners() -> list:
    """(local address, pid) of every listening TCP socket on this host (ss)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        for pid in (int(p) for p in re.findall(r"pid=(\d+)", line)):
            found.append((parts[3], pid))
    return found


def process_tree(pid: int) -> set:
    """``pid`` and its descendants."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        children.setdefault(pp, []).append(p)
    seen, todo = set(), [pid]
    while todo:
        p = todo.pop()
        if p not in seen:
            seen.add(p)
            todo.extend(children.get(p, []))
    return seen

def job_listeners(job: LocalJob) -> Dict[str, int]:
    """{local address: pid} of every listening TCP socket of the job's processes (its
    lighthouses, replica groups, and their children: torchrun's agents and workers)."""
    pids: set = set()
    for proc in [*job.lighthouses.values(), *job.replicas.values()]:
        pids |= process_tree(proc.popen.pid)
    return {addr: pid for addr, pid in listeners() if pid in pids}


def wildcard(seen: Dict[str, int]) -> Dict[str, int]:
    """Those of ``seen`` (:func:`job_listeners`) that listen on every interface."""
    return {a: p for a, p in seen.items() if a.rsplit(":", 1)[0] in ("0.0.0.0", "*", "[::]", "::")}
