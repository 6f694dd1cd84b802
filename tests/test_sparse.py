"""The sparse 2-bit outer codec (``sync.outer.compression=topk2``; core/tensors/sparse.py,
issue #29 §1): the codec's bound, error feedback over many rounds, the all-gather sum on
real Gloo groups, and the codec wired into a real hierarchy (threads over real
lighthouses, as tests/test_outer_compression.py does for int8: both levels ``localsgd``,
so ``θ(topk2) − θ(fp32) = Σ_c ρ_c``, the clusters' final residuals, holds exactly)."""

import threading
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from hier_localsgd.config import ConfigError, load_config
from hier_localsgd.core.links.stats import PAYLOAD
from hier_localsgd.core.links.link import LinkProcessGroup
from hier_localsgd.core.tensors import sparse
from hier_localsgd.core.tensors.compress import ErrorFeedback
from hier_localsgd.costs import ring_allreduce_bytes
from test_outer_compression import BLOCK, C, N, R, STEPS, _at, _final_residual_sum, run

CHUNK, K = 256, 4


def test_the_codec_keeps_k_per_chunk_within_a_third_of_the_chunk_scale_and_decodes_to_the_same_bits():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 1, 10_000)
    payload, dec = sparse.encode(x, CHUNK, K)
    assert payload.dtype == torch.uint8 and payload.numel() == sparse.sparse_nbytes(x.numel(), CHUNK, K)
    assert torch.equal(sparse.decode(payload.clone(), x.numel(), CHUNK, K), dec)  # the bytes alone decide
    kept = dec != 0
    chunks = -(-x.numel() // CHUNK)
    assert int(kept.sum()) == chunks * K  # k per chunk (no kept value is exactly 0 here)
    err = (x - dec).abs()
    assert bool((err[kept] <= sparse.error_bound(x, CHUNK, K)[kept]).all())
    # the kept ones are each chunk's largest: every dropped element is at most the smallest kept of its chunk
    pad = torch.zeros(chunks * CHUNK)
    pad[: x.numel()] = x.abs()
    kpad = torch.zeros(chunks * CHUNK, dtype=torch.bool)
    kpad[: x.numel()] = kept
    rows, krows = pad.view(chunks, CHUNK), kpad.view(chunks, CHUNK)
    smallest_kept = torch.where(krows, rows, torch.full_like(rows, float("inf"))).amin(1)
    largest_dropped = torch.where(krows, torch.zeros_like(rows), rows).amax(1)
    assert bool((largest_dropped <= smallest_kept).all())
    # 9 bytes per 256 elements: 4 positions, 1 byte of codes, a 4-byte scale
    assert sparse.sparse_nbytes(256 * 1000, CHUNK, K) == 9000
    fp32_ring = ring_allreduce_bytes(256 * 1000 * 4, 2)
    assert fp32_ring / sparse.sparse_allreduce_bytes(256 * 1000, 2, CHUNK, K) == pytest.approx(1024 / 9)  # 113.8x


@pytest.mark.parametrize("chunk, k", [(100, 7), (64, 1), (3, 3), (256, 256)])
def test_odd_chunks_and_k_round_trip(chunk, k):
    x = torch.randn(1001, generator=torch.Generator().manual_seed(chunk + k))
    payload, dec = sparse.encode(x, chunk, k)
    assert payload.numel() == sparse.SparseLayout(1001, chunk, k).nbytes
    assert torch.equal(sparse.decode(payload, 1001, chunk, k), dec)
    kept = dec != 0
    assert bool(((x - dec).abs()[kept] <= sparse.error_bound(x, chunk, k)[kept]).all())
    if k == chunk:  # everything kept: only the 2-bit rounding is lost
        assert int(kept.sum()) >= 1001 - chunk


def test_kept_zeros_alternate_between_the_two_middle_levels_by_position():
    """A chunk with fewer than k non-zeros keeps some exact zeros; each sits halfway between
    −s/3 and s/3, and the encoder alternates by position (even: −s/3, odd: +s/3), so such
    chunks carry no one-sided bias (error feedback takes the s/3 back)."""
    x = torch.zeros(256)
    x[255] = 3.0
    payload, dec = sparse.encode(x, CHUNK, 9)
    assert dec[255] == 3.0
    zeros_kept = [i for i in range(255) if dec[i] != 0]
    assert len(zeros_kept) == 8
    for i in zeros_kept:
        assert float(dec[i]) == pytest.approx(-1.0 if i % 2 == 0 else 1.0), (i, float(dec[i]))


def test_non_finite_input_decodes_to_nan_in_its_chunk_only_and_bad_sizes_are_refused():
    x = torch.randn(1024)
    x[5] = float("nan")
    _, dec = sparse.encode(x, CHUNK, K)
    assert bool(torch.isnan(dec[:CHUNK]).any()) and not bool(torch.isnan(dec[CHUNK:]).any())
    with pytest.raises(ValueError, match="chunk 512"):
        sparse.encode(x, 512, K)
    with pytest.raises(ValueError, match="topk 0"):
        sparse.encode(x, CHUNK, 0)
    with pytest.raises(ValueError, match="expected"):
        sparse.decode(torch.zeros(10, dtype=torch.uint8), 1024, CHUNK, K)


def test_error_feedback_delivers_everything_but_the_last_residual_over_many_rounds():
    """Σ decoded = Σ input − residual after every round (the telescoping identity), and on
    a stream with a steady direction (as pseudo-gradients have) the undelivered part
    shrinks against what was delivered: 1.6 % kept per round still moves the sum."""
    g = torch.Generator().manual_seed(1)
    n = 4096
    bias = torch.randn(n, generator=g) * torch.logspace(-1, 1, n)
    ef = ErrorFeedback(sparse.TOPK2, CHUNK)
    true, sent = torch.zeros(n), torch.zeros(n)
    for t in range(400):
        x = bias + torch.randn(n, generator=g)
        payload = ef.encode_with(x, lambda v: sparse.encode(v, CHUNK, K))
        ef.commit()
        true += x
        sent += sparse.decode(payload, n, CHUNK, K)
        assert ef.residual is not None
        torch.testing.assert_close(true - sent, ef.residual, rtol=0, atol=1e-5 * (1 + float(true.abs().max())))  # fp32 sums
    # measured: 0.74 of the sum's norm after 10 rounds, 0.26 after 100, 0.069 after 400
    assert float(ef.residual.norm()) < 0.15 * float(true.norm()), (float(ef.residual.norm()), float(true.norm()))
    # a rolled-back round leaves the committed residual as it was
    before = ef.residual.clone()
    ef.encode_with(torch.ones(n), lambda v: sparse.encode(v, CHUNK, K))
    ef.rollback()
    assert torch.equal(ef.residual, before)


def test_the_sum_over_real_gloo_is_the_same_bits_on_both_ranks_and_sends_the_payload_once():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pgs = [LinkProcessGroup("outer", timedelta(seconds=30)) for _ in range(2)]
    xs = [torch.randn(3000, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    payloads = [sparse.encode(x, CHUNK, K)[0] for x in xs]
    want = sparse.decode(payloads[0], 3000, CHUNK, K) + sparse.decode(payloads[1], 3000, CHUNK, K)
    out, stats = {}, {}

    def rank(r: int) -> None:
        pgs[r].configure(f"127.0.0.1:{store.port}/sparse", f"r{r}", r, 2, quorum_id=1)
        t = torch.empty(3000)
        with pgs[r].kind(PAYLOAD):
            res = sparse.sparse_allreduce_sum(t, pgs[r], CHUNK, K, payloads[r], rank=r, world=2)
        out[r], stats[r] = t, (res, pgs[r].stats.sent_bytes.get(PAYLOAD, 0))

    ths = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    assert torch.equal(out[0], out[1]) and torch.equal(out[0], want)
    for r in range(2):
        res, sent = stats[r]
        assert res.ok and res.bytes_sent == sparse.sparse_allreduce_bytes(3000, 2, CHUNK, K)
        assert sent == res.bytes_sent  # what the link counted on the wire


# ---------------------------------------------------------------------------
# Wired into a real hierarchy (threads over real lighthouses, Managers and Gloo groups).


def test_topk2_outer_rounds_keep_replicas_identical_and_the_identity():
    seen, reps = run("topk2")
    ref, _ = run("none")
    for step in range(2, STEPS + 1, 2):
        models = {k: _at(seen, k, step)[2] for k in seen}
        assert len({m.numpy().tobytes() for m in models.values()}) == 1, f"replicas differ after the outer round at step {step}"
        for c in range(C):  # every member holds its leader's committed residual
            res = [_at(seen, (c, r), step)[3] for r in range(R)]
            assert all(torch.equal(x, res[0]) for x in res), f"cluster {c} residuals differ at step {step}"
    for rep in reps.values():
        assert not rep.kinds("rollback"), rep.kinds("rollback")
    got, want = seen[(0, 0)][-1][2], ref[(0, 0)][-1][2]
    rho = _final_residual_sum(seen, seen.keys())
    assert float(rho.abs().max()) > 0 and not torch.equal(got, want)
    # everything not applied yet is in the residuals (1.6 % of each chunk goes per round)
    torch.testing.assert_close(got - want, rho, rtol=0, atol=1e-5)


def test_topk2_slow_link_bytes_are_the_sparse_bytes():
    _, reps = run("topk2")
    _, ref = run("none")
    rounds = STEPS // 2
    for c in range(C):
        sent = reps[(c, 0)].sync.outer_stats.sent_bytes["payload"]
        fp32 = ref[(c, 0)].sync.outer_stats.sent_bytes["payload"]
        assert sent == rounds * sparse.sparse_allreduce_bytes(N, C, BLOCK, sparse.DEFAULT_TOPK)
        assert fp32 / sent == pytest.approx(1024 / 9)  # 4 of 256 kept, W = 2: 113.8x fewer bytes
        calls = reps[(c, 0)].sync.outer_stats.calls
        assert calls["allgather/payload"] == rounds and "allreduce/payload" not in calls and "alltoall/payload" not in calls
        assert reps[(c, 1)].sync.outer_stats.sent_bytes.get("payload", 0) == 0  # only leaders cross the slow link


def test_the_topk2_residual_survives_a_leader_change():
    """c0r0 stops after the outer round at step 6; c0r1 leads on with the residual it holds
    (the identity over the whole run shows it was used, not reset)."""
    seen, reps = run("topk2", leave_at=6)
    ref, _ = run("none", leave_at=6)
    old = _at(seen, (0, 0), 6)
    assert old[1] and float(old[3].abs().max()) > 0
    assert torch.equal(_at(seen, (0, 1), 6)[3], old[3])
    assert reps[(0, 1)].kinds("leader", leader=True)
    assert [e for e in reps[(0, 1)].kinds("commit", level="outer") if e["step"] > 6]
    keys = [k for k in seen if k != (0, 0)]
    finals = [seen[k][-1][2] for k in keys]
    assert all(torch.equal(f, finals[0]) for f in finals)
    torch.testing.assert_close(finals[0] - ref[(0, 1)][-1][2], _final_residual_sum(seen, keys), rtol=0, atol=1e-5)


def test_overlapped_topk2_outer_rounds_stay_consistent_and_keep_the_identity():
    seen, reps = run("topk2", delay=1)
    ref, _ = run("none", delay=1)
    for rep in reps.values():
        assert not rep.kinds("rollback"), rep.kinds("rollback")
    finals = [seen[k][-1][2] for k in seen]
    assert all(torch.equal(f, finals[0]) for f in finals)
    torch.testing.assert_close(seen[(0, 0)][-1][2] - ref[(0, 0)][-1][2], _final_residual_sum(seen, seen.keys()), rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["sync.outer.compression=topk2", "sync.outer.topk=0"], "sync.outer.topk", "between 1 and"),
        (["sync.outer.compression=topk2", "sync.outer.topk=300"], "sync.outer.topk", "between 1 and"),
        (["sync.outer.compression=topk2", "sync.outer.compression_block=512"], "sync.outer.compression_block", "at most 256"),
        (["sync.inner.compression=topk2"], "sync.inner.compression", "only the outer level"),
        # a lost packet of the sparse payload decodes to wrong values (a zeroed code is -s)
        (["sync.outer.compression=topk2", "links.outer.loss=bernoulli", "links.outer.p=0.01", "links.outer.fill=zero"],
         "links.outer.loss", "loss-free outer link"),
    ],
)
def test_bad_topk2_settings_name_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as e:
        load_config(["model=tiny", *overrides])
    assert str(e.value).startswith(field) and words in str(e.value), str(e.value)
