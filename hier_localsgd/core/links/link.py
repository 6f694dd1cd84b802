"""The process group of one level's links: a torchft ProcessGroup wrapper.

Each level (inner: a cluster's replica groups; outer: the clusters' leaders) gets
its own :class:`LinkProcessGroup` around a reconfigurable torchft
``ProcessGroupGloo``. The torchft Manager of that level reconfigures it on every
quorum change. The wrapper:

* counts the bytes every collective puts on the wire, per level and per kind (stats.py)
  (``payload``: model-sized reductions and broadcasts; ``control``: consistency
  checks, headers, resyncs), using the standard algorithm models: ring
  all-reduce sends 2(n-1)/n·S per rank, a broadcast root sends (n-1)·S;
* checks invariant I1 when the group is formed: an outer group may not contain two
  members of one cluster (their replica ids' trailing digits are the cluster id);
* injects failures on request (:meth:`arm_failure`): the next payload collective
  runs for real but its result is reported as failed, exactly as a broken link
  would be seen by the Manager. Tests and fault plans use it.

* emulates a lossy, slow link when the level has a ``links.<level>`` spec
  (:mod:`hier_localsgd.core.links.lossy`): payload collectives lose packets and fill them,
  every collective takes at least its latency/bandwidth bound;
* runs on the level's backend (``train.backends.<level>``, core/runtime/device.py): Gloo, or
  torchft's NCCL groups. Tensors not on the backend's device are staged: device tensors
  handed to Gloo go through pinned host buffers (one buffer per tensor slot, shape and
  dtype, reused across rounds), host tensors handed to NCCL through device buffers
  (allocated per collective);
  the copy back happens when the collective completes (a chained future), so a waiter
  that abandons the collective (peers.py) is never blocked by the copy. Loss masks are
  sampled on the host (one flag per packet, a seeded stream independent of the device,
  so a CPU and a GPU run lose the same packets), moved to the tensor's device once per
  collective, and every fill runs on that device.

The compressed outer reduce (``sync.outer.compression``,
:mod:`hier_localsgd.core.tensors.compressed_allreduce`) runs an all-to-all and an all-gather of
packed uint8 ``[codes | fp32 scales]`` rows: both are counted here by the bytes they
really send (all-to-all: the ``W−1`` rows for the other ranks; ring all-gather: ``W−1``
chunks), take at least their bandwidth/latency bound computed from those bytes, and, on
a lossy link, lose packets of those bytes with the ``zero`` fill (a lost packet arrives
as zero bytes: codes 0, and a zeroed scale makes its whole block decode to 0). Packets
are cut at multiples of 4 bytes so a scale is lost whole, never in part.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional

import torch
import torchft.process_group as _torchft_pg
from torch.distributed import PrefixStore, ReduceOp
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions, BroadcastOptions, Work
from torchft.process_group import ProcessGroup, ProcessGroupGloo, ProcessGroupWrapper

from hier_localsgd.core.runtime.addresses import STORE_ATTEMPT_S, connect_store, quorum_tag
from hier_localsgd.core.runtime.choices import NCCL_BACKENDS
from hier_localsgd.core.runtime.device import comm_device, settle
from hier_localsgd.core.runtime.invariants import InvariantViolation, check_distinct_clusters
from hier_localsgd.core.links.works import ChainedWork, DoneWork, FailedWork, PeerWork, TimedWork
from hier_localsgd.core.links.lossy import LinkEmulation, LinkSpec
from hier_localsgd.core.links.stats import PAYLOAD, LinkStats, sent_per_rank

logger = logging.getLogger(__name__)

# The connect bound of the configure running in this thread (LinkProcessGroup.configure).
_connect = threading.local()


def _create_store_client(store_addr: str, timeout: timedelta) -> PrefixStore:
    """torchft's ``create_store_client`` (the same ``host:port/prefix`` and PrefixStore),
    with the connect bounded by :func:`~hier_localsgd.core.runtime.addresses.connect_store`:
    torchft 0.2.0's process groups connect to the quorum's store through it, and c10d's
    own connect outlasts the phase deadline when the store's host dies mid-connect."""
    within = getattr(_connect, "within", None)
    op_timeout = min(timeout, within) if within is not None else timeout
    return PrefixStore(store_addr.partition("/")[2], connect_store(store_addr, op_timeout, within))


