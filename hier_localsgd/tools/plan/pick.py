"""The outer configuration the planner would pick for the link (issue #29 §3, the model half).

For the configured H_inner and H_outer, every outer variant the hierarchy runs — payload
(``none``, ``int8``, ``topk2``), overlap delay ``D`` (0 .. inner rounds between fragment
syncs − 1) and streaming fragments ``F`` (the divisors of H_outer) — is costed with the
planner's own model (network.py: :func:`outer_round_s`, :func:`hier_variant_sync_per_step`).

The pick is the variant with the least **modelled time to the target**, relative to an
outer level that costs nothing (:func:`time_factor`)::

    (step + sync per step) / (step + inner share) × cost(payload) × (1 + D·H_inner / N)

* *sync per step*: the exposed sync of the variant (what its overlap does not hide);
* *cost(payload)*: the steps the payload needs to the same loss, as a multiple of fp32's
  (:data:`PAYLOAD_STEP_COST`; ``plan.topk2_step_cost``). A **calibration on the demo
  workload**, not a law: int8 ended 150 steps at fp32's loss to the fourth decimal, and
  topk2 (4 of 256) needed 300 steps where fp32 needed 150 to the bench's target
  (docs/benchmarks.md, one seed each);
* *D·H_inner / N*: an overlapped round's merge reaches the model ``D`` inner rounds late,
  so the run is that many steps behind at every point (measured: the overlapped global
  model crossed the target one inner round after blocking hier's in every seed, at the
  same optimisation steps); ``N`` is the run's ``train.steps``. Over a long run the lag
  vanishes: the least exposed time times the payload's cost wins.

Variants within ``hide_fraction`` (1 %) of the least modelled time count as equal; among
them the least stale (smallest ``D``), then the fewest fragments, then the cheapest payload
in loss. Each row also says whether the variant *hides* (exposed outer seconds per step at
most ``hide_fraction`` of the step).

Why not "the least stale variant that hides", the rule the issue first specified (and this
code's before 2026-11-29): topk2's rounds hide at every rate from 10 Mbit/s to 1 Gbit/s on the
demo workload, so that rule picked topk2 everywhere, and its doubled steps made the auto
configuration 0.54–0.68× flat DiLoCo's speed at 100 Mbit/s and 1 Gbit/s (docs/benchmarks.md,
the auto pilot).

Here (``hier-localsgd plan``) it takes the configured ``links.outer`` and the planner's step
time; ``sync.outer.auto`` (experiments/auto.py) calls the same :func:`pick_outer` at a local
job's start with the WAN and the step measured, and applies the pick to every process.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Collection, Dict, List, Tuple

from hier_localsgd.core.links.lossy import LinkSpec
from hier_localsgd.core.runtime.choices import MAX_CHUNK, TOPK2, TOPK2_STEP_COST
from hier_localsgd.tools.plan.network import OuterVariant, SyncTimes, hier_variant_sync_per_step, outer_round_bytes, outer_round_s

PAYLOADS = ("none", "int8", "topk2")  # in the order of the loss they cost (docs/benchmarks.md)
HIDE_FRACTION = 0.01  # exposed outer seconds per step at most this share of the step: hidden
# Steps to the same loss as a multiple of fp32's, on the demo workload (a calibration; the
# module docstring): topk2's is plan.topk2_step_cost.
PAYLOAD_STEP_COST = {"none": 1.0, "int8": 1.0, TOPK2: TOPK2_STEP_COST}


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


def time_factor(sync_per_step_s: float, step_s: float, inner_share_s: float, payload_cost: float, lag_steps: int,
                steps: int) -> float:
    """Modelled time to the target relative to an outer level that costs nothing (the
    module docstring): ``(step + sync)/(step + inner share) × payload cost × (1 + lag/N)``;
    ``steps`` (N) ≤ 0 leaves the lag out."""
    base = step_s + inner_share_s
    t = (step_s + sync_per_step_s) / base if base > 0 else 1.0
    return t * payload_cost * (1.0 + (lag_steps / steps if steps > 0 else 0.0))


def pick_outer(st: SyncTimes, step_s: float, clusters: int, wan: LinkSpec, round_overhead_s: float, h_inner: int, h_outer: int,
               base: OuterVariant, hide_fraction: float = HIDE_FRACTION, refused: Collection[Tuple[str, int, int]] = (),
               steps: int = 0, topk2_step_cost: float = TOPK2_STEP_COST) -> Dict[str, Any]:
    """The variant to run and the costed table it was chosen from (rows sorted as ranked).
    ``refused``: ``(compression, delay, fragments)`` the job's config does not accept (a
    lossy link, fewer layer units than fragments): left out. ``steps``: the run's length
    (``train.steps``), over which an overlapped round's lag is counted."""
    rows = []
    inner_share = st.inner_s / h_inner
    cost = {**PAYLOAD_STEP_COST, TOPK2: topk2_step_cost}
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
            "payload_step_cost": cost[v.compression], "lag_steps": v.delay * h_inner,
            "time_factor": time_factor(per_step, step_s, inner_share, cost[v.compression], v.delay * h_inner, steps),
        })
    least = min(r["time_factor"] for r in rows)

    def rank(r: Dict[str, Any]) -> tuple:
        if r["time_factor"] <= least * (1.0 + hide_fraction):  # equal within the tolerance
            return (0, r["delay"], r["fragments"], PAYLOADS.index(r["compression"]), r["time_factor"])
        return (1, r["time_factor"], r["delay"], r["fragments"], PAYLOADS.index(r["compression"]))

    rows.sort(key=rank)
    best = rows[0]
    return {"pick": best, "overrides": overrides_of(best, base), "hide_fraction": hide_fraction, "base": asdict(base),
            "steps": steps, "payload_step_cost": cost, "rows": rows}


def overrides_of(v: Any, base: OuterVariant) -> List[str]:
    """The ``sync.outer`` overrides that run variant ``v`` (a row of :func:`pick_outer`, or an
    :class:`OuterVariant`) over the configured ``base``."""
    get = (lambda k: v[k]) if isinstance(v, dict) else (lambda k: getattr(v, k))
    out = [f"sync.outer.compression={get('compression')}", f"sync.outer.delay={get('delay')}", f"sync.outer.fragments={get('fragments')}"]
    if get("compression") == TOPK2 and (get("block"), get("topk")) != (base.block, base.topk):
        out += [f"sync.outer.compression_block={get('block')}", f"sync.outer.topk={get('topk')}"]
    return out
