"""The planner's sync times per level and mode, and the recommended sync periods (formulas: planner.py; costs: hier_localsgd/costs.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

from hier_localsgd import costs
from hier_localsgd.core.tensors.fragments import outer_period
from hier_localsgd.core.runtime.choices import DEFAULT_TOPK
from hier_localsgd.core.links.lossy import LinkSpec
from hier_localsgd.core.tensors.compress import quantized_nbytes
from hier_localsgd.sync.compression import down_format, latency_hops, payload_bytes, push_bytes
from hier_localsgd.sync.sections import SyncConfig


# ----------------------------------------------------------------------------- network
@dataclass(frozen=True)
class SyncTimes:
    """Seconds per sync of each kind, and the bytes one rank puts on the wire for it."""

    sync_bytes: float  # S per rank (model bytes in the sync dtype, /G with fsdp)
    inner_s: float
    outer_allreduce_s: float
    broadcast_s: float
    flat_s: float
    ddp_s: float
    inner_bytes: float
    outer_bytes: float
    broadcast_bytes: float  # sent by the leader
    flat_bytes: float
    ddp_bytes: float
    wide_link: str  # which link bounds flat/ddp ("wan", or "lan" with one cluster)


def sync_times(sync_bytes: float, clusters: int, replicas: int, lan: LinkSpec, wan: LinkSpec, round_overhead_s: float) -> SyncTimes:
    """Per-sync times of every level and mode (ring bound + ``round_overhead_s``).

    ``sync_bytes``: S, what one rank syncs; ``lan``/``wan``: ``links.inner``/``links.outer``
    (:func:`hier_localsgd.tools.deployment.links`). flat and ddp run one ring over every
    replica group, bounded by the WAN when it crosses clusters.
    """
    s, c, r = sync_bytes, clusters, replicas
    n = c * r
    wide = wan if c > 1 else lan
    o = round_overhead_s
    return SyncTimes(
        sync_bytes=s,
        inner_s=lan.allreduce_time(s, r) + o,
        outer_allreduce_s=wan.allreduce_time(s, c) + o,
        broadcast_s=lan.broadcast_time(s, r),
        flat_s=wide.allreduce_time(s, n) + o,
        ddp_s=wide.allreduce_time(s, n) + o,
        inner_bytes=costs.ring_allreduce_bytes(s, r),
        outer_bytes=costs.ring_allreduce_bytes(s, c),
        broadcast_bytes=(r - 1) * s,
        flat_bytes=costs.ring_allreduce_bytes(s, n),
        ddp_bytes=costs.ring_allreduce_bytes(s, n),
        wide_link="wan" if c > 1 else "lan",
    )


def h_values(sync: SyncConfig) -> Dict[str, int]:
    """The H values of ``sync``: steps per inner round, inner rounds per outer round, steps per flat sync."""
    return {"inner": sync.inner.every, "outer": sync.outer.every, "flat": sync.flat.every}


def hier_sync_per_step(inner_s: float, outer_s: float, broadcast_s: float, h_inner: int, h_outer: int) -> float:
    """hier's exposed sync seconds per local step: ``inner/H_inner + (outer + broadcast)/(H_inner H_outer)``."""
    return inner_s / h_inner + (outer_s + broadcast_s) / outer_period(h_inner, h_outer)


@dataclass(frozen=True)
class OuterVariant:
    """What of ``sync.outer`` changes the outer round's time: overlap (``delay`` inner
    rounds), compression (format, block) and streaming fragments (``F``)."""

    delay: int = 0
    compression: str = "none"
    block: int = 256
    topk: int = DEFAULT_TOPK  # kept per chunk of ``block`` with topk2
    fragments: int = 1
    elem_bytes: int = 4  # bytes per element of the synced model (what is quantized per element)

    @classmethod
    def of(cls, sync: SyncConfig, elem_bytes: int = 4) -> "OuterVariant":
        o = sync.outer
        return cls(delay=o.delay, compression=o.compression, block=o.compression_block, topk=o.topk, fragments=o.fragments,
                   elem_bytes=elem_bytes)


