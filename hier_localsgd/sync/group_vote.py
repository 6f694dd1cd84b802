"""One outcome per replica group and round: the ranks of a group vote before they branch.

A replica group of G > 1 ranks runs G rounds side by side, one per ring (rank k of every
group forms ring k, hier.py), and each rank sees only its own ring: a collective that
fails on ring 1 alone, a quorum call that one rank's client gives up on. torchft's
ManagerServer (on group rank 0) aggregates the group's ranks: it sends one quorum request
to the lighthouse once every rank has asked, and decides a commit once every rank has
voted. So the ranks must make the same Manager calls in the same order. A rank that skips
the outer quorum its sibling asked for leaves the sibling's request waiting until its
timeout, and then the group's inner commit vote too (issue #30: in a 2 x 2 job of
tensor-parallel groups, rank 0 went INNER_REDUCE -> OUTER_QUORUM, rank 1 INNER_REDUCE ->
INNER_COMMIT; rank 1's commit vote timed out 30 s later, it exited, and torchrun
restarted the whole group).

So before each branch that decides which calls follow, the ranks agree
(:meth:`GroupVote.agree`): each rank gives its flags, one all-reduce (MIN) on the group's
own process group gives every rank the same answer, and every rank takes the path that
answer names. The worst outcome wins: a failure one rank sees, every rank acts on.

The group's own process group (torchrun's, the one DDP or tensor parallelism uses) is the
channel: it joins only the group's ranks, which live and die together (torchrun ends and
restarts all of them when one dies), so a vote never waits for another replica group. It
runs on the training thread, where the group's other collectives run, so the ranks issue
it in the same order. Its timeout is the group's (``max(inner_reduce, local_step)``,
job.py). A vote that fails (a sibling died) counts as every flag false on the
rank that saw it; torchrun then ends the group. With one rank per group there is nothing
to agree on and no collective is issued.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Optional, Tuple

import torch

logger = logging.getLogger(__name__)


class GroupVote:
    """The vote of one replica group's ranks (see the module docstring).

    Args:
        group: the group's own torch.distributed process group; None with one rank.
        size: the group's number of ranks (G).
        device: where the vote's tensor lives (the model's device for an NCCL group, else the CPU).
        events: the process's event sink; a ``group_vote`` event records every flag a
            sibling overruled on this rank.
    """

    def __init__(self, group: Optional[Any], size: int, device: torch.device = torch.device("cpu"),
                 events: Optional[Callable[..., None]] = None) -> None:
        self.group = group if size > 1 else None
        self.size = size
        self.device = device
        self._events = events

    @property
    def active(self) -> bool:
        return self.group is not None

    def total(self, value: float) -> float:
        """``value`` summed over the group's ranks (float64; NaN if any rank's is). Every
        rank calls it; with one rank, ``value``. A sum that fails (a sibling died: torchrun
        ends the group) gives this rank's own ``value``."""
        if self.group is None:
            return value
        import torch.distributed as dist

        v = torch.tensor([value], dtype=torch.float64, device=self.device)
        try:
            dist.all_reduce(v, op=dist.ReduceOp.SUM, group=self.group)
        except Exception as e:
            logger.warning("group sum failed (%s): this rank's own value", e)
            return value
        return float(v.item())

    def agree(self, what: str, **flags: bool) -> Dict[str, bool]:
        """Each flag, true only if it is true on every rank of the group. ``what`` names
        the branch (logs, events). Blocks until every rank has voted (the group's timeout)."""
        if self.group is None:
            return dict(flags)
        import torch.distributed as dist

        names = list(flags)
        v = torch.tensor([1.0 if flags[n] else 0.0 for n in names], device=self.device)
        try:
            dist.all_reduce(v, op=dist.ReduceOp.MIN, group=self.group)
            agreed = {n: bool(x > 0.5) for n, x in zip(names, v.tolist())}
        except Exception as e:  # a sibling died: torchrun ends the group; act on the worst
            logger.warning("group vote on %s failed (%s): every flag false", what, e)
            agreed = {n: False for n in names}
        overruled = sorted(n for n in names if flags[n] and not agreed[n])
        if overruled:
            logger.warning("group vote on %s: a sibling rank overruled %s", what, overruled)
            if self._events is not None:
                self._events("group_vote", what=what, overruled=overruled)
        return agreed

    def slices(self, what: str, ready: bool = True) -> Tuple[bool, Optional[Callable[..., Dict[str, bool]]]]:
        """Before a quorum request of a group of several ranks (core/ft/managers.py
        ``LevelManager.start_quorum``, ``agree``: why): whether every rank is ``ready`` to
        ask, and the vote its slices take. This vote also starts every rank's first slice
        at the same instant. With one rank: (``ready``, None), and no collective."""
        if self.group is None:
            return ready, None
        ok = self.agree(f"{what} start", ready=ready)["ready"]
        return ok, lambda **flags: self.agree(f"{what} slice", **flags)
