"""The committed state of a replica group (:class:`CommittedState`, owned by
:class:`~hier_localsgd.sync.hier.HierarchicalSync`).

What a round commits and what a failure restores: the model at the last commit, the
inner optimizer's state, each level's backup and momentum, the counters; the state dicts
a heal transfers (torchft's checkpoint transport) and a durable checkpoint holds.
Rollback restores the last commit exactly (staged updates are dropped, never applied).
A heal keeps what it replaced, so a healed member's local steps can still count as an
inner stale update (:meth:`CommittedState.stale_inner`).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch

from hier_localsgd.sync.user_state import hyperparameters, set_hyperparameters
from hier_localsgd.core.tensors import guard
from hier_localsgd.core.runtime.device import host_copy, host_state, host_state_finite
from hier_localsgd.core.tensors.flat_params import checksum, checksum_int
from hier_localsgd.core.tensors.level import Staged
from hier_localsgd.core.runtime.phases import Phase
from hier_localsgd.sync.common import OuterResult, Status
from hier_localsgd.sync.state import SyncState

logger = logging.getLogger("hier_localsgd.sync.hier")  # one logger name for the whole round


class Carried(Protocol):
    """State another part of the round owns that heals and checkpoints with the committed
    state (:meth:`CommittedState.carry`): plain values the heal format carries."""

    def state_dict(self) -> Dict[str, object]: ...

    def load_state_dict(self, sd: Optional[Dict[str, object]]) -> None: ...


class CommittedState:
    """The committed model and inner optimizer, heals, rollback and keep_local.

    Attributes the round sets (public: hier.py drives them):
        inner_stale: (its last committed inner backup, its live model, the steps between
            that commit and the donor's state) just before this round's heal replaced them:
            an inner stale update's base, work and age (:meth:`stale_inner`).
        defer_heal / pending_heal: the early inner quorum (early.py) and the heal it
            received, applied at the sync point.
        serve_step: the step an early quorum announced while it is in flight: what a heal serves.
        kept_sent: keep_local kept steps whose pseudo-gradient a failed round had already
            sent: never a stale update (the leader's final outer commit may hold them already).
        round_start_hash: keep_local: the committed state's checksum when the round began.
    """

    def __init__(self, st: SyncState) -> None:
        self.st = st
        # Host state (core/runtime/device.py): pinned host memory when the model is on CUDA.
        self.model = host_copy(st.flat.data)  # the full model at the last commit
        self.opt_backup = host_state(st.opt.state_dict())
        self.inner_stale: Optional[Tuple[torch.Tensor, torch.Tensor, int]] = None
        self.defer_heal = False
        self.pending_heal: Optional[Dict[str, object]] = None
        self.serve_step: Optional[int] = None
        self.kept_sent = False
        self.round_start_hash: Optional[int] = None
        self.carried: Dict[str, Carried] = {}

    def carry(self, name: str, part: Carried) -> None:
        """``part``'s state heals and checkpoints with the committed state, under ``name``
        (the asynchronous outer level's token count: a healed member that comes to lead
        pushes what its cluster holds, not what it saw since it joined)."""
        self.carried[name] = part

    def discard_local_work(self, why: str) -> None:
        """Counts the local steps since the last commit as discarded; a ``discard`` event
        says why (the chaos report's breakdown of lost work: ``rollback``, or a weight-0
        commit after a ``join``, a ``heal``, an ``errored`` Manager or a guard ``resync``)."""
        work = self.st.work
        n = work["steps_since_commit"]
        work["steps_since_commit"] = 0
        self.kept_sent = False
        self.count_discarded(n, "inner", why)

    def count_discarded(self, n: int, level: str, why: str) -> None:
        """``n`` steps lost at ``level``: the work counter and the ``discard`` event saying why."""
        self.st.work["steps_discarded"] += n
        if n:
            self.st.events("discard", level=level, reason=why, steps=n, step=self.st.counters.step)

    def apply(
        self, ok: bool, staged: Staged, result: Optional[OuterResult], plan: guard.GuardPlan, rank: int, weight0_why: str,
        adopt: Callable[[OuterResult, torch.Tensor], None], carried_at_launch: int,
    ) -> bool:
        """INNER_COMMIT's outcome: adopt the staged state, or roll back. ``rank``: this
        member's in the quorum; ``weight0_why``: why its steps carried weight 0 ("" if they
        counted); ``adopt``: the outer level's adoption of a committed outer result;
        ``carried_at_launch``: the inner-committed steps an overlapped outer round carried."""
        st = self.st
        c = st.counters
        outer_final = st.leader and result is not None and result.status == Status.OUTER_COMMITTED
        if not ok:
            if outer_final:
                # The outer commit is final even though our cluster's round failed.
                assert result is not None and result.params is not None
                self.take_out_stand_in()
                # Alone: the push schedule stays the cluster's (its members roll back).
                adopt(replace(result, push_in=0), st.inner.backup)
            self.rollback("inner commit vote failed")
            return False

        st.inner.commit(staged)
        if result is not None:  # the cluster model meets the outer level: no stand-in past here (overlap.py)
            self.take_out_stand_in()
        st.inner.norm_ref = guard.accepted_median(plan.fingerprints, plan.weights) or st.inner.norm_ref
        self.kept_sent = False
        if plan.weights and plan.weights[min(rank, len(plan.weights) - 1)] == 0:
            # committed, but our steps carried weight 0
            self.discard_local_work(weight0_why or ("resync" if plan.source is not None else "guard_failed"))
        st.since_outer += st.work["steps_since_commit"]
        st.work["steps_since_commit"] = 0
        adopted = result is not None and result.status != Status.ABORT and result.params is not None
        if adopted and result is not None and result.status == Status.OUTER_COMMITTED:
            # What the outer round carried: all inner-committed work since the last outer
            # commit, or (overlapped) what there was at its launch; the rest rides on the next.
            carried = min(carried_at_launch, st.since_outer) if result.merge else st.since_outer
            if result.cluster_weight == 0:
                # The global model moved without this cluster's work (it had just
                # healed to a newer one): the work it carried is lost. A push refused as a
                # repeat (its earlier push from the same base merged, to step held_to):
                # only the steps past that one are.
                lost = carried if result.held_to < 0 else min(carried, max(0, result.step - result.held_to))
                self.count_discarded(lost, "outer", "cluster_weight0")
            st.since_outer -= carried
        st.tracker.set_extra(**st.work_counters())
        if adopted:
            assert result is not None and result.params is not None
            if result.status == Status.OUTER_COMMITTED:
                adopt(result, st.inner.backup)
            else:
                st.inner.set_backup(result.params)
                c.outer_round, c.step = result.outer_round, result.step
            if st.comp is not None and result.residual is not None and not st.leader:
                st.comp.load(result.residual)  # the leader's committed residual (compression.py)
        if plan.total_weight > 0 or adopted:
            c.inner_round += 1
        self.publish()
        if weight0_why == "excluded":  # its optimizer took the poisoned steps: back to the last commit's
            self.restore_optimizer()
        self.keep_optimizer()
        st.tracker.set_counters(step=c.step, inner_round=c.inner_round, outer_round=c.outer_round)
        st.tracker.mark_commit("inner", c.inner_round)
        st.events(
            "commit", level="inner", inner_round=c.inner_round, outer_round=c.outer_round, step=c.step,
            outer=bool(result is not None and result.status == Status.OUTER_COMMITTED),
            cluster_weight=result.cluster_weight if result is not None and result.status == Status.OUTER_COMMITTED else None,
            **({"held_to": result.held_to} if result is not None and result.status == Status.OUTER_COMMITTED and result.held_to >= 0 else {}),
            total_weight=plan.total_weight, participants=len(plan.weights), checksum=checksum(self.model),
        )
        st.tracker.enter(Phase.LOCAL)
        return True

    def publish(self) -> None:
        """The full committed model from every rank's committed slice; the model becomes it.

        One rank per group: a copy. Several: an all-gather over the group's own process
        group (never an FT group: ranks of one group share no FT group, I1)."""
        st = self.st
        g = st.settings.group_world_size
        if g == 1 or st.settings.group_shards:
            self.model.copy_(st.inner.backup)
        else:
            import torch.distributed as dist

            dev = st.flat.data.device if dist.get_backend(st.group) == "nccl" else torch.device("cpu")  # type: ignore[arg-type]
            mine = torch.zeros(st.slice_len, dtype=self.model.dtype, device=dev)
            mine[: st.part.stop - st.part.start] = st.inner.backup
            parts = [torch.empty_like(mine) for _ in range(g)]
            dist.all_gather(parts, mine, group=st.group)
            self.model.copy_(torch.cat(parts)[: self.model.numel()])
        st.flat.load_(self.model)

    def keep_optimizer(self) -> None:
        """The inner optimizer's state becomes the committed one (after a commit)."""
        self.opt_backup = host_state(self.st.opt.state_dict())

    def restore_optimizer(self) -> None:
        """An excluded member's inner optimizer goes back to its state at the last commit
        (before the poisoned steps), or starts afresh if that state is not finite either."""
        st = self.st
        if host_state_finite(self.opt_backup):
            live = hyperparameters(st.opt)  # a scheduler's lr stays where the loop has it (user_state.py)
            st.opt.load_state_dict(copy.deepcopy(self.opt_backup))
            set_hyperparameters(st.opt, live)
            st.events("optimizer_restored", step=st.counters.step, how="last commit")
        else:
            st.opt.state.clear()
            st.events("optimizer_restored", step=st.counters.step, how="reset")

    def rollback(self, reason: str) -> None:
        st = self.st
        if self._may_keep_local():
            self._keep_local(reason)
            return
        self.discard_local_work("rollback")
        st.tracker.set_extra(**st.work_counters())
        st.tracker.enter(Phase.ROLLBACK, None, reason=reason)
        # the committed slice may have moved this round (resync, or a final outer commit)
        self.publish()
        live = hyperparameters(st.opt)  # a scheduler's lr stays where the loop has it (user_state.py)
        st.opt.load_state_dict(copy.deepcopy(self.opt_backup))
        set_hyperparameters(st.opt, live)
        st.tracker.set_counters(step=st.counters.step, outer_round=st.counters.outer_round)
        st.events("rollback", level="inner", reason=reason, step=st.counters.step)
        st.tracker.enter(Phase.LOCAL)

    def _may_keep_local(self) -> bool:
        """sync.failed_round=keep_local, one rank per group, and the committed state
        (model, levels' backups and momenta, outer snapshot and residual) exactly as it was
        when the round began: then the live model is this group's own local progress from
        that state, which no failure touched (updates are staged and applied only on commit)."""
        start = self.round_start_hash
        self.round_start_hash = None
        return start is not None and self.st.settings.group_world_size == 1 and self.inner_hash() == start

    def _keep_local(self, reason: str) -> None:
        """A failed round that keeps the local steps (sync.failed_round=keep_local): the
        model and the inner optimizer stay as they are and ``steps_since_commit`` keeps
        counting, so the next round's pseudo-gradient (backup − live model) carries this
        round's steps too, as one longer round would. Nothing committed changes; the failure
        still counts towards max_commit_failures / max_quorum_failures as a rollback does."""
        st = self.st
        st.tracker.set_extra(**st.work_counters())
        st.events("keep_local", level="inner", reason=reason, step=st.counters.step)
        logger.info("%s: round failed (%s); keeping %d local steps for the next round", st.id, reason,
                    st.work["steps_since_commit"])
        st.tracker.enter(Phase.LOCAL, reason=f"round failed, local steps kept: {reason}")

    def stale_inner(self, join: bool) -> Optional[Tuple[torch.Tensor, torch.Tensor, int]]:
        """(live, base, rounds behind) of an inner stale update, or None (weight 0 if this
        member healed).

        A member that healed in this round's quorum (it skipped rounds through a
        cluster-lighthouse outage, or was stopped while its peers committed) holds local
        steps that started from its own last commit. They are still work: as the outer
        level does for a cluster behind (outer_round.py, OuterLevel's ``_stale``), it contributes
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
        st = self.st
        if join or self.inner_stale is None or self.kept_sent:
            return None
        steps = st.work["steps_since_commit"]
        base, live, behind_steps = self.inner_stale
        behind = -(-max(behind_steps, steps) // st.settings.h_inner)
        if steps <= 0 or behind > st.settings.inner_max_staleness:
            return None
        return live.to(st.flat.data.device), base, behind

    @torch.no_grad()
    def take_out_stand_in(self) -> bool:
        """Eager updates (overlap.py): the committed cluster model without the pending
        stand-in step (``θ + U``, ``U`` zeroed). Returns whether one was pending; the caller
        publishes the model unless a commit that follows does."""
        u = self.st.stand_in
        if u is None or not bool(u.any()):
            return False
        self.st.inner.set_backup(self.st.inner.backup + u)
        u.zero_()
        return True

    @torch.no_grad()
    def take_out_stand_in_live(self) -> None:
        """A launch whose inner commit failed finds a stand-in still pending (its apply
        round's commit failed too): take it out of the committed state *and* of the live
        model. One rank per group: added to both (the live model may hold local steps that
        ``sync.failed_round=keep_local`` kept). Several: the committed slice, then the
        group's all-gather, which every rank runs whatever its slice holds (its fragment
        may miss a rank's slice)."""
        st = self.st
        u = st.stand_in
        if u is None:
            return
        if st.settings.group_world_size == 1 or st.settings.group_shards:
            if bool(u.any()):
                self.model[st.part] += u.to(self.model.device)
                live = st.flat.data  # FSDP's ShardedParams: a fresh tensor, so written back with load_
                live[st.part] += u.to(live.device)
                if st.settings.group_shards:
                    st.flat.load_(live)
                self.take_out_stand_in()
            return
        self.take_out_stand_in()
        self.publish()

    def without_stand_in(self, model: torch.Tensor) -> torch.Tensor:
        """``model`` (a cluster model) with the pending stand-in step taken out: what it
        contributes to a blocking outer round."""
        u = self.st.stand_in
        return model if u is None else model + u

    def inner_hash(self) -> int:
        return checksum_int(*self.inner_tensors())

    def inner_tensors(self) -> List[torch.Tensor]:
        """The cluster's replicated committed tensors (the inner guard compares and resyncs them)."""
        st = self.st
        eager = [] if st.stand_in is None else [st.stand_in] + ([] if st.outer.momentum is None else [st.outer.momentum])
        return (st.inner.state_tensors() + [st.outer.backup] + ([st.snap] if st.snap is not None else [])
                + ([st.comp.residual] if st.comp is not None else []) + eager)

    def state_dict(self) -> Dict[str, object]:
        """What a donor serves a healing peer of its cluster: committed state only."""
        st, c = self.st, self.st.counters
        # An early quorum (early.py) serves a heal while the donor's last local step still
        # runs: it announced the sync point's step, and so must the heal, or the healed
        # member would sit one step behind and the guard would resync it at weight 0.
        step = self.serve_step if self.serve_step is not None else c.step
        return {
            "model": self.model.clone(),
            "inner": st.inner.state_dict(),
            "outer_backup": st.outer.backup.clone(),
            "optimizer": self.opt_backup,  # replaced, never mutated, at each commit
            "counters": {"step": step, "inner_round": c.inner_round, "outer_round": c.outer_round},
            "outer_snapshot": None if st.snap is None else {"model": st.snap.clone(), "step": st.snap_step},
            "outer_compression": None if st.comp is None else st.comp.state_dict(),
            # Eager updates: the pending stand-in and the outer momentum it is computed with.
            "eager": None if st.stand_in is None else {
                "stand_in": st.stand_in.clone(), "momentum": None if st.outer.momentum is None else st.outer.momentum.clone()},
            "user": st.user.served(),
            "carried": {name: part.state_dict() for name, part in self.carried.items()},
        }

    def load_state_dict(self, sd: Dict[str, object]) -> None:
        """A heal from a peer of its cluster (or a checkpoint): the committed state becomes ``sd``."""
        st = self.st
        if self.defer_heal:
            # Received by an early quorum while the last local step runs (early.py):
            # applied at the sync point, on the training thread.
            self.pending_heal = sd
            return
        if (self.inner_stale is None and st.settings.inner_max_staleness > 0 and st.settings.group_world_size == 1
                and st.work["steps_since_commit"] > 0):
            # What the heal replaces: the work an inner stale update contributes (stale_inner),
            # on the host (committed state costs no device memory), and how many steps of
            # training lie between its base (its last commit) and the donor's state.
            donor = sd["counters"]
            assert isinstance(donor, dict)
            behind = int(donor["step"]) - (st.counters.step - st.work["steps_since_commit"])
            self.inner_stale = (st.inner.backup.clone(), host_copy(st.flat.data[st.part]), behind)
        st.inner.load_state_dict(sd["inner"])  # type: ignore[arg-type]
        st.outer.set_backup(sd["outer_backup"])  # type: ignore[arg-type]
        self.opt_backup = copy.deepcopy(sd["optimizer"])
        st.opt.load_state_dict(copy.deepcopy(sd["optimizer"]))  # type: ignore[arg-type]
        counters = sd["counters"]
        assert isinstance(counters, dict)
        st.counters.step = int(counters["step"])
        st.counters.inner_round = int(counters["inner_round"])
        st.counters.outer_round = int(counters["outer_round"])
        snap = sd.get("outer_snapshot")
        if st.snap is not None and isinstance(snap, dict):
            st.snap.copy_(snap["model"])  # the merge at the next apply round needs it
            st.snap_step = int(snap["step"])
        if st.comp is not None:
            st.comp.load_state_dict(sd.get("outer_compression"), "the healing donor or checkpoint")  # type: ignore[arg-type]
        if st.stand_in is not None:
            self._load_eager(sd.get("eager"))
        st.user.load(sd.get("user"), "the healing donor or checkpoint", step=st.counters.step)  # type: ignore[arg-type]
        carried = sd.get("carried")
        for name, part in self.carried.items():  # a donor or checkpoint without it: None
            part.load_state_dict(carried.get(name) if isinstance(carried, dict) else None)  # type: ignore[arg-type]
        self.model.copy_(sd["model"])  # type: ignore[arg-type]
        if st.stand_in is None:
            self._drop_foreign_stand_in(sd.get("eager"))
        st.flat.load_(self.model)
        st.tracker.set_counters(**{k: int(v) for k, v in counters.items()})
        logger.info("%s healed from a peer of its cluster: %s", st.id, counters)

    @torch.no_grad()
    def _drop_foreign_stand_in(self, eager: object) -> None:
        """A checkpoint written with eager updates, resumed without: a pending stand-in is
        taken out of the model it holds (else the model would keep that step for good)."""
        u = eager.get("stand_in") if isinstance(eager, dict) else None
        if not isinstance(u, torch.Tensor) or not bool(u.any()):
            return
        st = self.st
        if st.settings.group_world_size > 1 and not st.settings.group_shards:
            raise RuntimeError("the checkpoint holds a pending eager-update stand-in and this job runs without "
                               "sync.outer.eager: resume it with sync.outer.eager=true (several ranks per group)")
        st.inner.set_backup(st.inner.backup + u)
        self.model[st.part] += u.to(self.model.device)
        logger.warning("%s: the checkpoint's pending eager stand-in was taken out (sync.outer.eager is off)", st.id)

    def _load_eager(self, eager: object) -> None:
        """A heal's or checkpoint's eager state; one without it (written with eager updates
        off) has no stand-in pending, and the outer momentum stays as it is."""
        st = self.st
        assert st.stand_in is not None
        if not isinstance(eager, dict):
            st.stand_in.zero_()
            return
        st.stand_in.copy_(eager["stand_in"])
        if eager.get("momentum") is not None:
            st.outer.set_momentum(eager["momentum"])

    def snapshot(self) -> Dict[str, object]:
        """The committed state for a durable checkpoint (clones; call right after a commit)."""
        sd = self.state_dict()
        sd["optimizer"] = copy.deepcopy(self.opt_backup)
        sd["outer"] = self.st.outer.state_dict()
        return sd

    def restore(self, sd: Dict[str, object]) -> None:
        """Loads a checkpoint's state (before the join round of a resumed job)."""
        self.load_state_dict(sd)
        self.st.outer.load_state_dict(sd["outer"])  # type: ignore[arg-type]
        self.st.since_outer = 0
