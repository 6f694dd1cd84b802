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

The same exchange screens contributions (:func:`screen`, issue #30: one diverging replica
group turned a whole job to NaN). Each member's slot also carries the norm of the
pseudo-gradient it is about to send (per round of local work at the inner level; for a
group of several ranks, of the whole group's, so every ring judges a group alike), or
:data:`NONFINITE`. A contribution is excluded from the round (weight 0; the round commits
for the others) when

* it holds a NaN or an infinity, or
* its norm exceeds ``ratio`` times the reference: the median of the other contributors'
  norms in this round, or, with no other contributor, the median of the members' running
  references (each level's median accepted norm at its last commit, :class:`~hier_localsgd.core.tensors.level.Level`).

Cost: one extra pass over the contribution to take its norm (one subtraction and one
reduction per element, once per round, not per step) and three floats per member in the
exchange (norm, reference, who). Limits: a majority of outsized contributions in one round
outvotes the median (non-finite ones are excluded whatever the majority); with one contributor and no
reference yet (a level's first commit) only the non-finite check applies; a legitimate
contribution more than ``ratio`` times its peers' is excluded too (a stale update of many
rounds is judged per round of its work at the inner level, not at the outer).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import List, Optional

import torch

_FIELDS = 10  # hash_hi, hash_lo, outer_round, inner_round, step, weight, present, norm, ref, who
NONFINITE = -1.0  # the norm field of a contribution that holds a NaN or an infinity


@dataclass(frozen=True)
class Fingerprint:
    hash: int
    outer_round: int
    inner_round: int
    step: int
    weight: float
    norm: float = 0.0  # of the contribution (screen()); NONFINITE; 0: not measured (weight 0)
    ref: float = 0.0  # the member's running reference for its level (Level.norm_ref); 0: none yet
    who: int = -1  # the member's name (member_code), for the events that name an excluded one

    def state_key(self) -> tuple:
        return (self.hash, self.outer_round, self.inner_round, self.step)

    def newness(self) -> tuple:
        return (self.outer_round, self.inner_round, self.step)


def member_code(cluster: int, replica: int) -> int:
    """A member's name as one exact float64 integer (the fingerprint's ``who``)."""
    return cluster * 65536 + replica


def member_name(code: int, level: str) -> str:
    """``c1r0`` for an inner member, ``c1`` for a cluster at the outer level; ``?`` if unknown."""
    if code < 0:
        return "?"
    cluster, replica = divmod(code, 65536)
    return f"c{cluster}" if level == "outer" else f"c{cluster}r{replica}"


def contribution_norm(sum_of_squares: float) -> float:
    """The norm the exchange carries, from a contribution's sum of squares (over every rank
    of the group): :data:`NONFINITE` for a NaN, an infinity or an overflow."""
    if not math.isfinite(sum_of_squares):
        return NONFINITE
    return math.sqrt(sum_of_squares)


def screen(fps: List[Fingerprint], ratio: float) -> List[str]:
    """Why each member's contribution is excluded this round ("" = kept); see the module
    docstring. Members with weight 0 contribute nothing and are never excluded. ``ratio``
    <= 0: only the non-finite check."""
    refs = [fp.ref for fp in fps if fp.ref > 0 and math.isfinite(fp.ref)]
    history = statistics.median(refs) if refs else 0.0
    out = []
    for i, fp in enumerate(fps):
        if fp.weight == 0:
            out.append("")
            continue
        if fp.norm == NONFINITE or not math.isfinite(fp.norm):
            out.append("non-finite values")
            continue
        others = [o.norm for j, o in enumerate(fps) if j != i and o.weight > 0 and o.norm > 0 and math.isfinite(o.norm)]
        ref = statistics.median(others) if others else history
        if ratio > 0 and ref > 0 and fp.norm > ratio * ref:
            of = "the other contributors' median" if others else "the level's running reference"
            out.append(f"norm {fp.norm:.3g} > {ratio:g} x {of} {ref:.3g}")
        else:
            out.append("")
    return out


def accepted_median(fps: List[Fingerprint], weights: List[float]) -> float:
    """The median norm of the contributions a round used (0 if none was measured): what a
    level keeps as its running reference when the round commits."""
    norms = [fp.norm for fp, w in zip(fps, weights) if w > 0 and fp.norm > 0 and math.isfinite(fp.norm)]
    return statistics.median(norms) if norms else 0.0


@dataclass(frozen=True)
class GuardPlan:
    fingerprints: List[Fingerprint]
    source: Optional[int]  # rank to resync from, None if every member agrees
    weights: List[float]  # effective weight of each member this round
    # Why each member's contribution was excluded ("" = not excluded): screen().
    excluded: List[str] = field(default_factory=list)
    # This member's exchange failed: it knows nothing of the others. It still runs the
    # round's reduce, sending zeros, so the members whose exchange went through are not
    # left waiting in it (matched collectives); its commit vote fails.
    failed: bool = False

    @property
    def total_weight(self) -> float:
        return float(sum(self.weights))

    def excluded_ranks(self) -> List[int]:
        return [i for i, why in enumerate(self.excluded) if why]

    def diverged(self, rank: int) -> bool:
        return self.source is not None and self.fingerprints[rank].state_key() != self.fingerprints[self.source].state_key()


def encode(rank: int, size: int, mine: Fingerprint) -> torch.Tensor:
    v = torch.zeros(size * _FIELDS, dtype=torch.float64)
    h = mine.hash & 0xFFFFFFFFFFFFFFFF
    v[rank * _FIELDS : (rank + 1) * _FIELDS] = torch.tensor(
        [h >> 32, h & 0xFFFFFFFF, mine.outer_round, mine.inner_round, mine.step, mine.weight, 1.0,
         mine.norm if math.isfinite(mine.norm) else NONFINITE, mine.ref, mine.who],
        dtype=torch.float64,
    )
    return v


def decode(v: torch.Tensor, size: int) -> List[Fingerprint]:
    out = []
    for i in range(size):
        hi, lo, o, inn, step, w, present, norm, ref, who = v[i * _FIELDS : (i + 1) * _FIELDS].tolist()
        if present != 1.0:
            raise RuntimeError(f"consistency vector slot {i} filled {present} times (expected once)")
        out.append(Fingerprint(hash=(int(hi) << 32) | int(lo), outer_round=int(o), inner_round=int(inn), step=int(step), weight=w,
                               norm=norm, ref=ref, who=int(who)))
    return out


def plan(fps: List[Fingerprint], max_behind: int = 0, ratio: float = 0.0) -> GuardPlan:
    """The round's plan from every member's fingerprint. ``max_behind`` (the outer level's
    ``sync.outer.max_staleness``): a member behind the source by 1..max_behind outer rounds
    keeps its weight; it measures its pseudo-gradient from its own, older global model
    (a stale update; the caller keeps that base, outer_round.py). ``ratio``: the norm
    screen's (:func:`screen`); a screened-out contribution has weight 0."""
    excluded = screen(fps, ratio)
    weights = [0.0 if why else fp.weight for fp, why in zip(fps, excluded)]
    keys = {fp.state_key() for fp in fps}
    if len(keys) == 1:
        return GuardPlan(fps, None, weights, excluded)
    # Newest state wins; min() over (-newness, rank) picks the lowest rank among ties.
    source = min(range(len(fps)), key=lambda i: (tuple(-x for x in fps[i].newness()), i))
    src = fps[source]

    def keeps(fp: Fingerprint) -> bool:
        return fp.newness() == src.newness() or 0 < src.outer_round - fp.outer_round <= max_behind

    return GuardPlan(fps, source, [w if keeps(fp) else 0.0 for fp, w in zip(fps, weights)], excluded)


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
