"""``sync.outer.auto=true``: the outer configuration picked for the measured link and step
(issue #29 §3).

At the start of a local job (``hier-localsgd demo``, a bench arm), before any replica group
starts, the launcher

1. **measures the WAN** the outer level will use: all-reduces between one process per
   cluster over the job's own network (the cluster namespaces of ``run.netns``, shaped as
   the job's; or loopback with the configured ``links.outer`` emulation), a small payload
   and a large one, and fits the ring model's latency ``α`` and rate ``B`` to them
   (:func:`fit_link`);
2. **measures the step**: bare training loops (train/bare.py), one per replica group,
   concurrently, as the job's processes will run;
3. **chooses** with the planner's model (tools/plan/pick.py ``pick_outer``: every payload ×
   delay × fragments variant costed; the least modelled time to the target, counting the
   exposed outer time, the payload's step cost (``plan.topk2_step_cost``) and an overlapped
   merge's lag over ``train.steps``; among near-equals the least stale, then the fewest
   fragments, then the cheapest payload in loss), from those inputs only
   (:func:`choose`), and passes the pick's overrides to every process;
4. **logs** the inputs and the choice (``<run.dir>/auto.json``, one line on stdout); the
   dashboard shows it; ``python -m hier_localsgd.experiments.auto replay <auto.json>``
   recomputes the choice from the logged inputs alone.

What it replaces: ``sync.outer.compression``, ``delay`` and ``fragments`` (H_inner and
H_outer stay as configured), among the variants the job's config accepts (a lossy outer
link refuses topk2; a model with fewer layer units than fragments refuses F). While the job
runs, the demo's launcher watches the rate its outer rounds see and, when it moves past
``sync.outer.auto_rechoose``, probes again and re-chooses, restarting every group from its
durable checkpoints (experiments/auto_watch.py). What it does not do: choose for processes it
does not launch (a user's own launcher runs ``replay`` or the ``plan`` command and passes the
overrides to every process, so every process runs one configuration).

With the user-space emulation on loopback the measured rate is the emulator's (plus the
collective's own overhead): the measurement is of the path the job's bytes take, and on
kernel-shaped links (``run.netns=true``) of the kernel's shaper.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from hier_localsgd import costs
from hier_localsgd.core.links.lossy import LinkSpec
from hier_localsgd.core.runtime.status import AUTO_FILE
from hier_localsgd.tools.plan.network import OuterVariant, sync_times
from hier_localsgd.core.runtime.choices import TOPK2_STEP_COST
from hier_localsgd.tools.plan.pick import HIDE_FRACTION, overrides_of, pick_outer, variants

if TYPE_CHECKING:
    from hier_localsgd.config import Config
    from hier_localsgd.launch.local import LocalJob

SMALL_BYTES = 4096  # the latency probe
LARGE_BYTES = 1 << 20  # the rate probe's first size; grown until its transfer dominates
MAX_LARGE_BYTES = 64 << 20
PROBE_REPS = 3
PROBE_STEPS = 8  # bare-loop steps per replica group (the first, the warm-up, is trimmed)


@dataclass(frozen=True)
class AutoInputs:
    """Everything the choice depends on (logged; :func:`choose` is a function of it alone)."""

    clusters: int
    replicas: int
    h_inner: int
    h_outer: int
    sync_bytes: float  # one rank's model in fp32
    step_s: float  # measured: a bare loop's step with every group running
    wan_bandwidth_Bps: float  # measured
    wan_latency_s: float  # measured, one way per hop
    lan_bandwidth_Bps: float  # configured (links.inner): the inner level is not the subject
    lan_latency_s: float
    round_overhead_s: float  # plan.round_overhead_s
    base: Dict[str, Any] = field(default_factory=dict)  # the configured sync.outer (block, topk)
    hide_fraction: float = HIDE_FRACTION
    eager: bool = False  # sync.outer.eager as configured (off again if the pick blocks)
    # [compression, delay, fragments] the job's config refuses (a lossy outer link refuses
    # topk2, a model with fewer layer units than fragments refuses F): never picked.
    refused: List[List[Any]] = field(default_factory=list)
    steps: int = 0  # train.steps: the run over which an overlapped merge's lag counts (0: not counted)
    topk2_step_cost: float = TOPK2_STEP_COST  # plan.topk2_step_cost


def choose(inp: AutoInputs) -> Dict[str, Any]:
    """The pick (tools/plan/pick.py) for ``inp``: ``{"pick", "overrides", "rows", ...}``. The
    overrides name the picked configuration in full, ``sync.outer.auto=false`` included, so
    every process checks and runs that configuration."""
    lan = LinkSpec(bandwidth_Bps=inp.lan_bandwidth_Bps, latency_s=inp.lan_latency_s)
    wan = LinkSpec(bandwidth_Bps=inp.wan_bandwidth_Bps, latency_s=inp.wan_latency_s)
    st = sync_times(inp.sync_bytes, inp.clusters, inp.replicas, lan, wan, inp.round_overhead_s)
    got = pick_outer(st, inp.step_s, inp.clusters, wan, inp.round_overhead_s, inp.h_inner, inp.h_outer,
                     OuterVariant(**inp.base), inp.hide_fraction, refused={tuple(r) for r in inp.refused},
                     steps=inp.steps, topk2_step_cost=inp.topk2_step_cost)
    if inp.eager and got["pick"]["delay"] == 0:
        got["overrides"].append("sync.outer.eager=false")  # nothing to stand in for in a blocking round
    got["overrides"].append("sync.outer.auto=false")
    return got


def refused_variants(overrides: Sequence[str], h_outer: int, base: OuterVariant) -> List[List[Any]]:
    """The variants the job's config refuses (its own checks: load_config), as [compression,
    delay, fragments]."""
    from hier_localsgd.config import ConfigError, load_config

    out = []
    for v in variants(h_outer, base):
        try:
            load_config([*overrides, *overrides_of(v, base), "sync.outer.auto=false", "sync.outer.eager=false"], validate_for="demo")
        except ConfigError:
            out.append([v.compression, v.delay, v.fragments])
    return out


def fit_link(small: tuple[float, float], large: tuple[float, float], clusters: int) -> tuple[float, float]:
    """(rate B/s, one-way latency s) of a link from two ring all-reduce timings
    ``(payload bytes, seconds)``: ``t = 2(n−1)·α + ring_bytes(S, n)/B`` (costs.allreduce_time;
    ``clusters`` >= 2)."""
    (s0, t0), (s1, t1) = small, large
    wire0, wire1 = costs.ring_allreduce_bytes(s0, clusters), costs.ring_allreduce_bytes(s1, clusters)
    if wire1 <= wire0 or t1 <= t0:
        raise ValueError(f"auto: the large probe ({s1:.0f} B, {t1:.4f} s) was not slower than the small one ({s0:.0f} B, {t0:.4f} s)")
    rate = (wire1 - wire0) / (t1 - t0)
    latency = max(0.0, t0 - wire0 / rate) / costs.latency_hops("allreduce", clusters)
    return rate, latency


class Loopback:
    """Loopback as linkcheck's workers' network: every cluster on 127.0.0.1 (no namespaces)."""

    def service_address(self, _where: Any) -> str:
        return "127.0.0.1"

    def cluster_iface(self, _cluster: int) -> str:
        return "lo"

    def wrap(self, argv: Sequence[str], where: Any) -> List[str]:
        return list(argv)


def probe_wan(job: "LocalJob", cfg: "Config") -> Dict[str, Any]:
    """Times ring all-reduces of two sizes between one process per cluster on the job's
    network; returns the fitted link and every timing."""
    from hier_localsgd.experiments.linkcheck import run_workers

    from hier_localsgd.experiments.linkcheck import STORE_PORT
    from hier_localsgd.launch.local import free_port

    C = cfg.topology.clusters
    net = job.netns if job.netns is not None else Loopback()
    # The job's user-space emulation (kernel-shaped jobs set no rate there, but may keep a latency).
    emu = cfg.link_spec("outer")
    port = STORE_PORT if job.netns is not None else free_port()  # loopback is shared with whatever else runs here

    def timed(nbytes: int) -> float:
        res = run_workers(net, C, nbytes, PROBE_REPS, emu.bandwidth_Bps, emulate_latency_s=emu.latency_s, port=port)
        return statistics.median(max(r["times_s"][i] for r in res) for i in range(PROBE_REPS))

    t_small = timed(SMALL_BYTES)
    large, t_large = LARGE_BYTES, timed(LARGE_BYTES)
    while t_large < 10 * t_small + 0.05 and large < MAX_LARGE_BYTES:  # the transfer must dominate the fit
        large *= 8
        t_large = timed(large)
    rate, latency = fit_link((SMALL_BYTES, t_small), (large, t_large), C)
    return {"bandwidth_Bps": rate, "latency_s": latency, "probes": [[SMALL_BYTES, t_small], [large, t_large]],
            "network": "netns" if job.netns is not None else "loopback (links.outer emulation)"}


def probe_step(cfg: "Config", overrides: List[str], out: Path) -> tuple[float, int]:
    """(a bare loop's mean step time, one per replica group, run concurrently; the model's
    parameter count)."""
    from hier_localsgd.experiments.bare_loops import run_bare

    over = [*overrides, f"train.steps={PROBE_STEPS}", "train.eval_every=0"]
    step = run_bare(over, cfg, out)
    first = out / "bare" / "c0r0.json"
    if step is None or not first.exists():
        raise RuntimeError(f"auto: the bare-loop step probe wrote no result under {out / 'bare'}")
    return step, int(json.loads(first.read_text())["params"])


def inputs_for(cfg: "Config", overrides: Sequence[str], step_s: float, params: int, wan: Dict[str, Any]) -> AutoInputs:
    """The choice's inputs: the measured step and WAN, the rest from ``cfg``."""
    from hier_localsgd.core.runtime.device import DTYPES

    lan = cfg.link_spec("inner")
    o = cfg.sync.outer
    base = OuterVariant(block=o.compression_block, topk=o.topk)
    # What one rank syncs: its slice (1/G of the model) in the parameters' dtype.
    elem = DTYPES[cfg.train.param_dtype].itemsize
    return AutoInputs(
        clusters=cfg.topology.clusters, replicas=cfg.topology.replicas_per_cluster,
        h_inner=cfg.sync.inner.every, h_outer=o.every, sync_bytes=float(params * elem) / cfg.topology.ranks_per_replica,
        step_s=step_s, wan_bandwidth_Bps=wan["bandwidth_Bps"], wan_latency_s=wan["latency_s"],
        lan_bandwidth_Bps=lan.bandwidth_Bps, lan_latency_s=lan.latency_s, round_overhead_s=cfg.plan.round_overhead_s,
        base=asdict(base), eager=o.eager, refused=refused_variants(overrides, o.every, base),
        steps=cfg.train.steps, topk2_step_cost=cfg.plan.topk2_step_cost,
    )