# torchft's ProcessGroupWrapper.configure looks the name up in its module at each call
# (pinned torchft 0.2.0); fail at import, not mid-run, if that ever changes.
assert callable(getattr(_torchft_pg, "create_store_client", None)), "torchft.process_group.create_store_client is gone"
_torchft_pg.create_store_client = _create_store_client


_gloo_host: Optional[str] = None


def bind_gloo(hostname: str) -> None:
    """Gloo groups of this process listen on ``hostname``'s address (``run.hostname``).

    Gloo's default device binds what ``gethostname()`` resolves to (or the interface in
    ``GLOO_SOCKET_IFNAME``), not the address the process advertises: across hosts whose
    ``run.hostname`` is an overlay address (security.wan=tunnel) the model would travel
    outside the tunnel. torchft builds the Gloo backend inside its reconfigurable group,
    with no argument for the device, so its constructor is replaced, once per process, by
    one that passes a device bound to ``hostname``. ``GLOO_SOCKET_IFNAME``, when set, wins.

    Raises:
        ValueError: a second, different hostname in one process.
    """
    global _gloo_host
    if not hostname or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    if _gloo_host is not None:
        if _gloo_host != hostname:
            raise ValueError(f"Gloo is bound to {_gloo_host!r} in this process; cannot bind {hostname!r} too")
        return
    base = _torchft_pg.BaseProcessGroupGloo

    def bound(store: Any, rank: int, size: int, timeout: Optional[timedelta] = None) -> Any:
        opts = base._Options()
        if timeout is not None:
            opts._timeout = timeout
        opts._devices = [base.create_device(hostname=hostname)]
        return base(store, rank, size, opts)

    _torchft_pg.BaseProcessGroupGloo = bound  # type: ignore[assignment]
    _gloo_host = hostname


def backend_pg(backend: str, timeout: timedelta) -> ProcessGroup:
    """A fresh reconfigurable torchft process group of ``backend`` (core/runtime/device.py):
    ``gloo`` ProcessGroupGloo (its device: :func:`bind_gloo`), ``nccl`` ProcessGroupBabyNCCL
    (NCCL in a subprocess), ``nccl_inproc`` ProcessGroupNCCL."""
    if backend == "gloo":
        return ProcessGroupGloo(timeout=timeout)
    if backend == "nccl":
        from torchft.process_group import ProcessGroupBabyNCCL

        return ProcessGroupBabyNCCL(timeout=timeout)
    if backend == "nccl_inproc":
        from torchft.process_group import ProcessGroupNCCL

        return ProcessGroupNCCL(timeout=timeout)
    raise ValueError(f"unknown backend {backend!r} (expected gloo, nccl or nccl_inproc)")


