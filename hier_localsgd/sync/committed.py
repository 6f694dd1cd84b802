"""The committed state of a replica group (a mixin of :class:`HierarchicalSync`).

What a round commits and what a failure restores: the model at the last commit, the
inner optimizer's state, each level's backup and momentum, the counters; the state dicts
a heal transfers (torchft's checkpoint transport) and a durable checkpoint holds.
Rollback restores the last commit exactly (staged updates are dropped, never applied).
A heal keeps what it replaced, so a healed member's local steps can still count as an
inner stale update (:meth:`CommittedState._stale_inner`).
"""

from __future__ import annotations

import copy
import logging
from typing import Dict, List, Optional, Tuple

import torch

from hier_localsgd.core.device import host_copy
from hier_localsgd.core.flat import checksum_int
from hier_localsgd.core.phases import Phase

logger = logging.getLogger("hier_localsgd.sync.hier")  # one logger name for the whole round


class CommittedState:
    """The committed-state methods; state lives on :class:`HierarchicalSync`."""

    def _discard_local_work(self, why: str) -> None:
        """Counts the local steps since the last commit as discarded; a ``discard`` event
        says why (the chaos report's breakdown of lost work: ``rollback``, or a weight-0
        commit after a ``join``, a ``heal``, an ``errored`` Manager or a guard ``resync``)."""
        n = self.work["steps_since_commit"]
        self.work["steps_since_commit"] = 0
        self._kept_sent = False
        self._count_discarded(n, "inner", why)

    def _count_discarded(self, n: int, level: str, why: str) -> None:
        """``n`` steps lost at ``level``: the work counter and the ``discard`` event saying why."""
        self.work["steps_discarded"] += n
        if n:
            self.events("discard", level=level, reason=why, steps=n, step=self.counters.step)

    def _publish_committed(self) -> None:
        """The full committed model from every rank's committed slice; the model becomes it.

        One rank per group: a copy. Several: an all-gather over the group's own process
        group (never an FT group: ranks of one group share no FT group, I1)."""
        g = self.s.group_world_size
        if g == 1 or self.s.group_shards:
            self._committed.copy_(self.inner.backup)
        else:
            import torch.distributed as dist

            dev = self.flat.data.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")  # type: ignore[arg-type]
            mine = torch.zeros(self._slice_len, dtype=self._committed.dtype, device=dev)
            mine[: self.part.stop - self.part.start] = self.inner.backup
            parts = [torch.empty_like(mine) for _ in range(g)]
            dist.all_gather(parts, mine, group=self.group)
            self._committed.copy_(torch.cat(parts)[: self._committed.numel()])
        self.flat.load_(self._committed)

    def _rollback(self, reason: str) -> None:
        if self._may_keep_local():
            self._keep_local(reason)
            return
        self._discard_local_work("rollback")
        self.tracker.set_extra(**self.work_counters())
        self.tracker.enter(Phase.ROLLBACK, None, reason=reason)
        # the committed slice may have moved this round (resync, or a final outer commit)
        self._publish_committed()
        self.opt.load_state_dict(copy.deepcopy(self._opt_backup))
        self.tracker.set_counters(step=self.counters.step, outer_round=self.counters.outer_round)
        self.events("rollback", level="inner", reason=reason, step=self.counters.step)
        self.tracker.enter(Phase.LOCAL)

    def _may_keep_local(self) -> bool:
        """sync.failed_round=keep_local, one rank per group, and the committed state
        (model, levels' backups and momenta, outer snapshot and residual) exactly as it was
        when the round began: then the live model is this group's own local progress from
        that state, which no failure touched (updates are staged and applied only on commit)."""
        start = self._round_start_hash
        self._round_start_hash = None
        return start is not None and self.s.group_world_size == 1 and self._inner_hash() == start

    def _keep_local(self, reason: str) -> None:
        """A failed round that keeps the local steps (sync.failed_round=keep_local): the
        model and the inner optimizer stay as they are and ``steps_since_commit`` keeps
        counting, so the next round's pseudo-gradient (backup − live model) carries this
        round's steps too, as one longer round would. Nothing committed changes; the failure
        still counts towards max_commit_failures / max_quorum_failures as a rollback does."""
        self.tracker.set_extra(**self.work_counters())
        self.events("keep_local", level="inner", reason=reason, step=self.counters.step)
        logger.info("%s: round failed (%s); keeping %d local steps for the next round", self.id, reason,
                    self.work["steps_since_commit"])
        self.tracker.enter(Phase.LOCAL, reason=f"round failed, local steps kept: {reason}")

    def _stale_inner(self, join: bool) -> Optional[Tuple[torch.Tensor, torch.Tensor, int]]:
        """(live, base, rounds behind) of an inner stale update, or None (weight 0 if this
        member healed).

        A member that healed in this round's quorum (it skipped rounds through a
        cluster-lighthouse outage, or was stopped while its peers committed) holds local
        steps that started from its own last commit. They are still work: as the outer
        level does for a cluster behind (outer_round.py, ``_stale``), it contributes
        ``base - live`` measured from that commit, and every member applies the round's
        average to the healed, newest model — asynchronous Local SGD with one stale
        contribution. Only when its base is at most ``inner_max_staleness`` rounds behind
        the healed model (the donor's step less its base's, in rounds of ``h_inner`` steps,
        rounded up; older work is dropped, weight 0, as before), never in a join round (a
        restart has no steps), and only with one rank per group (each rank heals on its own
        Manager; the ranks could decide differently). The pair was kept by the heal (committed.py) before it
        replaced the model; nothing else changes: the consistency guard sees the healed
        state, and a failed round rolls back to it. Not for steps that keep_local kept from a
        failed round in which they were already sent: a commit that holds them may exist (the
        leader's outer commit is final even when its cluster's round fails, and peers may have
        committed a round this member failed), so they could count twice."""
        if join or self._inner_stale is None or self._kept_sent:
            return None
        steps = self.work["steps_since_commit"]
        base, live, behind_steps = self._inner_stale
        behind = -(-max(behind_steps, steps) // self.s.h_inner)
        if steps <= 0 or behind > self.s.inner_max_staleness:
            return None
        return live.to(self.flat.data.device), base, behind

    def _inner_hash(self) -> int:
        return checksum_int(*self._inner_tensors())

    def _inner_tensors(self) -> List[torch.Tensor]:
        """The cluster's replicated committed tensors (the inner guard compares and resyncs them)."""
        return (self.inner.state_tensors() + [self.outer.backup] + ([self._snap] if self._snap is not None else [])
                + ([self.comp.residual] if self.comp is not None else []))

    def _inner_state_dict(self) -> Dict[str, object]:
        """What a donor serves a healing peer of its cluster: committed state only."""
        c = self.counters
        # An early quorum (early.py) serves a heal while the donor's last local step still
        # runs: it announced the sync point's step, and so must the heal, or the healed
        # member would sit one step behind and the guard would resync it at weight 0.
        step = self._serve_step if self._serve_step is not None else c.step
        return {
            "model": self._committed.clone(),
            "inner": self.inner.state_dict(),
            "outer_backup": self.outer.backup.clone(),
            "optimizer": self._opt_backup,  # replaced, never mutated, at each commit
            "counters": {"step": step, "inner_round": c.inner_round, "outer_round": c.outer_round},
            "outer_snapshot": None if self._snap is None else {"model": self._snap.clone(), "step": self._snap_step},
            "outer_compression": None if self.comp is None else self.comp.state_dict(),
            "user": self.user.served(),
        }

    def _load_inner_state(self, sd: Dict[str, object]) -> None:
        if self._defer_heal:
            # Received by an early quorum while the last local step runs (early.py):
            # applied at the sync point, on the training thread.
            self._pending_heal = sd
            return
        if (self._inner_stale is None and self.s.inner_max_staleness > 0 and self.s.group_world_size == 1
                and self.work["steps_since_commit"] > 0):
            # What the heal replaces: the work an inner stale update contributes (_stale_inner),
            # on the host (committed state costs no device memory), and how many steps of
            # training lie between its base (its last commit) and the donor's state.
            donor = sd["counters"]
            assert isinstance(donor, dict)
            behind = int(donor["step"]) - (self.counters.step - self.work["steps_since_commit"])
            self._inner_stale = (self.inner.backup.clone(), host_copy(self.flat.data[self.part]), behind)
        self.inner.load_state_dict(sd["inner"])  # type: ignore[arg-type]
        self.outer.set_backup(sd["outer_backup"])  # type: ignore[arg-type]
        self._opt_backup = copy.deepcopy(sd["optimizer"])
        self.opt.load_state_dict(copy.deepcopy(sd["optimizer"]))  # type: ignore[arg-type]
        counters = sd["counters"]
        assert isinstance(counters, dict)
        self.counters.step = int(counters["step"])
        self.counters.inner_round = int(counters["inner_round"])
        self.counters.outer_round = int(counters["outer_round"])
        snap = sd.get("outer_snapshot")
        if self._snap is not None and isinstance(snap, dict):
            self._snap.copy_(snap["model"])  # the merge at the next apply round needs it
            self._snap_step = int(snap["step"])
        if self.comp is not None:
            self.comp.load_state_dict(sd.get("outer_compression"), "the healing donor or checkpoint")  # type: ignore[arg-type]
        self.user.load(sd.get("user"), "the healing donor or checkpoint")  # type: ignore[arg-type]
        self._committed.copy_(sd["model"])  # type: ignore[arg-type]
        self.flat.load_(self._committed)
        self.tracker.set_counters(**{k: int(v) for k, v in counters.items()})
        logger.info("%s healed from a peer of its cluster: %s", self.id, counters)

    def snapshot(self) -> Dict[str, object]:
        """The committed state for a durable checkpoint (clones; call right after a commit)."""
        sd = self._inner_state_dict()
        sd["optimizer"] = copy.deepcopy(self._opt_backup)
        sd["outer"] = self.outer.state_dict()
        return sd

    def restore(self, sd: Dict[str, object]) -> None:
        """Loads a checkpoint's state (before the join round of a resumed job)."""
        self._load_inner_state(sd)
        self.outer.load_state_dict(sd["outer"])  # type: ignore[arg-type]
        self._since_outer = 0

    def _outer_state_dict(self) -> Dict[str, object]:
        """What a leader serves another cluster's healing leader (overlapped: the stage's
        outer level and launch counters, the state its outer round runs on)."""
        outer_round, step = self._outer_view or (self.counters.outer_round, self.counters.step)
        return {
            "outer": self._outer_target.state_dict(),
            "counters": {"outer_round": outer_round, "step": step},
        }

    def _load_outer_state(self, sd: Dict[str, object]) -> None:
        base = self._outer_target.backup.clone()  # the global model this cluster's work started from
        self._outer_target.load_state_dict(sd["outer"])  # type: ignore[arg-type]
        counters = sd["counters"]
        assert isinstance(counters, dict)
        self._outer_healed = (int(counters["outer_round"]), int(counters["step"]))
        self._outer_base = base
        logger.info("%s healed its outer level from another cluster: %s", self.id, counters)
