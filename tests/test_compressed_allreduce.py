"""compressed_allreduce over real Gloo groups of spawned processes: 2 on torchft's
ProcessGroupGloo (TCPStore), 3 on plain c10d Gloo (FileStore)."""

import os
from datetime import timedelta

import pytest
import torch

from hier_localsgd.core.tensors.compress import FP8, INT8, ErrorFeedback
from hier_localsgd.core.tensors.compressed_allreduce import (
    compressed_allreduce_bytes,
    fp32_ring_allreduce_bytes,
    mean_error_bound,
    shard_layout,
)

N = 10_007  # not a multiple of W·block: the last shard carries padding
BLOCK = 64
EF_ROUNDS = 5
WHOLE = 2 * 3 * BLOCK * 5  # whole shards for W = 2 and 3
DRIFT_ROUNDS = 40


def _drift_input(rank: int, rnd: int) -> torch.Tensor:
    # pseudo-gradients that share a direction across rounds, as in training
    bias = 0.05 * torch.randn(N, generator=torch.Generator().manual_seed(77 + rank))
    return bias + 0.1 * torch.randn(N, generator=torch.Generator().manual_seed(10_000 * rank + rnd))


def _input(rank: int, fmt: str, rnd: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * rnd + (fmt == FP8))
    # ranks differ in scale too, so the per-block scales differ between ranks
    return torch.randn(N, generator=gen) * torch.logspace(-3, 1, N) * (1 + rank)


def _rank_main(rank: int, world: int, store_path: str, out_dir: str, torchft_port: int = 0) -> None:
    import torch.distributed as dist

    from hier_localsgd.core.tensors.compressed_allreduce import compressed_allreduce

    torch.set_num_threads(1)
    if torchft_port:
        # torchft's wrapper, as the outer level will call it (its own configure/store)
        from torchft.process_group import ProcessGroupGloo

        pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
        pg.configure(f"127.0.0.1:{torchft_port}/cmp", f"r{rank}", rank, world)
    else:
        store = dist.FileStore(store_path, world)
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
    out = {}
    for fmt in (INT8, FP8):
        t = _input(rank, fmt).clone()
        res = compressed_allreduce(t, pg, fmt, BLOCK, "avg", timeout=timedelta(seconds=60))
        out[fmt] = (t, res.bytes_sent, res.bytes_received)
        ef = ErrorFeedback(fmt, BLOCK)
        rounds = []
        for rnd in range(EF_ROUNDS):
            t = _input(rank, fmt, rnd + 1).clone()
            compressed_allreduce(t, pg, fmt, BLOCK, "sum", timeout=timedelta(seconds=60), error_feedback=ef)
            ef.commit()
            rounds.append(t)
        out[fmt + "_ef"] = rounds
        # with a zero residual the error-feedback path must send exactly what the plain
        # one does (same blocks, padding aligned with the shards)
        plain = _input(rank, fmt, 1).clone()
        compressed_allreduce(plain, pg, fmt, BLOCK, "sum", timeout=timedelta(seconds=60))
        out[fmt + "_plain_round1"] = plain
    # many rounds with error feedback on the first quantization only, then on both
    for variant in ("first", "both"):
        ef, sf = ErrorFeedback(INT8, BLOCK), (ErrorFeedback(INT8, BLOCK) if variant == "both" else None)
        applied = torch.zeros(N, dtype=torch.float64)
        for rnd in range(DRIFT_ROUNDS):
            t = _drift_input(rank, rnd)
            compressed_allreduce(t, pg, INT8, BLOCK, "avg", timedelta(seconds=60), error_feedback=ef, shard_feedback=sf)
            ef.commit()
            if sf is not None:
                sf.commit()
            applied += t.double()
        shard = None if sf is None else sf.residual
        out["drift_" + variant] = (applied, ef.residual, shard)
    # a tensor of whole shards (no padding: the input is quantized in place, not copied)
    whole = _input(rank, INT8)[:WHOLE].clone()
    compressed_allreduce(whole, pg, INT8, BLOCK, "avg", timeout=timedelta(seconds=60))
    out["whole"] = whole
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def _spawn(world: int, target, tmp_path, *extra) -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=target, args=(r, world, str(tmp_path / "store"), str(tmp_path), *extra)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    for p in procs:
        if p.exitcode is None:
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world


