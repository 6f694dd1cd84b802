"""Blockwise quantization of outer payloads, with error feedback (issue #13 §3).

A flat fp32 tensor is cut into blocks of ``block`` elements; each block gets one
fp32 scale and its elements are stored as one byte each:

``int8``
    symmetric absmax: ``scale = max|x| / 127``, ``q = round(x / scale)`` (round to
    nearest, ties to even) clamped to ``[-127, 127]``; ``x̂ = q · scale``.
    Bound per element: ``|x − x̂| ≤ scale / 2`` (plus fp32 rounding of the division
    and the product, below ``scale · 2⁻¹⁶``; :func:`error_bound` includes it).
    One quantization step is ``scale``.

``fp8``
    ``torch.float8_e4m3fn`` (4 exponent bits, 3 mantissa bits, largest finite 448):
    ``scale = max|x| / 448``, ``q = fp8(x / scale)`` (torch's cast rounds to nearest
    even); ``x̂ = float(q) · scale``. Bound per element, with ``s = |x| / scale``:
    ``|x − x̂| ≤ scale · max(2⁻⁴ · s, 2⁻¹⁰)`` — half a unit in the last place of a
    3-bit mantissa is 2⁻⁴ relative for normal numbers (``s ≥ 2⁻⁶``), and subnormals
    are spaced 2⁻⁹ apart. :func:`error_bound` adds the same fp32 slack as int8.
    Casting to and from ``float8_e4m3fn`` works on CPU in torch 2.13 with plain
    ATen kernels: no triton is imported (checked by :func:`check_format`, which
    raises :class:`FormatUnavailable` where a device cannot do it).

A block of zeros gets scale 0 and decodes to zeros. A block holding a NaN or an
infinity gets a NaN scale, so the whole block decodes to NaN: a compressed
collective then propagates a non-finite value like an fp32 all-reduce does (the
caller's guard sees it) instead of raising on one rank and leaving its peers
waiting for their timeout.

Wire size of ``n`` elements: ``ceil(n / block)`` blocks, each ``block`` bytes of
codes plus 4 bytes of scale (:func:`quantized_nbytes`); with ``block=256`` that is
1.0156 bytes per element, 3.94× less than fp32.

Error feedback (:class:`ErrorFeedback`): the quantization error of round ``t`` is
added to round ``t+1``'s input, so what is applied over many rounds telescopes:
``Σ applied = Σ true − residual_final``, and the residual is bounded by one
quantization error of the last round. The residual is staged by each encode and
only becomes the state after :meth:`ErrorFeedback.commit` (the outer round
committed); a failed round calls :meth:`ErrorFeedback.rollback`, because its
quantized payload was never applied and subtracting its error would count it twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from hier_localsgd.core.runtime.choices import DEFAULT_BLOCK, FORMATS, FP8, INT8, TOPK2, FormatUnavailable

# Largest code magnitude the absmax of a block is mapped to.
_QMAX = {INT8: 127.0, FP8: 448.0}
_CODE_DTYPE = {INT8: torch.int8, FP8: torch.float8_e4m3fn}
_SCALE_BYTES = 4  # fp32 scales: exact, and the same bits on every rank
# fp32 slack in error_bound: the division x/scale and the product q*scale each round
# once (relative 2^-24, on values up to QMAX·scale); 2^-16·scale covers both.
_FP32_SLACK = 2.0**-16


def check_format(fmt: str, block: int, device: torch.device | str = "cpu") -> None:
    """Validates ``fmt`` and ``block`` and proves the format works on ``device``.

    For fp8 it casts a few known values to ``float8_e4m3fn`` and back on ``device``
    and compares with the exact e4m3 values; a build or device without the cast
    raises :class:`FormatUnavailable` with the reason (rather than failing in the
    middle of a collective, where the peers would wait for their timeout).

    Raises:
        ValueError: unknown format or a block size < 1.
        FormatUnavailable: fp8 cannot be cast on ``device``.
    """
    _validate(fmt, block)
    if fmt == FP8:
        probe = torch.tensor([1.0, -0.3, 448.0, 2.0**-9, 17.0], device=device)
        # exact e4m3fn values: 0.3 -> 0.3125 (nearest of 0.28125/0.3125), 17 -> 16 (tie to even)
        expected = [1.0, -0.3125, 448.0, 2.0**-9, 16.0]
        try:
            back = probe.to(torch.float8_e4m3fn).to(torch.float32).cpu().tolist()
        except Exception as e:  # noqa: BLE001 - any failure means "not available here"
            raise FormatUnavailable(
                f"fp8 (float8_e4m3fn) cast is not available on {device} with torch {torch.__version__}: {e}"
            ) from e
        if back != expected:
            raise FormatUnavailable(f"fp8 cast on {device} gave {back}, expected e4m3fn values {expected}")


def _validate(fmt: str, block: int) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"compression format {fmt!r}: expected one of {FORMATS}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"compression block {block!r}: expected an int >= 1")


@dataclass(frozen=True)
class Quantized:
    """A quantized flat tensor.

    Attributes:
        codes: one byte per element, ``nblocks * block`` of them (the tail of the last
            block is padding, encoded from zeros); dtype int8 or float8_e4m3fn.
        scales: fp32, one per block.
        numel: elements of the original tensor.
        fmt: ``int8`` or ``fp8``.
        block: elements per block.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    fmt: str
    block: int

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()


