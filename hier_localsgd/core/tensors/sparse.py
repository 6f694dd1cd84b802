"""Sparse, low-bit outer payloads: chunked top-k with 2-bit values (issue #29 §1).

The SparseLoCo/DeMo class of codec, as ``sync.outer.compression=topk2``:

1. the flat fp32 tensor is cut into chunks of ``chunk`` elements (zero padding completes
   the last one);
2. in each chunk the ``k`` elements of largest magnitude are kept (``torch.topk``), the
   rest is left to the sender's error feedback;
3. each kept value gets a 2-bit code on four levels ``{−s, −s/3, s/3, s}``, with ``s`` the
   largest kept magnitude of its chunk (one fp32 scale per chunk): round to the nearest
   level, so the error of a kept value is at most ``s/3``;
4. the payload is three arrays of fixed size, so every sender's payload has the same
   length (an all-gather needs that): the kept positions inside their chunk (one byte
   each: ``chunk ≤ 256``, ``log2(chunk)`` bits rounded up to a byte), the codes packed
   four to a byte, and the scales.

Bytes for ``n`` elements: ``ceil(n/chunk) · (k + ceil(k/4) + 4)``. With ``chunk=256`` and
``k=4`` (1.6 % kept) that is 9 bytes per 256 elements, 0.28 bits per element: 114×
less than fp32 (:func:`sparse_nbytes`).

Decoding is a scatter of distinct positions into zeros, so the same bytes decode to the
same bits on every rank. Sums over senders (:func:`sparse_allreduce_sum`) add the
decoded payloads in rank order on every rank: replicas stay bit-identical without a
second quantization (unlike the int8 all-reduce's requantized shards).

Non-finite input: a chunk holding a NaN or an infinity keeps it among its top k
(``topk`` ranks NaN first) and gets a NaN scale, so its kept values decode to NaN on
every rank (the caller's guard sees it), as the int8 codec does.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, List, Optional

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import AllgatherOptions

from hier_localsgd.core.runtime.choices import DEFAULT_TOPK, MAX_CHUNK, TOPK2  # noqa: F401 - sparse.TOPK2 etc. for its callers

_LEVELS = 3.0  # codes 0..3 map to (code / 1.5 − 1) · s: −s, −s/3, s/3, s
_SCALE_BYTES = 4


def check_sparse(chunk: int, k: int) -> None:
    """Raises ValueError unless ``1 ≤ k ≤ chunk ≤ MAX_CHUNK``."""
    if not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk {chunk}: the topk2 codec needs 1 <= chunk <= {MAX_CHUNK} (a position is one byte)")
    if not 1 <= k <= chunk:
        raise ValueError(f"topk {k}: must be between 1 and the chunk size {chunk}")


@dataclass(frozen=True)
class SparseLayout:
    """Where the three arrays of one payload start, for ``numel`` elements."""

    numel: int
    chunk: int
    k: int

    @property
    def chunks(self) -> int:
        return max(1, math.ceil(self.numel / self.chunk))

    @property
    def code_bytes(self) -> int:
        """Packed 2-bit codes of one chunk (four to a byte)."""
        return math.ceil(self.k / 4)

    @property
    def nbytes(self) -> int:
        return self.chunks * (self.k + self.code_bytes + _SCALE_BYTES)


def sparse_nbytes(numel: int, chunk: int, k: int) -> int:
    """Payload bytes of ``numel`` elements (what one sender puts on the wire per peer)."""
    check_sparse(chunk, k)
    return SparseLayout(numel, chunk, k).nbytes


def sparse_allreduce_bytes(numel: int, world: int, chunk: int, k: int) -> int:
    """Payload bytes one rank sends in :func:`sparse_allreduce_sum`: its payload to each
    of the ``W−1`` others (an all-gather)."""
    return (world - 1) * sparse_nbytes(numel, chunk, k)


def encode(x: torch.Tensor, chunk: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The payload of ``x`` (uint8, :attr:`SparseLayout.nbytes` long) and what it decodes
    to (fp32, ``x``'s number of elements): the caller's error feedback keeps the rest."""
    check_sparse(chunk, k)
    flat = x.detach().reshape(-1).to(torch.float32)
    lay = SparseLayout(flat.numel(), chunk, k)
    rows = torch.zeros(lay.chunks * chunk, dtype=torch.float32, device=flat.device)
    rows[: flat.numel()] = flat
    rows = rows.view(lay.chunks, chunk)
    _, idx = torch.topk(rows.abs(), k, dim=1, sorted=False)
    kept = rows.gather(1, idx)
    scale = kept.abs().amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1)
    codes = torch.round((kept / safe + 1.0) * (_LEVELS / 2)).clamp_(0, _LEVELS).to(torch.uint8)
    # A kept exact 0 (a chunk with fewer than k non-zeros) sits halfway between −s/3 and
    # s/3: alternate by position so such chunks carry no one-sided bias (error feedback
    # takes the s/3 back either way).
    zero = kept == 0
    if bool(zero.any()):
        codes[zero] = torch.where(idx[zero] % 2 == 0, 1, 2).to(torch.uint8)
    payload = _pack(idx.to(torch.uint8), codes, scale, lay)
    return payload, decode(payload, flat.numel(), chunk, k)


def _pack(idx: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, lay: SparseLayout) -> torch.Tensor:
    pad = lay.code_bytes * 4 - lay.k
    if pad:
        codes = torch.cat([codes, torch.zeros(lay.chunks, pad, dtype=torch.uint8, device=codes.device)], dim=1)
    c = codes.view(lay.chunks, lay.code_bytes, 4).to(torch.int32)
    packed = (c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)).to(torch.uint8)
    return torch.cat([idx.reshape(-1), packed.reshape(-1), scale.contiguous().view(torch.uint8)])


