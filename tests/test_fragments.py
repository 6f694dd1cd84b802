"""Streaming fragments (core/tensors/fragments.py) on torchtitan's debugmodel and the tiny LM, and wired into
the hierarchy's outer level (sync.outer.fragments)."""

import itertools
import random

import pytest
import torch

from hier_localsgd.core.tensors.fragments import FragmentSchedule, fragment_parameters, split_fragments
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


# ---------------------------------------------------------------------------
# Wired into the hierarchy (sync.outer.fragments): real lighthouses, Managers and Gloo
# groups, replica groups as threads so every local update is exact (harness.py).

from harness import ThreadedHier, local_steps  # noqa: E402
from hier_localsgd.core.tensors.flat_params import FlatParams  # noqa: E402
from hier_localsgd.core.tensors.fragments import flat_ranges, gather, localize, scatter_  # noqa: E402
from hier_localsgd.sync.overlap import is_apply_round, is_launch_round  # noqa: E402

C, R, H_IN, H_OUT, NUMEL = 2, 2, 1, 4, 4
FRAGS = (((0, 1), (3, 4)), ((1, 3),))  # two fragments; the first is not contiguous


def test_flat_ranges_cover_the_flat_vector_once_and_name_the_right_elements(debugmodel):
    flat = FlatParams(debugmodel)
    frags = split_fragments(debugmodel, 3)
    ranges = flat_ranges(debugmodel, flat.params, frags)
    spans = sorted(r for rs in ranges for r in rs)
    assert spans[0][0] == 0 and spans[-1][1] == flat.numel
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # no gap, no overlap
    params = dict(debugmodel.named_parameters())
    for frag, rs in zip(frags, ranges):
        expected = torch.cat([params[n].detach().reshape(-1) for n in frag.names])
        torch.testing.assert_close(gather(flat.data, rs), expected, rtol=0, atol=0)
    # A rank's slice (several ranks per group): offsets into the slice, empty where none.
    assert localize(((0, 10), (20, 30)), slice(5, 25)) == ((0, 5), (15, 20))
    assert localize(((0, 4),), slice(5, 25)) == ()
    t = torch.arange(6.0)
    torch.testing.assert_close(scatter_(torch.zeros(6), ((0, 2), (4, 6)), gather(t, ((0, 2), (4, 6)))), torch.tensor([0.0, 1, 0, 0, 4, 5]))


def _update(c: int, r: int, k: int) -> torch.Tensor:
    sign = 1.0 if r == 0 else -0.5
    return torch.tensor([0.1 * (c + 1), sign * 0.2 * (c + 1), 0.05 * (k + 1) * (r + 1) * (c + 1), -0.03 * (c + 2) * (k + 1)])


def _nesterov(p, buf, g, lr=0.7, mu=0.9):
    buf = mu * buf + g
    return p - lr * (g + mu * buf), buf


def _reference(steps: int, delay: int):
    """Streaming DiLoCo over two levels by hand: fragment (outer rounds so far mod F) every
    H_IN·H_OUT/F steps, applied ``delay`` inner rounds later as θ_g + (θ_now − θ_s) on the
    fragment's elements only; the run's last round syncs the whole model and blocks."""
    F = len(FRAGS)
    idx = [torch.tensor([i for a, b in rs for i in range(a, b)]) for rs in FRAGS]
    z = torch.zeros(NUMEL, dtype=torch.float64)
    theta_g, gbuf = z.clone(), z.clone()
    theta_c, cbuf, snap = [z.clone() for _ in range(C)], [z.clone() for _ in range(C)], [z.clone() for _ in range(C)]
    pending, rounds, traj, synced = None, 0, [], []
    for k in range(steps):
        step = k + 1
        for c in range(C):
            avg = -sum(_update(c, r, k).double() for r in range(R)) / R
            theta_c[c], cbuf[c] = _nesterov(theta_c[c], cbuf[c], avg)
        if pending is not None and is_apply_round(step, H_IN, H_OUT, delay, F):
            i, theta_g, gbuf = pending
            for c in range(C):
                theta_c[c][i] = theta_g[i] + (theta_c[c][i] - snap[c][i])
            pending = None
        if is_launch_round(step, H_IN, H_OUT, F):
            last = step == steps
            i = torch.arange(NUMEL) if last else idx[rounds % F]
            synced.append(None if last else rounds % F)
            d = sum(theta_g[i] - theta_c[c][i] for c in range(C)) / C
            g, b = theta_g.clone(), gbuf.clone()
            g[i], b[i] = _nesterov(theta_g[i], gbuf[i], d)
            rounds += 1
            if delay == 0 or last:
                theta_g, gbuf = g, b
                for c in range(C):
                    theta_c[c][i] = theta_g[i]
            else:
                snap = [t.clone() for t in theta_c]
                pending = (i, g, b)
        traj.append([t.clone() for t in theta_c])
    return traj, theta_g, synced