def quantized_nbytes(numel: int, fmt: str, block: int) -> int:
    """Bytes of codes plus scales for ``numel`` elements (what :class:`Quantized` holds)."""
    _validate(fmt, block)
    nblocks = math.ceil(numel / block)
    return nblocks * block + nblocks * _SCALE_BYTES


def quantize(x: torch.Tensor, fmt: str, block: int = DEFAULT_BLOCK) -> Quantized:
    """Quantizes a tensor (flattened) blockwise; see the module docstring for the bounds.

    Raises:
        ValueError: unknown format, bad block, or ``x`` not floating point.
    """
    _validate(fmt, block)
    if not x.is_floating_point():
        raise ValueError(f"quantize: expected a floating point tensor, got {x.dtype}")
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    nblocks = math.ceil(n / block)
    if n == nblocks * block:
        blocks = flat.view(nblocks, block)  # no copy: the callers pad to whole blocks
    else:
        padded = torch.zeros(nblocks * block, dtype=torch.float32, device=flat.device)
        padded[:n] = flat
        blocks = padded.view(nblocks, block)
    qmax = _QMAX[fmt]
    # max and -min instead of abs().amax(): no full-size temporary. Both propagate NaN,
    # and an infinity makes the absmax infinite, so `finite` flags every bad block.
    absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg())
    finite = torch.isfinite(absmax)
    scales = torch.where(finite, absmax / qmax, torch.full_like(absmax, float("nan")))
    # a zero block (or a non-finite one) is divided by 1: its codes are 0 either way
    divisor = torch.where(finite & (absmax > 0), scales, torch.ones_like(scales))
    scaled = blocks / divisor.unsqueeze(1)
    if not bool(finite.all()):  # rare: zero the codes of non-finite blocks (NaN has no int8 code)
        scaled[~finite] = 0.0
    # clamp: absmax/qmax rounds, so x/scale may exceed qmax by an ulp
    scaled.clamp_(-qmax, qmax)
    if fmt == INT8:
        codes = scaled.round_().to(torch.int8)
    else:
        codes = scaled.to(torch.float8_e4m3fn)
    return Quantized(codes=codes.reshape(-1), scales=scales, numel=n, fmt=fmt, block=block)


_FP8_LUTS: Dict[torch.device, torch.Tensor] = {}