class LinkProcessGroup(ProcessGroupWrapper):
    """A level's process group (see module docstring).

    Args:
        level: "inner", "outer", or a baseline's name; used in stats and errors.
        timeout: the backend's timeout for rendezvous and every collective.
        distinct_clusters: enforce invariant I1 at configure time (outer level).
        backend: ``gloo`` (default), ``nccl`` or ``nccl_inproc`` (:func:`backend_pg`).
    """

    def __init__(self, level: str, timeout: timedelta, distinct_clusters: bool = False, emulation: Optional[LinkSpec] = None,
                 backend: str = "gloo") -> None:
        super().__init__(pg=backend_pg(backend, timeout))
        self.backend = backend
        self._staging: Dict[tuple, torch.Tensor] = {}  # (slot, shape, dtype) -> reused staging buffer
        self.staged_bytes = 0  # bytes copied to and from staging buffers (both ways)
        self.level = level
        self.stats = LinkStats()
        self.set_emulation(emulation)
        self._distinct_clusters = distinct_clusters
        self._kind = PAYLOAD
        self._armed: Optional[tuple] = None  # (exception, kind): arm_failure
        self._world = 1
        self._rank = 0
        self._lock = threading.Lock()
        # torchft catches exceptions raised by configure() and only logs them; the
        # Manager wrapper re-raises a violation recorded here (managers.py).
        self.violation: Optional[InvariantViolation] = None
        self._ids: List[int] = []
        # Process groups with an abandoned collective (peers.py), set aside unaborted and
        # kept alive: aborting or destroying a Gloo group waits for its pending work, so
        # the next quorum's configure would block until that collective ends.
        self._retired: List[object] = []
        self._retire_pending = False
        self._quorum_tag = ""  # see note_quorum
        # time.monotonic() by which configure must be done (the caller's phase deadline,
        # LevelManager._quorum_once); None: the backend timeout bounds it.
        self.configure_deadline: Optional[float] = None

    def set_emulation(self, spec: Optional[LinkSpec]) -> None:
        """Emulates ``spec`` on this level's links (None or inactive: a plain link)."""
        self.emu = LinkEmulation(spec, self.level) if spec is not None and spec.active else None
        self.stats.emulation = self.emu

    def share_stats(self, stats: LinkStats) -> None:
        """Accounts into ``stats`` (one account for a level across re-created groups)."""
        if stats.emulation is None:
            stats.emulation = self.emu
        self.stats = stats
        self.emu = stats.emulation

    def note_quorum(self, quorum: object) -> None:
        """Remembers the quorum torchft is about to configure this group for.

        torchft's rendezvous prefix is ``<store>/torchft/<quorum id>/<group rank>``, and a
        restarted lighthouse numbers quorums from 1 again: a reissued id would read keys
        an earlier quorum of that id left in the same store (a dead peer's address:
        "connection refused", seen in a chaos run). The prefix therefore also carries
        the quorum's tag (addresses.quorum_tag: its id, max step and full member ids, the
        same on every member)."""
        self._quorum_tag = quorum_tag(quorum)

    def retire(self) -> None:
        """A collective on the current group was abandoned: the next configure sets the
        group aside (neither aborted nor destroyed: both wait for the pending work) instead
        of aborting it. One group per abandoned round, released at process exit.

        The pinned staging buffers go with it: the abandoned collective may still complete
        into them (its work holds them), so the next round stages into fresh ones."""
        self._retire_pending = True
        self._staging = {}

    # -- configuration ---------------------------------------------------------
    def configure(
        self,
        store_addr: str,
        replica_id: str,
        rank: int,
        world_size: int,
        quorum_id: Optional[int] = None,
        group_rank: Optional[int] = None,
        group_world_size: Optional[int] = None,
        global_ranks: Optional[List[int]] = None,
    ) -> None:
        self.violation = None  # each quorum's group is judged afresh
        if self._distinct_clusters:
            gws = group_world_size or 1
            try:
                check_distinct_clusters(self.level, [g // gws for g in global_ranks or []])
            except InvariantViolation as e:
                self.violation = e
                raise
        self._world, self._rank = world_size, rank
        gws = group_world_size or 1
        # Stable identities of the members (replica index / cluster id): loss streams are
        # keyed by them, so they survive membership changes.
        self._ids = [g // gws for g in global_ranks] if global_ranks and len(global_ranks) == world_size else list(range(world_size))
        logger.info(
            "%s link configured: rank %d of %d, quorum %s", self.level, rank, world_size, quorum_id
        )
        if self._quorum_tag:
            store_addr = f"{store_addr}/q{self._quorum_tag}"
        if self._retire_pending and self._pg is not None:
            self._retired.append(self._pg)
            # A fresh reconfigurable Gloo wrapper (torchft's configure aborts only a group it
            # still holds). Not None: with no inner group, torchft's configure would call this
            # wrapper's own _create_pg, which is not implemented, and every later quorum fails.
            self._pg = backend_pg(self.backend, self._timeout)
        self._retire_pending = False
        # A store whose host died after the quorum formed, even mid-connect: fail within the
        # phase (torchft records the error; the round's collectives fail at once and its
        # commit vote fails), not after c10d's connect retries (addresses.connect_store).
        within = self._timeout
        if self.configure_deadline is not None:
            within = min(within, timedelta(seconds=max(STORE_ATTEMPT_S, self.configure_deadline - time.monotonic())))
        _connect.within = within
        try:
            super().configure(
                store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
            )
        finally:
            _connect.within = None

    # -- accounting and fault injection --------------------------------------------
    @contextmanager
    def kind(self, kind: str) -> Iterator[None]:
        """Counts the collectives issued inside the block as ``kind``."""
        prev, self._kind = self._kind, kind
        try:
            yield
        finally:
            self._kind = prev

    def arm_failure(self, exc: Exception, kind: str = PAYLOAD) -> None:
        """The next collective of ``kind`` (PAYLOAD or CONTROL) on this group completes on
        the wire but reports ``exc``."""
        with self._lock:
            self._armed = (exc, kind)

    def _finish(self, work: Work) -> Work:
        with self._lock:
            if self._armed is None or self._armed[1] != self._kind:
                return work
            exc, self._armed = self._armed[0], None
        self.stats.injected_failures += 1
        logger.warning("%s link: injecting failure %r", self.level, exc)
        return FailedWork(work, exc)

    def _timed_work(self, op: str, started: float, work: Work) -> Work:
        """A payload collective on a link without emulation: timed from this call to its
        completion (no analytical bound: 0), as the emulated ones are (LinkStats.timed).
        ``sync.outer.auto``'s link watch reads these times (experiments/auto_watch.py)."""
        if self._kind != PAYLOAD:
            return work
        stats = self.stats
        return TimedWork(work, lambda: stats.timed(op, PAYLOAD, started, 0.0, span=False))  # totals only: status stays small

    @staticmethod
    def _nbytes(tensors: List[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- staging to the backend's device -----------------------------------------------
    def _buffer(self, slot: int, t: torch.Tensor, dev: torch.device) -> torch.Tensor:
        """A staging buffer for ``t`` on ``dev``: pinned host buffers are kept for reuse
        (pinning is costly), device buffers are fresh (freed when the collective is done,
        so staging holds no device memory between rounds)."""
        if dev.type != "cpu":
            return torch.empty(t.shape, dtype=t.dtype, device=dev)
        key = (slot, tuple(t.shape), t.dtype, dev)
        buf = self._staging.get(key)
        if buf is None:
            pin = dev.type == "cpu" and t.is_cuda  # pinned host memory for device tensors
            buf = self._staging[key] = torch.empty(t.shape, dtype=t.dtype, device=dev, pin_memory=pin)
        return buf

    def _staged(self, inputs: List[torch.Tensor], outputs: List[torch.Tensor], run: object) -> Work:
        """Runs ``run(staged_inputs, staged_outputs)`` on the backend's device and copies the
        outputs back on completion; without staging, ``run(inputs, outputs)``."""
        # NCCL: on the tensors' own GPU (a helper thread's current device may be GPU 0); Gloo: the host
        cuda = next((t.device for t in inputs + outputs if t.is_cuda), None)
        dev = (cuda or comm_device(self.backend)) if self.backend in NCCL_BACKENDS else torch.device("cpu")
        if all(t.device == dev for t in inputs + outputs):
            return run(inputs, outputs)  # type: ignore[operator]
        s_in = [self._buffer(i, t, dev) for i, t in enumerate(inputs)]
        for b, t in zip(s_in, inputs):
            b.copy_(t)  # synchronous: the backend reads the buffer at once
        aliased = [next((j for j, t in enumerate(inputs) if t is o), -1) for o in outputs]
        s_out = [s_in[j] if j >= 0 else self._buffer(len(inputs) + i, o, dev) for i, (o, j) in enumerate(zip(outputs, aliased))]
        self.staged_bytes += sum(t.numel() * t.element_size() for t in inputs + outputs)
        work: Work = run(s_in, s_out)  # type: ignore[operator]

        def back(fut: torch.futures.Future) -> List[torch.Tensor]:
            fut.value()  # a failed collective fails the chained future
            for o, b in zip(outputs, s_out):
                o.copy_(b)
            return outputs

        return ChainedWork(work, work.get_future().then(back))

    # -- collectives -----------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts: object) -> Work:
        return self._staged(tensors, tensors, lambda i, o: self._allreduce(i, opts))

    def broadcast(self, tensor_list: List[torch.Tensor], opts: object) -> Work:
        return self._staged(tensor_list, tensor_list, lambda i, o: self._broadcast(i, opts))

    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensor: List[torch.Tensor], opts: object) -> Work:
        flat_out = [t for row in output_tensors for t in row]
        shape = [len(row) for row in output_tensors]

        def run(i: List[torch.Tensor], o: List[torch.Tensor]) -> Work:
            rows, k = [], 0
            for n in shape:
                rows.append(o[k : k + n])
                k += n
            return self._allgather(rows, i, opts)

        return self._staged(input_tensor, flat_out, run)

    def _allreduce(self, tensors: List[torch.Tensor], opts: object) -> Work:
        n = self._nbytes(tensors)
        self.stats.record("allreduce", self._kind, n, sent_per_rank("allreduce", n, self._world))
        emu = self.emu
        if emu is None:
            return self._finish(self._timed_work("allreduce", time.time(), super().allreduce(tensors, opts)))
        started = time.time()
        is_sum = getattr(opts, "reduceOp", ReduceOp.SUM) == ReduceOp.SUM
        if self._kind == PAYLOAD and emu.spec.model.enabled and self._world > 1 and is_sum and len(tensors) == 1:
            self._lossy_allreduce(tensors[0], opts)
        else:
            self.parent.allreduce(tensors, opts).wait()
        settle(tensors)
        bound = emu.spec.allreduce_time(n, self._world)
        emu.pad(started, bound)
        self.stats.timed("allreduce", self._kind, started, bound)
        return self._finish(DoneWork(tensors))

    def _lossy_allreduce(self, t: torch.Tensor, opts: object) -> None:
        emu = self.emu
        assert emu is not None
        timeout = getattr(opts, "timeout", None)
        per, npk = emu.packets(t.numel(), t.element_size())
        if emu.spec.where == "per_sender":
            lost = torch.from_numpy(emu.stream(self._ids[self._rank]).sample(npk)).to(t.device)
            # Arrival counts first (tiny; emulation machinery, not counted): then only
            # the packets that will miss a contribution need this rank's own values kept.
            arrived = (~lost).to(torch.int32)
            count_opts = AllreduceOptions()
            count_opts.reduceOp = ReduceOp.SUM
            if timeout is not None:
                count_opts.timeout = timeout
            self.parent.allreduce([arrived], count_opts).wait()
            saved = emu.save_rows(t, arrived, self._world, per)
            emu.zero_packets(t, lost, per)
            self.parent.allreduce([t], opts).wait()
            emu.fill_per_sender(t, arrived, self._world, per, saved)
        else:
            parts = [torch.empty_like(t) for _ in range(self._world)]
            ag = AllgatherOptions()
            if timeout is not None:
                ag.timeout = timeout
            self.parent.allgather([parts], [t], ag).wait()
            emu.reduce_per_receiver(parts, self._rank, self._ids, t)
        emu.payload_bytes_sent += t.numel() * t.element_size()
        emu.collectives += 1

    def _broadcast(self, tensor_list: List[torch.Tensor], opts: object) -> Work:
        n = self._nbytes(tensor_list)
        root = getattr(opts, "rootRank", 0)
        sent = float((self._world - 1) * n) if self._rank == root else 0.0
        self.stats.record("broadcast", self._kind, n, sent)
        emu = self.emu
        if emu is None:
            return self._finish(self._timed_work("broadcast", time.time(), super().broadcast(tensor_list, opts)))
        started = time.time()
        if self._kind == PAYLOAD and emu.spec.model.enabled and self._world > 1 and len(tensor_list) == 1:
            self._lossy_broadcast(tensor_list[0], root, opts)
        else:
            self.parent.broadcast(tensor_list, opts).wait()
        settle(tensor_list)
        bound = emu.spec.broadcast_time(n, self._world)
        emu.pad(started, bound)
        self.stats.timed("broadcast", self._kind, started, bound)
        return self._finish(DoneWork(tensor_list))

    def _lossy_broadcast(self, t: torch.Tensor, root: int, opts: object) -> None:
        """Receivers replace lost packets: ``zero`` by 0, ``stale``/``rescale`` by their own
        value from before the broadcast (one sender: nothing to rescale)."""
        emu = self.emu
        assert emu is not None
        per, npk = emu.packets(t.numel(), t.element_size())
        own = t.detach().clone()
        if emu.spec.where == "per_sender":
            lost = torch.zeros(npk, dtype=torch.uint8, device=t.device)
            if self._rank == root:
                lost = torch.from_numpy(emu.stream(self._ids[root]).sample(npk)).to(device=t.device, dtype=torch.uint8)
            self.parent.broadcast([t], opts).wait()
            mask_opts = BroadcastOptions()
            mask_opts.rootRank = root
            if getattr(opts, "timeout", None) is not None:
                mask_opts.timeout = opts.timeout  # type: ignore[attr-defined]
            self.parent.broadcast([lost], mask_opts).wait()  # emulation machinery, not counted
            lost_b = lost.bool()
        else:
            self.parent.broadcast([t], opts).wait()
            lost_b = torch.zeros(npk, dtype=torch.bool, device=t.device)
            if self._rank != root:
                lost_b = torch.from_numpy(emu.stream(self._ids[root], self._ids[self._rank]).sample(npk)).to(t.device)
        if self._rank != root and bool(lost_b.any()):
            if emu.spec.fill == "zero":
                emu.zero_packets(t, lost_b, per)
            else:
                for (rows, sl), (own_rows, _) in zip(emu.packet_rows(t, per), emu.packet_rows(own, per)):
                    rows[lost_b[sl]] = own_rows[lost_b[sl]]
        emu.payload_bytes_sent += t.numel() * t.element_size()
        emu.collectives += 1

    def _allgather(self, output_tensors: List[List[torch.Tensor]], input_tensor: List[torch.Tensor], opts: object) -> Work:
        n = self._nbytes(input_tensor)
        self.stats.record("allgather", self._kind, n, sent_per_rank("allgather", n, self._world))
        emu = self.emu
        if emu is None:
            return self._finish(self._timed_work("allgather", time.time(), self._exchange_allgather(output_tensors, input_tensor, opts)))
        started = time.time()
        self._exchange_allgather(output_tensors, input_tensor, opts).wait()
        if self._kind == PAYLOAD and emu.spec.model.enabled and self._world > 1 and len(output_tensors) == 1:
            self._lossy_allgather(output_tensors[0], opts)
            emu.payload_bytes_sent += (self._world - 1) * n
            emu.collectives += 1
        settle([t for row in output_tensors for t in row])
        bound = emu.spec.allgather_time(n, self._world)
        emu.pad(started, bound)
        self.stats.timed("allgather", self._kind, started, bound)
        return self._finish(DoneWork(input_tensor))

    @property
    def quorum_rank(self) -> int:
        """This member's rank in the group as last configured."""
        return self._rank

    @property
    def quorum_size(self) -> int:
        return self._world

    def alltoall_base(
        self, output_buffer: torch.Tensor, input_buffer: torch.Tensor,
        output_split_sizes: List[int], input_split_sizes: List[int], opts: AllToAllOptions,
    ) -> Work:
        """Equal splits only (empty split lists): row ``j`` of ``input_buffer`` goes to rank
        ``j``. Counted as the ``W−1`` rows sent to the other ranks."""
        if output_split_sizes or input_split_sizes:
            raise ValueError(f"{self.level} link: alltoall_base with explicit split sizes is not supported")
        # staged like the other collectives: NCCL's send/recv take device tensors only
        return self._staged([input_buffer], [output_buffer], lambda i, o: self._alltoall(o[0], i[0], opts))

    def _alltoall(self, output_buffer: torch.Tensor, input_buffer: torch.Tensor, opts: AllToAllOptions) -> Work:
        n = self._nbytes([input_buffer])
        row = n // max(1, self._world)
        self.stats.record("alltoall", self._kind, n, sent_per_rank("alltoall", n, self._world))
        emu = self.emu
        if emu is None:
            return self._finish(self._timed_work("alltoall", time.time(), self._exchange_alltoall(output_buffer, input_buffer, opts)))
        started = time.time()
        self._exchange_alltoall(output_buffer, input_buffer, opts).wait()
        if self._kind == PAYLOAD and emu.spec.model.enabled and self._world > 1:
            # each row goes to one receiver: the receiver draws the loss of every row it got
            rows = output_buffer.view(self._world, -1)
            for s in range(self._world):
                if s != self._rank:
                    self._lose(rows[s], emu.stream(self._ids[s], self._ids[self._rank]))
            emu.payload_bytes_sent += (self._world - 1) * row
            emu.collectives += 1
        settle([output_buffer])
        bound = emu.spec.allgather_time(row, self._world)  # W−1 rows of `row` bytes each way
        emu.pad(started, bound)
        self.stats.timed("alltoall", self._kind, started, bound)
        return self._finish(DoneWork([output_buffer]))

    # -- all-to-all and all-gather as concurrent point-to-point exchanges ---------------
    # Gloo's own alltoall and allgather moved their bytes at 2.07x and 1.57x the
    # per-direction bound on a kernel-shaped link, where its send/recv, posted in both
    # directions at once, ran at 1.07-1.15x (docs/benchmarks.md, the int8 all-reduce).
    # Same bytes, same matching (one tag per operation; a pair's messages keep their order).
    _TAG_ALLTOALL, _TAG_ALLGATHER = 1, 2

    def _exchange(self, sends: Dict[int, torch.Tensor], recvs: Dict[int, torch.Tensor], tag: int,
                  opts: object, result: List[torch.Tensor]) -> Work:
        timeout = getattr(opts, "timeout", None)
        if timeout is None or timeout.total_seconds() <= 0:  # c10d's default is -1 ms: unset
            timeout = self._timeout
        works: List[Work] = []
        for j in sorted(set(sends) | set(recvs)):
            if j in recvs:
                works.append(self.parent.recv([recvs[j]], j, tag))
            if j in sends:
                works.append(self.parent.send([sends[j]], j, tag))
        return PeerWork(works, result, timeout)

    def _exchange_alltoall(self, output_buffer: torch.Tensor, input_buffer: torch.Tensor, opts: object) -> Work:
        if self.backend in NCCL_BACKENDS:  # its own collective: paired send/recv in order could deadlock
            return self.parent.alltoall_base(output_buffer, input_buffer, [], [], opts)
        ins, outs = input_buffer.view(self._world, -1), output_buffer.view(self._world, -1)
        outs[self._rank].copy_(ins[self._rank])
        others = [j for j in range(self._world) if j != self._rank]
        return self._exchange({j: ins[j] for j in others}, {j: outs[j] for j in others}, self._TAG_ALLTOALL, opts, [output_buffer])

    def _exchange_allgather(self, output_tensors: List[List[torch.Tensor]], input_tensor: List[torch.Tensor], opts: object) -> Work:
        if self.backend in NCCL_BACKENDS:  # as for the all-to-all
            return self.parent.allgather(output_tensors, input_tensor, opts)
        if len(output_tensors) != 1 or len(input_tensor) != 1:
            raise ValueError(f"{self.level} link: allgather of one tensor only (got {len(input_tensor)})")
        outs, mine = output_tensors[0], input_tensor[0]
        outs[self._rank].copy_(mine)
        others = [j for j in range(self._world) if j != self._rank]
        return self._exchange({j: mine for j in others}, {j: outs[j] for j in others}, self._TAG_ALLGATHER, opts, outs)

    def _lose(self, t: torch.Tensor, stream: object) -> torch.Tensor:
        """Zeroes the lost packets of the bytes of ``t`` (in place); returns the loss mask.
        Packets hold a multiple of 4 bytes, so an fp32 scale is lost whole."""
        emu = self.emu
        assert emu is not None
        raw = t.reshape(-1).view(torch.uint8)
        per = max(4, emu.spec.payload_bytes // 4 * 4)
        npk = (raw.numel() + per - 1) // per
        lost = torch.from_numpy(stream.sample(npk)).to(t.device)  # type: ignore[attr-defined]
        emu.zero_packets(raw, lost, per)
        return lost

    def _lossy_allgather(self, outs: List[torch.Tensor], opts: object) -> None:
        """Loss on a payload all-gather (``zero`` fill). per_sender: the sender's mask is
        shared (an uncounted all-gather of masks) and applied to every copy of its chunk,
        its own included, so all copies stay alike; per_receiver: each receiver loses
        every other sender's packets independently and keeps its own chunk intact."""
        emu = self.emu
        assert emu is not None
        me = self._rank
        if emu.spec.where == "per_sender":
            raw_len = outs[me].numel() * outs[me].element_size()
            per = max(4, emu.spec.payload_bytes // 4 * 4)
            npk = (raw_len + per - 1) // per
            # on the payload's device: the backend (NCCL on CUDA) gathers the masks too
            mine = torch.from_numpy(emu.stream(self._ids[me]).sample(npk)).to(device=outs[me].device, dtype=torch.uint8)
            masks = [torch.empty_like(mine) for _ in range(self._world)]
            ag = AllgatherOptions()
            if getattr(opts, "timeout", None) is not None:
                ag.timeout = opts.timeout  # type: ignore[attr-defined]
            self.parent.allgather([masks], [mine], ag).wait()  # emulation machinery, not counted
            for s, out in enumerate(outs):
                emu.zero_packets(out.reshape(-1).view(torch.uint8), masks[s].bool(), per)
        else:
            for s, out in enumerate(outs):
                if s != me:
                    self._lose(out, emu.stream(self._ids[s], self._ids[me]))

    def getBackendName(self) -> str:
        return f"hier-link-{self.level}"
