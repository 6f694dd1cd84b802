"""Non-circular checks of the link model on real, kernel-shaped links (issue #14 §2).

The user-space emulation (lossy.py) makes a collective last its analytic ring bound by
sleeping until it; comparing that emulation against the same bound proves nothing. Here
the bound meets a link it does not control: one process per cluster, each in its own
network namespace (netns.py), joined through veth pairs and a bridge whose cluster
uplinks the kernel shapes with ``tbf`` at the rate under test. The processes form the
project's own level process group (:class:`~hier_localsgd.core.links.link.LinkProcessGroup` around
torchft's Gloo group, as an outer level would) and time model-sized all-reduces.

Three figures, each measured against something it was not derived from:

* ``time_vs_bound`` — the all-reduce's wall time on the shaped link ÷ the ring bound
  ``2(n-1)/n · S / B`` for the shaped rate ``B`` (the planner's and emulator's model), less
  the bytes tbf's bucket lets through at once (``netns.tbf_transfer_s``) on kernel links.
* ``wire_vs_analytic`` — bytes each process's uplink really sent (its interface's
  ``tx_bytes`` in ``/proc/net/dev``, headers and TCP acknowledgements included) ÷ the
  analytic ring count ``2(n-1)/n · S`` (link.py's accounting). Above 1 by the
  Ethernet/IP/TCP headers and the acknowledgements of what the process received.
* ``emulated_vs_kernel`` — the same all-reduce on unshaped links with the user-space
  emulation at the same rate ÷ the kernel-shaped time.

``op="int8"`` times the outer level's compressed all-reduce instead
(core/tensors/compressed_allreduce.py: all-to-all of int8 shards, dequantize and sum, requantize,
all-gather), ``op="topk2"`` the sparse 2-bit one (core/tensors/sparse.py: an all-gather of
sparse payloads, 4 of every 256 elements kept); the bound and the analytic bytes are those
of the compressed payload. ``busy=N``
runs N processes spinning on the CPU alongside (as training does next to an overlapped
outer round), to separate the link's cost from CPU contention.

What is real and what is not: bandwidth is the kernel's (tbf's token bucket on both
ends of each uplink); there is no added latency (``tc netem`` is not available on these
machines, so a latency term, if wanted, would come from user space and is left out:
the α term of the bound is 0 here); all processes share this machine's cores, so a
collective's own compute (Gloo's reduction, copies) adds to the time as it would on a
real host.

Failure semantics: every wait has a timeout (the store, the process group, the
workers' exit); a worker that fails or times out makes :func:`measure` raise
:class:`LinkCheckError` with its stderr tail; the network is always removed
(``ClusterNetwork.close``), also on failure.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional

from hier_localsgd import costs
from hier_localsgd.core.security.secret import TUNNEL_MTU

STORE_PORT = 29517  # inside a fresh namespace: nothing else listens there
WORKER_TIMEOUT = timedelta(seconds=300)


class LinkCheckError(RuntimeError):
    """A worker failed or timed out; the message carries its stderr tail."""


@dataclass
class Measurement:
    """One configuration's figures (medians over repetitions; every repetition kept)."""

    clusters: int
    rate_mbit: float
    nbytes: int
    mode: str  # "kernel" (tbf-shaped, no emulation) or "emulated" (unshaped, user-space rate)
    op: str = "allreduce"  # or "int8": the compressed all-reduce
    busy: int = 0  # CPU-spinning processes alongside
    burst_bytes: Optional[int] = None  # tbf's bucket (kernel mode)
    times_s: List[float] = field(default_factory=list)  # slowest rank, per repetition
    tx_bytes: List[float] = field(default_factory=list)  # mean over ranks, per repetition
    bound_s: float = 0.0
    analytic_bytes: float = 0.0
    tunnel: bool = False  # through the WireGuard mesh (security.wan=tunnel; launch/tunnel.py)

    @property
    def time_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def time_vs_bound(self) -> float:
        return self.time_s / self.bound_s

    @property
    def wire_vs_analytic(self) -> float:
        return statistics.median(self.tx_bytes) / self.analytic_bytes

    def as_dict(self) -> Dict[str, Any]:
        return {**asdict(self), "time_s": self.time_s, "time_vs_bound": self.time_vs_bound, "wire_vs_analytic": self.wire_vs_analytic}


