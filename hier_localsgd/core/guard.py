"""Consistency guard: every member of a level checks it holds the same committed state.

torchft heals a replica whose step is behind. Some divergences leave steps equal:
a leader whose outer commit succeeded while its cluster's inner commit failed,
two stragglers that each formed a quorum alone, per-receiver packet loss on a
lossy link. The guard catches all of them at the start of every REDUCE phase:

1. every member contributes its slot of a small float64 vector — a 64-bit hash of
   its committed state (split in two exact halves), its counters, and the weight
   it intends to give its pseudo-gradient — and the vector is summed, so every
   member sees every member's slot (an all-gather done with one all-reduce);
2. if all slots agree, nothing happens. Otherwise the *source* is the member with
   the newest state (highest outer round, then inner round, then step; ties go
   to the lowest rank) and it broadcasts its committed state; every member adopts
   it ("resync");
3. members that are *behind* the source (older outer round, inner round or step)
   contribute weight 0 to this round: their pseudo-gradients were measured from a
   stale base. At the outer level, a cluster 1..``sync.outer.max_staleness`` outer
   rounds behind keeps its weight instead (its update is measured from its own base
   and applied to the newest model: a stale update). Members with the same history whose state differs only in value (a
   lossy link's per-receiver noise, a corrupted copy) keep their weight: their bases
   differ by noise, and their local work is still work.

Every member computes the same plan from the same summed vector, so they agree on
the source and on the total weight without another round trip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

_FIELDS = 7  # hash_hi, hash_lo, outer_round, inner_round, step, weight, present


@dataclass(frozen=True)
class Fingerprint:
    hash: int
    outer_round: int
    inner_round: int
    step: int
    weight: float

    def state_key(self) -> tuple:
        return (self.hash, self.outer_round, self.inner_round, self.step)

    def newness(self) -> tuple:
        return (self.outer_round, self.inner_round, self.step)


@dataclass(frozen=True)
class GuardPlan:
    fingerprints: List[Fingerprint]
    source: Optional[int]  # rank to resync from, None if every member agrees
    weights: List[float]  # effective weight of each member this round

    @property
    def total_weight(self) -> float:
        return float(sum(self.weights))

    def diverged(self, rank: int) -> bool:
        return self.source is not None and self.fingerprints[rank].state_key() != self.fingerprints[self.source].state_key()


def encode(rank: int, size: int, mine: Fingerprint) -> torch.Tensor:
    v = torch.zeros(size * _FIELDS, dtype=torch.float64)
    h = mine.hash & 0xFFFFFFFFFFFFFFFF
    v[rank * _FIELDS : (rank + 1) * _FIELDS] = torch.tensor(
        [h >> 32, h & 0xFFFFFFFF, mine.outer_round, mine.inner_round, mine.step, mine.weight, 1.0],
        dtype=torch.float64,
    )
    return v


def decode(v: torch.Tensor, size: int) -> List[Fingerprint]:
    out = []
    for i in range(size):
        hi, lo, o, inn, step, w, present = v[i * _FIELDS : (i + 1) * _FIELDS].tolist()
        if present != 1.0:
            raise RuntimeError(f"consistency vector slot {i} filled {present} times (expected once)")
        out.append(Fingerprint(hash=(int(hi) << 32) | int(lo), outer_round=int(o), inner_round=int(inn), step=int(step), weight=w))
    return out


def plan(fps: List[Fingerprint], max_behind: int = 0) -> GuardPlan:
    """The round's plan from every member's fingerprint. ``max_behind`` (the outer level's
    ``sync.outer.max_staleness``): a member behind the source by 1..max_behind outer rounds
    keeps its weight; it measures its pseudo-gradient from its own, older global model
    (a stale update; the caller keeps that base, outer_round.py)."""
    keys = {fp.state_key() for fp in fps}
    if len(keys) == 1:
        return GuardPlan(fps, None, [fp.weight for fp in fps])
    # Newest state wins; min() over (-newness, rank) picks the lowest rank among ties.
    source = min(range(len(fps)), key=lambda i: (tuple(-x for x in fps[i].newness()), i))
    src = fps[source]

    def keeps(fp: Fingerprint) -> bool:
        return fp.newness() == src.newness() or 0 < src.outer_round - fp.outer_round <= max_behind

    return GuardPlan(fps, source, [fp.weight if keeps(fp) else 0.0 for fp in fps])


def pack(tensors: List[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


@torch.no_grad()
def unpack_into(flat: torch.Tensor, tensors: List[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
    if offset != flat.numel():
        raise RuntimeError(f"resync payload has {flat.numel()} values, expected {offset}")