def _run(steps: int, delay: int, **kw):
    seen, reps = {}, {}
    h = ThreadedHier(C, R, H_IN, H_OUT, numel=NUMEL, outer_delay=delay, final_step=steps, outer_fragments=FRAGS, **kw)
    try:
        def body(rep):
            reps[rep.key] = rep
            seen[rep.key] = []
            local_steps(rep, _update, steps, record=lambda r: seen[r.key].append(r.flat.data.clone()))

        h.run(body)
    finally:
        h.close()
    return seen, reps


@pytest.mark.parametrize("delay", [0, 1])
def test_outer_fragments_sync_in_turn_as_hand_computed_and_the_last_round_syncs_all(delay):
    steps = 10  # fragment rounds at 2, 4, 6, 8 (fragments 0, 1, 0, 1); the round at 10 syncs all
    expected, theta_g, synced = _reference(steps, delay)
    assert synced == [0, 1, 0, 1, None]
    seen, reps = _run(steps, delay)
    for key, traj in seen.items():
        for k, got in enumerate(traj):
            torch.testing.assert_close(got.double(), expected[k][key[0]], rtol=0, atol=1e-5, msg=f"{key} after step {k + 1}")
        torch.testing.assert_close(traj[-1].double(), theta_g, rtol=0, atol=1e-5)
    leaders = [rep for rep in reps.values() if rep.sync.leader]
    assert len(leaders) == C
    for rep in leaders:
        commits = rep.kinds("commit", level="outer")
        assert [e["fragment"] for e in commits] == synced, commits
    # Between a fragment's rounds the clusters differ only outside it: after the blocking
    # round at step 2 (fragment 0) the clusters agree on fragment 0's elements, not on 1's.
    if delay == 0:
        i0 = [i for a, b in FRAGS[0] for i in range(a, b)]
        i1 = [i for a, b in FRAGS[1] for i in range(a, b)]
        after2 = {c: seen[(c, 0)][1] for c in range(C)}
        torch.testing.assert_close(after2[0][i0], after2[1][i0], rtol=0, atol=0)
        assert not torch.allclose(after2[0][i1], after2[1][i1])


def test_int8_outer_fragments_move_the_residual_only_inside_the_synced_fragment():
    """Blocking int8 with fragments: at a fragment's round the error-feedback residual
    changes inside that fragment's ranges only (its other entries wait for their own
    fragment's round), and every member of a cluster holds the leader's residual."""
    steps, seen = 10, {}
    h = ThreadedHier(C, R, H_IN, H_OUT, numel=NUMEL, final_step=steps, outer_fragments=FRAGS,
                     outer_compression="int8", compression_block=2)
    try:
        def body(rep):
            seen[rep.key] = []
            local_steps(rep, _update, steps, record=lambda r: seen[r.key].append(r.sync.comp.residual.clone()))

        h.run(body)
    finally:
        h.close()
    inside = [sorted(i for a, b in rs for i in range(a, b)) for rs in FRAGS]
    moved_inside = 0
    for (c, r), res in seen.items():
        torch.testing.assert_close(res[-1], seen[(c, 0)][-1], rtol=0, atol=0)  # the cluster's one residual
        for step, frag in ((2, 0), (4, 1), (6, 0), (8, 1)):
            before, after = res[step - 2], res[step - 1]
            outside = [i for i in range(NUMEL) if i not in inside[frag]]
            torch.testing.assert_close(after[outside], before[outside], rtol=0, atol=0, msg=f"c{c}r{r} step {step}")
            moved_inside += int(not torch.equal(after[inside[frag]], before[inside[frag]]))
    assert moved_inside > 0  # the residual does move inside the synced fragment


def test_int8_outer_fragments_overlapped_keep_replicas_identical():
    steps = 10
    seen, reps = _run(steps, delay=1, outer_compression="int8", compression_block=2)
    finals = [traj[-1] for traj in seen.values()]
    for f in finals[1:]:
        torch.testing.assert_close(f, finals[0], rtol=0, atol=0)
    for rep in reps.values():
        assert not rep.kinds("rollback"), rep.kinds("rollback")
        assert rep.sync.counters.outer_round == 5
