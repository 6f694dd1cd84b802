"""The outer configuration the planner would pick for the link (issue #29 §3, the model half).

For the configured H_inner and H_outer, every outer variant the hierarchy runs — payload
(``none``, ``int8``, ``topk2``), overlap delay ``D`` (0 .. inner rounds between fragment
syncs − 1) and streaming fragments ``F`` (the divisors of H_outer) — is costed with the
planner's own model (network.py: :func:`outer_round_s`, :func:`hier_variant_sync_per_step`).
The pick is the variant whose outer round *hides*: its exposed outer time per step (what
is left after the overlap, without the inner level's share, which no outer variant
changes) is at most ``hide_fraction`` of the compute step; among those the one with the
least staleness (smallest ``D``), then the fewest fragments, then the payload that costs
the least loss (fp32, then int8, then topk2: docs/benchmarks.md measured topk2's excess
loss at about twice fp32's on the demo workload). If no variant hides, the one with the
least exposed time.

Here (``hier-localsgd plan``) it takes the configured ``links.outer`` and the planner's step
time; ``sync.outer.auto`` (experiments/auto.py) calls the same :func:`pick_outer` at a local
job's start with the WAN and the step measured, and applies the pick to every process.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Collection, Dict, List, Tuple

from hier_localsgd.core.links.lossy import LinkSpec
from hier_localsgd.core.runtime.choices import MAX_CHUNK, TOPK2
from hier_localsgd.tools.plan.network import OuterVariant, SyncTimes, hier_variant_sync_per_step, outer_round_bytes, outer_round_s

PAYLOADS = ("none", "int8", "topk2")  # in the order of the loss they cost (docs/benchmarks.md)
HIDE_FRACTION = 0.01  # exposed outer seconds per step at most this share of the step: hidden


def variants(h_outer: int, base: OuterVariant) -> List[OuterVariant]:
    """Every (payload, D, F) the hierarchy accepts for this H_outer (sections.py's checks:
    F divides H_outer, D below the inner rounds between fragment syncs)."""
    # topk2's chunk holds at most MAX_CHUNK elements and keeps at most all of them: a
    # compression_block or topk that is legal for int8 (or unused) is clamped for it
    chunk = min(base.block, MAX_CHUNK)
    sparse = {"block": chunk, "topk": min(base.topk, chunk)}
    out = []
    for f in (f for f in range(1, h_outer + 1) if h_outer % f == 0):
        for d in range(h_outer // f):
            for comp in PAYLOADS:
                out.append(replace(base, compression=comp, delay=d, fragments=f, **(sparse if comp == TOPK2 else {})))
    return out


def pick_outer(st: SyncTimes, step_s: float, clusters: int, wan: LinkSpec, round_overhead_s: float, h_inner: int, h_outer: int,
               base: OuterVariant, hide_fraction: float = HIDE_FRACTION, refused: Collection[Tuple[str, int, int]] = ()) -> Dict[str, Any]:
    """The variant to run and the costed table it was chosen from (rows sorted as ranked).
    ``refused``: ``(compression, delay, fragments)`` the job's config does not accept (a
    lossy link, fewer layer units than fragments): left out."""
    rows = []
    inner_share = st.inner_s / h_inner
    for v in variants(h_outer, base):
        if (v.compression, v.delay, v.fragments) in refused:
            continue
        o = outer_round_s(st.sync_bytes, clusters, wan, v, round_overhead_s)
        per_step = hier_variant_sync_per_step(st, o, step_s, h_inner, h_outer, v)
        exposed = max(0.0, per_step - inner_share)
        # The share of the outer round's WAN time that runs behind compute (the D inner rounds it overlaps).
        behind = min(o, v.delay * (h_inner * step_s + st.inner_s))
        rows.append({
            "compression": v.compression, "delay": v.delay, "fragments": v.fragments, "block": v.block, "topk": v.topk,
            "outer_round_s": o, "bytes_per_round": outer_round_bytes(st.sync_bytes, clusters, v),
            "outer_exposed_per_step_s": exposed, "hides": exposed <= hide_fraction * step_s,
            "sync_per_step_s": per_step, "wan_hidden_fraction": behind / o if o > 0 else 1.0,
        })

    def rank(r: Dict[str, Any]) -> tuple:
        if r["hides"]:
            return (0, r["delay"], r["fragments"], PAYLOADS.index(r["compression"]))
        return (1, r["outer_exposed_per_step_s"], r["delay"], r["fragments"], PAYLOADS.index(r["compression"]))

    rows.sort(key=rank)
    best = rows[0]
    return {"pick": best, "overrides": overrides_of(best, base), "hide_fraction": hide_fraction, "base": asdict(base), "rows": rows}


def overrides_of(v: Any, base: OuterVariant) -> List[str]:
    """The ``sync.outer`` overrides that run variant ``v`` (a row of :func:`pick_outer`, or an
    :class:`OuterVariant`) over the configured ``base``."""
    get = (lambda k: v[k]) if isinstance(v, dict) else (lambda k: getattr(v, k))
    out = [f"sync.outer.compression={get('compression')}", f"sync.outer.delay={get('delay')}", f"sync.outer.fragments={get('fragments')}"]
    if get("compression") == TOPK2 and (get("block"), get("topk")) != (base.block, base.topk):
        out += [f"sync.outer.compression_block={get('block')}", f"sync.outer.topk={get('topk')}"]
    return out
