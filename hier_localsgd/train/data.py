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
:func:`check_input` vets such a file before any process starts (config validation
of every training command calls it), so a bad file fails once, naming
``data.path`` or ``data.text_column``, instead of in every worker.

Sharding: every (cluster, replica) reads its own shard. Batches are addressed
by (shard, step) — ``batch(step)`` is a pure function of the seed, the shard and
the step — so a restarted replica resumes its data position exactly by
resuming its step.
"""

from __future__ import annotations

import codecs
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional, Protocol, Tuple

import numpy as np
import torch

if TYPE_CHECKING:
    from hier_localsgd.train.sections import DataConfig

EVAL_SHARD = 2**31 - 1
# check_input reads at most about this much of a text file (more only when a batch needs
# more): validating a large corpus must not cost as much as loading it.
CHECK_PREFIX_BYTES = 1 << 20


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
    stream: int = 0  # 0: the original order; else another, same chain and eval set

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
        rng = _rng(self.seed, self.shard, step) if not self.stream else np.random.default_rng(np.random.SeedSequence([self.seed, self.shard, step, self.stream]))
        return self._pair(self.chain.sample(self.batch_size, self.seq_len + 1, rng))

    def eval_batches(self) -> list[Tuple[torch.Tensor, torch.Tensor]]:
        return [
            self._pair(self.chain.sample(self.batch_size, self.seq_len + 1, _rng(self.seed, EVAL_SHARD, i)))
            for i in range(self.n_eval_batches)
        ]


def bpe_tokens(texts: List[str], vocab_size: int) -> Tuple[torch.Tensor, int]:
    """``texts`` as the tokens of a byte-level BPE trained on them (``tokenizers``), and the
    vocabulary's size. Training is deterministic: every process gets the same merges."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, show_progress=False)
    ids = [i for enc in tok.encode_batch(texts) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.int64), tok.get_vocab_size()


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
        tokenizer: str = "bytes",
        bpe_vocab: int = 512,
    ) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"data.path={path!r}: no such file")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        import datasets  # heavy import, only for real-text runs

        try:
            ds = datasets.load_dataset("text" if kind == "text" else "parquet", data_files=path, split="train")
        except datasets.exceptions.DatasetGenerationError as e:
            # check_input catches the known causes up front; this names the file for the
            # rest (e.g. a bad byte past the prefix it reads), instead of datasets' generic line.
            cause = e.__cause__ or e
            raise ValueError(f"data.path={path!r}: the datasets loader failed: {cause.__class__.__name__}: {cause}") from e
        if text_column not in ds.column_names:
            raise ValueError(f"data.text_column={text_column!r}: not a column of {path} ({ds.column_names})")
        if tokenizer == "bpe":
            tokens, self.vocab_size = bpe_tokens([str(x) for x in ds[text_column]], bpe_vocab)
        else:
            raw = "\n".join(str(x) for x in ds[text_column]).encode("utf-8")
            tokens = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))
        n_eval, per_shard = split_sizes(len(tokens), seq_len, num_shards, eval_fraction)
        train = tokens[:-n_eval]
        if per_shard < seq_len + 1:
            raise ValueError(
                f"data.path={path!r}: {len(tokens)} tokens is too short; "
                f"{_needs(seq_len, num_shards, eval_fraction)}"
            )
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


def split_sizes(n_tokens: int, seq_len: int, num_shards: int, eval_fraction: float) -> Tuple[int, int]:
    """How :class:`ByteTextData` splits ``n_tokens``: (held-out eval tokens, training tokens per shard).

    The held-out tail is ``eval_fraction`` of the corpus but at least one sequence of
    ``seq_len + 1`` tokens; the rest is cut into ``num_shards`` equal shards.
    """
    n_eval = max(seq_len + 1, int(n_tokens * eval_fraction))
    return n_eval, max(n_tokens - n_eval, 0) // num_shards


