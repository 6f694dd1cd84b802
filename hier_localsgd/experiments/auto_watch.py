"""``sync.outer.auto`` re-chooses when the WAN changes while the job runs (issue #29 §3).

The launcher's pick at the start (experiments/auto.py) rests on one measurement of the WAN.
While the job runs, :class:`LinkWatch` reads what the outer level's payload collectives take
in every replica group's published status (the link counters: seconds inside the
collectives, the bytes they carried, how many there were) and turns each new batch of them
into a **reading**: the bytes a leader sent over the collectives' time, less their latency
terms at the probed latency. It sends nothing itself: the job's own rounds are the
measurement.

A passive reading is biased (a leader's collective also holds its wait for a later leader;
a busy CPU slows it; a small round on a fast link is all latency), and the bias is the same
while nothing changes. So the watch **detects** a change against a baseline, the median of
its first :data:`WINDOWS` readings under the running pick: :data:`WINDOWS` readings in a row
beyond ``sync.outer.auto_rechoose`` (a factor f: outside [1/f, f] of the baseline), on the same
side. It then asks the planner (:func:`auto.choose`) for the pick at the readings' rate, every
other input as logged. Only a pick that differs **fires**, and then
:func:`wait_rechoosing` stops every replica group, **probes the WAN again** while it carries
nothing (:func:`auto.probe_wan`, as at the start: the readings decide whether to stop, the
probe decides what to run), picks for the probed link, logs the readings, the probe and the
pick in ``auto.json`` (its top holds the running pick, which ``replay`` recomputes; its
``history`` every pick), and starts every group again with the new overrides and
``checkpoint.resume=true``. Every group resumes from its newest durable checkpoint; the join
round heals the rest.

Failure semantics and costs:

* Needs durable checkpoints (``checkpoint.every > 0``): without them a restart would lose the
  run, so the watch stays off and says so in one line.
* A probe that fails after the stop (it raises: a worker that timed out, say) restarts every
  group with the running pick, says so in one line, and takes the changed link's readings as
  the new baseline (no second stop for the same change).
* A re-choice costs the steps since each group's newest checkpoint (up to
  ``checkpoint.every`` outer rounds, and a round's checkpoint is written after its commit),
  the probe (seconds; longer on a slow link, whose large probe takes longer), and a restart
  (the processes' imports and the join). A compression residual written for another codec
  starts from zeros (sync/compression.py: a bounded, one-off loss); an overlapped round in
  flight at the stop is not lost work: its cluster's steps since the last applied global
  model are in the checkpoint's model and go into the next round.
* The step time, the model and the rest stay as probed at the start; the probe measures the
  rate and the latency again. A link that moves by less than the factor, or to a rate at
  which the planner picks the same, keeps its pick and its groups.
* A group that restarts (a crash) publishes new counters; its first reading after the restart
  is skipped. Readings exist only where collectives complete: a link that carries nothing
  (a partition) gives none, and the job's own fault handling applies.
* Local jobs only (``demo``; the bench's links do not change): a user's own launcher runs
  ``replay`` or ``plan`` and restarts its processes with the overrides itself.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from hier_localsgd import costs
from hier_localsgd.core.links.stats import PAYLOAD, sent_per_rank
from hier_localsgd.core.runtime.status import AUTO_FILE, write_json_atomic
from hier_localsgd.experiments.auto import AutoInputs, choose, probe_wan

if TYPE_CHECKING:
    from hier_localsgd.config import Config
    from hier_localsgd.launch.local import Key, LocalJob

WINDOWS = 3  # readings that make the baseline, and readings in a row beyond the factor that re-choose
MIN_TRANSFER_S = 1e-3  # a collective's transfer time is counted as at least this (latency-bound rounds)

RING_OPS = ("allreduce", "alltoall", "allgather")  # the collectives of a synchronous outer round (not a push's HTTP)
Counters = Dict[str, Tuple[float, float, int]]  # op -> (seconds inside, tensor bytes, calls)


def outer_counters(status: Optional[Dict[str, Any]]) -> Counters:
    """The outer level's payload collectives in a published status (api.py ``link``): those of
    :data:`RING_OPS` that were timed (every link times them since core/links/link.py's
    ``_timed_work``; an asynchronous outer level's pushes are not read)."""
    link = ((status or {}).get("link") or {}).get("outer") or {}
    secs, tensor, calls = (link.get(k) or {} for k in ("seconds", "tensor_bytes", "calls"))
    out: Counters = {}
    for key, s in secs.items():
        op, _, kind = key.partition("/")
        if kind == PAYLOAD and op in RING_OPS and calls.get(key):
            out[op] = (float(s), float(tensor.get(key, 0)), int(calls[key]))
    return out


def window_rate(before: Counters, after: Counters, world: int, latency_s: float) -> Optional[float]:
    """The rate (B/s) of the collectives completed between two readings of one process's
    counters: the bytes it sent over their time, less each collective's latency terms. None
    when none completed (or the counters went back: a restarted process)."""
    sent = busy = 0.0
    for op, (s1, b1, n1) in after.items():
        s0, b0, n0 = before.get(op, (0.0, 0.0, 0))
        n = n1 - n0
        if n <= 0 or s1 < s0:
            continue
        sent += n * sent_per_rank(op, (b1 - b0) / n, world)
        busy += max(MIN_TRANSFER_S * n, (s1 - s0) - n * costs.latency_hops(op, world) * latency_s)
    return sent / busy if sent > 0 and busy > 0 else None


class LinkWatch:
    """Watches the outer level's rate under the running pick; :meth:`poll` says when to re-choose.

    ``inputs`` are the running pick's (auto.json's), ``factor`` is ``sync.outer.auto_rechoose``.
    After :meth:`poll` returned a choice, :meth:`restarted` starts a new baseline under it.
    """

    def __init__(self, job: "LocalJob", inputs: AutoInputs, overrides: Sequence[str], factor: float) -> None:
        if factor <= 1:
            raise ValueError(f"LinkWatch: factor {factor} must be above 1")
        self.job, self.inputs, self.overrides, self.factor = job, inputs, list(overrides), factor
        self.readings: List[float] = []
        self.baseline: Optional[float] = None
        self._seen: Dict["Key", Tuple[Any, Counters]] = {}

    def read(self) -> Optional[float]:
        """A reading: the highest rate among the groups whose outer collectives completed since
        the last poll (the leader that waited least for the others), or None."""
        rates = []
        for key in self.job.keys():
            st = self.job.last_status(key)
            if st is None:
                continue
            now, who = outer_counters(st), st.get("started_at")
            prev = self._seen.get(key)
            self._seen[key] = (who, now)
            if prev is not None and prev[0] == who:
                r = window_rate(prev[1], now, self.inputs.clusters, self.inputs.wan_latency_s)
                if r is not None:
                    rates.append(r)
        return max(rates) if rates else None

    def poll(self) -> Optional[Dict[str, Any]]:
        """Takes a reading; returns ``{"rate_Bps", "ratios", "baseline_Bps", "pick"}`` when the
        link has moved past the factor and the planner's pick at the readings' rate differs
        from the running one (the job must stop and re-probe), else None."""
        r = self.read()
        if r is None:
            return None
        if self.baseline is None:
            self.readings.append(r)
            if len(self.readings) == WINDOWS:
                self.baseline, self.readings = statistics.median(self.readings), []
            return None
        self.readings = (self.readings + [r])[-WINDOWS:]
        ratios = [x / self.baseline for x in self.readings]
        if len(ratios) < WINDOWS or not (all(x > self.factor for x in ratios) or all(x < 1 / self.factor for x in ratios)):
            return None
        rate = statistics.median(self.readings)
        got = choose(replace(self.inputs, wan_bandwidth_Bps=rate))
        if got["overrides"] == self.overrides:
            return None
        return {"rate_Bps": rate, "ratios": ratios, "baseline_Bps": self.baseline, "pick": got["pick"]}

    def restarted(self, inputs: AutoInputs, overrides: Sequence[str]) -> None:
        """The job runs ``overrides`` (picked for ``inputs``) from now: a new baseline."""
        self.inputs, self.overrides = inputs, list(overrides)
        self.readings, self.baseline, self._seen = [], None, {}


def log_rechoice(run_dir: Path, seen: Dict[str, Any], probe: Dict[str, Any], inputs: AutoInputs, got: Dict[str, Any],
                 step: Optional[int]) -> None:
    """``auto.json`` holds the running pick at its top (``inputs``, ``pick``, ``overrides``:
    what ``replay`` recomputes) and every pick in ``history``, the start's first; a re-choice
    logs what the watch read (``seen``) and what the new probe measured."""
    path = run_dir / AUTO_FILE
    rec = json.loads(path.read_text())
    history = rec.get("history") or [{"reason": "start", "t": None, "inputs": rec["inputs"], "pick": rec["pick"], "overrides": rec["overrides"]}]
    entry = {"reason": "link", "t": time.time(), "step": step, "seen": seen, "wan_probe": probe, "inputs": asdict(inputs),
             "pick": got["pick"], "overrides": got["overrides"]}
    rec.update(inputs=entry["inputs"], wan_probe=probe, pick=got["pick"], overrides=got["overrides"], history=[*history, entry])
    write_json_atomic(path, rec)  # the dashboard reads it while the job runs


def watch_for(cfg: "Config", job: "LocalJob") -> Optional[LinkWatch]:
    """The watch of an auto job, from its ``auto.json``; None (and one line saying why) where it
    cannot run: ``sync.outer.auto_rechoose=0``, or no durable checkpoints to restart from."""
    o = cfg.sync.outer
    if not o.auto or not o.auto_rechoose:
        return None
    if not cfg.checkpoint.every:
        print("auto: no re-choice if the link changes: it restarts from durable checkpoints (set checkpoint.every > 0)", flush=True)
        return None
    rec = json.loads((Path(job.run_dir) / AUTO_FILE).read_text())
    return LinkWatch(job, AutoInputs(**rec["inputs"]), rec["overrides"], o.auto_rechoose)


def wait_rechoosing(job: "LocalJob", cfg: "Config", watch: Optional[LinkWatch], compose: Callable[[List[str]], List[str]],
                    timeout_s: float, tick: Optional[Callable[[], None]] = None, restart: bool = False) -> Dict["Key", Optional[int]]:
    """``job.wait`` that re-chooses when ``watch`` fires: stops every group, probes the WAN
    again while it carries nothing (auto.probe_wan, as at the start), picks for the probed
    link (the step and the rest as logged), logs it, and starts every group again with
    ``compose(new overrides)`` and ``checkpoint.resume=true`` (the lighthouses stay up).
    ``compose`` turns a pick's overrides into the job's whole override list. Returns the
    exit codes as ``job.wait`` does."""
    deadline = time.time() + timeout_s
    while True:
        fired: List[Dict[str, Any]] = []

        def check() -> bool:
            if tick is not None:
                tick()
            if watch is not None:
                seen = watch.poll()
                if seen is not None:
                    fired.append(seen)
            return bool(fired)

        codes = job.wait(max(0.0, deadline - time.time()), tick=check, restart=restart)
        if not fired or time.time() >= deadline or all(c is not None for c in codes.values()):
            return codes  # (a reading after the last group exited changes nothing)
        assert watch is not None
        seen = fired[0]
        step = max((int((job.last_status(k) or {}).get("step") or 0) for k in job.keys()), default=None)
        print(f"auto: the outer rounds read {seen['rate_Bps'] * 8 / 1e6:.2f} Mbit/s, {statistics.median(seen['ratios']):.3g}x "
              f"their baseline: stopping every group to probe the WAN again", flush=True)
        job.stop_replicas("sync.outer.auto: re-choosing for the link")
        try:
            probe = probe_wan(job, cfg)
        except Exception as e:  # the groups are stopped: they go on with the running pick
            print(f"auto: the WAN probe failed ({e}); every group resumes with the running pick", flush=True)
            inputs, overrides = watch.inputs, watch.overrides
        else:
            inputs = replace(watch.inputs, wan_bandwidth_Bps=probe["bandwidth_Bps"], wan_latency_s=probe["latency_s"])
            got = choose(inputs)
            overrides = got["overrides"]
            log_rechoice(Path(job.run_dir), seen, probe, inputs, got, step)
            print(f"auto: WAN {probe['bandwidth_Bps'] * 8 / 1e6:.1f} Mbit/s {probe['latency_s'] * 1e3:.1f} ms -> "
                  f"{' '.join(overrides)}; every group resumes from its newest checkpoint", flush=True)
        job.overrides = [*compose(overrides), "checkpoint.resume=true"]
        watch.restarted(inputs, overrides)  # a new baseline: after a failed probe, the changed link's
        job.start_all()
