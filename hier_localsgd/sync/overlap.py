"""Overlapped outer sync: the leader's WAN round runs behind its cluster's training.

With ``sync.outer.delay = D > 0`` an outer round no longer blocks the cluster:

* **Launch** (the outer round's inner round, step ``s`` a multiple of ``h_inner·h_outer``):
  after its inner commit every member keeps a *snapshot* of the committed cluster model
  ``θ_s`` (the outer round's input). The leader starts OUTER_QUORUM → OUTER_REDUCE →
  OUTER_COMMIT on a background thread (:class:`OuterStage`) over its own process group,
  with a copy of the outer level's state, and returns to training at once.
* **Apply** (the inner round at step ``s + D·h_inner``): the leader collects the result
  (waiting at most until the stage's deadline) and broadcasts a header and, if the outer
  round committed, the global model ``θ_g`` inside the inner round, which every member
  merges with the local progress made since the snapshot (:func:`merge_keep_local`):

      θ ← θ_g + (θ_now − θ_s)

  where ``θ_now`` is the model this inner round commits. The outer level's backup
  becomes ``θ_g``; the progress since the snapshot is not yet in the global model and
  reaches it in the next outer round's pseudo-gradient (``θ_g' − θ_cluster`` includes
  it). Nothing is discarded for the overlap, and with ``D = 0`` the outer round runs
  blocking, as before.

Why "keep the local delta" rather than Streaming DiLoCo's mixing
``(1−α)·θ_g + α·θ_now``: the delta keeps every step of the D inner rounds (goodput
accounting stays exact: the steps since the snapshot are counted with the next outer
round), needs no new hyper-parameter, and with ``D = 0`` it reduces to adopting
``θ_g`` exactly, so results at ``D = 0`` are unchanged.

Eager updates (``sync.outer.eager``; Kale et al., arXiv 2502.12996): with the rule above
the D inner rounds between launch and apply train from ``θ_s``, without the outer step
(lr 0.7, Nesterov momentum 0.9) that the global round will bring; the step arrives D
rounds late, a weaker optimizer step. Eager updates apply an outer step at the launch,
with the cluster's own pseudo-gradient ``Δ_c = θ_p − θ_s`` standing in for the quorum's
average ``Δ̄`` (``θ_p``: the outer backup, the last global model; ``m``: the outer
momentum, which every member keeps in step with its leader's, broadcast with each
global model), and correct it when the global step arrives:

    launch:  θ_e = θ_p − u(Δ_c; m)        the cluster trains on from θ_e
    apply:   θ ← θ_g + (θ_now − θ_e),     θ_g = θ_p − u(Δ̄; m)

where ``u(Δ; m) = lr·(Δ + μ(μm + Δ))`` is the outer step (Nesterov). Since ``u`` is
affine in ``Δ`` with the same ``m`` on both sides, the apply round's correction is
``θ_g − θ_e = −lr(1+μ)(Δ̄ − Δ_c)``: only the clusters' disagreement, and no step's
momentum arrives late. The cluster holds the *stand-in* ``U = θ_s − θ_e`` (replicated
like the snapshot, in heals and checkpoints); the code takes it out first and then merges
as without eager updates (``θ_now + U`` is the model without the stand-in, and
``θ_g + (θ_now + U − θ_s)`` is the formula above). The stand-in is taken out, and only
then, whenever the cluster model next meets the outer level: the apply round (committed:
merged; the outer round failed: ``θ ← θ_now + U``, the run goes on as if the launch had
not stepped), a blocking round (the final one: the leader contributes ``θ + U``), or a
launch that finds one never resolved (its apply round's inner commit failed). With
streaming fragments the stand-in covers the fragment the launched round syncs. With
``D = 0`` there is nothing to stand in for: eager needs ``sync.outer.delay > 0``.

Fault semantics:

* A failure of the background round (quorum, reduce, commit vote, a deadline) costs
  only the outer stage: the apply round's header says INNER_ONLY, nobody merges, the
  outer backup stays where it was, and the next outer round's pseudo-gradient still
  carries all the work since the last outer commit. Inner work is never rolled back for it.
* Every wait keeps a deadline: the stage's phases have the outer timeouts of the
  blocking path (:class:`PhaseTracker` with :data:`STAGE_TRANSITIONS`); the leader waits
  for the result at the apply round at most until the stage's current deadline, then
  abandons it (:meth:`OuterStage.abandon`: the caller shuts its outer Manager down,
  which aborts the stage's process group, and builds a fresh one at the next outer round).
* The leader losing leadership (or dying) while the stage is in flight: a demoted
  leader abandons it; a new leader has no stage, so its apply round says INNER_ONLY; the
  cluster stays consistent (every member merges, or none). If the dead leader's outer
  commit had succeeded elsewhere, the cluster's next outer round finds its outer level
  behind and heals it from another cluster (weight 0), as for any leader change.
* An exception the stage raises that must end the process (``FatalSyncError``: repeated
  quorum failures, an outage past its limit, an invariant violation) is re-raised by
  :meth:`OuterStage.collect` on the training thread.

Invariant I1 with overlap (docs/invariants.md): the leader has an inner collective
(its cluster's inner rounds) and an outer collective in flight at once, on two groups
that share no pair of processes (the outer group's members are of distinct clusters,
I1(a), checked when it forms). :class:`~hier_localsgd.core.runtime.invariants.CollectiveGate` allows
exactly that pair of levels to overlap, and at most one collective per level.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, FrozenSet, Optional

import torch

from hier_localsgd.core.tensors.fragments import Ranges, gather, outer_period, scatter_
from hier_localsgd.core.tensors.level import Level
from hier_localsgd.core.runtime.phases import Phase, PhaseTracker
from hier_localsgd.core.runtime.device import carry_device

logger = logging.getLogger(__name__)

# The background stage's own phase machine: LOCAL is its idle state.
STAGE_TRANSITIONS: Dict[Phase, FrozenSet[Phase]] = {
    Phase.START: frozenset({Phase.OUTER_QUORUM}),
    Phase.LOCAL: frozenset({Phase.OUTER_QUORUM}),
    Phase.OUTER_QUORUM: frozenset({Phase.OUTER_REDUCE, Phase.LOCAL}),
    Phase.OUTER_REDUCE: frozenset({Phase.OUTER_COMMIT, Phase.LOCAL}),
    Phase.OUTER_COMMIT: frozenset({Phase.LOCAL}),
    Phase.ROLLBACK: frozenset({Phase.LOCAL}),
    Phase.STOPPED: frozenset(),
}


@torch.no_grad()
def merge_keep_local(global_model: torch.Tensor, snapshot: torch.Tensor, now: torch.Tensor) -> torch.Tensor:
    """``θ_g + (θ_now − θ_s)``: the global result with the progress made since the snapshot."""
    return global_model + (now - snapshot)


@torch.no_grad()
def eager_stand_in(outer: Level, snap: torch.Tensor, ranges: Optional[Ranges]) -> torch.Tensor:
    """``U = θ_s − θ_e``: the outer step this cluster's own pseudo-gradient ``θ_p − θ_s``
    would take from the outer backup ``θ_p`` with the committed momentum (``ranges``:
    only those elements; zero elsewhere). Pure: the level's state is not touched."""
    staged = outer.stage(outer.pseudo_grad(snap, ranges), ranges)
    if ranges is None:
        return snap - staged.backup
    out = torch.zeros_like(snap)
    scatter_(out, ranges, gather(snap, ranges) - gather(staged.backup, ranges))
    return out


