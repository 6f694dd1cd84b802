"""A state-dict format that cannot run code: typed JSON header, raw tensor bytes.

Heals carry a replica's committed state across the network. torchft's HTTP transport
sends it as a pickle and loads it with ``weights_only=False``: whoever serves a heal
runs code in the healing process. This format has no code path at all: the decoder
builds only ``None``, ``bool``, ``int``, ``float``, ``str``, lists, tuples, dicts and
tensors of the dtypes in :data:`DTYPES`, from a header it parses with ``json``.

Layout (all integers little-endian)::

    b"HLW1" | u64 header length | header (UTF-8 JSON, padded with spaces to 64 bytes)
    | tensor 0 bytes | pad to 64 | tensor 1 bytes | pad to 64 | ...

The header is ``{"tree": T, "tensors": [[dtype, shape, nbytes], ...]}`` where a tree
``T`` is a JSON scalar (``null``/bool/number/string) or one of the tagged objects
``{"L": [T...]}`` (list), ``{"T": [T...]}`` (tuple), ``{"D": [[T, T]...]}`` (dict: keys
may be any scalar or tuple, as in an optimizer's ``state`` keyed by int) and
``{"X": i}`` (tensor ``i``; ``{"N": i}``: the same, returned as a numpy array; ``{"DT": i}``: a
DTensor's local shard, returned as a :class:`LocalShard`). Tensor data is 64-byte aligned, so the decoder returns
tensors that view the received buffer without a copy.

Failure semantics: :func:`encode` raises :class:`WireError` naming the path of a value it
cannot carry (``user.scheduler.fn``) — nothing is silently dropped; :func:`decode` raises
:class:`WireError` for anything but an exact, well-formed payload (bad magic, a header
over :data:`MAX_HEADER`, malformed JSON or tree, an unknown tag or dtype, a size that does
not match its shape, a tensor index out of range or used twice, a truncated or
over-long body, nesting deeper than :data:`MAX_DEPTH`).
"""

from __future__ import annotations

import json
import math
import numbers
import struct
from typing import Any, BinaryIO, Dict, List

import torch

MAGIC = b"HLW1"
ALIGN = 64
MAX_HEADER = 16 << 20  # bytes of JSON: far above any state dict's structure (a few hundred bytes per tensor)
MAX_DIM = 1 << 48  # elements per dimension, and per tensor
MAX_DEPTH = 64  # nesting of lists/dicts; a state dict is a few levels deep

DTYPES: Dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
              torch.int64, torch.int32, torch.int16, torch.int8, torch.uint64, torch.uint32, torch.uint16, torch.uint8, torch.bool,
              torch.float8_e4m3fn, torch.float8_e5m2)
}
_NAMES = {d: n for n, d in DTYPES.items()}


class WireError(ValueError):
    """A state dict that cannot be encoded, or a payload that is not a valid one."""


