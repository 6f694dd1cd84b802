"""The phase state machine: legal order, I3 (no collective outside a quorum), deadlines."""

import time
from datetime import timedelta

import pytest
import torch
from torch import nn

from hier_localsgd.core.tensors.flat_params import FlatParams
from hier_localsgd.core.runtime.invariants import CollectiveGate, InvariantViolation, check_disjoint_tensors, check_distinct_clusters
from hier_localsgd.core.runtime.phases import Phase, PhaseError, PhaseTracker

P = Phase


def walk(tracker, *phases):
    for p in phases:
        tracker.enter(p, timedelta(seconds=5))


def test_full_outer_round_is_legal_and_published():
    seen = []
    tr = PhaseTracker("t", listeners=[lambda t, snap: seen.append((t.src, t.dst, snap["phase"]))])
    walk(tr, P.INNER_QUORUM, P.INNER_REDUCE, P.OUTER_QUORUM, P.OUTER_REDUCE, P.OUTER_COMMIT, P.BROADCAST, P.INNER_COMMIT, P.LOCAL)
    assert [d for _, d, _ in seen][-1] == P.LOCAL
    assert all(snap == d.value for _, d, snap in seen)


def test_broadcast_without_a_quorum_is_impossible():
    """Seed 004 broadcast outside a quorum; here BROADCAST cannot follow LOCAL."""
    tr = PhaseTracker("t")
    walk(tr, P.LOCAL)
    with pytest.raises(PhaseError, match="LOCAL -> BROADCAST"):
        tr.enter(P.BROADCAST, timedelta(seconds=1))
    with pytest.raises(PhaseError, match="inner collective in phase LOCAL"):
        tr.require("inner")


def test_outer_collective_only_in_outer_reduce():
    tr = PhaseTracker("t")
    walk(tr, P.INNER_QUORUM, P.INNER_REDUCE)
    tr.require("inner")
    with pytest.raises(PhaseError, match="outer collective in phase INNER_REDUCE"):
        tr.require("outer")
    walk(tr, P.OUTER_QUORUM)
    with pytest.raises(PhaseError):
        tr.require("outer")  # quorum phase: the group is not ready for collectives
    walk(tr, P.OUTER_REDUCE)
    tr.require("outer")


def test_rollback_from_any_phase_then_local_and_stopped_is_terminal():
    tr = PhaseTracker("t")
    walk(tr, P.INNER_QUORUM, P.INNER_REDUCE, P.OUTER_QUORUM)
    tr.enter(P.ROLLBACK, None, reason="x")
    with pytest.raises(PhaseError):
        tr.enter(P.INNER_COMMIT, None)
    walk(tr, P.LOCAL)
    tr.enter(P.STOPPED, None)
    with pytest.raises(PhaseError, match="STOPPED"):
        tr.enter(P.LOCAL, None)


def test_remaining_counts_down_from_the_phase_timeout():
    tr = PhaseTracker("t")
    tr.enter(P.INNER_QUORUM, timedelta(seconds=2))
    time.sleep(0.3)
    rem = tr.remaining().total_seconds()
    assert 1.0 < rem < 1.8
    assert tr.deadline() is not None


def test_distinct_clusters_check():
    check_distinct_clusters("outer", [0, 1, 2])
    with pytest.raises(InvariantViolation, match=r"I1.*cluster\(s\) \[1\]"):
        check_distinct_clusters("outer", [0, 1, 1])


def test_collective_gate_rejects_overlapping_collectives():
    gate = CollectiveGate()
    with gate.collective("inner", "broadcast"):
        with pytest.raises(InvariantViolation, match="outer allreduce started while a inner broadcast"):
            with gate.collective("outer", "allreduce"):
                pass
    with gate.collective("outer", "allreduce"):
        pass


def test_separate_optimizers_check_rejects_shared_tensors():
    a, b = torch.zeros(3), torch.zeros(3)
    check_disjoint_tensors([("inner", [a]), ("outer", [b])])
    with pytest.raises(InvariantViolation, match="I2"):
        check_disjoint_tensors([("inner", [a]), ("outer", [a[1:]])])


def test_flat_params_keep_parameter_identity_and_write_in_place():
    """Seed 004 wrote `p` instead of `p.data`; FlatParams only ever writes storage."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = [id(p) for p in model.parameters()]
    flat = FlatParams(model)
    flat.load_(torch.arange(flat.numel, dtype=torch.float32))
    assert [id(p) for p in model.parameters()] == ids
    assert opt.param_groups[0]["params"][0] is model.weight
    assert torch.equal(model.weight.detach().reshape(-1), torch.arange(6, dtype=torch.float32))
    assert all(p.is_leaf and p.requires_grad for p in model.parameters())
    flat.check_in_place()
    model.weight.data = torch.zeros(2, 3)  # what seed 004's bug amounted to
    with pytest.raises(InvariantViolation, match="I4"):
        flat.check_in_place()


def test_group_rank_check_rejects_a_rank_outside_the_group():
    from hier_localsgd.core.runtime.invariants import check_group_rank

    check_group_rank("inner", 1, 2)  # rank 1 of 2: fine
    for rank, size in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(InvariantViolation) as e:
            check_group_rank("inner", rank, size)
        assert "I6" in str(e.value) and f"group_rank={rank}" in str(e.value)


def test_a_phase_deadline_comes_from_the_budgets_named_once():
    """enter(phase) arms the phase's own budget from Timeouts (BROADCAST: leader's or member's);
    an explicit timeout (or None) still wins; no budgets and no timeout is an error."""
    import time as _t
    from datetime import timedelta

    import pytest

    from hier_localsgd.core.runtime.timeouts import Timeouts

    t = Timeouts(inner_quorum=timedelta(seconds=7), broadcast=timedelta(seconds=11))
    assert t.broadcast_wait > t.broadcast  # the two BROADCAST budgets differ
    tr = PhaseTracker("t")
    with pytest.raises(ValueError, match="without a timeout"):
        tr.enter(Phase.INNER_QUORUM)
    tr.budgets = t
    for phase, leader, want in [(Phase.INNER_QUORUM, True, 7), (Phase.INNER_REDUCE, True, t.inner_reduce.total_seconds()),
                                (Phase.BROADCAST, True, 11), (Phase.BROADCAST, False, t.broadcast_wait.total_seconds())]:
        tr2 = PhaseTracker("t2", transitions={p: frozenset(Phase) for p in Phase})
        tr2.budgets = t
        tr2.enter(phase, leader=leader)
        assert tr2.deadline() - _t.time() == pytest.approx(want, abs=1.0), (phase, leader)
    tr.enter(Phase.INNER_QUORUM, None)
    assert tr.deadline() is None