def _fp8_to_fp32(codes: torch.Tensor) -> torch.Tensor:
    # torch's CPU cast from float8_e4m3fn measured about twice as slow as a gather from
    # a 256-entry table (docs/compression.md); the table is built from that same cast,
    # so it gives the same bits (NaN codes included). A benign race between threads
    # only builds the table twice.
    lut = _FP8_LUTS.get(codes.device)
    if lut is None:
        lut = torch.arange(256, dtype=torch.uint8, device=codes.device).view(torch.float8_e4m3fn).to(torch.float32)
        _FP8_LUTS[codes.device] = lut
    return lut.index_select(0, codes.reshape(-1).view(torch.uint8).to(torch.int32)).view(codes.shape)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 flat tensor ``q`` encodes (``numel`` elements). Deterministic: the same
    codes and scales give the same bits on every rank."""
    nblocks = q.scales.numel()
    codes = q.codes.view(nblocks, q.block)
    values = (_fp8_to_fp32(codes) if q.fmt == FP8 else codes.to(torch.float32)).mul_(q.scales.unsqueeze(1))
    return values.reshape(-1)[: q.numel]


def _per_element_scale(q: Quantized) -> torch.Tensor:
    return q.scales.repeat_interleave(q.block)[: q.numel]


def error_bound(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """Per element of ``x``, the largest ``|x − dequantize(q)|`` the format allows
    (module docstring), fp32 slack included."""
    scale = _per_element_scale(q)
    flat = x.detach().reshape(-1).to(torch.float32)
    if q.fmt == INT8:
        return scale * (0.5 + _FP32_SLACK)
    rel = flat.abs() * 2.0**-4
    return torch.maximum(rel, scale * 2.0**-10) + scale * _FP32_SLACK


def step_size(q: Quantized) -> torch.Tensor:
    """One quantization step per element: ``scale`` for int8; for fp8 the spacing of
    e4m3 codes at the element's own code (2⁻³ of its binade, 2⁻⁹ for subnormals),
    times the scale."""
    scale = _per_element_scale(q)
    if q.fmt == INT8:
        return scale
    c = q.codes.to(torch.float32)[: q.numel].abs()
    exp = torch.floor(torch.log2(torch.clamp(c, min=2.0**-6)))
    return torch.pow(2.0, exp - 3) * scale


class ErrorFeedback:
    """Keeps the quantization residual of one sender and adds it to the next input.

    Usage per outer round (one object per leader, on the outer level)::

        q = ef.encode(pseudo_grad)   # quantize pseudo_grad + residual, stage the new residual
        ... send q; the round commits or not ...
        ef.commit()  or  ef.rollback()

    Invariant: after ``commit``, ``residual = (input + old residual) − dequantize(q)``,
    so over committed rounds ``Σ dequantize(q) = Σ input − residual``.

    Failure semantics: ``encode`` never changes the committed residual; a round that
    fails (peer lost, should_commit False, timeout) must ``rollback`` — its payload
    was never applied. An element whose input is NaN/inf leaves a residual of 0 (its
    block decodes to NaN and the round is expected to be discarded by the caller's
    guard; a NaN residual would poison every later round).

    The residual travels with the leader's outer state: ``state_dict`` holds only the
    committed residual (a staged one belongs to a round that has not committed), and
    ``load_state_dict`` on a new or healed leader restores it. Losing it (a leader dies
    without handing its state over) costs at most one quantization error per element,
    once; call :meth:`reset`.
    """

    def __init__(self, fmt: str, block: int = DEFAULT_BLOCK) -> None:
        if fmt != TOPK2:  # the sparse codec's chunk and k are checked where it is built (sparse.py)
            check_format(fmt, block)
        self.fmt = fmt
        self.block = block
        self.residual: Optional[torch.Tensor] = None
        self._staged: Optional[torch.Tensor] = None
        # What the residual is the error of, where that can change under it: the
        # compressed all-reduce's shard residual is tagged (numel, world, rank) and reset
        # when the quorum gives this rank another shard. None for a whole-tensor residual.
        self.owner: Optional[Tuple[int, ...]] = None

    def encode(self, x: torch.Tensor) -> Quantized:
        """Quantizes ``x + residual`` and stages the new residual.

        Raises:
            ValueError: ``x`` has a different number of elements than the residual.
        """
        v = self._with_residual(x)
        q = quantize(v, self.fmt, self.block)
        self._stage(v, dequantize(q))
        return q

    def encode_with(self, x: torch.Tensor, codec: Callable[[torch.Tensor], Tuple[Any, torch.Tensor]]) -> Any:
        """Like :meth:`encode` with another codec (``codec(v) -> (payload, decoded v)``,
        e.g. the sparse one, sparse.py): encodes ``x + residual``, stages what the payload
        does not deliver, returns the payload."""
        v = self._with_residual(x)
        payload, decoded = codec(v)
        self._stage(v, decoded)
        return payload

    def _with_residual(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.detach().reshape(-1).to(torch.float32)
        if self.residual is not None and self.residual.numel() != flat.numel():
            raise ValueError(
                f"ErrorFeedback: input has {flat.numel()} elements, residual {self.residual.numel()} "
                "(the model changed? reset() first)"
            )
        return flat if self.residual is None else flat + self.residual.to(flat.device)

    def _stage(self, v: torch.Tensor, decoded: torch.Tensor) -> None:
        """Stages what the payload of ``v`` (input plus residual) does not deliver."""
        staged = v - decoded
        self._staged = torch.where(torch.isfinite(staged), staged, torch.zeros_like(staged))

    def fold(self, start: int, error: torch.Tensor, numel: int) -> None:
        """Adds ``error`` to the staged residual at ``[start, start + len)`` (clipped to
        ``numel``): the error of a later quantization of this sender's contribution,
        e.g. the reduced shard it owns in a compressed all-reduce, re-sent next round
        through this residual. Without a staged encode (a round this sender contributed
        nothing to) the committed residual (or zeros) is staged first. Non-finite
        elements of ``error`` add 0. Committed or rolled back with the round."""
        if self._staged is None:
            self._staged = torch.zeros(numel, dtype=torch.float32) if self.residual is None else self.residual.clone()
        if self._staged.numel() != numel:
            raise ValueError(f"ErrorFeedback.fold: residual has {self._staged.numel()} elements, expected {numel}")
        stop = min(numel, start + error.numel())
        if stop > start:
            e = error.reshape(-1)[: stop - start].to(torch.float32)
            self._staged[start:stop] += torch.where(torch.isfinite(e), e, torch.zeros_like(e))

    @property
    def has_staged(self) -> bool:
        return self._staged is not None

    def commit(self) -> None:
        """The round whose payload ``encode`` produced was applied: keep its residual."""
        if self._staged is None:
            raise RuntimeError("ErrorFeedback.commit without a staged encode")
        self.residual, self._staged = self._staged, None

    def rollback(self) -> None:
        """The round failed: forget its residual, keep the committed one."""
        self._staged = None

    def reset(self) -> None:
        self.residual = None
        self._staged = None
        self.owner = None

    def state_dict(self) -> Dict[str, Any]:
        return {
            "fmt": self.fmt,
            "block": self.block,
            "residual": None if self.residual is None else self.residual.detach().clone(),
            "owner": None if self.owner is None else list(self.owner),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores a committed residual; drops any staged one.

        Raises:
            ValueError: the state was written for another format or block size (its
                residual is an error of a different quantizer; reset() instead).
        """
        if state.get("fmt") != self.fmt or state.get("block") != self.block:
            raise ValueError(
                f"ErrorFeedback state is for {state.get('fmt')!r}/block {state.get('block')!r}, "
                f"this one is {self.fmt!r}/block {self.block}"
            )
        r = state.get("residual")
        self.residual = None if r is None else r.detach().to(torch.float32).clone()
        self._staged = None
        owner = state.get("owner")
        self.owner = None if owner is None else tuple(owner)
