"""The one α–β cost model of a collective: bytes on the wire and a lower bound on time.

A link has a one-way latency α (seconds per hop) and a bandwidth B (bytes/s). For a
payload of S bytes over n ranks, with the standard algorithm models:

* ring all-reduce: each rank sends ``2(n-1)/n · S`` and the collective takes at least
  ``2(n-1)/n · S/B + 2(n-1)·α``;
* broadcast (the root sends every copy): the root sends ``(n-1)·S``, at least
  ``(n-1)·S/B + α``;
* all-gather (ring): each rank sends ``(n-1)·S``, at least ``(n-1)·S/B + (n-1)·α``;
* a point-to-point transfer (a heal): ``S/B + α``;
* an all-to-all (pairwise exchange): ``n-1`` latencies (:func:`latency_hops` holds every count).

Every use reads it from here: the link accounting (core/links/link.py), the link emulation's
sleep-to-the-bound (core/links/lossy.py), the planner and simulator (tools/) and the
benchmark's byte budget (experiments/bench.py). A bandwidth of 0 means "not modelled":
the bandwidth term is left out (the emulation's "unthrottled"). n <= 1 costs nothing.
"""

from __future__ import annotations


def gbps_to_Bps(gbps: float) -> float:
    """Gbit/s (the configuration's unit) to bytes/s."""
    return gbps * 1e9 / 8


def ring_factor(n: int) -> float:
    """Bytes one rank sends per payload byte in a ring all-reduce over n: ``2(n-1)/n``."""
    return 0.0 if n <= 1 else 2.0 * (n - 1) / n


def ring_allreduce_bytes(nbytes: float, n: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` over ``n`` ranks."""
    return ring_factor(n) * nbytes


def _wire(nbytes: float, bandwidth_Bps: float) -> float:
    return nbytes / bandwidth_Bps if bandwidth_Bps > 0 else 0.0


def latency_hops(op: str, n: int) -> int:
    """One-way latencies in sequence in one ``op`` collective over ``n`` ranks: ``2(n-1)`` for
    a ring all-reduce (reduce-scatter, then all-gather), ``n-1`` for a ring all-gather and for
    an all-to-all (pairwise exchange in n-1 steps), 1 for a broadcast (0 for n <= 1)."""
    if n <= 1:
        return 0
    hops = {"allreduce": 2 * (n - 1), "allgather": n - 1, "alltoall": n - 1, "broadcast": 1}
    if op not in hops:
        raise ValueError(f"latency_hops: op {op!r} — expected one of {sorted(hops)}")
    return hops[op]


def allreduce_time(nbytes: float, n: int, latency_s: float, bandwidth_Bps: float) -> float:
    """Ring lower bound ``2(n-1)/n · S/B + 2(n-1)·α`` seconds (0 for n <= 1)."""
    if n <= 1:
        return 0.0
    return latency_hops("allreduce", n) * latency_s + _wire(ring_allreduce_bytes(nbytes, n), bandwidth_Bps)


def broadcast_time(nbytes: float, n: int, latency_s: float, bandwidth_Bps: float) -> float:
    """Root to n-1 peers, the root sending every copy: ``(n-1)·S/B + α`` (0 for n <= 1)."""
    if n <= 1:
        return 0.0
    return latency_hops("broadcast", n) * latency_s + _wire((n - 1) * nbytes, bandwidth_Bps)


def allgather_time(nbytes: float, n: int, latency_s: float, bandwidth_Bps: float) -> float:
    """Ring all-gather of ``nbytes`` per rank: ``(n-1)·S/B + (n-1)·α`` (0 for n <= 1)."""
    if n <= 1:
        return 0.0
    return latency_hops("allgather", n) * latency_s + _wire((n - 1) * nbytes, bandwidth_Bps)


def transfer_time(nbytes: float, latency_s: float, bandwidth_Bps: float) -> float:
    """One point-to-point transfer (a heal): ``S/B + α``."""
    return latency_s + _wire(nbytes, bandwidth_Bps)