def resolve(cfg: "Config", job: "LocalJob") -> List[str]:
    """Measures, chooses, logs; returns the overrides every process of ``job`` gets."""
    from hier_localsgd.tools.plan.planner import check_plan_section

    check_plan_section(cfg.plan)  # the pick reads plan.round_overhead_s and plan.topk2_step_cost
    run_dir = Path(job.run_dir)
    wan = probe_wan(job, cfg)
    step_s, params = probe_step(cfg, list(job.overrides), run_dir / "auto_probe")
    inp = inputs_for(cfg, list(job.overrides), step_s, params, wan)
    choice = choose(inp)
    record = {"inputs": asdict(inp), "wan_probe": wan, "pick": choice["pick"], "overrides": choice["overrides"]}
    (run_dir / AUTO_FILE).write_text(json.dumps(record, indent=2))
    p = choice["pick"]
    print(f"auto: WAN {wan['bandwidth_Bps'] * 8 / 1e6:.1f} Mbit/s {wan['latency_s'] * 1e3:.1f} ms, step {step_s * 1e3:.0f} ms "
          f"-> {' '.join(choice['overrides'])} (outer round {p['outer_round_s']:.2f} s, exposed {p['outer_exposed_per_step_s'] * 1e3:.1f} "
          f"ms/step, {'hides' if p['hides'] else 'does not hide'}, modelled time {p['time_factor']:.3f}x an outer level that costs nothing; "
          f"{run_dir / AUTO_FILE})", flush=True)
    return choice["overrides"]


def replay(path: str | Path) -> Dict[str, Any]:
    """The choice recomputed from a logged ``auto.json``'s inputs alone."""
    record = json.loads(Path(path).read_text())
    return choose(AutoInputs(**record["inputs"]))


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m hier_localsgd.experiments.auto replay <auto.json>``: prints the overrides the
    logged inputs give, and whether they are the logged ones."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "replay":
        print("usage: python -m hier_localsgd.experiments.auto replay <run.dir>/auto.json", file=sys.stderr)
        return 2
    logged = json.loads(Path(argv[1]).read_text())["overrides"]
    again = replay(argv[1])["overrides"]
    print(" ".join(again))
    print("same as logged" if again == logged else f"differs from the logged {' '.join(logged)}")
    return 0 if again == logged else 1


if __name__ == "__main__":
    sys.exit(main())
