"""Blockwise quantization and error feedback (hier_localsgd/compress.py), one process."""

import subprocess
import sys

import pytest
import torch

from hier_localsgd.core.tensors.compress import (
    FP8,
    INT8,
    ErrorFeedback,
    FormatUnavailable,
    check_format,
    dequantize,
    error_bound,
    quantize,
    quantized_nbytes,
    step_size,
)


def _pseudo_grad(gen: torch.Generator, n: int) -> torch.Tensor:
    # magnitudes that differ by orders between blocks, as a model's layers do
    base = torch.randn(n, generator=gen)
    spread = torch.logspace(-4, 1, n).roll(int(torch.randint(0, n, (1,), generator=gen)))
    return base * spread


@pytest.mark.parametrize("fmt", [INT8, FP8])
@pytest.mark.parametrize("n,block", [(10_000, 256), (1_001, 64), (7, 256), (4_096, 1)])
def test_round_trip_is_within_the_format_bound_and_the_bound_is_nearly_reached(fmt, n, block):
    gen = torch.Generator().manual_seed(n + block)
    x = _pseudo_grad(gen, n)
    q = quantize(x, fmt, block)
    err = (x - dequantize(q)).abs()
    bound = error_bound(x, q)
    assert q.codes.numel() == -(-n // block) * block and q.scales.numel() == -(-n // block)
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item()}"
    if block > 1 and n > 100:
        # the stated bound is tight, not a loose envelope: some element comes close to it
        # (int8 rounding error is uniform in [0, scale/2]; e4m3's relative error reaches 2^-4)
        assert float((err / bound).max()) > (0.9 if fmt == INT8 else 0.5)


