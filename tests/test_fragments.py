"""Streaming fragments (hier_localsgd/fragments.py) on torchtitan's debugmodel and the tiny LM."""

import itertools
import random

import pytest

from hier_localsgd.core.fragments import FragmentSchedule, fragment_parameters, split_fragments
from hier_localsgd.train.model import build_model


@pytest.fixture(scope="module")
def debugmodel():
    return build_model("llama3_debugmodel", 2048, 64, 0, seed=0)


def _check_partition(model, frags):
    all_names = [n for n, _ in model.named_parameters()]
    seen = [n for f in frags for n in f.names]
    assert sorted(seen) == sorted(all_names)  # cover, and disjoint (no name twice)
    assert len(seen) == len(set(seen))
    assert all(f.names for f in frags)
    for f in frags:
        assert f.numel == sum(p.numel() for p in fragment_parameters(model, f))
    assert sum(f.numel for f in frags) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("balance", ["contiguous", "greedy"])
@pytest.mark.parametrize("F", [1, 3, 5, 9])
def test_debugmodel_fragments_are_disjoint_cover_it_and_sync_once_per_cycle(debugmodel, F, balance):
    frags = split_fragments(debugmodel, F, balance=balance)
    assert len(frags) == F
    _check_partition(debugmodel, frags)
    # a layer (or the embedding, the final norm, the output) is never split between fragments
    by_layer = {}
    for f in frags:
        for n in f.names:
            by_layer.setdefault(n.split(".")[1] if n.startswith("layers.") else n, set()).add(f.index)
    assert all(len(v) == 1 for v in by_layer.values())
    # three full cycles of H inner rounds: each cycle syncs every parameter exactly once
    H = 2 * F
    sched = FragmentSchedule(H, F)
    for cycle in range(3):
        synced = []
        for r in range(cycle * H + 1, (cycle + 1) * H + 1):
            f = sched.fragment_due(r)
            if f is not None:
                synced.extend(frags[f].names)
        assert sorted(synced) == sorted(n for n, _ in debugmodel.named_parameters())


def test_contiguous_split_is_the_best_contiguous_one(debugmodel):
    """Against brute force over every contiguous split of the 9 units into 3 and 5."""
    frags = split_fragments(debugmodel, 1)
    sizes = []
    for name in frags[0].units:
        sizes.append(sum(p.numel() for n, p in debugmodel.named_parameters() if n == name or n.startswith(name + ".")))
    assert len(sizes) == 9 and sum(sizes) == 6_163_712
    for F in (3, 5):
        best = min(
            max(sum(sizes[a:b]) for a, b in zip((0, *cuts), (*cuts, len(sizes))))
            for cuts in itertools.combinations(range(1, len(sizes)), F - 1)
        )
        got = split_fragments(debugmodel, F)
        assert max(f.numel for f in got) == best
        # contiguous: each fragment's units are consecutive in model order
        order = list(frags[0].units)
        for f in got:
            idx = [order.index(u) for u in f.units]
            assert idx == list(range(idx[0], idx[0] + len(idx)))


def test_named_groups_must_cover_exactly_once():
    model = build_model("tiny", 64, 16, 32, seed=0)
    frags = split_fragments(model, 2, by="groups", groups={"emb": ["embed"], "mlp": ["hidden"], "head": ["out"]})
    _check_partition(model, frags)
    with pytest.raises(ValueError, match="unmatched"):
        split_fragments(model, 2, by="groups", groups={"emb": ["embed"], "mlp": ["hidden"]})
    with pytest.raises(ValueError, match="several"):
        split_fragments(model, 2, by="groups", groups={"a": ["embed", "hidden"], "b": ["hidden.weight", "out"]})
    with pytest.raises(ValueError, match="units"):
        split_fragments(model, 4)  # three units only


def test_schedule_spacing_and_refusals():
    s = FragmentSchedule(9, 3)
    assert [s.fragment_due(r) for r in range(1, 10)] == [None, None, 0, None, None, 1, None, None, 2]
    with pytest.raises(ValueError, match="multiple"):
        FragmentSchedule(10, 3)
    with pytest.raises(ValueError, match="counted from 1"):
        s.is_sync_round(0)


def test_failed_syncs_are_retried_so_every_fragment_still_commits_once_per_F_commits(debugmodel):
    """Keyed by committed syncs (torchft's rule): with syncs failing at random, each run
    of F consecutive commits covers every parameter exactly once."""
    F = 5
    frags = split_fragments(debugmodel, F)
    sched = FragmentSchedule(10, F)
    rng = random.Random(7)
    committed = []
    for r in range(1, 400):
        if sched.is_sync_round(r):
            f = sched.fragment_for_sync(len(committed))
            if rng.random() < 0.3:
                continue  # this sync failed: nothing committed
            committed.append(f)
    assert len(committed) >= 4 * F
    for k in range(0, len(committed) - F + 1, F):
        names = [n for f in committed[k : k + F] for n in frags[f].names]
        assert sorted(names) == sorted(n for n, _ in debugmodel.named_parameters())
