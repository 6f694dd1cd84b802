"""The per-level outer optimizer and staging (no network)."""

import torch

from hier_localsgd.core.tensors.level import Level, LevelAlgorithm, OuterSGD


def test_outer_sgd_matches_torch_sgd_nesterov_over_several_steps():
    torch.manual_seed(0)
    p0 = torch.randn(7)
    grads = [torch.randn(7) for _ in range(4)]
    ref = torch.nn.Parameter(p0.clone())
    torch_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    ours = OuterSGD(7, lr=0.7, momentum=0.9, nesterov=True, dtype=torch.float32)
    param = p0.clone()
    for g in grads:
        ref.grad = g.clone()
        torch_opt.step()
        param, buf = ours.stage(param, g)
        ours.buf.copy_(buf)
        torch.testing.assert_close(param, ref.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.buf, torch_opt.state[ref]["momentum_buffer"])


def test_localsgd_level_is_exact_parameter_average():
    init = torch.zeros(4)
    lv = Level("inner", LevelAlgorithm.build("localsgd", lr=0.123, momentum=0.5), init)
    assert (lv.algorithm.lr, lv.algorithm.momentum) == (1.0, 0.0)
    lives = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([3.0, 2.0, 1.0, 0.0])]
    avg_grad = sum(lv.pseudo_grad(x) for x in lives) / len(lives)
    staged = lv.stage(avg_grad)
    torch.testing.assert_close(staged.backup, (lives[0] + lives[1]) / 2)


def test_stage_leaves_committed_state_untouched_until_commit():
    lv = Level("outer", LevelAlgorithm.build("diloco"), torch.ones(3))
    before = (lv.backup.clone(), lv.opt.buf.clone())
    staged = lv.stage(torch.full((3,), 0.5))
    torch.testing.assert_close(lv.backup, before[0])
    torch.testing.assert_close(lv.opt.buf, before[1])
    lv.commit(staged)
    torch.testing.assert_close(lv.backup, staged.backup)
    torch.testing.assert_close(lv.opt.buf, torch.full((3,), 0.5))


def test_state_dict_is_a_copy_of_committed_state():
    lv = Level("inner", LevelAlgorithm.build("diloco"), torch.zeros(2))
    sd = lv.state_dict()
    lv.commit(lv.stage(torch.ones(2)))
    assert sd["backup"].abs().sum() == 0 and sd["momentum"].abs().sum() == 0


def test_a_step_standing_for_part_of_a_round_against_a_hand_computation():
    """OuterSGD.stage(share=w): m ← μ^w m + g; Nesterov θ − lr (g + w μ m), heavy ball
    θ − lr (g + w μ^w m_old) (level.py); w = 1 is the plain step, w outside (0, 1] refused."""
    nes = OuterSGD(2, lr=0.5, momentum=0.8, nesterov=True, dtype=torch.float64)
    hb = OuterSGD(2, lr=0.5, momentum=0.8, nesterov=False, dtype=torch.float64)
    for o in (nes, hb):
        o.buf.copy_(torch.tensor([1.0, -2.0], dtype=torch.float64))
    p, g = torch.tensor([3.0, 4.0], dtype=torch.float64), torch.tensor([0.1, 0.3], dtype=torch.float64)
    m = 0.8 ** 0.25 * torch.tensor([1.0, -2.0], dtype=torch.float64) + g
    new_p, new_m = nes.stage(p, g, share=0.25)
    torch.testing.assert_close(new_m, m)
    torch.testing.assert_close(new_p, p - 0.5 * (g + 0.25 * 0.8 * m))
    new_p, new_m = hb.stage(p, g, share=0.25)
    torch.testing.assert_close(new_m, m)
    torch.testing.assert_close(new_p, p - 0.5 * (g + 0.25 * 0.8 ** 0.25 * torch.tensor([1.0, -2.0], dtype=torch.float64)))
    for o in (nes, hb):  # share 1 is the plain step, for both
        torch.testing.assert_close(o.stage(p, g, share=1.0)[0], o.stage(p, g)[0])
        assert torch.allclose(o.stage(p, g, share=0.999999)[0], o.stage(p, g)[0], atol=1e-5)
    for bad in (0.0, -0.5, 1.5):
        try:
            nes.stage(p, g, share=bad)
        except ValueError as e:
            assert "share" in str(e)
        else:
            raise AssertionError(f"share={bad} accepted")


def test_a_round_split_into_parts_moves_the_model_about_as_the_whole_round():
    """With momentum built up over 20 whole rounds, one more round taken as k batches of 1/k
    (each with 1/k of the round's gradient) moves the model within 10 % of that round taken
    whole, for k = 2..10; a whole momentum step per batch (the rule before share) moves it
    about k times as far, and a sliver of a round (w = 0.03) moves it by a few percent."""
    G = torch.ones(1, dtype=torch.float64)

    def warm() -> tuple:
        o = OuterSGD(1, lr=0.7, momentum=0.9, nesterov=True, dtype=torch.float64)
        p = torch.zeros(1, dtype=torch.float64)
        for _ in range(20):
            p, b = o.stage(p, G)
            o.buf.copy_(b)
        return o, p

    o, p0 = warm()
    whole = float(p0 - o.stage(p0, G)[0])
    for k in range(2, 11):
        for share_rule in (True, False):
            o, p = warm()
            for _ in range(k):
                p, b = o.stage(p, G / k, share=1 / k if share_rule else 1.0)
                o.buf.copy_(b)
            moved = float(p0 - p)
            if share_rule:
                assert abs(moved / whole - 1) < 0.1, (k, moved, whole)
            else:
                assert moved / whole > 0.5 * k, (k, moved, whole)
    o, p = warm()
    sliver = float(p - o.stage(p, 0.03 * G, share=0.03)[0])
    assert 0 < sliver / whole < 0.05, sliver / whole
