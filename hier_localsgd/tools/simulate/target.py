"""Time to a target loss, modelled as merged work (``simulate.target_rounds``; issue #33 §4).

The simulator has no loss model. What it knows is what each step of the global model
holds, and that is what this rule counts:

* a synchronous outer round merges the full periods of the clusters that contribute to it:
  a share ``k / C`` of a round for ``k`` of ``C`` clusters (1 without failures);
* an asynchronous version steps the model by its batch's share of a round,
  ``w = min(1, Σ a_i / C)`` with ``a_i = min(1, n_i / n_full) · λ(s_i)``, the weights the
  global model server gives its contributions (sync/global_model.py's
  :func:`~hier_localsgd.sync.global_model.contribution_weight` and ``batch_share``, which
  the simulator's pushes.py imports).

The global model's **progress** is the sum of its steps' shares, and it reaches the target
when the progress reaches ``target_rounds``, a number of synchronous rounds. That number
is a **calibration**: the rounds a synchronous run of the same workload took to its target
(its steps to the target over ``H_inner · H_outer``). Given it, the rule is meant to
predict the time to the target of other deployments of that workload (clusters of other
speeds, the asynchronous level, failures: a round that fails adds nothing, nor does a
discarded push). Measured: within 1.1 % for two clusters at equal speeds, −16 to +5 % at
half speed, and **refuted** for three clusters at 1.0 / 0.7 / 0.4 (+22 to +82 %: their
stale versions moved the model further than their shares; docs/planner.md, the strict
xfail in tests/test_simulate.py). What it assumes, and where it is wrong: a share of a round is worth that share
of a round's loss whatever its staleness does beyond λ, whatever the outer momentum carries
between versions, and whether one cluster's data or several made it (k batches of 1/k of a
round count as one round). benchmarks/validate_simulate.py ``--set target`` checks it
against recorded runs (docs/planner.md).

The crossing is timed when a cluster first holds that model (or a later one): the commit
that ends a synchronous round or adopts a blocking push's answer (after the broadcast in
the cluster), or an overlapped push's apply round, where the bench evaluates the global
model.
"""

from __future__ import annotations

from typing import Optional


class Progress:
    """The global model's progress in synchronous rounds' worth; the version at which it
    reached ``target_rounds`` (0: no target, nothing recorded), and when a cluster first
    held that version or a later one."""

    def __init__(self, target_rounds: float) -> None:
        self.target_rounds = target_rounds
        self.rounds = 0.0
        self.version: Optional[int] = None  # the version whose step reached the target
        self.reached_at: Optional[float] = None

    def step(self, version: int, share: float) -> None:
        """The global model's step to ``version`` is worth ``share`` of a round."""
        self.rounds += share
        # a tolerance for shares summed in floating point (three thirds are one round)
        if self.target_rounds > 0 and self.version is None and self.rounds >= self.target_rounds - 1e-9:
            self.version = version

    def adopted(self, t: float, version: int) -> None:
        """A cluster holds ``version`` from ``t`` on (its commit after the broadcast, or an
        overlapped push's apply round): where the bench evaluates the global model."""
        if self.version is not None and self.reached_at is None and version >= self.version:
            self.reached_at = t
