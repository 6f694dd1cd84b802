"""The invariants that keep the hierarchy free of seed 004's deadlocks, named once.

Each invariant has a name used in error messages, docs/invariants.md and tests.
The checks here run in the code paths where the invariant could be broken; a
violation raises :class:`InvariantViolation` naming the invariant.

I1 ONE_GROUP_PER_PAIR
    No pair of processes shares two process groups that can issue collectives
    concurrently. Structure gives most of it: a process is in its cluster's inner
    group and, only while it is its cluster's leader, in the outer group, so two
    processes share both only if two members of one cluster sit in the outer
    group. Checked (a) when the outer group is configured from a quorum: its
    members' cluster ids must be distinct (:func:`check_distinct_clusters`), and
    (b) inside a process: collectives on different groups never overlap in time
    (:class:`CollectiveGate`), except the inner and outer levels of a leader with the
    overlapped outer sync (overlap.py): those two groups share no pair of processes,
    by (a), so they may each have one collective in flight at once.
I2 SEPARATE_OPTIMIZERS
    The inner optimizer, the inner level's outer optimizer and the outer level's
    outer optimizer are separate objects over separate tensors
    (:func:`check_disjoint_tensors`).
I3 QUORUM_BEFORE_COLLECTIVE
    A collective runs only inside its level's open quorum
    (:meth:`hier_localsgd.core.runtime.phases.PhaseTracker.require`).
I4 PARAMETERS_WRITTEN_IN_PLACE
    Synchronisation reads and writes parameter *storage* under ``no_grad``; the
    model's Parameter objects (which the optimizer holds) are never replaced
    (:class:`hier_localsgd.core.tensors.flat_params.FlatParams`).
I5 COUNTERS_ADVANCE_EVERYWHERE
    The local-step counter is advanced by the training loop of every replica, not
    inside a leader-only code path; round counters are part of the replicated state.
I6 CONSISTENT_GROUP_RANKS
    Every Manager of a level is created with the same group world size and its
    own group rank, so checkpoint metadata lookups by rank always succeed
    (seed 004's "rank not found") (:func:`check_group_rank`).
I7 FAILURE_STOPS_HEARTBEAT
    Every way a process fails ends with its Managers shut down (heartbeats
    stopped) and the process exiting (:mod:`hier_localsgd.core.runtime.runtime`).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Sequence

import torch

ONE_GROUP_PER_PAIR = "I1 one-group-per-pair"
SEPARATE_OPTIMIZERS = "I2 separate-optimizers"
QUORUM_BEFORE_COLLECTIVE = "I3 quorum-before-collective"
PARAMETERS_WRITTEN_IN_PLACE = "I4 parameters-written-in-place"
COUNTERS_ADVANCE_EVERYWHERE = "I5 counters-advance-everywhere"
CONSISTENT_GROUP_RANKS = "I6 consistent-group-ranks"
FAILURE_STOPS_HEARTBEAT = "I7 failure-stops-heartbeat"


class InvariantViolation(RuntimeError):
    def __init__(self, invariant: str, detail: str) -> None:
        self.invariant = invariant
        super().__init__(f"invariant {invariant} violated: {detail}")


def check_distinct_clusters(level: str, cluster_ids: Optional[Sequence[int]]) -> None:
    """I1(a): an outer group's members must come from distinct clusters.

    ``cluster_ids`` are the trailing digits of the members' replica ids as torchft
    passes them to ``ProcessGroup.configure`` (``global_ranks``).
    """
    if not cluster_ids:
        return
    seen = set()
    dups = sorted({c for c in cluster_ids if c in seen or seen.add(c)})  # type: ignore[func-returns-value]
    if dups:
        raise InvariantViolation(
            ONE_GROUP_PER_PAIR,
            f"{level} process group formed with two members of cluster(s) {dups} "
            f"(members' clusters: {list(cluster_ids)}); those processes would share both the "
            f"inner and the outer group",
        )


class CollectiveGate:
    """I1(b): at most one collective in flight per level, and collectives of two levels
    in flight at once only for a pair of levels declared ``concurrent``.

    ``concurrent`` names pairs whose groups share no pair of processes: the inner and
    outer levels under the overlapped outer sync (the outer group's members are of
    distinct clusters, I1(a)). Without it the sync state machine is sequential, so this
    never fires in correct code; it turns a future mistake (say, an outer all-reduce
    started before the inner broadcast finished) into an immediate error instead of a
    cross-group deadlock.
    """

    def __init__(self, concurrent: Iterable[tuple[str, str]] = ()) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, str] = {}  # level -> its op in flight
        self._concurrent = {frozenset(p) for p in concurrent}

    @contextmanager
    def collective(self, level: str, op: str) -> Iterator[None]:
        with self._lock:
            for other, other_op in self._active.items():
                if other == level or frozenset((level, other)) not in self._concurrent:
                    raise InvariantViolation(
                        ONE_GROUP_PER_PAIR,
                        f"{level} {op} started while a {other} {other_op} collective is in flight",
                    )
            self._active[level] = op
        try:
            yield
        finally:
            with self._lock:
                self._active.pop(level, None)


def check_disjoint_tensors(named_groups: Iterable[tuple[str, Iterable[torch.Tensor]]]) -> None:
    """I2: no tensor storage is shared between the named groups (e.g. optimizers)."""
    owner: dict[int, str] = {}
    for name, tensors in named_groups:
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr in owner and owner[ptr] != name:
                raise InvariantViolation(
                    SEPARATE_OPTIMIZERS, f"{name} and {owner[ptr]} share a tensor storage"
                )
            owner[ptr] = name


def check_group_rank(level: str, group_rank: int, group_world_size: int) -> None:
    """I6: a Manager's group rank must lie in [0, group_world_size)."""
    if group_world_size < 1 or not 0 <= group_rank < group_world_size:
        raise InvariantViolation(
            CONSISTENT_GROUP_RANKS,
            f"{level} manager created with group_rank={group_rank}, "
            f"group_world_size={group_world_size}",
        )
