"""The process group of one level's links: a torchft ProcessGroup wrapper.

Each level (inner: a cluster's replica groups; outer: the clusters' leaders) gets
its own :class:`LinkProcessGroup` around a reconfigurable torchft
``ProcessGroupGloo``. The torchft Manager of that level reconfigures it on every
quorum change. The wrapper:

* counts the bytes every collective puts on the wire, per level and per kind
  (``payload``: model-sized reductions and broadcasts; ``control``: consistency
  checks, headers, resyncs), using the standard algorithm models: ring
  all-reduce sends 2(n-1)/n·S per rank, a broadcast root sends (n-1)·S;
* checks invariant I1 when the group is formed: an outer group may not contain two
  members of one cluster (their replica ids' trailing digits are the cluster id);
* injects failures on request (:meth:`arm_failure`): the next payload collective
  runs for real but its result is reported as failed, exactly as a broken link
  would be seen by the Manager. Tests and fault plans use it.

Lossy and WAN link emulation (loss models, latency, bandwidth) plug in here; see
docs/architecture.md.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, Iterator, List, Optional

import torch
from torch.distributed.distributed_c10d import Work
from torchft.process_group import ProcessGroupGloo, ProcessGroupWrapper

from hier_localsgd.invariants import InvariantViolation, check_distinct_clusters

logger = logging.getLogger(__name__)

PAYLOAD = "payload"
CONTROL = "control"


def ring_allreduce_bytes(nbytes: int, world: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``world`` ranks."""
    return 0.0 if world <= 1 else 2.0 * (world - 1) / world * nbytes


@dataclass
class LinkStats:
    """What one level's links carried in this process."""

    sent_bytes: Dict[str, float] = field(default_factory=lambda: defaultdict(float))
    tensor_bytes: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    injected_failures: int = 0

    def record(self, op: str, kind: str, tensor_bytes: int, sent: float) -> None:
        key = f"{op}/{kind}"
        self.calls[key] += 1
        self.tensor_bytes[key] += tensor_bytes
        self.sent_bytes[kind] += sent

    def as_dict(self) -> Dict[str, object]:
        return {
            "sent_bytes": dict(self.sent_bytes),
            "sent_bytes_total": sum(self.sent_bytes.values()),
            "tensor_bytes": dict(self.tensor_bytes),
            "calls": dict(self.calls),
            "injected_failures": self.injected_failures,
        }


class _FailedWork(Work):
    """The real collective's work, reported as failed (an injected link failure)."""

    def __init__(self, work: Work, exc: Exception) -> None:
        super().__init__()
        self._work = work
        self._exc = exc

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self._work.wait()
        raise self._exc

    def get_future(self) -> torch.futures.Future:
        exc = self._exc

        def fail(_: torch.futures.Future) -> None:
            raise exc

        return self._work.get_future().then(fail)


class LinkProcessGroup(ProcessGroupWrapper):
    """A level's process group (see module docstring).

    Args:
        level: "inner", "outer", or a baseline's name; used in stats and errors.
        timeout: Gloo timeout for rendezvous and every collective.
        distinct_clusters: enforce invariant I1 at configure time (outer level).
    """

    def __init__(self, level: str, timeout: timedelta, distinct_clusters: bool = False) -> None:
        super().__init__(pg=ProcessGroupGloo(timeout=timeout))
        self.level = level
        self.stats = LinkStats()
        self._distinct_clusters = distinct_clusters
        self._kind = PAYLOAD
        self._armed: Optional[Exception] = None
        self._world = 1
        self._rank = 0
        self._lock = threading.Lock()
        # torchft catches exceptions raised by configure() and only logs them; the
        # Manager wrapper re-raises a violation recorded here (managers.py).
        self.violation: Optional[InvariantViolation] = None

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
        if self._distinct_clusters:
            gws = group_world_size or 1
            try:
                check_distinct_clusters(self.level, [g // gws for g in global_ranks or []])
            except InvariantViolation as e:
                self.violation = e
                raise
        self._world, self._rank = world_size, rank
        logger.info(
            "%s link configured: rank %d of %d, quorum %s", self.level, rank, world_size, quorum_id
        )
        super().configure(
            store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
        )

    @property
    def world(self) -> int:
        return self._world

    # -- accounting and fault injection --------------------------------------------
    @contextmanager
    def kind(self, kind: str) -> Iterator[None]:
        """Counts the collectives issued inside the block as ``kind``."""
        prev, self._kind = self._kind, kind
        try:
            yield
        finally:
            self._kind = prev

    def arm_failure(self, exc: Exception) -> None:
        """The next payload collective on this group completes on the wire but reports ``exc``."""
        with self._lock:
            self._armed = exc

    def _finish(self, work: Work) -> Work:
        if self._kind != PAYLOAD:
            return work
        with self._lock:
            exc, self._armed = self._armed, None
        if exc is None:
            return work
        self.stats.injected_failures += 1
        logger.warning("%s link: injecting failure %r", self.level, exc)
        return _FailedWork(work, exc)

    @staticmethod
    def _nbytes(tensors: List[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    # -- collectives -----------------------------------------------------------
    def allreduce(self, tensors: List[torch.Tensor], opts: object) -> Work:
        n = self._nbytes(tensors)
        self.stats.record("allreduce", self._kind, n, ring_allreduce_bytes(n, self._world))
        return self._finish(super().allreduce(tensors, opts))

    def broadcast(self, tensor_list: List[torch.Tensor], opts: object) -> Work:
        n = self._nbytes(tensor_list)
        root = getattr(opts, "rootRank", 0)
        sent = float((self._world - 1) * n) if self._rank == root else 0.0
        self.stats.record("broadcast", self._kind, n, sent)
        return self._finish(super().broadcast(tensor_list, opts))

    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensor: List[torch.Tensor], opts: object) -> Work:
        n = self._nbytes(input_tensor)
        self.stats.record("allgather", self._kind, n, float((self._world - 1) * n))
        return self._finish(super().allgather(output_tensors, input_tensor, opts))

    def getBackendName(self) -> str:
        return f"hier-link-{self.level}"