class LocalShard:
    """A DTensor's local shard as received (tag ``DT``); the receiver wraps it back into a
    DTensor on its own mesh with the placements of its own state (heals.py ``rewrap``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _pad(n: int) -> int:
    return (-n) % ALIGN


class Encoded:
    """An encoded state dict, ready to write: the header bytes and the tensors whose
    bytes follow it (CPU, contiguous). ``size``: the exact payload length."""

    def __init__(self, header: bytes, tensors: List[torch.Tensor]) -> None:
        self.header, self.tensors = header, tensors
        self.size = len(header) + sum(t.numel() * t.element_size() + _pad(t.numel() * t.element_size()) for t in tensors)

    def chunks(self):
        """The payload as byte chunks (the header, then each tensor and its padding)."""
        yield self.header
        for t in self.tensors:
            n = t.numel() * t.element_size()
            if n:
                yield memoryview(t.reshape(-1).view(torch.uint8).numpy())
            if _pad(n):
                yield bytes(_pad(n))

    def write(self, f: BinaryIO) -> None:
        for c in self.chunks():
            f.write(c)

    def to_bytes(self) -> bytes:
        return b"".join(bytes(c) for c in self.chunks())


def encode(obj: Any) -> Encoded:
    """Encodes a state dict; raises :class:`WireError` naming a value it cannot carry."""
    tensors: List[torch.Tensor] = []

    def enc(v: Any, path: str, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"{path}: nested deeper than {MAX_DEPTH}")
        if v is None or isinstance(v, (bool, str)):
            return v
        if type(v).__name__ == "bool_" and type(v).__module__ == "numpy":
            return bool(v)
        if isinstance(v, numbers.Integral):  # numpy's integers too
            return int(v)
        if isinstance(v, numbers.Real):
            return float(v)
        if isinstance(v, torch.Tensor):
            tag = "X"
            if hasattr(v, "device_mesh") and hasattr(v, "to_local"):  # a DTensor (FSDP2): this rank's shard
                v, tag = v.to_local(), "DT"
            if type(v) not in (torch.Tensor, torch.nn.Parameter):
                raise WireError(f"{path}: a tensor subclass ({type(v).__name__}) cannot be sent")
            if v.layout != torch.strided or v.is_quantized or v.dtype not in _NAMES:
                raise WireError(f"{path}: a {v.layout} tensor of {v.dtype} cannot be sent (dense tensors of {', '.join(DTYPES)})")
            t = v.detach().resolve_conj().resolve_neg()
            if t.device.type != "cpu":
                t = t.cpu()
            tensors.append(t.contiguous())
            return {tag: len(tensors) - 1}
        if type(v).__module__ == "numpy" and type(v).__name__ == "ndarray":  # an RNG state, say
            try:
                t = torch.from_numpy(v.astype(v.dtype.newbyteorder("=")))
            except (TypeError, ValueError):
                raise WireError(f"{path}: a numpy array of {v.dtype} cannot be sent") from None
            if t.dtype not in _NAMES:
                raise WireError(f"{path}: a numpy array of {v.dtype} cannot be sent")
            tensors.append(t.contiguous())
            return {"N": len(tensors) - 1}
        if isinstance(v, torch.Size):
            return {"T": [int(x) for x in v]}
        if isinstance(v, list):
            return {"L": [enc(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, tuple):
            return {"T": [enc(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if isinstance(v, dict):
            items = []
            for k, x in v.items():
                if not (k is None or isinstance(k, (bool, int, float, str, tuple))):
                    raise WireError(f"{path}: a dict key of type {type(k).__name__} cannot be sent")
                items.append([enc(k, f"{path}.<key>", depth + 1), enc(x, f"{path}.{k}", depth + 1)])
            return {"D": items}
        raise WireError(f"{path or '<root>'}: a value of type {type(v).__name__} cannot be sent "
                        "(tensors, numbers, strings, None, and lists/tuples/dicts of them)")

    tree = enc(obj, "", 0)
    meta = [[_NAMES[t.dtype], list(t.shape), t.numel() * t.element_size()] for t in tensors]
    body = json.dumps({"tree": tree, "tensors": meta}, separators=(",", ":"), allow_nan=True).encode()
    body += b" " * _pad(len(MAGIC) + 8 + len(body))
    return Encoded(MAGIC + struct.pack("<Q", len(body)) + body, tensors)


def decode(buf: bytes | bytearray | memoryview, max_bytes: int) -> Any:
    """Decodes a whole payload (tensors view ``buf``: pass a buffer nobody else writes).

    Raises :class:`WireError` for anything but an exact, well-formed payload of at most
    ``max_bytes``."""
    mv = memoryview(buf)
    if len(mv) > max_bytes:
        raise WireError(f"payload of {len(mv)} bytes exceeds the limit of {max_bytes}")
    if len(mv) < len(MAGIC) + 8 or bytes(mv[:4]) != MAGIC:
        raise WireError("not a state-dict payload (bad magic)")
    (hlen,) = struct.unpack("<Q", mv[4:12])
    if hlen > MAX_HEADER or 12 + hlen > len(mv):
        raise WireError(f"header of {hlen} bytes is over the limit or past the payload's end ({len(mv)} bytes)")
    try:
        head = json.loads(bytes(mv[12:12 + hlen]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as e:
        raise WireError(f"malformed header: {str(e)[:120]}") from None
    if not isinstance(head, dict) or set(head) != {"tree", "tensors"} or not isinstance(head["tensors"], list):
        raise WireError("malformed header: expected {tree, tensors}")
    pos = 12 + hlen
    tensors: List[torch.Tensor] = []
    for i, m in enumerate(head["tensors"]):
        tensors.append(_tensor(mv, pos, i, m))
        n = m[2]
        pos += n + _pad(n)
    if pos != len(mv):
        raise WireError(f"payload is {len(mv)} bytes, its header describes {pos}")
    used = [False] * len(tensors)

    def dec(v: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise WireError(f"tree nested deeper than {MAX_DEPTH}")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if not isinstance(v, dict) or len(v) != 1:
            raise WireError(f"malformed tree node of type {type(v).__name__}")
        (tag, x), = v.items()
        if tag in ("X", "N", "DT"):
            if type(x) is not int or not 0 <= x < len(tensors) or used[x]:
                raise WireError(f"bad tensor reference {x!r}")
            used[x] = True
            return tensors[x] if tag == "X" else tensors[x].numpy() if tag == "N" else LocalShard(tensors[x])
        if not isinstance(x, list):
            raise WireError(f"malformed {tag!r} node")
        if tag == "L":
            return [dec(e, depth + 1) for e in x]
        if tag == "T":
            return tuple(dec(e, depth + 1) for e in x)
        if tag == "D":
            out = {}
            for kv in x:
                if not isinstance(kv, list) or len(kv) != 2:
                    raise WireError("malformed dict item")
                k = dec(kv[0], depth + 1)
                if isinstance(k, (torch.Tensor, list, dict)):
                    raise WireError("a dict key must be a scalar or tuple")
                out[k] = dec(kv[1], depth + 1)
            return out
        raise WireError(f"unknown tree tag {tag!r}")

    try:
        tree = dec(head["tree"], 0)
    except (TypeError, RecursionError) as e:  # unhashable tuple keys holding lists, deep recursion
        raise WireError(f"malformed tree: {str(e)[:120]}") from None
    if not all(used):
        raise WireError("a tensor of the payload is not referenced by its tree")
    return tree


def _tensor(mv: memoryview, pos: int, i: int, m: Any) -> torch.Tensor:
    if not (isinstance(m, list) and len(m) == 3 and isinstance(m[0], str) and isinstance(m[1], list)
            and type(m[2]) is int):
        raise WireError(f"tensor {i}: malformed entry")
    name, shape, n = m
    dtype = DTYPES.get(name)
    if dtype is None:
        raise WireError(f"tensor {i}: dtype {name[:40]!r} is not allowed")
    if not all(type(d) is int and 0 <= d < MAX_DIM for d in shape) or len(shape) > 32 or math.prod(d for d in shape if d) >= MAX_DIM:
        raise WireError(f"tensor {i}: bad shape")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if n != math.prod(shape) * itemsize:
        raise WireError(f"tensor {i}: {n} bytes do not match shape {shape[:8]} of {name}")
    if pos + n > len(mv):
        raise WireError(f"tensor {i}: truncated ({n} bytes at {pos}, payload is {len(mv)})")
    if pos % ALIGN:
        raise WireError(f"tensor {i}: at offset {pos}, not {ALIGN}-byte aligned")
    try:
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        t = torch.frombuffer(mv, dtype=dtype, count=n // itemsize, offset=pos).view(shape)
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:
        raise WireError(f"tensor {i}: {str(e)[:120]}") from None
    if dtype == torch.bool and bool((t.view(torch.uint8) > 1).any()):
        raise WireError(f"tensor {i}: a bool tensor holds bytes other than 0 and 1")
    return t



def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in a state dict (a receiver sizes its limit by its own)."""
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor sends its shard
        return t.numel() * t.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0