def outer_round_s(sync_bytes: float, clusters: int, wan: LinkSpec, v: OuterVariant, round_overhead_s: float) -> float:
    """One outer round's WAN collective (α–β) + ``round_overhead_s``: a fragment's bytes
    (``S/F``), as an fp32 ring all-reduce or (compressed) the all-to-all and all-gather of
    quantized shards (``topk2``: the all-gather of sparse payloads), the latency hops of
    ``sync.compression.latency_hops`` and the bytes one leader sends."""
    if clusters <= 1:
        return round_overhead_s
    if v.compression == "none":
        return wan.allreduce_time(sync_bytes / v.fragments, clusters) + round_overhead_s
    sent = outer_round_bytes(sync_bytes, clusters, v)
    wire = sent / wan.bandwidth_Bps if wan.bandwidth_Bps > 0 else 0.0
    return latency_hops(clusters, v.compression) * wan.latency_s + wire + round_overhead_s


def async_push_bytes(sync_bytes: float, v: OuterVariant) -> float:
    """The pseudo-gradient one asynchronous push sends up (``sync.outer.compression``:
    sync/compression.py ``push_bytes``); what comes back: :func:`async_down_bytes`."""
    if v.compression == "none":
        return sync_bytes
    return float(push_bytes(int(sync_bytes // v.elem_bytes), v.compression, v.block, v.topk))


def async_down_bytes(sync_bytes: float, v: OuterVariant, compress_down: bool, versions: int = 1) -> float:
    """What one push's answer brings down: the model (``S``) or, with a compression and
    ``sync.async_outer.compress_down``, ``versions`` quantized steps since the leader's base
    (sync/compression.py ``down_format``; sync/global_model.py), never more than the model.
    A cluster on schedule is one version behind (a lone push, or every cluster in one batch)."""
    fmt = down_format(v.compression, compress_down, v.block)
    if fmt is None:
        return sync_bytes
    return float(min(versions * quantized_nbytes(int(sync_bytes // v.elem_bytes), *fmt), sync_bytes))


def async_push_s(up_bytes: float, down_bytes: float, wan: LinkSpec, round_overhead_s: float) -> float:
    """The asynchronous outer level's exchange (``sync.async_outer``): the pseudo-gradient
    up to the global model server (``up_bytes``: :func:`async_push_bytes`) and the model
    or its steps back (``down_bytes``: :func:`async_down_bytes`), one WAN transfer each (no ring, nobody waited for), plus a round's overhead. Not
    modelled here: the server's own link shared by the clusters' pushes, and the grace window
    (sync/global_server.py; the simulator models the window: tools/simulate/batches.py)."""
    return async_leg_s(up_bytes, wan, round_overhead_s) + async_leg_s(down_bytes, wan, round_overhead_s)


def async_leg_s(nbytes: float, wan: LinkSpec, round_overhead_s: float) -> float:
    """One way of :func:`async_push_s`: ``nbytes`` over the WAN and half the round's overhead
    (the simulator times the upload and the download apart)."""
    return costs.transfer_time(nbytes, wan.latency_s, wan.bandwidth_Bps) + round_overhead_s / 2


def outer_round_bytes(sync_bytes: float, clusters: int, v: OuterVariant) -> float:
    """Bytes one leader sends in one outer round: a fragment (``S/F``), fp32 ring or compressed."""
    part = sync_bytes / v.fragments
    if v.compression == "none":
        return costs.ring_allreduce_bytes(part, clusters)
    return float(payload_bytes(int(part // v.elem_bytes), clusters, v.compression, v.block, v.topk)) if clusters > 1 else 0.0


def hier_variant_sync_per_step(st: SyncTimes, outer_s: float, step_s: float, h_inner: int, h_outer: int, v: OuterVariant) -> float:
    """hier's exposed sync seconds per local step with overlap, compression and fragments:

        inner/H_inner + F·(max(0, outer − D·(H_inner·step + inner)) + broadcasts)/(H_inner·H_outer)

    ``outer``: :func:`outer_round_s`. An overlapped outer round hides behind the ``D`` inner
    rounds (their compute and their inner syncs) it runs alongside; what is left blocks at
    the apply round. Broadcasts: the model, plus the residual with compression. With the
    defaults (``D = 0``, no compression, ``F = 1``) this is :func:`hier_sync_per_step`."""
    exposed = max(0.0, outer_s - v.delay * (h_inner * step_s + st.inner_s))
    broadcasts = st.broadcast_s * (2 if v.compression != "none" else 1)
    return st.inner_s / h_inner + v.fragments * (exposed + broadcasts) / outer_period(h_inner, h_outer)


def sync_per_step(st: SyncTimes, mode: str, h_inner: int, h_outer: int, h_flat_: int, ddp_overlap: float = 0.0) -> float:
    """Average exposed sync seconds per local step of one mode (hier: blocking, fp32, whole
    model; :func:`hier_variant_sync_per_step` for the rest)."""
    if mode == "ddp":
        return st.ddp_s * (1.0 - ddp_overlap)
    if mode == "flat":
        return st.flat_s / h_flat_
    return hier_sync_per_step(st.inner_s, st.outer_allreduce_s, st.broadcast_s, h_inner, h_outer)


def cluster_paces(step_s: float, speeds: Sequence[float], sync_per_step: float, asynchronous: bool) -> List[float]:
    """Each cluster's seconds per step, its syncs included (``topology.cluster_speed``: its
    compute is ``step_s / speed``). With the asynchronous outer level every cluster keeps its
    own pace; with the synchronous one each outer round waits for the last cluster, so every
    cluster runs at the slowest's pace (its steps at its own speed, the rest waiting)."""
    steps = [step_s / s for s in speeds]
    if asynchronous:
        return [s + sync_per_step for s in steps]
    return [max(steps) + sync_per_step] * len(steps)


def paced_shares(step_s: float, speeds: Sequence[float], paces: Sequence[float]) -> List[float]:
    """Each cluster's compute share of its wall time at its pace (:func:`cluster_paces`); their
    mean is the goodput without failures."""
    return [step_s / sp / pace for sp, pace in zip(speeds, paces)]


def comm_fraction(step_s: float, sync_s: float) -> float:
    """Share of wall time spent communicating: ``sync / (compute + sync)``."""
    return sync_s / (step_s + sync_s) if step_s + sync_s > 0 else 0.0


def recommend_h(st: SyncTimes, step_s: float, target: float, inner_share: float) -> Dict[str, Any]:
    """Smallest H values that keep the communication fraction at or below ``target``.

    Per-step budget ``b = target/(1-target) step_s``. hier: H_inner is the smallest with
    ``inner_s/H_inner <= inner_share b``; H_outer the smallest with
    ``inner_s/H_inner + (outer_s + bcast_s)/(H_inner H_outer) <= b``. flat: the smallest
    H with ``flat_s/H <= b``. ddp has no H: reported as reachable or not.
    """
    b = target / (1.0 - target) * step_s
    out: Dict[str, Any] = {"budget_per_step_s": b}
    if b <= 0:
        return {**out, "h_inner": None, "h_outer": None, "h_flat": None, "ddp_meets_target": False}
    h_in = max(1, math.ceil(st.inner_s / (inner_share * b) - 1e-12)) if st.inner_s > 0 else 1
    left = b - st.inner_s / h_in
    outer = st.outer_allreduce_s + st.broadcast_s
    h_out = max(1, math.ceil(outer / (h_in * left) - 1e-12)) if outer > 0 else 1
    hf = max(1, math.ceil(st.flat_s / b - 1e-12)) if st.flat_s > 0 else 1
    frac = comm_fraction(step_s, sync_per_step(st, "hier", h_in, h_out, hf))
    return {
        **out,
        "h_inner": h_in,
        "h_outer": h_out,
        "outer_period_steps": outer_period(h_in, h_out),
        "hier_fraction": frac,
        "h_flat": hf,
        "flat_fraction": comm_fraction(step_s, st.flat_s / hf),
        "ddp_meets_target": comm_fraction(step_s, st.ddp_s) <= target,
    }