def test_int8_truncation_would_violate_the_bound():
    """The bound test discriminates: rounding toward zero instead of to nearest (an easy
    slip) makes errors up to a whole step, beyond scale/2."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4096, generator=gen)
    q = quantize(x, INT8, 256)
    scale = q.scales.repeat_interleave(256)
    truncated = torch.trunc(x / scale) * scale
    assert bool(((x - truncated).abs() > error_bound(x, q)).any())


def test_zero_block_decodes_to_zero_and_non_finite_block_to_nan():
    x = torch.tensor([0.0, 0.0, 1.0, float("inf"), 2.0, -4.0])
    for fmt in (INT8, FP8):
        d = dequantize(quantize(x, fmt, 2))
        assert d[:2].tolist() == [0.0, 0.0]
        assert bool(d[2:4].isnan().all())
        assert d[4:].tolist() == pytest.approx([2.0, -4.0], rel=2**-4)


def test_fp8_table_decode_is_bitwise_the_cast_for_every_code():
    from hier_localsgd.core.tensors.compress import _fp8_to_fp32

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    by_table = _fp8_to_fp32(codes)
    by_cast = codes.to(torch.float32)
    assert torch.equal(by_table.view(torch.int32), by_cast.view(torch.int32))
    assert int(by_cast.isnan().sum()) == 2  # 0x7f and 0xff: the table is not trivially NaN-free


def test_quantized_nbytes_is_what_a_quantized_tensor_holds():
    for n, block in [(1, 1), (255, 256), (257, 256), (6_163_712, 256), (1000, 128)]:
        for fmt in (INT8, FP8):
            assert quantize(torch.ones(n), fmt, block).nbytes == quantized_nbytes(n, fmt, block)
    assert quantized_nbytes(256, INT8, 256) == 256 + 4


def test_bad_format_or_block_is_refused():
    with pytest.raises(ValueError, match="format"):
        quantize(torch.ones(4), "int4", 2)
    with pytest.raises(ValueError, match="block"):
        ErrorFeedback(INT8, 0)
    with pytest.raises(ValueError, match="floating"):
        quantize(torch.ones(4, dtype=torch.int64), INT8, 2)


def test_fp8_casts_on_cpu_without_triton():
    """The docstring's claim: torch 2.13's CPU cast to float8_e4m3fn needs no triton."""
    code = (
        "import sys, torch\n"
        "from hier_localsgd.core.tensors.compress import check_format, quantize, dequantize\n"
        "check_format('fp8', 256, 'cpu')\n"
        "dequantize(quantize(torch.randn(1000), 'fp8', 256))\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture
def no_fp8_cast(monkeypatch):
    """A torch build whose fp8 cast fails ("no kernel")."""
    real_to = torch.Tensor.to

    def broken_to(self, *args, **kwargs):
        if args and args[0] is torch.float8_e4m3fn:
            raise RuntimeError("no kernel")
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", broken_to)


def test_check_format_reports_a_wrong_cast_as_unavailable(no_fp8_cast):
    with pytest.raises(FormatUnavailable, match="no kernel"):
        check_format(FP8, 256)


@pytest.mark.parametrize("fmt", [INT8, FP8])
def test_error_feedback_keeps_the_accumulated_update_within_one_step(fmt):
    """Over 200 rounds Σ applied = Σ true − residual, and |residual| ≤ one quantization
    step of the last round. Without error feedback the same inputs drift further."""
    gen = torch.Generator().manual_seed(13)
    n, block, rounds = 3_000, 128, 200
    bias = 0.05 * torch.randn(n, generator=gen)  # pseudo-gradients share a direction, as in training
    ef = ErrorFeedback(fmt, block)
    true_sum = torch.zeros(n, dtype=torch.float64)
    applied_sum = torch.zeros(n, dtype=torch.float64)
    plain_sum = torch.zeros(n, dtype=torch.float64)
    for _ in range(rounds):
        g = bias + 0.1 * torch.randn(n, generator=gen)
        q = ef.encode(g)
        ef.commit()
        true_sum += g.double()
        applied_sum += dequantize(q).double()
        plain_sum += dequantize(quantize(g, fmt, block)).double()
    step = step_size(q).double()
    drift = (applied_sum - true_sum).abs()
    # fp32 slack: each round's x + residual and residual update round once (2^-24 relative
    # of values below 1), 200 rounds of it stay below 1e-4 while a step is ~1e-3 or more.
    assert bool((drift <= step + 1e-4).all()), f"max drift/step {(drift / step).max().item()}"
    # the telescoping identity itself, element by element
    assert torch.allclose(applied_sum, true_sum - ef.residual.double(), atol=1e-4, rtol=0)
    plain_drift = (plain_sum - true_sum).abs()
    assert float(plain_drift.max()) > 3 * float(step.max())


def test_rollback_keeps_the_committed_residual_and_commit_needs_an_encode():
    ef = ErrorFeedback(INT8, 4)
    ef.encode(torch.tensor([0.3, 1.0, 0.11, -0.2]))
    ef.commit()
    kept = ef.residual.clone()
    ef.encode(torch.tensor([5.0, 0.1, 0.7, 0.0]))
    ef.rollback()
    assert torch.equal(ef.residual, kept)
    with pytest.raises(RuntimeError, match="without a staged"):
        ef.commit()
    with pytest.raises(ValueError, match="elements"):
        ef.encode(torch.ones(5))


def test_state_dict_carries_the_residual_to_a_new_leader_bitwise():
    """A leader's state handed over mid-run: the new leader continues exactly as the old
    one would have (same codes), and a staged residual does not travel."""
    gen = torch.Generator().manual_seed(5)
    rounds = [torch.randn(500, generator=gen) for _ in range(6)]
    old = ErrorFeedback(FP8, 64)
    for g in rounds[:3]:
        old.encode(g)
        old.commit()
    old.encode(rounds[3])  # staged, never committed: the round failed with the leader
    old.owner = (500, 2, 1)  # a shard residual's owner tag travels with it
    new = ErrorFeedback(FP8, 64)
    new.load_state_dict(old.state_dict())
    assert new.owner == (500, 2, 1)
    old.rollback()
    for g in rounds[3:]:
        a, b = old.encode(g), new.encode(g)
        old.commit()
        new.commit()
        assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) and torch.equal(a.scales, b.scales)
    with pytest.raises(ValueError, match="int8"):
        ErrorFeedback(INT8, 64).load_state_dict(old.state_dict())


def test_the_commands_that_train_prove_fp8_and_a_lighthouse_does_not(no_fp8_cast):
    """A torch build that cannot cast fp8 is a one-line configuration error naming the field
    for a command that trains here; a lighthouse's configuration check does not cast (it
    imports no torch: tests/test_config.py)."""
    from hier_localsgd.config import ConfigError, load_config

    fp8 = ["sync.outer.compression=fp8", "model=tiny"]
    with pytest.raises(ConfigError, match=r"^sync\.outer\.compression: 'fp8' — .*no kernel"):
        load_config(fp8, validate_for="demo")
    assert load_config(fp8, validate_for="lighthouse").sync.outer.compression == "fp8"
