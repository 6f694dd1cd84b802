"""``hier-localsgd bench``: hierarchical vs flat DiLoCo vs DDP on emulated LAN/WAN links.

Runs the arms one after another in the same invocation, on the same workload, seed, token
budget (same steps x batch per replica group) and emulated network (``links.inner`` = LAN,
``links.outer`` = WAN; the flat and ddp rings span the clusters, so they run on the WAN
spec):

* ``ddp`` — gradient all-reduce every step across every replica group;
* ``flat_budget`` — torchft's DiLoCo across every replica group, syncing as often as the
  hierarchy's slow-link byte budget allows (a flat ring over n = C·R groups crosses the
  WAN on C of its n hops, C·2(n−1)/n·S per sync, vs C·2(C−1)/C·S per outer round);
* ``flat_count`` — the same, syncing exactly as often as the hierarchy's outer rounds;
* ``hier`` — inner over LAN every H_inner steps, outer over WAN every H_outer inner rounds;
* ``flat_overlap`` / ``hier_overlap`` (by ``bench.arms``) — ``flat_count`` with torchft's
  ``fragment_sync_delay`` = H_inner local steps, and ``hier`` with the outer round
  overlapped by one inner round (``sync.outer.delay=1``, overlap.py);
* ``flat_3x`` / ``flat_half`` / ``flat_overlap_3x`` / ``flat_overlap_half`` (by
  ``bench.arms``) — the flat period searched: about three times as often as ``flat_count``
  (every period // 3 steps) and half as often, blocking and with ``fragment_sync_delay`` (H_inner, or half the period
  where H_inner is not under it);
* ``hier_async`` / ``hier_async_overlap`` (by ``bench.arms``) — ``hier`` with the
  asynchronous outer level (``sync.async_outer.enabled``; overlapped: each push runs behind
  training, ``sync.outer.delay=1``): its curve is every group's evaluation on the hier grid
  in the order of training time (the clusters are at different steps at one time), and
  ``curve_global`` the global version each group last adopted, at the same points;
* a bare training loop (no sync, no machinery) per replica group, run concurrently like
  the arms, for the per-step overhead of the hierarchy on steps without a sync.

Per arm: training wall time, bytes on slow and fast links, final eval loss and excess over
the entropy floor, the wall time and slow-link bytes to reach the target loss (default:
the ddp arm's final loss + ``bench.target_margin``), and per level the measured time of
the payload all-reduce next to its analytical ring bound. Outputs: a markdown table, JSON,
and two plots (excess loss vs wall time, vs slow-link bytes).

**Real links** (``bench.links=kernel``): each cluster's lighthouse and replica groups run in
a network namespace of their own (``run.netns``, launch/netns.py), joined through veth pairs
and a bridge; every cluster uplink is shaped by the kernel's ``tbf`` at ``bench.wan_gbps`` in
both directions, and the user-space bandwidth padding of the WAN level is off
(``links.outer.bandwidth_gbps=0``). What stays in user space: the WAN latency
(``links.outer.latency_ms``; ``tc netem`` is unavailable here) as a *floor* — a collective
takes at least its ``2(n-1)·α`` — not added to the kernel's transfer time; and the LAN, which
is the loopback inside a cluster's namespace with its user-space emulation as before. Bytes
on the wire: each cluster uplink's counters (``/proc/net/dev`` in the cluster's namespace),
read before the processes start and after they end, reported next to the accounted
slow-link bytes (headers, acknowledgements and the control plane — heartbeats, quorums,
store traffic — are on the wire and not in the accounting). Unavailable namespaces or tbf
end the command with exit 2 and the reason.

``bench.mode=quick`` (tiny model, a couple of minutes) for smoke checks; ``full`` (the
debugmodel workload, under 30 minutes on 2 cores). The workload's periods are the mode's
preset unless ``bench.h_inner``/``bench.h_outer`` say otherwise (the flat arms follow).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from hier_localsgd import costs
from hier_localsgd.core.tensors.fragments import outer_period
from hier_localsgd.config import Config, ConfigError, load_config
from hier_localsgd.errors import fail
from hier_localsgd.launch.local import LocalJob
from hier_localsgd.experiments.bare_loops import run_bare
from hier_localsgd.launch.netns import tbf_transfer_s
from hier_localsgd.core.links.stats import sent_per_rank
from hier_localsgd.core.runtime.status import read_events, replica_dir


WORKLOADS = {
    # H_inner, H_outer; steps chosen so every arm's period divides them
    "quick": {"h": (5, 2), "steps": 60, "over": ["model=tiny", "train.batch_size=16", "train.eval_batches=4", "train.min_step_time_s=0.02"]},
    "full": {"h": (10, 3), "steps": 360, "over": ["model=llama3_debugmodel", "train.batch_size=4", "train.seq_len=64", "train.eval_batches=4"]},
}


def flat_budget_every(C: int, R: int, period: int) -> int:
    """Flat sync period with the hierarchy's slow-link bytes per step."""
    flat_wan = C * costs.ring_factor(C * R)  # models' worth of WAN bytes per flat sync
    hier_wan = C * costs.ring_factor(C)  # per outer round
    if hier_wan == 0:
        return period
    return max(1, round(period * flat_wan / hier_wan))


