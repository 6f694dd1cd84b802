"""The synthetic corpus's loss floor, sharding, and local text files."""

import math

import numpy as np
import pytest
import torch

from hier_localsgd.train.data import ByteTextData, MarkovChain, MarkovData, _rng


def test_entropy_rate_matches_the_true_models_empirical_loss():
    chain = MarkovChain(states=64, branching=4, seed=7)
    seqs = chain.sample(400, 501, _rng(7, 1, 2))  # 200k transitions
    nll = chain.nll(seqs)
    # Per-transition NLL has std <= ~1.5 nats; 200k samples -> std err < 0.01.
    assert abs(nll - chain.entropy_rate) < 0.03, (nll, chain.entropy_rate)
    assert 0 < chain.entropy_rate < math.log(4)


def test_stationary_distribution_is_stationary():
    chain = MarkovChain(states=50, branching=3, seed=3)
    P = np.zeros((50, 50))
    for s in range(50):
        P[s, chain.succ[s]] += chain.probs[s]
    np.testing.assert_allclose(chain.pi @ P, chain.pi, atol=1e-12)
    assert chain.pi.min() > 0


def test_shards_are_distinct_and_reproducible():
    chain = MarkovChain(states=32, branching=4, seed=1)
    a = MarkovData(chain, seed=1, shard=0, batch_size=4, seq_len=16, n_eval_batches=2)
    a2 = MarkovData(chain, seed=1, shard=0, batch_size=4, seq_len=16, n_eval_batches=2)
    b = MarkovData(chain, seed=1, shard=1, batch_size=4, seq_len=16, n_eval_batches=2)
    assert torch.equal(a.batch(5)[0], a2.batch(5)[0])  # same shard, same step
    assert not torch.equal(a.batch(5)[0], b.batch(5)[0])  # other shard
    assert not torch.equal(a.batch(5)[0], a.batch(6)[0])  # other step
    x, y = a.batch(0)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    for (ex, _), (ex2, _) in zip(a.eval_batches(), b.eval_batches()):
        assert torch.equal(ex, ex2)  # one held-out set for everyone


def test_text_file_through_datasets_byte_level(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"line {i}: the quick brown fox — jumps" for i in range(300)), encoding="utf-8")
    d0 = ByteTextData(str(path), "text", "text", seed=0, shard=0, num_shards=2, batch_size=3, seq_len=20, n_eval_batches=2, eval_fraction=0.1)
    d1 = ByteTextData(str(path), "text", "text", seed=0, shard=1, num_shards=2, batch_size=3, seq_len=20, n_eval_batches=2, eval_fraction=0.1)
    x, y = d0.batch(0)
    assert x.shape == (3, 20) and int(x.max()) < 256
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(d0.train[:50], d1.train[:50])
    assert d0.entropy_floor is None


def test_text_file_missing_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path"):
        ByteTextData(str(tmp_path / "nope.txt"), "text", "text", 0, 0, 1, 1, 4, 1, 0.1)


def test_a_sample_stream_reorders_training_batches_but_keeps_the_chain_and_eval_set():
    chain = MarkovChain(32, 4, 7)
    base, other = MarkovData(chain, 7, 0, 2, 16, 2), MarkovData(chain, 7, 0, 2, 16, 2, stream=3)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(base.eval_batches(), other.eval_batches()))
    assert not torch.equal(base.batch(5)[0], other.batch(5)[0])
    assert torch.equal(other.batch(5)[0], MarkovData(chain, 7, 0, 2, 16, 2, stream=3).batch(5)[0])  # reproducible
    assert torch.equal(base.batch(5)[0], MarkovData(chain, 7, 0, 2, 16, 2, stream=0).batch(5)[0])  # stream 0: the original order