@pytest.mark.slow
@pytest.mark.parametrize("world,group", [(2, "torchft"), (3, "c10d")])
def test_every_rank_ends_identical_within_the_bound_and_sends_the_analytic_bytes(world, group, tmp_path):
    if group == "torchft":
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        _spawn(world, _rank_main, tmp_path, store.port)
    else:
        _spawn(world, _rank_main, tmp_path)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for fmt in (INT8, FP8):
        results = [g[fmt][0] for g in got]
        for r in range(1, world):
            assert torch.equal(results[r].view(torch.int32), results[0].view(torch.int32)), f"{fmt}: rank {r} differs"
        inputs = [_input(r, fmt) for r in range(world)]
        true_mean = torch.stack(inputs).mean(0)
        err = (results[0] - true_mean).abs()
        bound = mean_error_bound(inputs, fmt, BLOCK, world)
        assert bool((err <= bound).all()), f"{fmt}: max err/bound {(err / bound).max().item()}"
        assert not torch.equal(results[0], true_mean)  # it really was quantized
        analytic = compressed_allreduce_bytes(N, world, fmt, BLOCK)
        for g in got:
            assert g[fmt][1] == analytic and g[fmt][2] == analytic
        # what the bytes are: 2(W-1) shards of ceil(ceil(N/W)/64) blocks, 65 + 4 bytes... per block
        lay = shard_layout(N, world, BLOCK)
        assert analytic == 2 * (world - 1) * lay.shard_blocks * (BLOCK + 4)
        assert fp32_ring_allreduce_bytes(N, world) / analytic > 3.5
        assert torch.equal(got[0][fmt + "_plain_round1"], got[0][fmt + "_ef"][0])
        whole_in = [_input(r, INT8)[:WHOLE] for r in range(world)]
        assert shard_layout(WHOLE, world, BLOCK).shard_elems * world == WHOLE
        assert all(torch.equal(g["whole"], got[0]["whole"]) for g in got)
        whole_err = (got[0]["whole"] - torch.stack(whole_in).mean(0)).abs()
        assert bool((whole_err <= mean_error_bound(whole_in, INT8, BLOCK, world)).all())
        if fmt == INT8:
            _check_drift(got, world)
        # replicas identical after every compressed round with error feedback
        for rnd in range(EF_ROUNDS):
            for r in range(1, world):
                assert torch.equal(got[r][fmt + "_ef"][rnd].view(torch.int32), got[0][fmt + "_ef"][rnd].view(torch.int32))


def _check_drift(got, world):
    true = sum(torch.stack([_drift_input(r, rnd) for r in range(world)]).double().mean(0) for rnd in range(DRIFT_ROUNDS))
    lay = shard_layout(N, world, BLOCK)
    drift = {}
    for variant in ("first", "both"):
        applied = got[0]["drift_" + variant][0]
        assert all(torch.equal(g["drift_" + variant][0], applied) for g in got)
        first = torch.stack([g["drift_" + variant][1] for g in got]).double().mean(0)
        drift[variant] = (applied - true).abs()
        if variant == "both":
            # the owners' shard residuals laid end to end cover the (padded) tensor
            shard = torch.cat([g["drift_both"][2] for g in got]).double()[:N]
            assert got[0]["drift_both"][2].numel() == lay.shard_elems
            # telescoping: Σ result = Σ true mean − mean_r(first residual_r) − shard residual
            # (fp32 rounding of 40 rounds of values below 1: far below 1e-4)
            assert torch.allclose(applied, true - first - shard, atol=1e-4, rtol=0)
    # without the second residual the requantization error accumulates round after round
    assert float(drift["both"].max()) * 2 < float(drift["first"].max())


def _absent_peer_main(rank: int, world: int, store_path: str, out_dir: str) -> None:
    import time

    import torch.distributed as dist

    from hier_localsgd.core.tensors.compressed_allreduce import compressed_allreduce

    store = dist.FileStore(store_path, world)
    pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=60))
    if rank == 1:
        store.wait(["rank0_done"], timedelta(seconds=120))  # never joins the collective
        return
    t = torch.arange(1000, dtype=torch.float32)
    before = t.clone()
    started = time.monotonic()
    try:
        compressed_allreduce(t, pg, INT8, 64, timeout=timedelta(seconds=2))
        outcome = "returned"
    except RuntimeError as e:
        outcome = f"raised: {e}"
    elapsed = time.monotonic() - started
    torch.save({"outcome": outcome, "elapsed": elapsed, "unchanged": torch.equal(t, before)}, os.path.join(out_dir, "r0.pt"))
    store.set("rank0_done", "1")


@pytest.mark.slow
def test_a_peer_that_never_arrives_makes_it_raise_within_the_timeout_and_leaves_the_tensor(tmp_path):
    _spawn(2, _absent_peer_main, tmp_path)
    r0 = torch.load(tmp_path / "r0.pt")
    assert r0["outcome"].startswith("raised"), r0
    assert r0["unchanged"]
    assert r0["elapsed"] < 30  # 2 s per collective, plus slack for 2 shared cores


def test_analytic_bytes_against_fp32_for_the_debugmodel():
    n = 6_163_712  # llama3_debugmodel's parameters
    for world in (2, 3, 8):
        ratio = fp32_ring_allreduce_bytes(n, world) / compressed_allreduce_bytes(n, world, INT8, 256)
        assert 3.9 < ratio < 3.94  # 4 / (1 + 4/256) = 3.938, less a little padding
    assert compressed_allreduce_bytes(n, 1, INT8, 256) == 0
    with pytest.raises(ValueError):
        compressed_allreduce_bytes(n, 2, "int4", 256)