def decode(payload: torch.Tensor, numel: int, chunk: int, k: int) -> torch.Tensor:
    """The fp32 tensor (``numel`` elements) a payload stands for; the same bits everywhere.

    Raises:
        ValueError: the payload's length is not the layout's."""
    lay = SparseLayout(numel, chunk, k)
    if payload.numel() != lay.nbytes or payload.dtype != torch.uint8:
        raise ValueError(f"topk2 payload of {payload.numel()} bytes ({payload.dtype}), expected {lay.nbytes} uint8 "
                         f"for {numel} elements, chunk {chunk}, k {k}")
    n_idx, n_codes = lay.chunks * k, lay.chunks * lay.code_bytes
    idx = payload[:n_idx].view(lay.chunks, k).to(torch.int64)
    packed = payload[n_idx: n_idx + n_codes].view(lay.chunks, lay.code_bytes).to(torch.int32)
    codes = torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=2).view(lay.chunks, -1)[:, :k]
    scale = payload[n_idx + n_codes:].clone().view(torch.float32).unsqueeze(1)
    values = (codes.to(torch.float32) / (_LEVELS / 2) - 1.0) * scale
    out = torch.zeros(lay.chunks, chunk, dtype=torch.float32, device=payload.device)
    out.scatter_(1, idx, values)  # positions in a chunk are distinct: no order to agree on
    return out.view(-1)[:numel]


def error_bound(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Per element, the largest ``|x − decode(encode(x))|`` for a kept element: a third of
    its chunk's largest kept magnitude (plus fp32 slack); dropped elements are off by
    themselves (error feedback carries them)."""
    flat = x.detach().reshape(-1).to(torch.float32)
    lay = SparseLayout(flat.numel(), chunk, k)
    rows = torch.zeros(lay.chunks * chunk)
    rows[: flat.numel()] = flat.abs()
    s = rows.view(lay.chunks, chunk).topk(k, dim=1).values.amax(dim=1, keepdim=True)
    return (s / _LEVELS * (1 + 2.0**-16)).expand(lay.chunks, chunk).reshape(-1)[: flat.numel()]


@dataclass(frozen=True)
class SparseAllreduceResult:
    bytes_sent: int
    bytes_received: int
    total_s: float
    ok: bool = True


def sparse_allreduce_sum(
    tensor: torch.Tensor,
    pg: ProcessGroup,
    chunk: int,
    k: int,
    payload: torch.Tensor,
    timeout: timedelta = timedelta(seconds=60),
    wait: Optional[Callable[[object, str], bool]] = None,
    remaining: Optional[Callable[[], timedelta]] = None,
    rank: Optional[int] = None,
    world: Optional[int] = None,
) -> SparseAllreduceResult:
    """Sums every rank's ``payload`` (this rank's :func:`encode` of its contribution) over
    ``pg`` into ``tensor`` (fp32, contiguous; overwritten): an all-gather of the payloads,
    then every rank decodes them in rank order and adds them up, so every rank ends with
    the same bits.

    ``wait``: as in :func:`hier_localsgd.core.tensors.compressed_allreduce.compressed_allreduce`
    (False: ``tensor`` unchanged, ``ok=False``); default: wait up to ``timeout`` and raise.
    ``remaining``: the collective's timeout, read when it is issued (a phase deadline).

    Failure semantics: a peer that fails or does not arrive makes the all-gather fail or
    time out; ``tensor`` is then unchanged and the caller rolls back its staged residual.

    Raises:
        ValueError: a non-fp32 or non-contiguous ``tensor``, or a payload of the wrong size.
        RuntimeError: the all-gather failed or timed out (without ``wait``).
    """
    if tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError(f"sparse_allreduce_sum: expected a contiguous fp32 tensor, got {tensor.dtype}")
    n = tensor.numel()
    expected = sparse_nbytes(n, chunk, k)
    if payload.numel() != expected:
        raise ValueError(f"sparse_allreduce_sum: payload of {payload.numel()} bytes, expected {expected}")
    started = time.perf_counter()
    rank = pg.rank() if rank is None else rank
    world = pg.size() if world is None else world
    gathered: List[torch.Tensor] = [torch.empty_like(payload) for _ in range(world)]
    opts = AllgatherOptions()
    opts.timeout = timeout if remaining is None else remaining()
    work = pg.allgather([gathered], [payload.contiguous()], opts)
    if wait is None:
        if not work.wait(opts.timeout):
            raise RuntimeError(f"sparse_allreduce_sum: all-gather did not complete within {opts.timeout}")
        ok = True
    else:
        ok = bool(wait(work, "all-gather"))
    if ok:
        acc = decode(gathered[0], n, chunk, k).clone()
        for j in range(1, world):
            acc += decode(gathered[j], n, chunk, k)
        tensor.view(-1).copy_(acc)
    moved = (world - 1) * payload.numel()
    return SparseAllreduceResult(moved, moved, time.perf_counter() - started, ok)


__all__ = [
    "DEFAULT_TOPK", "MAX_CHUNK", "TOPK2", "SparseAllreduceResult", "SparseLayout", "check_sparse", "decode", "encode",
    "error_bound", "sparse_allreduce_bytes", "sparse_allreduce_sum", "sparse_nbytes",
]
