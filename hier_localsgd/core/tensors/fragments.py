"""Streaming fragments for the outer level (issue #13 §2).

The model's parameters are split into ``F`` disjoint fragments that together cover
the model; the outer level syncs one fragment every ``H/F`` inner rounds, so a full
cycle of ``H`` inner rounds syncs every parameter exactly once while the WAN carries
``1/F`` of the model at a time (Streaming DiLoCo; torchft's ``DiLoCo`` with several
``model_fragments``).

Units, the indivisible pieces a fragment is made of:

* ``by="layer"`` (torchtitan layout): every parameter under ``layers.<i>.`` belongs to
  unit ``layers.<i>``; any other parameter to the unit of its top-level module
  (``tok_embeddings``, ``norm``, ``output``). Units keep the model's order.
* ``groups={name: [prefix, ...], ...}``: named parameter groups; a parameter belongs to
  the group one of whose prefixes equals its name or its name's leading dotted part.
  Every parameter must belong to exactly one group (ValueError otherwise, naming them).

Balance (by parameter count, what a fragment costs on the wire):

* ``contiguous`` (default): consecutive units, the split that minimizes the largest
  fragment (exact, dynamic programming over at most a few hundred units) — layers that
  are neighbours sync together, as in Streaming DiLoCo's sequential pattern;
* ``greedy``: largest unit first onto the lightest fragment (LPT), not contiguous,
  usually closer to equal sizes.

The schedule (:class:`FragmentSchedule`) keys the fragment by the number of
*committed* fragment syncs, as torchft does (``manager.current_step() % F``): a sync
that fails is retried for the same fragment at the next slot instead of skipping it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple

if TYPE_CHECKING:  # torch is imported where it is used: the configuration imports this module (core/runtime/choices.py)
    import torch
    from torch import nn

LAYER = "layer"
CONTIGUOUS = "contiguous"
GREEDY = "greedy"
_LAYER_RE = re.compile(r"^(layers\.\d+)\.")


@dataclass(frozen=True)
class Fragment:
    """One fragment: the parameter names it holds (model order) and their element count."""

    index: int
    units: Tuple[str, ...]
    names: Tuple[str, ...]
    numel: int


def _layer_units(model: nn.Module) -> List[Tuple[str, List[str], int]]:
    units: Dict[str, Tuple[List[str], List[int]]] = {}
    for name, p in model.named_parameters():
        m = _LAYER_RE.match(name)
        unit = m.group(1) if m else name.split(".", 1)[0]
        names, sizes = units.setdefault(unit, ([], []))
        names.append(name)
        sizes.append(p.numel())
    return [(u, names, sum(sizes)) for u, (names, sizes) in units.items()]


def _group_units(model: nn.Module, groups: Mapping[str, Sequence[str]]) -> List[Tuple[str, List[str], int]]:
    def matches(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    found: Dict[str, Tuple[List[str], int]] = {g: ([], 0) for g in groups}
    unmatched, overlapping = [], []
    for name, p in model.named_parameters():
        hits = [g for g, prefixes in groups.items() if any(matches(name, pre) for pre in prefixes)]
        if not hits:
            unmatched.append(name)
        elif len(hits) > 1:
            overlapping.append(f"{name} in {hits}")
        else:
            names, n = found[hits[0]]
            names.append(name)
            found[hits[0]] = (names, n + p.numel())
    if unmatched or overlapping:
        raise ValueError(
            f"fragment groups must cover every parameter exactly once: unmatched {unmatched[:5]}"
            f"{'...' if len(unmatched) > 5 else ''}, in several groups {overlapping[:5]}"
        )
    empty = [g for g, (names, _) in found.items() if not names]
    if empty:
        raise ValueError(f"fragment groups {empty} match no parameter")
    # model order of each group's first parameter
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    units = [(g, names, n) for g, (names, n) in found.items()]
    units.sort(key=lambda u: order[u[1][0]])
    return units


def _contiguous(sizes: List[int], parts: int) -> List[int]:
    """Start index of each part: the contiguous split minimizing the largest part."""
    u = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    # best[k][i]: smallest possible max part splitting the first i units into k parts
    best = [[inf] * (u + 1) for _ in range(parts + 1)]
    cut = [[0] * (u + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, u + 1):
            for j in range(k - 1, i):  # last part = units j..i-1, non-empty
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], u
    for k in range(parts, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def split_fragments(
    model: nn.Module,
    num_fragments: int,
    by: str = LAYER,
    groups: Optional[Mapping[str, Sequence[str]]] = None,
    balance: str = CONTIGUOUS,
) -> List[Fragment]:
    """Splits ``model``'s parameters into ``num_fragments`` disjoint fragments covering it.

    Args:
        num_fragments: F >= 1, at most the number of units.
        by: ``layer`` (torchtitan layout) or ``groups`` (then ``groups`` is required).
        groups: named parameter groups (module docstring).
        balance: ``contiguous`` or ``greedy``.

    Raises:
        ValueError: a bad argument, more fragments than units, or groups that do not
            cover the model exactly once.
    """
    if by == LAYER:
        units = _layer_units(model)
    elif by == "groups":
        if not groups:
            raise ValueError("split_fragments(by='groups') needs groups={name: [prefix, ...]}")
        units = _group_units(model, groups)
    else:
        raise ValueError(f"split_fragments: by={by!r}, expected {LAYER!r} or 'groups'")
    if not isinstance(num_fragments, int) or num_fragments < 1:
        raise ValueError(f"num_fragments {num_fragments!r}: expected an int >= 1")
    if num_fragments > len(units):
        raise ValueError(f"num_fragments {num_fragments} > {len(units)} units ({[u[0] for u in units]})")
    if balance == CONTIGUOUS:
        starts = _contiguous([u[2] for u in units], num_fragments) + [len(units)]
        members = [list(range(starts[f], starts[f + 1])) for f in range(num_fragments)]
    elif balance == GREEDY:
        members = [[] for _ in range(num_fragments)]
        loads = [0] * num_fragments
        # largest first, ties in model order; lightest fragment, ties by index: deterministic
        for i in sorted(range(len(units)), key=lambda i: (-units[i][2], i)):
            f = min(range(num_fragments), key=lambda f: (loads[f], f))
            members[f].append(i)
            loads[f] += units[i][2]
        for m in members:
            m.sort()
    else:
        raise ValueError(f"split_fragments: balance={balance!r}, expected {CONTIGUOUS!r} or {GREEDY!r}")
    return [
        Fragment(
            index=f,
            units=tuple(units[i][0] for i in m),
            names=tuple(n for i in m for n in units[i][1]),
            numel=sum(units[i][2] for i in m),
        )
        for f, m in enumerate(members)
    ]


def fragment_parameters(model: nn.Module, fragment: Fragment) -> List[nn.Parameter]:
    """The fragment's parameters, in model order (what its outer sync all-reduces)."""
    params = dict(model.named_parameters())
    return [params[n] for n in fragment.names]