def min_tokens(seq_len: int, num_shards: int, eval_fraction: float) -> int:
    """The fewest tokens with which every shard holds one training sequence of ``seq_len + 1`` tokens."""
    need = seq_len + 1

    def enough(n: int) -> bool:
        return split_sizes(n, seq_len, num_shards, eval_fraction)[1] >= need

    lo, hi = 0, need  # enough() is monotone in n; lo is never enough, hi ends up enough
    while not enough(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def _needs(seq_len: int, num_shards: int, eval_fraction: float) -> str:
    return (
        f"needs at least {min_tokens(seq_len, num_shards, eval_fraction)} (one sequence of train.seq_len+1={seq_len + 1} "
        f"tokens for each of {num_shards} shard(s), plus the held-out eval split, data.eval_fraction={eval_fraction})"
    )


def check_input(data: "DataConfig", seq_len: int, num_shards: int) -> None:
    """Checks, cheaply and before any process starts, that a text or parquet ``data.path`` can feed the job.

    A ``markov`` corpus needs nothing. Otherwise this reads the file's size, then for
    ``text`` at most about :data:`CHECK_PREFIX_BYTES` (more only when one batch needs more),
    decoding it as UTF-8 the way the ``datasets`` text loader does; for ``parquet`` the
    footer (schema, row counts) and the first rows of ``data.text_column`` until they hold
    enough tokens. A bad byte past the prefix of a large text file is not seen here;
    :class:`ByteTextData` then fails naming ``data.path``.

    Tokens are counted as :class:`ByteTextData` makes them (UTF-8 bytes, lines joined by
    one newline) and the minimum is :func:`min_tokens` of the job's shards.

    Raises:
        ValueError: whose message starts with the field and its value, e.g.
            ``data.path='c.txt': empty file (0 bytes)``: a path that is unset, missing, a
            directory or not a regular file, empty or unreadable; text that is not UTF-8
            or holds a NUL byte; a file that is not parquet, has no rows or an empty first
            row group; too few tokens for the shards (``data.path``); or a parquet file
            without ``data.text_column`` (``data.text_column``, listing the columns).
    """
    if data.kind == "markov":
        return
    where = f"data.path={data.path!r}"
    if not data.path:
        raise ValueError(f"{where}: required for data.kind={data.kind}")
    path = Path(data.path)
    if not path.exists():
        raise ValueError(f"{where}: no such file")
    if path.is_dir():
        raise ValueError(f"{where}: is a directory; data.kind={data.kind} reads one file")
    if not path.is_file():
        raise ValueError(f"{where}: not a regular file")  # a FIFO or device would block the loader
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise ValueError(f"{where}: cannot be read ({e.__class__.__name__}: {e.strerror or e})") from e
    if path.stat().st_size == 0:
        raise ValueError(f"{where}: empty file (0 bytes)")
    need = min_tokens(seq_len, num_shards, data.eval_fraction)
    if data.kind == "text":
        n = _count_text_tokens(path, need, where)
    else:
        n = _count_parquet_tokens(path, data.text_column, need, where)
    if n < need:
        raise ValueError(f"{where}: too short: {n} tokens (UTF-8 bytes), {_needs(seq_len, num_shards, data.eval_fraction)}")


def _count_text_tokens(path: Path, need: int, where: str) -> int:
    """Tokens of a UTF-8 text file, or a lower bound that is at least ``need`` when the prefix suffices.

    The ``datasets`` text loader opens the file with universal newlines (``\r\n`` and
    ``\r`` become ``\n``) and drops the last line's newline when :class:`ByteTextData`
    joins the lines, so the tokens are the bytes less one per ``\r\n`` and one trailing
    newline. Valid UTF-8 re-encodes to the same bytes.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()  # strict, as the loader decodes
    n = crlf = 0
    last = b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 16)
            if not chunk:
                break
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                at = n - pending + e.start
                raise ValueError(f"{where}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {at} is invalid); "
                                 f"data.kind=text reads UTF-8") from e
            nul = chunk.find(b"\0")
            if nul >= 0:
                raise ValueError(f"{where}: not text (a NUL byte at offset {n + nul}: a binary file, or UTF-16?); "
                                 f"data.kind=text reads UTF-8")
            crlf += chunk.count(b"\r\n") + (last == b"\r" and chunk[:1] == b"\n")
            n += len(chunk)
            last = chunk[-1:]
            if n >= CHECK_PREFIX_BYTES and n - crlf - 1 >= need:
                return n - crlf - 1  # enough; the rest of the file can only add tokens
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (ends inside a multi-byte character); data.kind=text reads UTF-8") from e
    return n - crlf - (1 if last in (b"\n", b"\r") else 0)


def _count_parquet_tokens(path: Path, column: str, need: int, where: str) -> int:
    """Tokens of ``column`` (as :class:`ByteTextData` joins it), reading rows only until ``need`` is reached."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)  # reads the footer: schema and row groups
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{where}: not a parquet file ({str(e).splitlines()[0] if str(e) else e.__class__.__name__})") from e
    names = pf.schema_arrow.names
    if column not in names:
        raise ValueError(f"data.text_column={column!r}: not a column of {str(path)!r} (its columns: {names})")
    meta = pf.metadata
    if meta.num_rows == 0:
        raise ValueError(f"{where}: no rows")
    if meta.row_group(0).num_rows == 0:
        # the datasets loader reads row group 0's size as its batch size, and 0 is invalid
        raise ValueError(f"{where}: its first row group is empty, which the datasets loader cannot read; rewrite the file")
    n = rows = 0
    try:
        for batch in pf.iter_batches(batch_size=1024, columns=[column]):
            for x in batch.column(0).to_pylist():
                n += len(str(x).encode("utf-8")) + (1 if rows else 0)  # str() and "\n".join, as ByteTextData
                rows += 1
            if n >= need:
                break
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{where}: column {column!r} cannot be read ({str(e).splitlines()[0] if str(e) else e.__class__.__name__})") from e
    return n


def uniform_loss(vocab: int) -> float:
    return math.log(vocab)


class DeviceData:
    """Feeds another data source's batches as tensors on ``device`` (``train.device``).

    On CUDA a batch is copied to pinned host memory and then to the device without
    blocking (stream-ordered before the forward that reads it); on CPU the source's
    tensors are returned as they are. Eval batches are moved once."""

    def __init__(self, source: Dataset, device: torch.device) -> None:
        self.source = source
        self.device = device
        self.vocab_size = source.vocab_size
        self.entropy_floor = source.entropy_floor

    def _to(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        x, y = self.source.batch(step)
        return self._to(x), self._to(y)

    def eval_batches(self) -> list[Tuple[torch.Tensor, torch.Tensor]]:
        return [(self._to(x), self._to(y)) for x, y in self.source.eval_batches()]
