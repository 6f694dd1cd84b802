"""Compressed outer payloads in the hierarchy (``sync.outer.compression``, issue #13 §3).

With ``int8`` or ``fp8`` the leaders' OUTER_REDUCE is
:func:`hier_localsgd.core.tensors.compressed_allreduce.compressed_allreduce` (all-to-all of
quantized shards, dequantize and sum, requantize, all-gather) instead of an fp32 ring
all-reduce, so the slow links carry about a quarter of the bytes
(docs/compression.md). With ``topk2`` (issue #29) it is
:func:`hier_localsgd.core.tensors.sparse.sparse_allreduce_sum`: each leader sends the
``topk`` largest of every chunk of ``compression_block`` elements with 2-bit values
(about 114× fewer bytes than fp32 at 4 of 256), the others' payloads are decoded and
summed in rank order, so there is no second quantization to fold. Every cluster keeps one **error-feedback residual**
(:class:`OuterCompression`), the part of its pseudo-gradients the quantizations have
not delivered yet:

* the leaders *sum* their weighted pseudo-gradients and divide by the round's total
  weight ``T``; the residual is kept in units of that applied mean (``ρ = e / T``),
  so encoding sends ``w·x + T·ρ`` and stages ``ρ' = e' / T`` with ``e'`` the new
  quantization error; the requantization error of the reduced shard the leader owns
  is folded into ``e'`` too (:meth:`ErrorFeedback.fold`). Per round the applied update
  is then ``Σ_c w_c·x_c / T + Σ_c ρ_c − Σ_c ρ'_c``, so over committed rounds it
  telescopes exactly to the uncompressed one plus ``Σ_c ρ_c(0) − Σ_c ρ_c(end)``, even
  when the total weight changes between rounds: within about one quantization step of
  each stage, for any number of rounds (tests/test_outer_compression.py checks the
  identity on a real hierarchy);
* it is **committed only with the outer round** (the leader's OUTER_COMMIT vote; with the
  asynchronous level, the server's answer that the push merged: :meth:`encode_push`) and
  rolled back on every other path, so a failed round never changes it;
* it is **the cluster's replicated state**, not the leader's alone: the leader sends it
  (fp32, reliable ``control`` traffic on the cluster's fast link) after the model in
  BROADCAST, every member adopts it with the round's inner commit, the consistency
  guard compares and resyncs it with the rest of the cluster's committed state, and a
  healing replica group receives it from its donor (and a durable checkpoint holds it).
  So when leadership moves to another replica group of the cluster, or a leader
  restarts and heals, the new leader starts from the same residual. Cost: one fp32
  copy of the model slice per outer round on the fast link, to each non-leader.
* it is **not** part of the outer level's state: clusters' residuals differ, so it stays
  out of the outer guard's fingerprint and out of what a leader serves another
  cluster's healing leader. A cluster whose outer level heals to a newer global model
  contributes weight 0 that round (it sends zeros and encodes nothing) and keeps its
  residual: the residual is the undelivered part of work that *was* committed, and it
  reaches the global model with the cluster's next contribution. Only a cluster all of
  whose replica groups restart at once loses it (zeros: at most one quantization error
  per element, once).

With the overlapped outer stage (``sync.outer.delay``) the stage works on a copy
(:meth:`OuterCompression.copy`), committed inside the stage and adopted, like the
stage's outer level, at the apply round; a dropped stage simply forgets its copy.
"""

from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import torch

from hier_localsgd import costs
from hier_localsgd.core.ft.comm import LevelComm
from hier_localsgd.core.tensors.fragments import Ranges, gather, scatter_
from hier_localsgd.core.runtime.choices import DEFAULT_BLOCK, DEFAULT_TOPK, FP8, INT8, MAX_CHUNK, TOPK2
from hier_localsgd.core.tensors.compress import ErrorFeedback, Quantized, check_format, dequantize, quantized_nbytes
from hier_localsgd.core.tensors.compressed_allreduce import compressed_allreduce_bytes
from hier_localsgd.core.tensors.sparse import check_sparse, sparse_allreduce_bytes, sparse_nbytes
from hier_localsgd.core.tensors.sparse import decode as sparse_decode, encode as sparse_encode
from hier_localsgd.core.links.stats import PAYLOAD
from hier_localsgd.sync.sections import COMPRESSIONS, NONE

