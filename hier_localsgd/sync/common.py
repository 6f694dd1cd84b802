"""What the hierarchical sync's parts share: its errors, identity, counters and results.

No logic here: hier.py (one round), outer_round.py (the leader's outer level) and
committed.py (the committed state: snapshots, heals, rollback) import these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Protocol

import torch

from hier_localsgd.core.runtime.runtime import EXIT_CONFIG

EventSink = Callable[..., None]  # events(kind, **fields): the process's event log


class FatalSyncError(RuntimeError):
    """The sync cannot continue (repeated quorum failures); the process must exit."""


class PoisonLimit(FatalSyncError):
    """This replica group's contributions were excluded too often (sync/poison.py): it gives
    up with exit code 2, which no launcher restarts (a restart would not fix its hardware
    or its data)."""

    exit_code = EXIT_CONFIG  # never retried (launch/replica.sh, launch/local.py)


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
    momentum: Optional[torch.Tensor] = None  # eager updates: the leader's committed outer momentum, as received
    fragment: Optional[int] = None  # streaming fragments: the one this round synced (None: the whole model)
    push_in: int = 0  # asynchronous, sync.async_outer.match_pace: steps to the cluster's next push (0: unchanged)
    # Asynchronous, a push refused as a repeat (weight 0): the step of the cluster's earlier
    # push from the same base, which the global model holds (-1: none; committed.py counts
    # only the steps past it as lost).
    held_to: int = -1
    # Asynchronous, the leader's only: the checksum of the version's model (the heal evidence
    # of chaos_evidence.py), written as an ``adopt`` event when an answer is adopted later
    # than it came (an overlapped push's apply round). Not in the header.
    checksum: Optional[int] = None

    def header(self) -> torch.Tensor:
        """What BROADCAST sends the cluster before the model (:meth:`from_header` reads it)."""
        frag = -1 if self.fragment is None else self.fragment
        return torch.tensor([int(self.status), self.outer_round, self.step, self.cluster_weight, frag, self.push_in, float(self.merge),
                             self.held_to], dtype=torch.float64)

    @staticmethod
    def empty_header() -> torch.Tensor:
        return torch.zeros(8, dtype=torch.float64)

    @staticmethod
    def from_header(header: torch.Tensor, params: Optional[torch.Tensor], **kw: object) -> "OuterResult":
        """The header's fields; ``kw`` adds the rest (a ``merge`` in it overrides the header's)."""
        frag = int(header[4])
        kw.setdefault("merge", bool(header[6]))
        return OuterResult(Status(int(header[0])), params, int(header[1]), int(header[2]), float(header[3]),
                           fragment=None if frag < 0 else frag, push_in=int(header[5]), held_to=int(header[7]), **kw)  # type: ignore[arg-type]


# What a replica announces as its step at the inner quorum (torchft heals every member
# below the quorum's highest step from one at it), packed into torchft's int64 step:
# outer rounds first, then local steps, then committed inner rounds. Each field saturates.
_OUTER_BITS, _STEP_BITS, _INNER_BITS = 22, 31, 10


def training_progress(outer_round: int, step: int, inner_round: int) -> int:
    """Who is ahead, in the order that decides who heals from whom inside a cluster:

    1. ``outer_round``: a group holding a later global model is ahead, whatever its local
       steps (a leader that kept syncing across clusters through its cluster lighthouse's
       outage must not heal from a member that only took more local steps meanwhile —
       seen: the leader fell back 12 outer rounds and the other cluster's leader, alone
       ahead, exited after max_quorum_failures);
    2. ``step``: then training progress (a restarted group's no-op join rounds are not);
    3. ``inner_round``: at equal steps, a member that committed a round is ahead of one
       that rolled it back. Only its low 10 bits count: the two differ by a round or two,
       so only a wrap between them (one case in 1024) can invert the order, and then the
       committed member re-adopts the rolled-back one's model — one round lost, never
       consistency.
    """
    o = min(max(outer_round, 0), (1 << _OUTER_BITS) - 1)
    s = min(max(step, 0), (1 << _STEP_BITS) - 1)
    return (o << (_STEP_BITS + _INNER_BITS)) | (s << _INNER_BITS) | (inner_round & ((1 << _INNER_BITS) - 1))


def outer_progress(outer_round: int, step: int, fresh: bool) -> int:
    """What a leader's cluster Manager announces at the outer quorum: the cluster's global
    round and step (so a leader behind heals from one ahead, never the reverse), then
    whether its outer state is its own (1) or possibly stale (0, ``fresh``: a Manager that
    has not committed or healed an outer round yet, e.g. a new leader after a failover,
    whose outer momentum was not kept while it was a member). At equal rounds a fresh
    leader heals the momentum from an established one; its cluster's work keeps its
    weight (same global model). Without this, torchft's own commit count decided: a new
    leader (count 0) healed from any established one, even one a round behind it — seen
    twice in a 12-minute chaos run, each time losing a committed global round."""
    return training_progress(outer_round, step, 0 if fresh else 1)


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
    def finish(self) -> None: ...  # after the last step (hier: sync/final.py; baselines: nothing)
    def work_counters(self) -> Dict[str, int]: ...  # steps run / discarded (chaos accounting)
    def link_stats(self) -> Dict[str, Dict[str, object]]: ...
    def global_model(self) -> Optional[torch.Tensor]: ...  # hier: the last global model applied (baselines: None)
    def close(self) -> None: ...  # stops heartbeats; idempotent
