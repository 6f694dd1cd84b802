"""What the hierarchical sync's parts share: its errors, identity, counters and results.

No logic here: hier.py (one round), outer_round.py (the leader's outer level) and
committed.py (the committed state: snapshots, heals, rollback) import these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Protocol

import torch

EventSink = Callable[..., None]  # events(kind, **fields): the process's event log


class FatalSyncError(RuntimeError):
    """The sync cannot continue (repeated quorum failures); the process must exit."""


class JobFinished(RuntimeError):
    """The job ended without this replica group (another group finished every step while
    this one was away): nobody is left to sync with. The process exits 0 with the message."""


class Status(enum.IntEnum):
    """What the leader's broadcast carries."""

    ABORT = 0  # the leader's round failed: nothing to adopt
    INNER_ONLY = 1  # the cluster model (outer level failed or skipped)
    OUTER_COMMITTED = 2  # the new global model


@dataclass
class Counters:
    """Replicated counters. ``step`` is advanced by the training loop of every replica (I5)."""

    step: int = 0  # local steps taken: the training position
    inner_round: int = 0  # inner rounds committed
    outer_round: int = 0  # outer rounds committed


@dataclass(frozen=True)
class Identity:
    cluster: int
    replica: int

    @property
    def inner_replica_id(self) -> str:
        # Sorted by the lighthouse: zero padding makes lexical order numeric order,
        # so the leader is the live replica group with the lowest index.
        return f"c{self.cluster}_r{self.replica:04d}"

    @property
    def outer_replica_id(self) -> str:
        # Trailing digits = cluster id: the outer link checks they are distinct (I1).
        return f"cluster{self.cluster:04d}"

    def __str__(self) -> str:
        return f"c{self.cluster}r{self.replica}"


@dataclass
class OuterResult:
    status: Status
    params: Optional[torch.Tensor]
    outer_round: int
    step: int
    cluster_weight: float = 1.0  # 0: the outer level did not use this cluster's work
    merge: bool = False  # overlapped: params is the global model, merged with the progress since the snapshot
    residual: Optional[torch.Tensor] = None  # compressed: the leader's committed residual, as received


class SyncStrategy(Protocol):
    """What the training loop calls, every mode alike (hier: HierarchicalSync; flat, ddp:
    baselines.py). Checkpoints (``snapshot``/``restore``) are the hierarchy's only
    (``checkpoint.*`` is refused for the baselines)."""

    counters: Counters  # replicated counters; the loop advances ``step`` (I5)

    @property
    def leader(self) -> bool: ...  # this group leads its cluster (baselines: never)

    def start(self) -> None: ...  # the join round, before any local step
    def before_forward(self) -> None: ...  # ddp: the step's quorum
    def before_optimizer_step(self) -> bool: ...  # ddp: gradient all-reduce + commit vote
    def after_optimizer_step(self) -> bool: ...  # hier/flat: a round at round boundaries
    def work_counters(self) -> Dict[str, int]: ...  # steps run / discarded (chaos accounting)
    def link_stats(self) -> Dict[str, Dict[str, object]]: ...
    def close(self) -> None: ...  # stops heartbeats; idempotent