logger = logging.getLogger(__name__)



class OuterCompression:
    """One cluster's compressed outer reduce and its committed error-feedback residual.

    Args:
        fmt: ``int8``, ``fp8`` or ``topk2`` (sparse: the ``topk`` largest of every chunk of
            ``block`` elements, 2-bit values; core/tensors/sparse.py).
        block: elements per quantization block (``topk2``: per chunk).
        numel: elements of this rank's slice of the model.
        topk: elements kept per chunk with ``topk2``.

    Raises:
        ValueError: bad ``fmt``/``block``/``topk``.
        FormatUnavailable: fp8 cannot be cast on this machine (checked once, here).
    """

    def __init__(self, fmt: str, block: int, numel: int, topk: int = DEFAULT_TOPK) -> None:
        if fmt == TOPK2:
            check_sparse(block, topk)
        else:
            check_format(fmt, block)
        self.fmt, self.block, self.numel, self.topk = fmt, block, numel, topk
        # committed; a stable tensor (the guard resyncs it in place)
        self.residual = torch.zeros(numel, dtype=torch.float32)
        self._ef = ErrorFeedback(fmt, block)
        self._total = 1.0
        self._ranges: Optional[Ranges] = None  # the fragment the staged residual covers

    def copy(self) -> "OuterCompression":
        """An independent copy of the committed state (the overlapped stage's)."""
        new = OuterCompression(self.fmt, self.block, self.numel, self.topk)
        new.residual.copy_(self.residual)
        return new

    def reduce(self, comm: LevelComm, grad: torch.Tensor, weight: float, total: float, ranges: Optional[Ranges] = None) -> bool:
        """Sums ``grad`` (this cluster's weighted pseudo-gradient; ignored at weight 0,
        where zeros are sent and nothing is encoded) across the outer quorum in place;
        ``total``: the round's total weight, which the caller divides the sum by. Stages
        the new residual. ``ranges``: ``grad`` is one outer fragment's elements
        (core/tensors/fragments.py); only their residual is used and staged. Returns False on
        failure (``grad`` then unchanged, the commit vote fails; the caller rolls back)."""
        self._ef.rollback()
        mine = self.residual if ranges is None else gather(self.residual, ranges)
        self._ef.residual = mine * total  # in units of the sum this round sends
        self._total, self._ranges = total, ranges
        if weight == 0:
            grad.zero_()
        # The codecs encode a contiguous fp32 host tensor, beside the residual: a bf16 model
        # (train.param_dtype) or a pseudo-gradient on a GPU goes through an fp32 host copy.
        host = grad.device.type == "cpu" and grad.dtype == torch.float32 and grad.is_contiguous()
        work = grad if host else grad.detach().to("cpu", torch.float32).contiguous()
        if self.fmt == TOPK2:  # nothing to fold: the sum of the decoded payloads is exact
            ok = comm.sparse_allreduce_sum(work, PAYLOAD, self.block, self.topk, self._ef if weight != 0 else None)
        else:
            ok = comm.compressed_allreduce_sum(work, PAYLOAD, self.fmt, self.block, self._ef if weight != 0 else None, self._ef)
        if ok and work is not grad:
            grad.copy_(work)
        return ok

    def encode_push(self, delta: torch.Tensor) -> Dict[str, object]:
        """The asynchronous outer level's push (async_outer.py): encodes ``delta`` (this
        cluster's pseudo-gradient, unweighted: the server weighs it) plus the committed
        residual, stages the new residual in the same units, and returns the request's
        payload (:func:`decode_push` reads it). The push's answer decides: merged
        (weight > 0) :meth:`commit`, anything else :meth:`rollback`."""
        self._ef.rollback()
        self._ef.residual = self.residual.clone()
        self._total, self._ranges = 1.0, None
        x = delta.detach().reshape(-1).to("cpu", torch.float32)
        head: Dict[str, object] = {"fmt": self.fmt, "block": self.block, "numel": x.numel()}
        if self.fmt == TOPK2:
            payload = self._ef.encode_with(x, lambda v: sparse_encode(v, self.block, self.topk))
            return {**head, "topk": self.topk, "payload": payload}
        q = self._ef.encode(x)
        return {**head, "codes": q.codes, "scales": q.scales}

    def commit(self) -> None:
        """The outer round committed: its staged residual becomes the state."""
        if self._ef.has_staged:
            self._ef.commit()
            assert self._ef.residual is not None
            if self._ranges is None:
                self.residual.copy_(self._ef.residual / self._total)
            else:
                scatter_(self.residual, self._ranges, self._ef.residual / self._total)
        self._ef.residual = None

    def rollback(self) -> None:
        """The outer round failed: keep the committed residual."""
        self._ef.rollback()

    @torch.no_grad()
    def load(self, residual: torch.Tensor) -> None:
        self._ef.rollback()
        self.residual.copy_(residual)

    def state_dict(self) -> Dict[str, object]:
        return {"fmt": self.fmt, "block": self.block, "residual": self.residual.clone()}

    def load_state_dict(self, sd: Optional[Dict[str, object]], source: str) -> None:
        """Loads a donor's (or a checkpoint's) residual; one written for another format,
        block or size, or none at all, resets it to zeros (a bounded, one-off loss)."""
        r = sd.get("residual") if isinstance(sd, dict) else None
        if (
            isinstance(sd, dict) and sd.get("fmt") == self.fmt and sd.get("block") == self.block
            and isinstance(r, torch.Tensor) and r.numel() == self.numel
        ):
            self.load(r)
            return
        logger.warning("outer compression: %s has no residual for %s/block %d/%d elements; starting from zeros", source, self.fmt, self.block, self.numel)
        self.load(torch.zeros(self.numel))