def outer_period(h_inner: int, h_outer: int, fragments: int = 1) -> int:
    """Local steps between the hierarchy's outer rounds: ``h_inner·h_outer`` (the whole
    model), or with ``F`` streaming fragments ``h_inner·h_outer/F`` (one fragment per outer
    round). The one home of this formula: the sync, the config, the planner, the
    simulator and the benchmarks all call it."""
    return h_inner * FragmentSchedule(h_outer, fragments).interval


@dataclass(frozen=True)
class FragmentSchedule:
    """Which fragment syncs when: one every ``H/F`` inner rounds.

    Inner rounds are counted from 1 since the start of training (or of the cycle the
    caller tracks); rounds ``k·H/F`` (k = 1, 2, ...) are sync slots.

    Attributes:
        sync_every: H, the inner rounds of a full cycle (what one outer round spans
            without fragments).
        num_fragments: F; H must be a multiple of F (torchft's DiLoCo asks the same),
            so that the slots are evenly spaced and a cycle has exactly F of them.
    """

    sync_every: int
    num_fragments: int

    def __post_init__(self) -> None:
        if self.num_fragments < 1 or self.sync_every < 1:
            raise ValueError(f"FragmentSchedule: H={self.sync_every}, F={self.num_fragments}: both must be >= 1")
        if self.sync_every % self.num_fragments:
            raise ValueError(
                f"FragmentSchedule: H={self.sync_every} inner rounds is not a multiple of F={self.num_fragments} "
                "fragments (one fragment syncs every H/F inner rounds)"
            )

    @property
    def interval(self) -> int:
        return self.sync_every // self.num_fragments

    def is_sync_round(self, inner_round: int) -> bool:
        """Whether a fragment sync happens after inner round ``inner_round`` (1-based)."""
        if inner_round < 1:
            raise ValueError(f"inner_round {inner_round}: rounds are counted from 1")
        return inner_round % self.interval == 0

    def fragment_for_sync(self, committed_syncs: int) -> int:
        """The fragment of the next sync, given how many fragment syncs have committed
        (a failed one does not count, so the same fragment is retried)."""
        return committed_syncs % self.num_fragments

    def fragment_due(self, inner_round: int) -> Optional[int]:
        """The fragment syncing after ``inner_round`` when every sync commits (None if
        the round is no slot)."""
        if not self.is_sync_round(inner_round):
            return None
        return self.fragment_for_sync(inner_round // self.interval - 1)


# -- fragments as ranges of the flat parameter vector (what the outer level syncs) --------

Ranges = Tuple[Tuple[int, int], ...]


def flat_ranges(model: nn.Module, flat_params: Sequence[nn.Parameter], fragments: Sequence[Fragment]) -> List[Ranges]:
    """Each fragment's ranges of the flat parameter vector, adjacent ranges merged.

    ``flat_params`` are the flat vector's parameters in order (``FlatParams.params``); a
    fragment's parameter that is not among them (frozen) is left out. Together the
    fragments cover the flat vector exactly once (a ValueError otherwise).
    """
    offsets: Dict[int, Tuple[int, int]] = {}
    off = 0
    for p in flat_params:
        offsets[id(p)] = (off, off + p.numel())
        off += p.numel()
    params = dict(model.named_parameters())
    out: List[Ranges] = []
    for frag in fragments:
        spans = sorted(offsets[id(params[n])] for n in frag.names if id(params[n]) in offsets)
        out.append(_merged(spans))
    covered = sorted(r for ranges in out for r in ranges)
    if _merged(covered) != ((0, off),) and off:
        raise ValueError(f"fragments {out} do not cover the {off} elements of the flat vector exactly once")
    return out


def _merged(spans: Sequence[Tuple[int, int]]) -> Ranges:
    merged: List[List[int]] = []
    for a, b in spans:
        if a >= b:
            continue
        if merged and merged[-1][1] == a:
            merged[-1][1] = b
        else:
            merged.append([a, b])
    return tuple((a, b) for a, b in merged)


def localize(ranges: Ranges, part: slice) -> Ranges:
    """``ranges`` of the flat vector as offsets into its slice ``part`` (0 = ``part.start``).
    Several ranks per group: a fragment may have no element in a rank's slice (its layers
    lie in another rank's); every cluster's rank of that slice then skips it alike."""
    out = [(max(a, part.start) - part.start, min(b, part.stop) - part.start) for a, b in ranges]
    return tuple((a, b) for a, b in out if a < b)


def gather(t: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """The elements of ``t`` in ``ranges``, as one new tensor (a copy)."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return t[a:b].clone()
    import torch

    return torch.cat([t[a:b] for a, b in ranges]) if ranges else t.new_empty(0)


def scatter_(dst: torch.Tensor, ranges: Ranges, src: torch.Tensor) -> torch.Tensor:
    """Writes ``src`` (as :func:`gather` made it) back into ``dst``'s ``ranges``; returns ``dst``."""
    o = 0
    for a, b in ranges:
        dst[a:b].copy_(src[o : o + b - a])
        o += b - a
    return dst