def _worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One rank: forms the group, times ``reps`` all-reduces, reads its uplink's counters."""
    import torch
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

    from hier_localsgd.core.links.link import LinkProcessGroup
    from hier_localsgd.core.links.lossy import LinkSpec
    from hier_localsgd.launch.netns import read_net_dev

    rank, world = spec["rank"], spec["world"]
    timeout = timedelta(seconds=spec["timeout_s"])
    port = spec.get("port", STORE_PORT)
    store = TCPStore(spec["host"], port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    lat = spec.get("emulate_latency_s", 0.0)
    emu = LinkSpec(bandwidth_Bps=spec["emulate_Bps"], latency_s=lat) if spec["emulate_Bps"] or lat else None
    pg = LinkProcessGroup("outer", timeout, emulation=emu)
    pg.configure(f"{spec['host']}:{port}/linkcheck", f"linkcheck_{rank}", rank, world)
    t = torch.randn(spec["nbytes"] // 4, generator=torch.Generator().manual_seed(rank))
    small = torch.zeros(1)

    def allreduce(x: torch.Tensor) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        opts.timeout = timeout
        pg.allreduce([x], opts).wait()

    if spec.get("op", "allreduce") == "int8":
        from hier_localsgd.core.tensors.compressed_allreduce import compressed_allreduce

        def payload(x: torch.Tensor) -> None:
            compressed_allreduce(x, pg, "int8", timeout=timeout, rank=rank, world=world)
    elif spec.get("op") == "topk2":
        from hier_localsgd.core.tensors import sparse

        def payload(x: torch.Tensor) -> None:
            enc, _ = sparse.encode(x, sparse.MAX_CHUNK, sparse.DEFAULT_TOPK)
            sparse.sparse_allreduce_sum(x, pg, sparse.MAX_CHUNK, sparse.DEFAULT_TOPK, enc, timeout=timeout, rank=rank, world=world)
    else:
        payload = allreduce

    def tx() -> int:
        return read_net_dev(Path("/proc/net/dev").read_text())[spec["iface"]][1]

    warm = t.clone()
    payload(warm)  # warm-up: connections, buffers
    times, sent = [], []
    for _ in range(spec["reps"]):
        allreduce(small)  # start together
        x = t.clone()
        before = tx()
        t0 = time.perf_counter()
        payload(x)
        times.append(time.perf_counter() - t0)
        allreduce(small)  # everyone's receive is over before the counter is read
        sent.append(tx() - before)
    store.set(f"done{rank}", "1")
    if rank == 0:  # keep the store up until every rank has finished with it
        store.wait([f"done{r}" for r in range(world)], timeout)
    # The warm-up's result, summed: a caller can check the bytes arrived intact (the exact
    # all-reduce is the sum of every rank's seeded tensor).
    return {"rank": rank, "times_s": times, "tx_bytes": sent, "result_sum": float(warm.double().sum())}


def measure(clusters: int = 2, rate_mbit: float = 50.0, nbytes: int = 4 * 1024 * 1024, reps: int = 3, modes: tuple = ("kernel", "emulated"),
            op: str = "allreduce", busy: int = 0, burst_bytes: Optional[int] = None, tunnel: bool = False,
            tunnel_mtu: int = TUNNEL_MTU) -> List[Measurement]:
    """Times ``reps`` all-reduces of ``nbytes`` among ``clusters`` processes (one per
    cluster namespace) for each mode, on a fresh cluster network removed afterwards
    (``op``, ``busy``: the module's docstring); ``tunnel``: inside the network's WireGuard
    mesh (the shaped uplinks then carry WireGuard's packets, overhead included), its
    interfaces at ``tunnel_mtu`` (security.tunnel_mtu).

    Raises:
        LinkCheckError: a worker failed or timed out.
        netns.NetnsError: namespaces cannot be built here (see ``netns.available``).
    """
    rate = rate_mbit * 1e6
    if op == "int8":
        from hier_localsgd.core.tensors.compressed_allreduce import compressed_allreduce_bytes

        sent = compressed_allreduce_bytes(nbytes // 4, clusters, "int8")  # per rank, both collectives
        analytic = float(sent)
    elif op == "topk2":
        from hier_localsgd.core.tensors import sparse

        analytic = float(sparse.sparse_allreduce_bytes(nbytes // 4, clusters, sparse.MAX_CHUNK, sparse.DEFAULT_TOPK))
    elif op == "allreduce":
        analytic = costs.ring_allreduce_bytes(nbytes, clusters)
    else:
        raise ValueError(f"linkcheck: op {op!r} — expected allreduce, int8 or topk2")
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        return _measure(clusters, rate, rate_mbit, nbytes, reps, modes, op, busy, analytic, burst_bytes, tunnel, tunnel_mtu)
    finally:
        for b in burners:
            b.kill()
            b.wait()


def _measure(clusters: int, rate: float, rate_mbit: float, nbytes: int, reps: int, modes: tuple, op: str, busy: int,
             analytic: float, burst_bytes: Optional[int] = None, tunnel: bool = False,
             tunnel_mtu: int = TUNNEL_MTU) -> List[Measurement]:
    import secrets

    from hier_localsgd.launch.netns import ClusterNetwork, tbf_burst_bytes, tbf_transfer_s

    burst = tbf_burst_bytes(rate) if burst_bytes is None else burst_bytes

    out = []
    with ClusterNetwork(clusters, tunnel_secret=secrets.token_bytes(32) if tunnel else None, tunnel_mtu=tunnel_mtu) as net:
        for mode in modes:
            for c in range(clusters):
                if mode == "kernel":
                    net.shape(c, rate, burst_bytes=burst)
                else:
                    net.unshape(c)
            # The emulator sleeps up to the bound at the rate; tbf first lets its bucket through.
            kernel = mode == "kernel"
            bound = tbf_transfer_s(analytic, rate, burst) if kernel else analytic / (rate / 8)
            m = Measurement(clusters, rate_mbit, nbytes, mode, op, busy, burst if kernel else None, bound_s=bound, analytic_bytes=analytic,
                            tunnel=tunnel)
            results = run_workers(net, clusters, nbytes, reps, rate / 8 if mode == "emulated" else 0.0, op)
            for i in range(reps):
                m.times_s.append(max(r["times_s"][i] for r in results))
                m.tx_bytes.append(sum(r["tx_bytes"][i] for r in results) / len(results))
            out.append(m)
    return out


def run_workers(net: Any, clusters: int, nbytes: int, reps: int, emulate_Bps: float, op: str = "allreduce",
                 emulate_latency_s: float = 0.0, port: int = STORE_PORT) -> List[Dict[str, Any]]:
    """One worker per cluster on ``net`` (a :class:`~hier_localsgd.launch.netns.ClusterNetwork`,
    or anything with its ``service_address``, ``cluster_iface`` and ``wrap``); their results.
    ``port``: the workers' store (a free one where the network is shared, as loopback is)."""
    procs = []
    for c in range(clusters):
        spec = {"rank": c, "world": clusters, "host": net.service_address(0), "port": port, "nbytes": nbytes, "reps": reps, "op": op,
                "emulate_Bps": emulate_Bps, "emulate_latency_s": emulate_latency_s, "iface": net.cluster_iface(c),
                "timeout_s": WORKER_TIMEOUT.total_seconds() / 2}
        argv = net.wrap([sys.executable, "-m", "hier_localsgd.experiments.linkcheck", json.dumps(spec)], where=c)
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    deadline = time.monotonic() + WORKER_TIMEOUT.total_seconds()
    try:
        for c, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as e:
                raise LinkCheckError(f"linkcheck worker of cluster {c} did not finish in {WORKER_TIMEOUT}") from e
            if p.returncode != 0:
                raise LinkCheckError(f"linkcheck worker of cluster {c} exited {p.returncode}: {err.strip()[-1500:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def report(ms: List[Measurement]) -> str:
    """A markdown table of the measurements, with the emulated-vs-kernel ratio per configuration."""
    lines = ["| clusters | rate | payload | op | busy | mode | time (s) | ring bound (s) | time/bound | wire bytes/analytic |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m in ms:
        lines.append(f"| {m.clusters} | {m.rate_mbit:g} Mbit/s | {m.nbytes / 2**20:.1f} MiB | {m.op} | {m.busy} | {m.mode} | {m.time_s:.3f} | "
                     f"{m.bound_s:.3f} | {m.time_vs_bound:.3f} | {m.wire_vs_analytic:.3f} |")
    kernel = {(m.clusters, m.rate_mbit, m.nbytes, m.op, m.busy): m for m in ms if m.mode == "kernel"}
    for m in ms:
        k = kernel.get((m.clusters, m.rate_mbit, m.nbytes, m.op, m.busy))
        if m.mode == "emulated" and k is not None:
            lines.append(f"\nemulated/kernel time, {m.clusters} clusters at {m.rate_mbit:g} Mbit/s, "
                         f"{m.nbytes / 2**20:.1f} MiB: {m.time_s / k.time_s:.3f}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m hier_localsgd.experiments.linkcheck '<worker spec json>'`` (a worker), or with
    ``--sweep OUT.json`` a sweep over rates and cluster counts, printed as markdown."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] != "--sweep":
        print(json.dumps(_worker(json.loads(args[0]))), flush=True)
        return 0
    from hier_localsgd.launch.netns import available

    why = available()
    if why is not None:
        print(f"linkcheck: cannot run: {why}")
        return 2
    ms: List[Measurement] = []
    for clusters in (2, 3):
        for rate in (100.0, 20.0):
            ms += measure(clusters=clusters, rate_mbit=rate, nbytes=8 * 1024 * 1024, reps=3)
            print(report(ms[-2:]), flush=True)
    print(report(ms))
    if len(args) > 1:
        Path(args[1]).write_text(json.dumps([m.as_dict() for m in ms], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
