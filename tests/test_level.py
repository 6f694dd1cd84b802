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