def flat_delay(every: int, h_in: int) -> int:
    """torchft's fragment_sync_delay for a flat arm: one inner period's steps, under the period."""
    return h_in if h_in < every else every // 2


def plan_arms(cfg: Config) -> Tuple[List[str], Dict[str, List[str]], int]:
    w = WORKLOADS[cfg.bench.mode]
    h_in, h_out = cfg.bench.h_inner or w["h"][0], cfg.bench.h_outer or w["h"][1]
    period = outer_period(h_in, h_out)
    C, R = cfg.topology.clusters, cfg.topology.replicas_per_cluster
    budget = flat_budget_every(C, R, period)
    often, seldom = max(1, period // 3), 2 * period  # the flat periods around flat_count's
    steps = w["steps"]
    # every selected arm's period divides the steps (the searched periods only when selected,
    # so the other arms' steps stay as they were)
    searched = [often if "3x" in a else seldom for a in cfg.bench.arms if a.startswith("flat") and a.endswith(("3x", "half"))]
    lcm = math.lcm(period, budget, *searched)
    steps = max(steps, lcm) if steps % lcm == 0 else ((steps + lcm - 1) // lcm) * lcm
    b = cfg.bench
    kernel = b.links == "kernel"  # the WAN's rate is tbf's (run_arm shapes it), not user space's
    common = [
        *w["over"], f"train.steps={steps}", f"sync.inner.every={h_in}", f"sync.outer.every={h_out}",
        f"links.inner.bandwidth_gbps={b.lan_gbps}", f"links.inner.latency_ms={b.lan_latency_ms}",
        f"links.outer.bandwidth_gbps={0 if kernel else b.wan_gbps}", f"links.outer.latency_ms={b.wan_latency_ms}",
        *(["run.netns=true"] if kernel else []),
    ]
    arms = {
        "ddp": ["sync.mode=ddp"],
        "flat_budget": ["sync.mode=flat", f"sync.flat.every={budget}"],
        "flat_count": ["sync.mode=flat", f"sync.flat.every={period}"],
        "hier": ["sync.mode=hier"],
        # the overlapped variants: torchft's own fragment_sync_delay (one inner period's worth
        # of local steps), and the hierarchy's outer round applied one inner round later
        "flat_overlap": ["sync.mode=flat", f"sync.flat.every={period}", f"sync.flat.delay={h_in}"],
        # the flat period searched (issue #29: every 10, 30, 60 on the full workload), blocking and
        # overlapped; a delay must stay under the period, so syncing every 10 overlaps 5 steps
        "flat_3x": ["sync.mode=flat", f"sync.flat.every={often}"],
        "flat_half": ["sync.mode=flat", f"sync.flat.every={seldom}"],
        "flat_overlap_3x": ["sync.mode=flat", f"sync.flat.every={often}", f"sync.flat.delay={flat_delay(often, h_in)}"],
        "flat_overlap_half": ["sync.mode=flat", f"sync.flat.every={seldom}", f"sync.flat.delay={flat_delay(seldom, h_in)}"],
        # torchft's streaming DiLoCo: three fragments in turn, one every period/3 steps, each overlapped
        "flat_overlap_frag3": ["sync.mode=flat", f"sync.flat.every={period}", f"sync.flat.delay={h_in}", "sync.flat.fragments=3"],
        "hier_overlap": ["sync.mode=hier", "sync.outer.delay=1"],
        # eager updates (sync/overlap.py): the cluster's own outer step stands in until the global one arrives
        "hier_overlap_eager": ["sync.mode=hier", "sync.outer.delay=1", "sync.outer.eager=true"],
        # the outer configuration picked for the measured link and step (experiments/auto.py)
        "hier_auto": ["sync.mode=hier", "sync.outer.auto=true"],
        # the asynchronous outer level (sync/global_server.py): no cluster waits for another
        "hier_async": ["sync.mode=hier", "sync.async_outer.enabled=true"],
        # ... with each push behind training, its answer merged at the next round (sync/async_outer.py)
        "hier_async_overlap": ["sync.mode=hier", "sync.async_outer.enabled=true", "sync.outer.delay=1"],
        "hier_int8": ["sync.mode=hier", "sync.outer.compression=int8"],
        "hier_overlap_int8": ["sync.mode=hier", "sync.outer.delay=1", "sync.outer.compression=int8"],
        # streaming fragments (core/tensors/fragments.py): half the model per outer round, twice as often
        "hier_frag2": ["sync.mode=hier", "sync.outer.fragments=2"],
        "hier_overlap_int8_frag2": ["sync.mode=hier", "sync.outer.delay=1", "sync.outer.compression=int8", "sync.outer.fragments=2"],
        # a third of the model per round, for WANs where one int8 round outlasts an inner round (bench.h_outer a multiple of 3, >= 6)
        "hier_overlap_int8_frag3": ["sync.mode=hier", "sync.outer.delay=1", "sync.outer.compression=int8", "sync.outer.fragments=3"],
    }
    return common, {a: arms[a] for a in b.arms}, steps


def _split_bytes(mode: str, result: dict, C: int, R: int) -> Tuple[float, float]:
    """(slow, fast) link bytes sent by one replica group."""
    link = result["link"]
    if mode == "hier":
        return link.get("outer", {}).get("sent_bytes_total", 0.0), link.get("inner", {}).get("sent_bytes_total", 0.0)
    total = sum(st["sent_bytes_total"] for st in link.values())
    n = C * R
    slow = total * C / n if n > C else total  # the ring crosses the WAN on C of its n hops
    return slow, total - slow


EVAL_KINDS = ("eval", "eval_global")  # the live model's evaluations; the global model's (train.eval_global)


def _curve(mode: str, events: Dict[Tuple[int, int], List[dict]], C: int, R: int, kind: str = "eval") -> List[Dict[str, float]]:
    """Per eval step of ``kind`` (EVAL_KINDS): mean eval loss, the spread of the groups'
    losses (0 when every group evaluated the same model: the eval set is shared), mean
    seconds since training started less every evaluation before it, job-wide slow bytes."""
    start = {}
    for k, evs in events.items():
        s = next((e["t"] for e in evs if e["kind"] == "phase" and e["src"] == "START"), None)
        if s is not None:
            start[k] = s
    by_step: Dict[int, List[Tuple[Tuple[int, int], dict]]] = {}
    for k, evs in events.items():
        spent = 0.0  # evaluation seconds so far: not training time
        for e in evs:
            if e["kind"] in EVAL_KINDS and k in start:
                spent += e.get("eval_s", 0.0)
                if e["kind"] == kind:
                    by_step.setdefault(e["step"], []).append((k, {**e, "t": e["t"] - spent}))
    curve = []
    for step in sorted(by_step):
        pts = by_step[step]
        if len(pts) < len(start):
            continue
        slow = 0.0
        for k, e in pts:
            b = e.get("bytes") or {}
            fake = {"link": {lv: {"sent_bytes_total": v} for lv, v in b.items()}}
            slow += _split_bytes(mode, fake, C, R)[0]
        t = sum(max(0.0, e["t"] - start[k]) for k, e in pts) / len(pts) if step > 0 else 0.0
        losses = [e["loss"] for _, e in pts]
        curve.append({"step": step, "loss": sum(losses) / len(losses), "spread": max(losses) - min(losses), "t": t, "slow_bytes": slow})
    return curve


def _time_curve(mode: str, events: Dict[Tuple[int, int], List[dict]], C: int, R: int, kind: str = "eval") -> List[Dict[str, float]]:
    """The asynchronous outer level (clusters at different steps at the same time): every
    group's evaluations of ``kind`` (EVAL_KINDS) on the hier grid, in the order of training
    time (seconds since its start less its evaluations before it), each with the job-wide
    slow bytes so far. ``eval``: the live model, the global version just adopted where the
    grid meets a push, else that version plus the cluster's steps since (a cluster on
    matched paces, sync.async_outer.match_pace, pushes off the grid); ``eval_global``: the
    global version the group last adopted. The first point at or under a target is the
    time the job's model reached it."""
    pts = []
    for k, evs in events.items():
        start = next((e["t"] for e in evs if e["kind"] == "phase" and e["src"] == "START"), None)
        if start is None:
            continue
        spent = 0.0
        for e in evs:
            if e["kind"] in EVAL_KINDS:
                spent += e.get("eval_s", 0.0)
                if e["kind"] == kind:
                    pts.append({"step": e["step"], "loss": e["loss"], "spread": 0.0, "t": max(0.0, e["t"] - spent - start) if e["step"] > 0 else 0.0,
                                "bytes": e.get("bytes") or {}, "key": k})
    pts.sort(key=lambda p: p["t"])
    latest: Dict[Tuple[int, int], float] = {}
    curve = []
    for p in pts:  # slow bytes: each group's counter at its latest evaluation so far
        fake = {"link": {lv: {"sent_bytes_total": v} for lv, v in p.pop("bytes").items()}}
        latest[p.pop("key")] = _split_bytes(mode, fake, C, R)[0]
        curve.append({**p, "slow_bytes": sum(latest.values())})
    return curve


PAYLOAD_OPS = ("allreduce", "alltoall", "allgather")  # a round: one all-reduce, or the compressed one's all-to-all + all-gather


def sync_ratio(results: List[dict], level: str, world: int,
                through_tbf: Optional[Callable[[float], float]] = None) -> Optional[Dict[str, float]]:
    """Mean measured time of a level's payload round (an all-reduce, or the compressed
    all-reduce's all-to-all and all-gather) and its bound. Without ``through_tbf`` the bound
    is the emulation's (link.py's analytic bound). With it (bytes one rank sends -> seconds
    through tbf: ``bench.links=kernel``, where the emulation holds only the latency), each
    collective's bound is the larger of its sent bytes through tbf (stats.sent_per_rank of
    its mean input, ``world`` ranks) and the latency floor the emulation slept."""
    secs = bound = 0.0
    rounds = 0
    for r in results:
        st = r["link"].get(level, {})
        calls, tensor, measured, floor = (st.get(k, {}) for k in ("calls", "tensor_bytes", "seconds", "bound_seconds"))
        for op in PAYLOAD_OPS:
            key, n = f"{op}/payload", calls.get(f"{op}/payload", 0)
            if not n:
                continue
            secs += measured.get(key, 0.0)
            if through_tbf is None:
                bound += floor.get(key, 0.0)
            else:
                bound += n * max(through_tbf(sent_per_rank(op, tensor.get(key, 0) / n, world)), floor.get(key, 0.0) / n)
        rounds += calls.get("allreduce/payload", 0) + calls.get("alltoall/payload", 0)
    if rounds == 0 or bound == 0:
        return None
    out = {"measured_s": secs / rounds, "bound_s": bound / rounds, "ratio": secs / bound, "calls": rounds}
    late = after_last_arrival(results, level)
    if late is not None:
        out.update(after_arrival_s=late["round_s"], arrival_skew_s=late["skew_s"], after_arrival_ratio=late["round_s"] / (bound / rounds))
    return out


def after_last_arrival(results: List[dict], level: str) -> Optional[Dict[str, float]]:
    """The level's payload rounds timed from the last member's arrival: each member's k-th
    call of an op is one collective (the call order is the same in every member of a
    group); its time is the latest end minus the latest start, its skew the latest start
    minus the earliest. What a member measures from its own start (``sync_ratio``'s
    ``measured_s``) also holds its wait for a peer that came later (a slower step, a later
    stage thread), which is no link time. ``inner``: a group per cluster; other levels: one
    group. Means per round (an all-reduce, or an all-to-all with its all-gather). None when
    a group's members made different numbers of calls (a member failed or changed: the
    calls no longer line up), or a group has one member, or nobody recorded spans."""
    groups: Dict[Any, List[dict]] = {}
    for r in results:
        spans = r["link"].get(level, {}).get("spans") or {}
        if spans:
            groups.setdefault(r.get("cluster") if level == "inner" else 0, []).append(spans)
    late = skew = 0.0
    rounds = 0
    for spans_of in groups.values():
        if len(spans_of) < 2:
            return None
        for op in PAYLOAD_OPS:
            lists = [sp.get(f"{op}/payload", []) for sp in spans_of]
            if len({len(x) for x in lists}) != 1:
                return None
            for calls in zip(*lists):
                starts, ends = [c[0] for c in calls], [c[1] for c in calls]
                late += max(0.0, max(ends) - max(starts))
                skew += max(starts) - min(starts)
            if op != "allgather":
                rounds += len(lists[0])
    if rounds == 0:
        return None
    return {"round_s": late / rounds, "skew_s": skew / rounds, "rounds": rounds}


def sync_eval(cfg: Config) -> List[str]:
    """Evaluation at the arm's own sync points: every outer round (hier; with ``sync.outer.delay``
    at the merge, D inner rounds later), every flat sync (torchft's ``fragment_sync_delay``
    merges at the sync step itself), and for ddp (synchronised at every step) on the hier
    period's grid. At these points the blocking arms' groups hold one model (the curve's
    ``spread`` shows it); an overlapped hier arm's clusters differ by their progress since
    the outer round's snapshot, and with streaming fragments by the fragments not synced
    in that round; for those the global model is evaluated too (``curve_global``), and for
    the asynchronous level, whose clusters on matched paces push off the grid."""
    s = cfg.sync
    period = s.outer_period
    if s.mode == "hier":
        overlap = ["train.eval_global=true"] if s.outer.delay or s.async_outer.enabled else []  # also the shared global model (its own curve)
        return [f"train.eval_every={period}", f"train.eval_offset={(s.outer.delay * s.inner.every) % period}", *overlap]
    if s.mode == "flat":
        return [f"train.eval_every={s.flat.every}", "train.eval_offset=0"]
    return [f"train.eval_every={period}", "train.eval_offset=0"]


def run_arm(name: str, overrides: List[str], out: Path, timeout_s: float, wan_bps: float = 0.0) -> Dict[str, Any]:
    """One arm as a local job. ``wan_bps`` > 0 (``bench.links=kernel``, with ``run.netns`` in
    ``overrides``): every cluster uplink is shaped by tbf at that rate and its counters are read."""
    overrides = [*overrides, *sync_eval(load_config(overrides, validate_for="demo"))]
    cfg = load_config(overrides, validate_for="demo")
    C, R = cfg.topology.clusters, cfg.topology.replicas_per_cluster
    run_dir = out / "runs" / name
    job = LocalJob(cfg, overrides, free_ports=True, run_dir_override=run_dir)
    t0 = time.time()
    wire: Optional[Dict[str, Any]] = None
    auto_pick: Optional[List[str]] = None
    try:
        if wan_bps and job.netns is not None:
            for c in range(C):
                job.netns.shape(c, wan_bps)
        if cfg.sync.outer.auto:  # measured on the arm's own (shaped) network (auto.py)
            from hier_localsgd.experiments.auto import resolve

            try:
                auto_pick = resolve(cfg, job)
                picked = [*overrides, *auto_pick]
                cfg = load_config(picked, validate_for="demo")
            except Exception as e:  # a probe that failed costs this arm, not the bench
                print(f"bench: {name}: sync.outer.auto failed: {e}", flush=True)
                return {"arm": name, "failed": True, "error": f"sync.outer.auto: {e}", "exit_codes": {}, "run_dir": str(run_dir)}
            job.overrides = [*picked, *sync_eval(cfg)]  # evaluated at the picked configuration's merges
            cfg = load_config(job.overrides, validate_for="demo")  # with them (train.eval_global: the global curve)
        if wan_bps and job.netns is not None:
            before = job.netns.uplink_bytes()
        job.start_lighthouses()
        job.start_all()
        codes = job.wait(timeout_s)
        if wan_bps and job.netns is not None:
            after = job.netns.uplink_bytes()
            wire = {"tx_bytes": sum(after[c][1] - before[c][1] for c in range(C)), "rx_bytes": sum(after[c][0] - before[c][0] for c in range(C)),
                    "per_cluster_tx": [after[c][1] - before[c][1] for c in range(C)], "rate_bps": wan_bps, "qdisc": job.netns.qdiscs(0).strip()}
    finally:
        job.stop()
    results = [job.result(k) for k in job.keys()]
    if any(r is None for r in results):
        return {"arm": name, "failed": True, "exit_codes": {f"c{c}r{r}": v for (c, r), v in codes.items()}, "run_dir": str(run_dir)}
    events = {k: read_events(replica_dir(run_dir, *k) / "events.jsonl") for k in job.keys()}
    mode = cfg.sync.mode
    slow = fast = 0.0
    for r in results:
        s, f = _split_bytes(mode, r, C, R)
        slow, fast = slow + s, fast + f
    floor = results[0]["entropy_floor"]
    final = sum(r["eval_loss"] for r in results) / len(results)
    levels = ["inner", "outer"] if mode == "hier" else [mode]
    local = [r["local_step_s"] for r in results if r.get("local_step_s")]
    wan_level, wan_n = ("outer", C) if mode == "hier" else (mode, C * R)
    curve_of = _time_curve if cfg.sync.async_outer.enabled else _curve  # asynchronous: clusters at different steps at one time

    def through_tbf(sent: float) -> float:
        # tbf's bucket goes ahead of the rate after an idle spell; the emulation's latency
        # floor (sync_ratio) overlaps this, never adds.
        return tbf_transfer_s(sent, wan_bps)
    return {
        "arm": name,
        "mode": mode,
        "sync_every": {"hier": [cfg.sync.inner.every, cfg.sync.outer.every], "flat": [cfg.sync.flat.every], "ddp": [1]}[mode],
        "outer_auto": auto_pick,  # sync.outer.auto: the overrides it picked (auto.json in the arm's run dir)
        "wall_s": max(r["wall_s"] for r in results),
        "job_wall_s": time.time() - t0,
        "slow_link_bytes": slow,
        "fast_link_bytes": fast,
        "final_eval_loss": final,
        "entropy_floor": floor,
        "excess_loss": None if floor is None else final - floor,
        "consistent": len({r["checksum"] for r in results}) == 1,
        "curve": curve_of(mode, events, C, R),
        # overlapped or asynchronous hier (train.eval_global): the global model, the one model the clusters share
        "curve_global": curve_of(mode, events, C, R, kind="eval_global") if cfg.train.eval_global else None,
        "sync": {lv: sync_ratio(results, lv, wan_n, through_tbf if wire and lv == wan_level else None) for lv in levels},
        "wire": None if wire is None else {**wire, "accounted_slow_bytes": slow, "wire_vs_accounted": wire["tx_bytes"] / slow if slow else None},
        "local_step_s": sum(local) / len(local) if local else None,
        "run_dir": str(run_dir),
    }


def to_target(curve: List[Dict[str, float]], target: float) -> Tuple[Optional[float], Optional[float]]:
    for p in curve:
        if p["loss"] <= target:
            return p["t"], p["slow_bytes"]
    return None, None


def late_cell(sy: Dict[str, Any]) -> str:
    """`` (after the last arrival: X ms = R, skew S ms)`` where the spans lined up (after_last_arrival)."""
    if sy.get("after_arrival_s") is None:
        return ""
    return (f" (after the last arrival {sy['after_arrival_s'] * 1e3:.0f} ms = {sy['after_arrival_ratio']:.2f}, "
            f"skew {sy['arrival_skew_s'] * 1e3:.0f} ms)")


def wire_cell(w: Optional[Dict[str, Any]]) -> str:
    """``MB (× accounted)`` of a kernel-link arm's uplink counters; ``-`` on emulated links."""
    if not w:
        return "-"
    ratio = "" if w.get("wire_vs_accounted") is None else f" ({w['wire_vs_accounted']:.3f}x)"
    return f"{w['tx_bytes'] / 1e6:.1f}{ratio}"


def table(rows: List[Dict[str, Any]], target: float) -> str:
    def f(x: Any, spec: str, scale: float = 1.0) -> str:
        return "-" if x is None else format(x / scale, spec)

    out = [f"| arm | sync every | wall s | slow-link MB | WAN wire MB (sent) | fast-link MB | final eval loss | excess | s to target {target:.3f} | slow MB to target | outer/single-level all-reduce: measured / bound | consistent |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("failed"):
            out.append(f"| {r['arm']} | FAILED {r['exit_codes']} |")
            continue
        lv = "outer" if r["mode"] == "hier" else r["mode"]
        sy = r["sync"].get(lv)
        syt = "-" if not sy else f"{sy['measured_s'] * 1e3:.0f} / {sy['bound_s'] * 1e3:.0f} ms = {sy['ratio']:.2f}" + late_cell(sy)
        out.append(
            f"| {r['arm']} | {r['sync_every']} | {r['wall_s']:.1f} | {f(r['slow_link_bytes'], '.1f', 1e6)} | {wire_cell(r.get('wire'))} | {f(r['fast_link_bytes'], '.1f', 1e6)} | "
            f"{r['final_eval_loss']:.4f} | {f(r['excess_loss'], '.4f')} | {f(r['time_to_target_s'], '.1f')} | {f(r['slow_bytes_to_target'], '.2f', 1e6)} | {syt} | {r['consistent']} |"
        )
    return "\n".join(out)


def plots(rows: List[Dict[str, Any]], out: Path) -> List[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for xkey, xlabel, fname, logx in [("t", "wall time since training started (s)", "bench_loss_vs_time.png", False),
                                       ("slow_bytes", "bytes on slow (WAN) links, all replica groups", "bench_loss_vs_slow_bytes.png", True)]:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for r in rows:
            if r.get("failed") or not r["curve"] or r["entropy_floor"] is None:
                continue
            pts = [p for p in r["curve"] if not (logx and p[xkey] <= 0)]
            ax.plot([p[xkey] for p in pts], [p["loss"] - r["entropy_floor"] for p in pts], marker="o", ms=3, label=r["arm"])
        if logx:
            ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss − entropy floor (nats)")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        paths.append(str(out / fname))
    return paths


def goals(rows: Dict[str, Dict[str, Any]], overhead: Optional[float]) -> List[str]:
    h = rows.get("hier")
    lines = []
    if not h or h.get("failed"):
        return ["hier arm missing: no goals evaluated"]

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return None if a is None or b is None or b == 0 else a / b

    for other, need_b, need_t in [("ddp", 100, 5), ("flat_budget", 2, 1.3), ("flat_count", 2, 1.3)]:
        o = rows.get(other)
        if not o or o.get("failed"):
            continue
        rb = ratio(o["slow_bytes_to_target"], h["slow_bytes_to_target"])
        rt = ratio(o["time_to_target_s"], h["time_to_target_s"])
        fb = "-" if rb is None else f"{rb:.1f}x"
        ft = "-" if rt is None else f"{rt:.2f}x"
        lines.append(f"slow-link bytes to target, {other} / hier = {fb} (goal >= {need_b}x); wall time to target {ft} (goal >= {need_t}x)")
    for lv, sy in h["sync"].items():
        if sy:
            lines.append(f"hier {lv} all-reduce: {sy['measured_s'] * 1e3:.1f} ms measured vs {sy['bound_s'] * 1e3:.1f} ms bound = {sy['ratio']:.2f}x (goal <= 1.2x)"
                         + late_cell(sy))
    if overhead is not None:
        lines.append(f"hier steps without a sync vs a bare loop: {overhead:+.1%} (goal <= +2%)")
    return lines


KERNEL_NOTE = ("WAN bandwidth: kernel tbf on every cluster uplink, both directions (user-space bandwidth padding off); "
               "WAN latency: user space, a floor of 2(n-1)*latency per collective; LAN: loopback inside each cluster's namespace, user-space emulated")


def links_unavailable(cfg: Config) -> Optional[str]:
    """With ``bench.links=kernel``: None if namespaces and tbf work here, else why not."""
    if cfg.bench.links != "kernel":
        return None
    from hier_localsgd.launch.netns import shaping_available

    return shaping_available()


def prepare(cfg: Config, overrides: List[str]) -> Optional[Tuple[Path, Dict[str, List[str]], int, List[str]]]:
    """The output folder, the arms, the steps per replica group and the overrides every arm
    shares (a single bench and a sweep alike); None, said in one line, if bench.links=kernel
    cannot run here."""
    out = Path(cfg.bench.out or Path(cfg.run.dir) / "bench")
    out.mkdir(parents=True, exist_ok=True)
    why = links_unavailable(cfg)
    if why:
        print(f"bench: bench.links=kernel: {why}", flush=True)
        return None
    common, arms, steps = plan_arms(cfg)
    # The workload's own settings yield to the user's (they come after them: the last wins).
    given = {o.split("=", 1)[0] for o in overrides if "=" in o}
    own = {o.split("=", 1)[0] for o in WORKLOADS[cfg.bench.mode]["over"]}
    common = [o for o in common if o.split("=", 1)[0] not in given & own]
    for name, extra in arms.items():  # an arm this workload cannot run fails here, in one line, not mid-sweep
        try:
            load_config([*overrides, *common, *extra], validate_for="demo")
        except ConfigError as e:
            fail("bench.arms", f"{name!r} cannot run with this workload ({e}); e.g. the *_fragF arms need bench.h_outer a multiple of F, overlapped ones >= 2F")
    return out, arms, steps, [*overrides, *common]


def run_bench(cfg: Config, overrides: List[str]) -> int:
    """One bench at ``bench.wan_gbps`` with one seed (cli.py runs bench_sweep.py instead when
    ``bench.sweep_gbps`` names WAN rates). Exit 0, 1 (a run failed), 2 (kernel links unavailable)."""
    prepared = prepare(cfg, overrides)
    if prepared is None:
        return 2
    out, arms, steps, base = prepared
    wan_bps = cfg.bench.wan_gbps * 1e9 if cfg.bench.links == "kernel" else 0.0
    print(f"bench ({cfg.bench.mode}, {cfg.bench.links} links): {list(arms)} + bare loop, {steps} steps per replica group -> {out}", flush=True)
    t0 = time.time()
    rows = []
    for name, extra in arms.items():
        print(f"[{time.time() - t0:.0f}s] arm {name} ...", flush=True)
        rows.append(run_arm(name, [*base, *extra], out, cfg.bench.timeout_s, wan_bps))
    print(f"[{time.time() - t0:.0f}s] bare loop ...", flush=True)
    bare_over = [o for o in base if o != "run.netns=true"]  # the bare loop has no network
    bare = run_bare([*bare_over, "sync.mode=hier"], load_config([*bare_over, "sync.mode=hier"], validate_for="demo"), out)
    by = {r["arm"]: r for r in rows}
    ddp = by.get("ddp")
    target = cfg.bench.target_loss or ((ddp["final_eval_loss"] + cfg.bench.target_margin) if ddp and not ddp.get("failed") else None)
    for r in rows:
        if not r.get("failed"):
            r["time_to_target_s"], r["slow_bytes_to_target"] = to_target(r["curve"], target) if target else (None, None)
    h = by.get("hier")
    overhead = (h["local_step_s"] / bare - 1.0) if h and not h.get("failed") and h.get("local_step_s") and bare else None
    report = {
        "mode": cfg.bench.mode,
        "steps": steps,
        "network": {"lan_gbps": cfg.bench.lan_gbps, "lan_latency_ms": cfg.bench.lan_latency_ms, "wan_gbps": cfg.bench.wan_gbps, "wan_latency_ms": cfg.bench.wan_latency_ms,
                    "links": cfg.bench.links, "what_is_kernel": KERNEL_NOTE if cfg.bench.links == "kernel" else None},
        "target_loss": target,
        "arms": rows,
        "bare_step_s": bare,
        "hier_local_step_s": h.get("local_step_s") if h else None,
        "nonsync_step_overhead": overhead,
        "goals": goals(by, overhead),
        "wall_s": time.time() - t0,
    }
    report["plots"] = plots(rows, out)
    md = table(rows, target or float("nan"))
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    (out / "bench.md").write_text(md + "\n\n" + "\n".join(f"- {g}" for g in report["goals"]) + "\n")
    print(md)
    for g in report["goals"]:
        print(f"  {g}")
    print(f"bench: {out / 'bench.md'}, {out / 'bench.json'}, plots {report['plots']}; {report['wall_s']:.0f} s")
    return 1 if any(r.get("failed") for r in rows) else 0