def is_launch_round(step: int, h_inner: int, h_outer: int, fragments: int = 1) -> bool:
    """The inner round that starts an outer round (as in the blocking path)."""
    return step > 0 and step % outer_period(h_inner, h_outer, fragments) == 0


def is_apply_round(step: int, h_inner: int, h_outer: int, delay: int, fragments: int = 1) -> bool:
    """The inner round that applies the outer round launched ``delay`` inner rounds earlier."""
    period = outer_period(h_inner, h_outer, fragments)
    return delay > 0 and step > period and step % period == delay * h_inner


class OuterStage:
    """One background outer round at a time, on its own thread and phase tracker.

    Args:
        describe: this process, for log lines.
        listener: called with the stage's phase on every transition (status file).
    """

    def __init__(self, describe: str, listener: Optional[Callable[[str], None]] = None) -> None:
        def on_transition(tr: Any, _snap: Dict[str, object]) -> None:
            if listener is not None:
                listener(tr.dst.value)

        self.tracker = PhaseTracker(f"{describe} outer stage", listeners=[on_transition], transitions=STAGE_TRANSITIONS)
        self._thread: Optional[threading.Thread] = None
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        self.launched_at: Optional[float] = None

    @property
    def busy(self) -> bool:
        """A round was launched and not yet collected or abandoned."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        """A launched round has not finished yet."""
        return self._thread is not None and not self._done.is_set()

    def launch(self, fn: Callable[[PhaseTracker], Any]) -> None:
        """Runs ``fn(tracker)`` on a daemon thread; its return value is :meth:`collect`'s."""
        if self.busy:
            raise RuntimeError("an outer stage is already in flight")
        self._result, self._error = None, None
        self._done.clear()
        on_device = carry_device()

        def run() -> None:
            try:
                on_device()  # this process's GPU, not GPU 0 (staging, NCCL)
                self._result = fn(self.tracker)
            except BaseException as e:  # handed to the training thread by collect()
                self._error = e
            finally:
                if self.tracker.phase != Phase.LOCAL:
                    self.tracker.enter(Phase.LOCAL, None, reason="stage ended")
                self._done.set()

        self.launched_at = time.time()
        self._thread = threading.Thread(target=run, name="outer-stage", daemon=True)
        self._thread.start()

    def wait_budget(self) -> timedelta:
        """How long :meth:`collect` may wait: until the stage's current phase deadline
        (the stage cannot legitimately run past it), at least a moment."""
        deadline = self.tracker.deadline()
        left = 0.0 if deadline is None else deadline - time.time()
        return timedelta(seconds=max(0.1, left))

    def collect(self, timeout: timedelta) -> tuple[bool, Any]:
        """Waits up to ``timeout`` for the launched round: (finished, result).

        Re-raises what the stage raised. Not finished: the caller abandons it."""
        if self._thread is None:
            return True, None
        if not self._done.wait(timeout.total_seconds()):
            return False, None
        self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return True, self._result

    def abandon(self, join: timedelta = timedelta(seconds=5)) -> None:
        """Forgets the round in flight (the caller has aborted its process group, so its
        waits fail); waits up to ``join`` for the thread to notice."""
        t, self._thread = self._thread, None
        if t is not None:
            t.join(join.total_seconds())
            if t.is_alive():
                logger.warning("outer stage thread still running after abandon; left behind (daemon)")
