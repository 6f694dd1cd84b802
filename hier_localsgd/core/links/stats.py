"""What one level's links carry, counted per collective kind.

``payload``: model-sized reductions and broadcasts; ``control``: consistency checks,
headers, resyncs. :class:`LinkStats` holds one level's counters in one process (the
process group of that level, link.py, records into it); :func:`sent_per_rank` is the
byte model the counters use, which the bench and the link watch (auto_watch.py) read
back. The standard algorithm models: ring all-reduce sends 2(n-1)/n·S per rank, a
broadcast root sends (n-1)·S.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hier_localsgd.costs import ring_allreduce_bytes
from hier_localsgd.core.links.lossy import LinkEmulation

PAYLOAD = "payload"
MAX_SPANS = 4096  # payload spans kept per collective kind (a long run's result.json stays small)
CONTROL = "control"


def sent_per_rank(op: str, tensor_bytes: float, world: int) -> float:
    """Bytes one rank sends over its links for one ``op`` collective whose input is
    ``tensor_bytes``, as :class:`LinkStats` counts them: the ring's 2(W−1)/W of it for an
    all-reduce, its W−1 other rows for an all-to-all, W−1 copies for an all-gather."""
    if op == "allreduce":
        return ring_allreduce_bytes(tensor_bytes, world)
    if op == "alltoall":
        return float((world - 1) * (tensor_bytes // max(1, world)))
    if op == "allgather":
        return float((world - 1) * tensor_bytes)
    raise ValueError(f"sent_per_rank: op {op!r} — expected allreduce, alltoall or allgather")


@dataclass
class LinkStats:
    """What one level's links carried in this process."""

    sent_bytes: Dict[str, float] = field(default_factory=lambda: defaultdict(float))
    tensor_bytes: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: Dict[str, int] = field(default_factory=lambda: defaultdict(int))
    injected_failures: int = 0
    # emulated links run collectives synchronously: measured time and analytical bound
    seconds: Dict[str, float] = field(default_factory=lambda: defaultdict(float))
    bound_seconds: Dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # each payload collective's [start, end] wall-clock seconds, in call order: the bench
    # lines up the members' k-th calls and measures from the last member's arrival
    spans: Dict[str, List[List[float]]] = field(default_factory=lambda: defaultdict(list))

    def record(self, op: str, kind: str, tensor_bytes: int, sent: float) -> None:
        key = f"{op}/{kind}"
        self.calls[key] += 1
        self.tensor_bytes[key] += tensor_bytes
        self.sent_bytes[kind] += sent

    def timed(self, op: str, kind: str, started: float, bound: float, span: bool = True) -> None:
        """A collective that began at ``started`` (``time.time()``) ended now; ``span``: keep
        its [start, end] (the emulated links' payload collectives, which the bench lines up)."""
        key, ended = f"{op}/{kind}", time.time()
        self.seconds[key] += ended - started
        self.bound_seconds[key] += bound
        if span and kind == PAYLOAD and len(self.spans[key]) < MAX_SPANS:
            self.spans[key].append([started, ended])

    emulation: Optional[LinkEmulation] = None

    def as_dict(self) -> Dict[str, object]:
        out: Dict[str, object] = {
            "sent_bytes": dict(self.sent_bytes),
            "sent_bytes_total": sum(self.sent_bytes.values()),
            "tensor_bytes": dict(self.tensor_bytes),
            "calls": dict(self.calls),
            "injected_failures": self.injected_failures,
        }
        if self.seconds:
            out["seconds"] = dict(self.seconds)
            out["bound_seconds"] = dict(self.bound_seconds)
            out["spans"] = dict(self.spans)
        if self.emulation is not None:
            out["loss"] = self.emulation.stats()
        return out
