"""Training data: a synthetic corpus with an exactly known loss floor, or local text.

``markov`` (default): a seeded sparse first-order Markov chain over ``states``
tokens. Each state has ``branching`` successors (always including ``s+1 mod V``,
and state 0 a self-loop, so the chain is irreducible and aperiodic) with
Dirichlet(``concentration``) transition probabilities. Its stationary
distribution π is found by power iteration and its entropy rate

    H = Σ_s π(s) · H(P(·|s))    (nats/token)

is the lowest cross-entropy any model can reach on next-token prediction when
every target has its predecessor in context — which is the case for every target
of every training and eval sequence here. Each run reports eval loss and its
excess over H.

``text`` / ``parquet``: a local file read with Hugging Face ``datasets``,
tokenised as UTF-8 bytes (vocab 256, no download). The loss floor is unknown.

Sharding: every (cluster, replica) reads its own shard. Batches are addressed
by (shard, step) — ``batch(step)`` is a pure function of the seed, the shard and
the step — so a restarted replica resumes its data position exactly by
resuming its step.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Tuple

import numpy as np
import torch

EVAL_SHARD = 2**31 - 1


class Dataset(Protocol):
    vocab_size: int
    entropy_floor: Optional[float]

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]: ...

    def eval_batches(self) -> list[Tuple[torch.Tensor, torch.Tensor]]: ...


class MarkovChain:
    """A seeded sparse Markov chain with a known entropy rate (see module docstring)."""

    def __init__(self, states: int, branching: int, seed: int, concentration: float = 0.5) -> None:
        if states < 2:
            raise ValueError(f"data.states={states}: need at least 2")
        if not 1 <= branching <= states:
            raise ValueError(f"data.branching={branching}: must be in [1, data.states={states}]")
        if concentration <= 0:
            raise ValueError(f"data.concentration={concentration}: must be positive")
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0x4D41524B]))
        succ = np.empty((states, branching), dtype=np.int64)
        for s in range(states):
            ring = (s + 1) % states
            others = rng.choice(np.setdiff1d(np.arange(states), [ring]), size=branching - 1, replace=False)
            succ[s, 0], succ[s, 1:] = ring, others
        if branching > 1 and 0 not in succ[0]:
            succ[0, 1] = 0  # a self-loop makes the chain aperiodic
        probs = rng.dirichlet(np.full(branching, concentration), size=states)
        probs = np.maximum(probs, 1e-12)
        probs /= probs.sum(axis=1, keepdims=True)
        self.states, self.branching = states, branching
        self.succ, self.probs = succ, probs
        self.cdf = np.cumsum(probs, axis=1)
        self.cdf[:, -1] = 1.0
        self.pi = self._stationary()
        self.pi_cdf = np.cumsum(self.pi)
        self.pi_cdf[-1] = 1.0
        row_entropy = -(probs * np.log(probs)).sum(axis=1)
        self.entropy_rate = float((self.pi * row_entropy).sum())

    def _stationary(self, tol: float = 1e-14, max_iter: int = 100_000) -> np.ndarray:
        pi = np.full(self.states, 1.0 / self.states)
        flat_succ, w = self.succ.ravel(), self.probs
        for _ in range(max_iter):
            new = np.bincount(flat_succ, weights=(pi[:, None] * w).ravel(), minlength=self.states)
            new /= new.sum()
            if np.abs(new - pi).sum() < tol:
                return new
            pi = new
        raise RuntimeError("Markov chain stationary distribution did not converge")

    def sample(self, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """``batch`` sequences of ``length`` tokens, each started from π."""
        out = np.empty((batch, length), dtype=np.int64)
        cur = np.searchsorted(self.pi_cdf, rng.random(batch), side="right")
        cur = np.minimum(cur, self.states - 1)
        out[:, 0] = cur
        u = rng.random((batch, length))
        for t in range(1, length):
            idx = (u[:, t, None] > self.cdf[cur]).sum(axis=1)
            cur = self.succ[cur, idx]
            out[:, t] = cur
        return out

    def nll(self, seqs: np.ndarray) -> float:
        """Mean true negative log-likelihood of next tokens (checks the entropy rate)."""
        prev, nxt = seqs[:, :-1].ravel(), seqs[:, 1:].ravel()
        match = self.succ[prev] == nxt[:, None]
        p = (self.probs[prev] * match).sum(axis=1)
        return float(-np.log(p).mean())


def _rng(seed: int, shard: int, step: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, shard, step]))


@dataclass
class MarkovData:
    chain: MarkovChain
    seed: int
    shard: int
    batch_size: int
    seq_len: int
    n_eval_batches: int

    @property
    def vocab_size(self) -> int:
        return self.chain.states

    @property
    def entropy_floor(self) -> Optional[float]:
        return self.chain.entropy_rate

    def _pair(self, seqs: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
        t = torch.from_numpy(seqs)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._pair(self.chain.sample(self.batch_size, self.seq_len + 1, _rng(self.seed, self.shard, step)))

    def eval_batches(self) -> list[Tuple[torch.Tensor, torch.Tensor]]:
        return [
            self._pair(self.chain.sample(self.batch_size, self.seq_len + 1, _rng(self.seed, EVAL_SHARD, i)))
            for i in range(self.n_eval_batches)
        ]


class ByteTextData:
    """A local text or parquet file as UTF-8 bytes; contiguous shards, held-out tail for eval."""

    vocab_size = 256
    entropy_floor: Optional[float] = None

    def __init__(
        self,
        path: str,
        kind: str,
        text_column: str,
        seed: int,
        shard: int,
        num_shards: int,
        batch_size: int,
        seq_len: int,
        n_eval_batches: int,
        eval_fraction: float,
    ) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"data.path={path!r}: no such file")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        import datasets  # heavy import, only for real-text runs

        ds = datasets.load_dataset("text" if kind == "text" else "parquet", data_files=path, split="train")
        if text_column not in ds.column_names:
            raise ValueError(f"data.text_column={text_column!r}: not a column of {path} ({ds.column_names})")
        raw = "\n".join(str(x) for x in ds[text_column]).encode("utf-8")
        tokens = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))
        n_eval = max(seq_len + 1, int(len(tokens) * eval_fraction))
        train = tokens[:-n_eval]
        per_shard = len(train) // num_shards
        if per_shard < seq_len + 1:
            raise ValueError(f"data.path={path!r}: {len(tokens)} bytes is too small for {num_shards} shards of sequences of {seq_len}")
        self.train = train[shard * per_shard : (shard + 1) * per_shard]
        self.held_out = tokens[-n_eval:]
        self.seed, self.shard = seed, shard
        self.batch_size, self.seq_len, self.n_eval = batch_size, seq_len, n_eval_batches

    def _windows(self, tokens: torch.Tensor, starts: np.ndarray) -> Tuple[torch.Tensor, torch.Tensor]:
        idx = torch.from_numpy(starts)[:, None] + torch.arange(self.seq_len + 1)[None, :]
        seqs = tokens[idx]
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        hi = len(self.train) - self.seq_len - 1
        starts = _rng(self.seed, self.shard, step).integers(0, hi + 1, size=self.batch_size)
        return self._windows(self.train, starts)

    def eval_batches(self) -> list[Tuple[torch.Tensor, torch.Tensor]]:
        hi = len(self.held_out) - self.seq_len - 1
        out = []
        for i in range(self.n_eval):
            starts = _rng(self.seed, EVAL_SHARD, i).integers(0, hi + 1, size=self.batch_size)
            out.append(self._windows(self.held_out, starts))
        return out


def uniform_loss(vocab: int) -> float:
    return math.log(vocab)
