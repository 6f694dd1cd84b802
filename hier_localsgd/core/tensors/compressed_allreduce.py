"""An all-reduce whose wire bytes are the compressed bytes (issue #13 §3).

The scheme is torchft's ``allreduce_quantized`` (torchft/collectives.py), on any
device and without triton, with a per-block scale instead of a per-row one:

1. each rank quantizes its (error-fed-back) tensor blockwise
   (:mod:`hier_localsgd.core.tensors.compress`), padded so that it splits into ``W`` shards of
   whole blocks; shard ``j`` is packed as ``[codes | fp32 scales]`` bytes;
2. all-to-all: rank ``j`` receives every rank's quantized shard ``j``;
3. rank ``j`` dequantizes the ``W`` versions of its shard, sums them in fp32 in
   rank order (averages for ``avg``) and quantizes the result once more;
4. all-gather of the quantized reduced shards; every rank — the owner included —
   dequantizes the same bytes, so every rank ends with the same bits.

Wire bytes per rank (payload, headers aside): the all-to-all sends ``W−1`` packed
shards, the all-gather sends its reduced shard to the ``W−1`` others, so
``2·(W−1)·shard_bytes`` with ``shard_bytes ≈ (n/W)·(1 + 4/block)``
(:func:`compressed_allreduce_bytes`), against ``2·(W−1)·(n/W)·4`` for an fp32 ring
all-reduce (:func:`fp32_ring_allreduce_bytes`): 3.94× fewer with ``block=256``.

Error: each input is quantized once (bounded as its format says) and the reduced
shard once more (:func:`mean_error_bound`). Both can be error-fed back: the first by
each rank's ``error_feedback`` (its whole tensor), the second by ``shard_feedback``
(the shard it owns). With both, over committed rounds
``Σ result = Σ true mean − mean_r(residual_r) − shard residuals`` (for ``avg``), so
the accumulated result stays within about one step of each quantizer of the true one.

The two exchanges are the process group's ``alltoall_base`` and ``allgather``; the
project's level group (core/links/link.py) runs them as concurrent point-to-point sends and
receives, which on a shaped link move their bytes at close to the link's rate where
Gloo's own alltoall and allgather did not (docs/benchmarks.md). The packed bytes travel
as uint8 because Gloo has no float8 type.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, List, Optional

import torch
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions

from hier_localsgd.core.tensors.compress import (
    _CODE_DTYPE,
    DEFAULT_BLOCK,
    ErrorFeedback,
    Quantized,
    _validate,
    dequantize,
    error_bound,
    quantize,
)

AVG = "avg"
SUM = "sum"
_SCALE_BYTES = 4


@dataclass(frozen=True)
class ShardLayout:
    """How ``numel`` elements split over ``world`` ranks in whole blocks.

    Attributes:
        shard_elems: elements per shard (a multiple of ``block``; the last shards hold
            zero padding when ``numel`` does not fill them).
        shard_blocks: blocks (and scales) per shard.
        shard_bytes: packed bytes of one quantized shard: codes then fp32 scales.
    """

    numel: int
    world: int
    block: int
    shard_elems: int
    shard_blocks: int
    shard_bytes: int


def shard_layout(numel: int, world: int, block: int) -> ShardLayout:
    if world < 1 or numel < 0:
        raise ValueError(f"shard_layout: numel {numel}, world {world}")
    shard_blocks = max(1, math.ceil(math.ceil(numel / world) / block))
    shard_elems = shard_blocks * block
    return ShardLayout(numel, world, block, shard_elems, shard_blocks, shard_elems + shard_blocks * _SCALE_BYTES)


def compressed_allreduce_bytes(n_elems: int, world: int, fmt: str, block: int = DEFAULT_BLOCK) -> int:
    """Payload bytes one rank sends in :func:`compressed_allreduce` (padding included):
    ``W−1`` packed shards in the all-to-all and ``W−1`` in the all-gather. Both
    formats use one byte per element; ``fmt`` is validated."""
    _validate(fmt, block)
    lay = shard_layout(n_elems, world, block)
    return 2 * (world - 1) * lay.shard_bytes


def fp32_ring_allreduce_bytes(n_elems: int, world: int) -> int:
    """Payload bytes one rank sends in a ring all-reduce of fp32 (reduce-scatter then
    all-gather, ``W−1`` chunks of ``n/W`` elements each)."""
    return 2 * (world - 1) * math.ceil(n_elems / world) * 4


@dataclass(frozen=True)
class CompressedAllreduceResult:
    """What one call did on this rank.

    Attributes:
        bytes_sent: payload bytes this rank sent (all-to-all rows for the other ranks
            plus the ``W−1`` chunks Gloo's ring all-gather forwards), counted from the
            buffers handed to the collectives.
        bytes_received: payload bytes this rank received (the same, by symmetry).
        alltoall_s, allgather_s: wall time of the two collectives (wait included).
        total_s: wall time of the whole call.
        ok: both collectives completed (always True unless a ``wait`` hook reported a
            failure; then ``tensor`` was left unchanged).
    """

    bytes_sent: int
    bytes_received: int
    alltoall_s: float
    allgather_s: float
    total_s: float
    ok: bool = True


def _pack(q: Quantized, lay: ShardLayout) -> torch.Tensor:
    """(W, shard_bytes) uint8: row j = shard j's codes then its scales."""
    codes = q.codes.view(torch.uint8).view(lay.world, lay.shard_elems)
    scales = q.scales.contiguous().view(torch.uint8).view(lay.world, lay.shard_blocks * _SCALE_BYTES)
    return torch.cat([codes, scales], dim=1).contiguous()


def _unpack(rows: torch.Tensor, fmt: str, lay: ShardLayout, numel: int) -> Quantized:
    """Inverse of :func:`_pack` for ``rows`` (R, shard_bytes) -> a Quantized of R shards."""
    r = rows.shape[0]
    codes = rows[:, : lay.shard_elems].contiguous().view(_CODE_DTYPE[fmt]).reshape(-1)
    scales = rows[:, lay.shard_elems :].contiguous().view(torch.float32).reshape(-1)
    return Quantized(codes=codes, scales=scales, numel=min(numel, r * lay.shard_elems), fmt=fmt, block=lay.block)


def _wait(work, timeout: timedelta, what: str) -> None:
    # Work.wait raises on a peer's failure or on its timeout; the op's own timeout is
    # set too (Gloo honours it inside the transport), so neither side waits forever.
    if not work.wait(timeout):
        raise RuntimeError(f"compressed_allreduce: {what} did not complete within {timeout}")


def _encode(tensor: torch.Tensor, fmt: str, block: int, lay: "ShardLayout", world: int, error_feedback: Optional[ErrorFeedback]) -> Quantized:
    """This rank's contribution, quantized over whole shards (zero padding completes them)."""
    n = tensor.numel()
    total = world * lay.shard_elems
    if error_feedback is not None:
        # encode adds the residual to the real elements and quantizes them; its blocks
        # are the padded tensor's first blocks (shards are whole blocks, padding only
        # completes the last block with zeros), and the remaining blocks are all padding:
        # code 0, scale 0
        q_real = error_feedback.encode(tensor)
        codes = torch.zeros(total, dtype=q_real.codes.dtype, device=tensor.device)
        codes[: q_real.codes.numel()] = q_real.codes
        scales = torch.zeros(world * lay.shard_blocks, dtype=torch.float32, device=tensor.device)
        scales[: q_real.scales.numel()] = q_real.scales
        q = Quantized(codes=codes, scales=scales, numel=total, fmt=fmt, block=block)
    elif n == total:
        q = quantize(tensor, fmt, block)  # whole shards already: read without a copy
    else:
        padded = torch.zeros(total, dtype=torch.float32, device=tensor.device)
        padded[:n] = tensor.view(-1)
        q = quantize(padded, fmt, block)
    return q


def _reduce_own_shard(
    recv: torch.Tensor, fmt: str, block: int, lay: "ShardLayout", world: int, rank: int, n: int, op: str,
    shard_feedback: Optional[ErrorFeedback], fold_feedback: Optional[ErrorFeedback],
) -> Quantized:
    """Dequantizes and sums the shard this rank owns (fp32, in rank order: the owner alone
    computes it, so the order only has to be fixed, not agreed) and requantizes it, with
    the second quantization's error kept (``shard_feedback``) or folded into this
    sender's own residual (``fold_feedback``)."""
    versions = dequantize(_unpack(recv, fmt, lay, world * lay.shard_elems)).view(world, lay.shard_elems)
    acc = versions[0].clone()
    for j in range(1, world):
        acc += versions[j]
    if op == AVG:
        acc /= world
    if shard_feedback is not None:
        owner = (n, world, rank)
        if shard_feedback.owner != owner:
            shard_feedback.reset()
            shard_feedback.owner = owner
        q_mine = shard_feedback.encode(acc)
    else:
        q_mine = quantize(acc, fmt, block)
        if fold_feedback is not None:
            err = acc - dequantize(q_mine)
            if op == AVG:
                err *= world
            fold_feedback.fold(rank * lay.shard_elems, err, n)
    return q_mine


def compressed_allreduce(
    tensor: torch.Tensor,
    pg: ProcessGroup,
    fmt: str,
    block: int = DEFAULT_BLOCK,
    op: str = AVG,
    timeout: timedelta = timedelta(seconds=60),
    error_feedback: Optional[ErrorFeedback] = None,
    shard_feedback: Optional[ErrorFeedback] = None,
    fold_feedback: Optional[ErrorFeedback] = None,
    wait: Optional[Callable[[object, str], bool]] = None,
    remaining: Optional[Callable[[], timedelta]] = None,
    rank: Optional[int] = None,
    world: Optional[int] = None,
) -> CompressedAllreduceResult:
    """All-reduces ``tensor`` in place over ``pg`` with quantized payloads.

    (Over 80 lines for its argument documentation; the encoding and the shard
    reduction are :func:`_encode` and :func:`_reduce_own_shard`.)

    Args:
        tensor: contiguous fp32 tensor (any shape, read flat), on the device ``pg``
            works on (CPU for Gloo). Every rank passes the same number of elements.
        pg: a c10d ``ProcessGroup`` (plain Gloo, or torchft's wrappers, which expose
            the same ``alltoall_base``/``allgather`` methods).
        fmt, block: quantization format and block size (:mod:`hier_localsgd.core.tensors.compress`);
            every rank must pass the same ones.
        op: ``avg`` or ``sum``.
        timeout: bound of each of the two collectives (so the call returns or raises
            within about twice this).
        error_feedback: this rank's residual; if given, ``tensor + residual`` is what is
            quantized and the new residual is staged — the caller commits it when the
            round commits, or rolls it back (:class:`ErrorFeedback`).
        shard_feedback: this rank's residual of the *second* quantization (of the
            reduced shard it owns); staged and committed/rolled back like
            ``error_feedback``. It is the error of shard ``rank`` of a ``world``-way
            split, so it is reset here when ``(numel, world, rank)`` changed (the
            quorum gave this rank another shard: a bounded, one-off loss).
        fold_feedback: instead of a shard residual, fold the error of the second
            quantization into this sender's own residual (usually ``error_feedback``;
            given even in a round this rank sends nothing): on the shard this rank owns,
            the error times ``world`` for ``avg`` (times 1 for ``sum``), so that it is
            re-sent in this rank's next contribution. Over committed rounds then
            ``Σ result = Σ true + (Σ_r residual_r,0 − Σ_r residual_r,T)`` (divided by
            ``world`` for ``avg``): one residual per sender, whatever the shard
            assignment (:meth:`ErrorFeedback.fold`). Exclusive with ``shard_feedback``.
        wait: a hook that waits for each collective's ``Work`` (and the name of the
            collective) and returns whether it completed; on False the call goes on
            with the next collective anyway (every rank runs both, so a failure on one
            rank never leaves its peers waiting), leaves ``tensor`` unchanged and
            returns ``ok=False``. Default: wait up to ``timeout`` and raise.
        remaining: if given, each collective's own timeout is ``remaining()`` at the
            time it is issued (a phase deadline) instead of ``timeout``.
        rank, world: this rank's place in ``pg`` (default ``pg.rank()``, ``pg.size()``;
            wrappers that do not know them pass them).

    Returns:
        byte counts and timings of this rank (:class:`CompressedAllreduceResult`).

    Failure semantics: a peer that fails or does not arrive makes a collective raise
    (RuntimeError from Gloo, or ours on timeout) within ``timeout``; ``tensor`` is
    then left unchanged (it is written only after the all-gather completed), and the
    staged residuals (``error_feedback``, ``shard_feedback``) must be rolled back by
    the caller. Non-finite
    inputs do not raise (peers would be left waiting): their blocks come out NaN on
    every rank.

    Raises:
        ValueError: bad ``fmt``/``block``/``op`` or a non-fp32 / non-contiguous tensor.
        RuntimeError: the collective failed or timed out.
    """
    _validate(fmt, block)
    if op not in (AVG, SUM):
        raise ValueError(f"compressed_allreduce: op {op!r}, expected {AVG!r} or {SUM!r}")
    if tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError(f"compressed_allreduce: expected a contiguous fp32 tensor, got {tensor.dtype}")
    if fold_feedback is not None and shard_feedback is not None:
        raise ValueError("compressed_allreduce: fold_feedback and shard_feedback are exclusive")
    started = time.perf_counter()
    rank = pg.rank() if rank is None else rank
    world = pg.size() if world is None else world
    ok = True

    def run(work: object, what: str) -> None:
        nonlocal ok
        if wait is None:
            _wait(work, timeout, what)
        elif not wait(work, what):
            ok = False

    def op_timeout() -> timedelta:
        return timeout if remaining is None else remaining()
    n = tensor.numel()
    lay = shard_layout(n, world, block)
    q = _encode(tensor, fmt, block, lay, world, error_feedback)
    send = _pack(q, lay)
    recv = torch.empty_like(send)

    a2a = AllToAllOptions()
    a2a.timeout = op_timeout()
    t0 = time.perf_counter()
    run(pg.alltoall_base(recv, send, [], [], a2a), "all-to-all")
    alltoall_s = time.perf_counter() - t0

    q_mine = _reduce_own_shard(recv, fmt, block, lay, world, rank, n, op, shard_feedback, fold_feedback)
    mine = _pack(q_mine, shard_layout(lay.shard_elems, 1, block))[0]

    gathered: List[torch.Tensor] = [torch.empty_like(mine) for _ in range(world)]
    ag = AllgatherOptions()
    ag.timeout = op_timeout()
    t0 = time.perf_counter()
    run(pg.allgather([gathered], [mine], ag), "all-gather")
    allgather_s = time.perf_counter() - t0

    if ok:
        result = dequantize(_unpack(torch.stack(gathered), fmt, lay, n))
        tensor.view(-1).copy_(result)
    # all-to-all: the W-1 rows not addressed to me; all-gather: my reduced shard of
    # mine.numel() bytes to each of the W-1 others (and as many received)
    sent = sum(send[j].numel() for j in range(world) if j != rank) + (world - 1) * mine.numel()
    received = sum(recv[j].numel() for j in range(world) if j != rank) + (world - 1) * mine.numel()
    return CompressedAllreduceResult(sent, received, alltoall_s, allgather_s, time.perf_counter() - started, ok)


def mean_error_bound(inputs: List[torch.Tensor], fmt: str, block: int, world: int) -> torch.Tensor:
    """Per element, the largest ``|compressed_allreduce(avg) − true mean|`` without
    error feedback: the mean of each input's own quantization bound, plus the bound of
    the second quantization of a value of at most that size (its block's absmax is at
    most the largest |mean| + first-stage error in the block)."""
    n = inputs[0].numel()
    lay = shard_layout(n, world, block)
    first = torch.stack([error_bound(x, quantize(x, fmt, block)) for x in inputs]).mean(0)
    mean = torch.stack([x.reshape(-1).float() for x in inputs]).mean(0)
    upper = mean.abs() + first
    padded = torch.zeros(world * lay.shard_elems)
    padded[:n] = upper
    # the reduced value's block absmax is at most the block max of `upper`
    # (for fp8 the bound also grows with the element itself, and |reduced| <= upper)
    second = error_bound(padded, quantize(padded, fmt, block))[:n]
    return first + second