def payload_bytes(numel: int, world: int, fmt: str, block: int, topk: int = DEFAULT_TOPK) -> int:
    """Payload bytes one leader sends in one compressed outer reduce of ``numel`` elements
    over ``world`` leaders (padding included): the one formula the summary's expected
    figure and the planner use."""
    if fmt == TOPK2:
        return sparse_allreduce_bytes(numel, world, block, topk)
    return compressed_allreduce_bytes(numel, world, fmt, block)


def push_bytes(numel: int, fmt: str, block: int, topk: int = DEFAULT_TOPK) -> int:
    """Bytes of one asynchronous push's pseudo-gradient of ``numel`` elements
    (:meth:`OuterCompression.encode_push`; ``none``: fp32): the planner's formula."""
    if fmt == NONE:
        return 4 * numel
    return sparse_nbytes(numel, block, topk) if fmt == TOPK2 else quantized_nbytes(numel, fmt, block)


def decode_push(d: object, numel: int) -> torch.Tensor:
    """The fp32 pseudo-gradient of a compressed push (:meth:`OuterCompression.encode_push`)
    for a model of ``numel`` elements: what the global model server merges.

    Raises:
        ValueError: one line naming what is wrong (an unknown format, a size or dtype that
            does not match the format's layout): the push is refused, nothing is merged."""
    if not isinstance(d, dict):
        raise ValueError(f"delta: expected a tensor or a compressed payload, got {type(d).__name__}")
    fmt, block = d.get("fmt"), d.get("block")
    if fmt not in (INT8, FP8, TOPK2):
        raise ValueError(f"delta.fmt: {fmt!r} is not a push format (int8, fp8, topk2)")
    # No upper bound for int8/fp8: the codes' count must match, and they came in the body.
    if type(block) is not int or block < 1 or (fmt == TOPK2 and block > MAX_CHUNK):
        raise ValueError(f"delta.block: {block!r} is not a block size for {fmt}")
    if type(d.get("numel")) is not int or d["numel"] != numel:
        raise ValueError(f"delta.numel: {d.get('numel')!r}, the model has {numel} elements")
    if fmt == TOPK2:
        k, payload = d.get("topk"), d.get("payload")
        if type(k) is not int or not 1 <= k <= block:
            raise ValueError(f"delta.topk: {k!r} is not between 1 and delta.block={block}")
        if not isinstance(payload, torch.Tensor) or payload.dim() != 1 or payload.dtype != torch.uint8 or payload.numel() != sparse_nbytes(numel, block, k):
            raise ValueError(f"delta.payload: expected {sparse_nbytes(numel, block, k)} uint8 bytes for {numel} elements, chunk {block}, k {k}")
        if int(payload[: -(-numel // block) * k].max()) >= block:  # the positions come first, one byte each
            raise ValueError(f"delta.payload: a position outside its chunk of {block}")
        return sparse_decode(payload, numel, block, k)
    codes, scales = d.get("codes"), d.get("scales")
    nblocks = -(-numel // block)
    want = torch.float8_e4m3fn if fmt == FP8 else torch.int8
    if not (isinstance(codes, torch.Tensor) and codes.dtype == want and codes.dim() == 1 and codes.numel() == nblocks * block):
        raise ValueError(f"delta.codes: expected {nblocks * block} {want} codes for {numel} elements in blocks of {block}")
    if not (isinstance(scales, torch.Tensor) and scales.dtype == torch.float32 and scales.dim() == 1 and scales.numel() == nblocks):
        raise ValueError(f"delta.scales: expected {nblocks} float32 scales")
    return dequantize(Quantized(codes=codes, scales=scales, numel=numel, fmt=fmt, block=block))


def down_format(compression: str, enabled: bool, block: int) -> Optional[Tuple[str, int]]:
    """The asynchronous level's format for the global model's updates on the way down
    (``sync.async_outer.compress_down``, global_model.py): fp8 with ``fp8`` pushes, int8
    with ``int8`` or ``topk2`` (the server's update is dense: momentum spreads a sparse
    push over every element; block ``DEFAULT_BLOCK`` then, topk2's block being its chunk);
    None (the model in fp32) without compression or with the switch off."""
    if not enabled or compression == NONE:
        return None
    return (FP8, block) if compression == FP8 else (INT8, block if compression == INT8 else DEFAULT_BLOCK)


def encode_update(q: Quantized) -> Dict[str, object]:
    """One quantized global-model update as a push's payload is laid out (:func:`decode_push`
    reads both): the wire form of an answer's ``updates``."""
    return {"fmt": q.fmt, "block": q.block, "numel": q.numel, "codes": q.codes, "scales": q.scales}


def latency_hops(world: int, fmt: str) -> int:
    """Sequential one-way trips of one compressed outer reduce: an all-to-all and an
    all-gather (``int8``/``fp8``), or an all-gather alone (``topk2``) (costs.latency_hops)."""
    ops = ("allgather",) if fmt == TOPK2 else ("alltoall", "allgather")
    return sum(costs.latency_hops(op, world) for op in ops)


def build(fmt: str, block: int, numel: int, topk: int = DEFAULT_TOPK) -> Optional[OuterCompression]:
    """The cluster's compression state for ``sync.outer.compression`` (None for ``none``)."""
    return None if fmt == NONE else OuterCompression(fmt, block, numel, topk)


__all__ = ["COMPRESSIONS", "DEFAULT_BLOCK", "NONE", "OuterCompression", "build", "decode_push", "down_format", "encode_update", "latency_hops", "payload_bytes", "push_bytes"]
