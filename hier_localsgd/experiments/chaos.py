"""``hier-localsgd chaos``: kill processes on a seeded schedule and measure the recovery.

Runs the configured topology on this machine (as the demo does), and while it trains
SIGKILLs processes by role — a ``non_leader`` replica group, a cluster's ``leader``, or a
whole ``cluster`` — at exponentially distributed intervals with mean
``chaos.kill_every_s`` (seeded by ``chaos.seed``); ``chaos.kinds`` adds phase-targeted and
simultaneous kills, hangs (SIGSTOP), lighthouse kills and network partitions
(chaos_faults.py, which also holds their evidence). Killed processes are restarted after
``chaos.restart_delay_s``, as the launch script or torchelastic would; they rejoin and
heal. No kills happen once every running process has passed ``chaos.stop_kills_at`` of the
steps, so the run can end consistent, and none that would leave no *continuous* process
(below): killing a cluster while the only other one is a fresh restart that has not healed
yet would end the job's trained state, which no restart can recover. With
``chaos.baseline``, a failure-free run with the same seed goes first.

Every figure in the report (``chaos.report``, default ``<run.dir>/chaos_report.json``, plus
a human summary) is computed from evidence: what the processes published (events.jsonl,
status.json, result.json) and the launcher's own record of starts, kills, exits (each
with the process's last status) and restarts. A figure without evidence is ``None``, not
a guess.

Terms. An *incarnation* is one process of one replica group (a restart is a new one). An
*outage* is a kill by the monkey (its targets) or an incarnation that exited non-zero on
its own. An incarnation *holds its cluster's model* from its start if it is one of the
job's first processes, else from its first inner heal or first inner commit at a step > 0
(a restart of a whole cluster holds a new model trained from step 0). A cluster is *lost*
in an outage when no incarnation outside the outage holds its model at that moment (a
``cluster`` kill; also a ``leader`` kill while the cluster's other groups are down). The
outage's *survivors* are the incarnations outside it that hold a model at that moment. An
incarnation is *continuous* if it is one of the job's first processes, or a restarted one
from its own heal on: its model descends without a break from the job's start.

* ``kills``: time, role, targets, each target's phase and step when killed.
* ``time_to_next_commit_s`` per kill: from the kill to the survivors' next commit — an
  *outer* commit by another cluster when the kill lost a cluster (inner commits never
  needed the dead cluster), else an inner commit by a surviving group of the victim's
  cluster.
* ``time_to_heal_s`` per restart (``restarts``): from the restart to the restarted
  incarnation's first inner commit at a step > 0 whose (step, model checksum) equals an
  inner commit that another continuous incarnation made after the outage. Step 0 never
  counts: every process's join round commits the same initial model. Commits from before
  the outage do not count either: a cluster restarted whole retrains from step 0 on the
  same batches and commits, at step 5, what it committed at step 5 before. Its two groups
  match each other but neither is continuous, so a lost cluster heals only when it matches
  another cluster, after it adopted a global model through an outer round (its leader's
  outer ``heal`` event alone is not evidence: the identical commit is).
* ``recovered``: kills whose every target's own restart (the first restart of that
  target after the kill) healed.
* ``hangs``: waits that ran into their deadline (``timeout`` events the processes write,
  decided by the clock, see comm.py), watchdog exits (the process's ``watchdog`` event,
  or exit code 3 recorded by the launcher without one), and stalls (no replica group's
  step advanced for longer than the heartbeat timeout plus the longest phase timeout
  while one was training, recorded by this driver); ``hangs_detail`` lists each.
* ``goodput`` = tokens whose work reaches the final model / tokens computed. Every replica
  group computes ``train.batch_size x train.seq_len x topology.ranks_per_replica`` tokens per
  local step, so this is steps kept / steps run, over every incarnation (a killed one's
  counters are its last status, read by the launcher when it records the exit, or by the
  monkey just before the kill). A step is kept only if it was committed at the inner
  level AND its cluster's model carrying it was then committed at the outer level with
  non-zero cluster weight (sync/hier.py discards what a live process loses at weight 0), or it
  is in the final model: work since the last outer commit at the end of the run counts
  as kept only if the run ended consistent (one final model), else it is
  ``unmerged_at_end``. Lost, in ``steps_lost``: ``rolled_back_or_weight0`` (the processes'
  own counters), ``uncommitted_at_death`` (a dead incarnation's steps since its last inner
  commit), ``with_lost_cluster`` (a dead incarnation's inner-committed steps when its
  cluster was lost before the next outer commit: a whole-cluster kill loses them, a
  leader-only or non-leader kill does not, since the cluster's survivors carry them),
  ``at_outer_weight0`` (those steps carried by survivors into an outer commit where the
  cluster had weight 0), ``unmerged_at_end``.
* ``process_efficiency``: 1 - (``rolled_back_or_weight0`` + ``uncommitted_at_death``) / steps
  run: the processes' own accounting, which ignores work lost with a cluster. This is
  what the simulator's "steps kept / steps run" predicts (docs/planner.md).
* ``throughput_retained`` = failure-free wall time / chaos wall time, both for
  ``train.steps`` steps (needs ``chaos.baseline``, and both runs to reach the steps;
  else None).
* ``consistent`` (identical final checksums) and the final eval loss next to the
  failure-free run's.
"""

from __future__ import annotations

import json
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from hier_localsgd.experiments.chaos_faults import FAULT_KINDS, PendingFaults, at_level, fault_evidence, is_commit, signal_group
from hier_localsgd.config import Config, load_config
from hier_localsgd.experiments.summary import summarize
from hier_localsgd.launch.local import Key, LocalJob
from hier_localsgd.core.phases import Phase
from hier_localsgd.core.status import read_events, replica_dir

WORK_KEYS = ("steps_run", "steps_discarded", "steps_since_commit", "steps_since_outer")


def name(key: Key) -> str:
    return f"c{key[0]}r{key[1]}"


def parse_name(s: str) -> Key:
    c, r = s[1:].split("r")
    return int(c), int(r)


def stall_limit_s(cfg: Config) -> float:
    """Heartbeat timeout + the longest phase timeout: the longest no replica group may go
    without a step when nothing hangs (a dead peer is noticed, then one phase runs out)."""
    t = cfg.timeouts_obj()
    phases = (Phase.INNER_QUORUM, Phase.INNER_REDUCE, Phase.INNER_COMMIT, Phase.OUTER_QUORUM, Phase.OUTER_REDUCE, Phase.OUTER_COMMIT, Phase.BROADCAST)
    return cfg.lighthouse.heartbeat_timeout_ms / 1000.0 + max(t.phase(p).total_seconds() for p in phases)


class StallWatch:
    """Records a stall when no replica group's step advanced for longer than ``limit_s``
    while one of them was training (state ``running``, alive, short of its steps)."""

    def __init__(self, job: LocalJob, limit_s: float, steps_total: int, t0: Optional[float] = None) -> None:
        self.job, self.limit_s, self.steps_total = job, limit_s, steps_total
        self.t0 = time.time() if t0 is None else t0
        self.last_progress = self.t0
        self.best: Dict[Tuple[Key, Any], int] = {}
        self.stalls: List[Dict[str, Any]] = []
        self._open: Optional[Dict[str, Any]] = None

    def __call__(self) -> None:
        now = time.time()
        progressed = training = False
        steps = {}
        for key, proc in self.job.replicas.items():
            st = self.job.status(key) or {}
            step = st.get("step")
            if not isinstance(step, int):
                continue
            steps[name(key)] = step
            inc = (key, st.get("pid"))
            if inc in self.best and step > self.best[inc]:
                progressed = True  # a new incarnation's first status is no progress
            self.best[inc] = max(step, self.best.get(inc, step))
            if proc.popen.poll() is None and st.get("state") == "running" and step < self.steps_total:
                training = True
        if progressed or not training:
            if self._open is not None:
                self._open["duration_s"] = now - self.t0 - self._open["since"]
                self._open = None
            self.last_progress = now
        elif self._open is None and now - self.last_progress > self.limit_s:
            self._open = {"t": now - self.t0, "since": self.last_progress - self.t0, "limit_s": self.limit_s, "steps": steps, "duration_s": None}
            self.stalls.append(self._open)

    def finish(self) -> None:
        if self._open is not None:
            self._open["duration_s"] = time.time() - self.t0 - self._open["since"]
            self._open = None


class ChaosMonkey:
    """Picks and kills targets on the seeded schedule; records what it did (and stalls)."""

    def __init__(self, job: LocalJob, cfg: Config) -> None:
        ch = cfg.chaos
        self.job, self.cfg = job, cfg
        self.rng = random.Random(ch.seed)
        self.mean = ch.kill_every_s
        self.roles = list(ch.roles)
        self.stop_at_step = int(cfg.train.steps * ch.stop_kills_at)
        self.t0 = time.time()
        self.next_kill = self.t0 + self.rng.expovariate(1.0 / self.mean)
        self.kills: List[Dict[str, Any]] = []
        self.work_at_kill: List[Dict[str, Any]] = []
        self.stall = StallWatch(job, stall_limit_s(cfg), cfg.train.steps, self.t0)
        # Kinds other than plain kills (chaos_faults.py); partitions only where the job
        # runs in network namespaces.
        self.kinds = [k for k in ch.kinds if k != "partition" or job.netns is not None]
        self.faults: List[Dict[str, Any]] = []
        self.pending = PendingFaults()
        self.armed: Optional[Dict[str, Any]] = None  # a phase_kill waiting for its phase
        self.kinds_done: List[str] = []

    def _running(self, continuous: Sequence["Incarnation"]) -> Dict[Key, dict]:
        """Processes a fault may hit: running, and continuous (not still recovering from an
        earlier fault: a restart counts once it has healed), so each fault's recovery is
        its own."""
        keys = {i.key for i in continuous}
        out = {}
        for key, proc in self.job.replicas.items():
            st = self.job.status(key) or {}
            if proc.popen.poll() is None and st.get("state") == "running" and st.get("pid") == proc.popen.pid and key in keys:
                out[key] = st
        return out

    def _continuous_now(self) -> List["Incarnation"]:
        events = {k: read_events(replica_dir(self.job.run_dir, *k) / "events.jsonl") for k in self.job.keys()}
        return Timeline(self.job.history, events, self.kills).continuous(time.time())

    def _pick(self, role: str, running: Dict[Key, dict], continuous: Sequence["Incarnation"]) -> Optional[List[Key]]:
        t = self.cfg.topology
        if role == "leader":
            cands = [[k] for k, st in running.items() if st.get("leader")]
        elif role == "non_leader":
            cands = [[k] for k, st in running.items() if not st.get("leader")]
        else:
            cands = [
                [(c, r) for r in range(t.replicas_per_cluster)]
                for c in range(t.clusters)
                if all((c, r) in running for r in range(t.replicas_per_cluster))
            ]
            if len(cands) < 2:  # never kill the last cluster standing
                cands = []
        # Never kill the last processes whose model continues from the job's start (a cluster
        # restarted whole is not standing until it healed): that would end the job's state,
        # and nothing could recover from it.
        cands = [ts for ts in cands if any(i.key not in ts for i in continuous)]
        return self.rng.choice(cands) if cands else None

    def __call__(self) -> None:
        self.stall()
        now = time.time()
        for action, arg in self.pending.due(now):
            self._end(action, arg)
        if self.armed is not None:
            self._phase_kill(now)
        if now < self.next_kill:
            return
        continuous = self._continuous_now()  # read once per fault: every events file
        running = self._running(continuous)
        if not running or min(int(st.get("step", 0)) for st in running.values()) >= self.stop_at_step:
            self.next_kill = float("inf")
            return
        # One fault of the non-kill kinds at a time (their evidence is per fault); with
        # kills only, no draw is made, so a seed gives the schedule it always gave.
        kinds = [k for k in self.kinds if not (k in FAULT_KINDS and self.pending.busy) and not (k == "phase_kill" and self.armed)]
        if self.cfg.chaos.draw == "cycle":  # in order; one still in progress waits its turn
            kind = self.kinds[len(self.kinds_done) % len(self.kinds)]
            kind = kind if kind in kinds else None
        else:
            kind = None if not kinds else kinds[0] if len(self.kinds) == 1 else self.rng.choice(kinds)
        done = False
        if kind == "kill":
            done = self._kill_role(running, continuous, now)
        elif kind == "phase_kill":
            role, phase = self.rng.choice(list(self.cfg.chaos.phase_targets)).split(":")
            self.armed = {"role": role, "phase": phase, "since": now}
            done = True
        elif kind == "multi_kill":
            done = self._multi_kill(running, continuous, now)
        elif kind is not None:
            done = self._fault(kind, running, now)
        if not done:
            self.next_kill = now + 1.0  # nothing eligible right now (restarting); try again soon
            return
        self.kinds_done.append(kind)
        self.next_kill = now + self.interval()

    def interval(self) -> float:
        """Time to the next fault: exponential with mean chaos.kill_every_s, or exactly that
        with chaos.draw=cycle (a fixed, reproducible schedule)."""
        return self.mean if self.cfg.chaos.draw == "cycle" else self.rng.expovariate(1.0 / self.mean)

    def _kill(self, targets: List[Key], running: Dict[Key, dict], now: float, role: str, kind: str = "kill", **extra: Any) -> None:
        record = {"t": now - self.t0, "t_abs": now, "kind": kind, "role": role, "targets": [name(k) for k in targets],
                  "pids": {}, "phase": {}, "step": {}, **extra}
        for key in targets:
            st = running[key]
            record["phase"][name(key)] = st.get("phase")
            record["step"][name(key)] = st.get("step")
            record["pids"][name(key)] = st.get("pid")
            self.work_at_kill.append({"key": key, "pid": st.get("pid"), **{k: st.get(k, 0) for k in WORK_KEYS}})
            self.job.kill(key, signal.SIGKILL)
        self.kills.append(record)

    def _kill_role(self, running: Dict[Key, dict], continuous: Sequence["Incarnation"], now: float) -> bool:
        roles = self.roles[:]
        self.rng.shuffle(roles)
        for role in roles:
            targets = self._pick(role, running, continuous)
            if targets:
                self._kill(targets, running, now, role)
                return True
        return False

    def _phase_kill(self, now: float) -> None:
        """Fires an armed phase_kill once a process of its role shows its phase (or, after
        ``chaos.phase_arm_s``, in whatever phase the role's first process is)."""
        arm = self.armed
        assert arm is not None
        continuous = self._continuous_now()
        running = self._running(continuous)
        cands = sorted(k for k, st in running.items() if bool(st.get("leader")) == (arm["role"] == "leader")
                       and any(i.key != k for i in continuous))
        hits = [k for k in cands if running[k].get("phase") == arm["phase"]]
        if hits or (cands and now - arm["since"] > self.cfg.chaos.phase_arm_s):
            target = (hits or cands)[0]
            self._kill([target], running, now, arm["role"], kind="phase_kill", armed_phase=arm["phase"], phase_hit=bool(hits))
            self.armed = None

    def _multi_kill(self, running: Dict[Key, dict], continuous: Sequence["Incarnation"], now: float) -> bool:
        """Two replica groups of different clusters at once (a leader and a non-leader where there are)."""
        by_cluster: Dict[int, List[Key]] = {}
        for k in running:
            by_cluster.setdefault(k[0], []).append(k)
        if len(by_cluster) < 2:
            return False
        c1, c2 = self.rng.sample(sorted(by_cluster), 2)
        first = [k for k in by_cluster[c1] if running[k].get("leader")] or by_cluster[c1]
        second = [k for k in by_cluster[c2] if not running[k].get("leader")] or by_cluster[c2]
        targets = [self.rng.choice(first), self.rng.choice(second)]
        if not any(i.key not in targets for i in continuous):
            return False
        self._kill(targets, running, now, "multi", kind="multi_kill")
        return True

    def _fault(self, kind: str, running: Dict[Key, dict], now: float) -> bool:
        ch = self.cfg.chaos
        rec: Dict[str, Any] = {"t": now - self.t0, "t_abs": now, "kind": kind}
        if kind == "hang":
            key = self.rng.choice(sorted(running))
            st = running[key]
            rec.update(target=name(key), phase=st.get("phase"), step=st.get("step"), leader=st.get("leader"), duration_s=ch.hang_s)
            signal_group(self.job.replicas[key].popen.pid, signal.SIGSTOP)
            self.pending.add(now + ch.hang_s, "cont", self.job.replicas[key].popen.pid)
        elif kind == "lighthouse":
            role = self.rng.choice(sorted(self.job.lighthouses))
            rec.update(target=role, duration_s=self.cfg.lighthouse.restart_delay_s)
            self.job.kill_lighthouse(role)  # the launcher's supervisor brings it back
        else:  # partition
            c = self.rng.randrange(self.cfg.topology.clusters)
            rec.update(target=f"cluster{c}", duration_s=ch.partition_s)
            self.job.partition(c)  # type: ignore[attr-defined]
            self.pending.add(now + ch.partition_s, "heal", c)
        self.faults.append(rec)
        return True

    def _end(self, action: str, arg: Any) -> None:
        if action == "cont":
            signal_group(arg, signal.SIGCONT)
        elif action == "heal":
            self.job.heal(arg)  # type: ignore[attr-defined]
        # The next fault waits a whole interval after this one ended: back-to-back
        # partitions left a cluster no time to rejoin before the run finished.
        self.next_kill = max(self.next_kill, time.time() + self.interval())

    def finish(self) -> None:
        """Ends every fault still in progress (a stopped process, a cut cluster)."""
        for action, arg in self.pending.due(time.time(), force=True):
            self._end(action, arg)


# ----------------------------------------------------------------------------- evidence


@dataclass
class Incarnation:
    """One process of one replica group, from the launcher's history."""

    key: Key
    pid: Optional[int]
    start: float
    restart: bool
    end: Optional[float] = None  # when the launcher saw it exit (None: running when the job ended)
    code: Optional[int] = None
    killed_at: Optional[float] = None
    last_status: Optional[Dict[str, Any]] = None
    holds_from: Optional[float] = None  # when it came to hold its cluster's model (None: never)
    until: float = float("inf")  # the next incarnation's start: its events end here

    @property
    def death(self) -> Optional[float]:
        return self.killed_at if self.killed_at is not None else self.end

    def alive_at(self, t: float) -> bool:
        return self.start <= t and (self.death is None or t < self.death)

    def holds_at(self, t: float) -> bool:
        return self.alive_at(t) and self.holds_from is not None and self.holds_from <= t


@dataclass
class Outage:
    """A kill (its targets) or an incarnation that exited non-zero on its own."""

    t: float
    keys: List[Key]
    dead: List[Incarnation]
    cause: str  # the kill's role, or "exit <code>"
    kill: Optional[Dict[str, Any]] = None


class Timeline:
    """Incarnations, outages and events of one job, for the analyses below.

    Args:
        history: ``LocalJob.history`` (start / restart / kill / exit records, an exit with
            the process's ``last_status``).
        events: every replica group's events.jsonl, by key.
        kills: the monkey's kill records (``t_abs``, ``targets``, ``pids``).
    """

    def __init__(self, history: Sequence[Dict[str, Any]], events: Dict[Key, List[Dict[str, Any]]], kills: Sequence[Dict[str, Any]] = ()) -> None:
        self.events = {tuple(k): list(v) for k, v in events.items()}
        self.incs: Dict[Key, List[Incarnation]] = {}
        for h in history:
            if not isinstance(h["key"], (tuple, list)) or len(h["key"]) != 2:
                continue  # a lighthouse's record (key: its role) or a network's (key: its cluster), not a replica group's
            key = tuple(h["key"])
            if h["event"] in ("start", "restart"):
                self.incs.setdefault(key, []).append(Incarnation(key, h.get("pid"), h["t"], h["event"] == "restart"))
                continue
            inc = self._by_pid(key, h.get("pid"))
            if inc is None:
                continue
            if h["event"] == "kill" and inc.killed_at is None:
                inc.killed_at = h["t"]
            elif h["event"] == "exit" and inc.end is None:
                inc.end, inc.code, inc.last_status = h["t"], h.get("code"), h.get("last_status")
        for key, incs in self.incs.items():
            for a, b in zip(incs, incs[1:]):
                a.until = b.start
            for inc in incs:
                inc.holds_from = inc.start if not inc.restart else next(
                    (e["t"] for e in self.of(inc) if (e["kind"] == "heal" and at_level(e, "inner"))
                     or (is_commit(e, "inner") and e.get("step", 0) > 0)),
                    None,
                )
        self.healed_at = self._heals()
        self.outages: List[Outage] = []
        killed_pids = set()
        for k in kills:
            keys = [parse_name(n) for n in k["targets"]]
            dead = []
            for key in keys:
                inc = self._by_pid(key, (k.get("pids") or {}).get(name(key))) or self.at(key, k["t_abs"])
                if inc is not None:
                    dead.append(inc)
                    killed_pids.add((key, inc.pid))
            self.outages.append(Outage(k["t_abs"], keys, dead, k["role"], k))
        for incs in self.incs.values():
            for inc in incs:
                if (inc.key, inc.pid) in killed_pids:
                    continue
                if inc.killed_at is not None:  # killed through the launcher, not by the monkey
                    self.outages.append(Outage(inc.killed_at, [inc.key], [inc], "kill (launcher)"))
                elif inc.code not in (0, None):
                    self.outages.append(Outage(inc.end or inc.start, [inc.key], [inc], f"exit {inc.code}"))
        self.outages.sort(key=lambda o: o.t)

    def _heals(self) -> Dict[int, float]:
        """When each restarted incarnation healed (by ``id``): its first inner commit at a step
        > 0 whose (step, checksum) equals an inner commit made after its predecessor died by
        another *continuous* incarnation (one of the job's first processes, or a restarted one
        from its own heal on). Step 0 is everyone's initial model; a commit from before the
        death could be matched by a cluster that retrained from step 0 on the same batches;
        and a whole cluster restarted together only matches itself until it adopts a global
        model, which continuous incarnations of other clusters also commit."""
        restarts = [i for incs in self.incs.values() for i in incs if i.restart]
        prev = {id(b): a for incs in self.incs.values() for a, b in zip(incs, incs[1:])}
        healed: Dict[int, float] = {}
        changed = True
        while changed:  # a heal can make another incarnation's heal evident (transitively)
            changed = False
            made: Dict[Tuple[int, str], List[Tuple[float, int]]] = {}
            for incs in self.incs.values():
                for i in incs:
                    since = healed.get(id(i)) if i.restart else -float("inf")
                    if since is None:
                        continue
                    for e in self.commits(i, "inner"):
                        if e.get("step", 0) > 0 and e["t"] >= since:
                            made.setdefault((e["step"], e.get("checksum")), []).append((e["t"], id(i)))
            for r in restarts:
                if id(r) in healed:
                    continue
                p = prev.get(id(r))
                died = (p.death if p is not None else None) or r.start
                for e in self.commits(r, "inner"):
                    if e.get("step", 0) > 0 and any(t > died and who != id(r) for t, who in made.get((e["step"], e.get("checksum")), [])):
                        healed[id(r)] = e["t"]
                        changed = True
                        break
        return healed

    def _by_pid(self, key: Key, pid: Any) -> Optional[Incarnation]:
        incs = self.incs.get(key, [])
        found = [i for i in incs if pid is not None and i.pid == pid]
        return found[-1] if found else None

    def at(self, key: Key, t: float) -> Optional[Incarnation]:
        """The incarnation of ``key`` whose span (start to the next start) contains ``t``."""
        found = [i for i in self.incs.get(key, []) if i.start <= t]
        return found[-1] if found else None

    def of(self, inc: Incarnation) -> List[Dict[str, Any]]:
        """The events ``inc`` wrote."""
        return [e for e in self.events.get(inc.key, []) if inc.start <= e["t"] < inc.until]

    def commits(self, inc: Incarnation, level: str) -> List[Dict[str, Any]]:
        return [e for e in self.of(inc) if is_commit(e, level)]

    def holders(self, t: float, exclude: Iterable[Key] = (), cluster: Optional[int] = None) -> List[Incarnation]:
        """Incarnations holding a model at ``t`` (of ``cluster``, if given), outside ``exclude``."""
        ex = set(exclude)
        return [
            inc for key, incs in self.incs.items() if key not in ex and (cluster is None or key[0] == cluster)
            for inc in incs if inc.holds_at(t)
        ]

    def continuous(self, t: float, exclude: Iterable[Key] = ()) -> List[Incarnation]:
        """Continuous incarnations alive at ``t`` outside ``exclude``: those whose model descends
        without a break from the job's start (first processes; restarted ones once healed)."""
        ex = set(exclude)
        out = []
        for key, incs in self.incs.items():
            if key in ex:
                continue
            for i in incs:
                healed = i.start if not i.restart else self.healed_at.get(id(i))
                if i.alive_at(t) and healed is not None and healed <= t:
                    out.append(i)
        return out

    def lost_clusters(self, o: Outage) -> List[int]:
        return sorted(c for c in {k[0] for k in o.keys} if not self.holders(o.t, o.keys, cluster=c))

    def state_lost(self) -> List[Outage]:
        """Outages after which no continuous incarnation was left: the job's trained state was
        gone, and whatever trains on starts again from step 0 (nothing heals after that)."""
        return [o for o in self.outages if not self.continuous(o.t, o.keys)]

    def restart_of(self, key: Key, t: float) -> Optional[Incarnation]:
        """``key``'s own restart after an outage at ``t``: its first incarnation started after ``t``."""
        return next((i for i in self.incs.get(key, []) if i.start > t), None)


def next_commit_s(tl: Timeline, o: Outage) -> Optional[float]:
    """Seconds from the outage to the survivors' next commit: an outer one when it lost a
    cluster, else an inner one by a surviving group of the victims' clusters."""
    lost = tl.lost_clusters(o)
    if lost:
        survivors = [i for i in tl.holders(o.t, o.keys) if i.key[0] not in lost]
        level = "outer"
    else:
        survivors = [i for i in tl.holders(o.t, o.keys) if i.key[0] in {k[0] for k in o.keys}]
        level = "inner"
    times = [e["t"] for i in survivors for e in tl.commits(i, level) if e["t"] > o.t]
    return min(times) - o.t if times else None


def heal_s(tl: Timeline, o: Outage, key: Key) -> Tuple[Optional[Incarnation], Optional[float]]:
    """``key``'s own restart after the outage (its first incarnation started after it), and
    seconds from that restart to its heal (:meth:`Timeline.healed_at`), or None."""
    restart = tl.restart_of(key, o.t)
    if restart is None:
        return None, None
    t = tl.healed_at.get(id(restart))
    return restart, None if t is None else t - restart.start


def work_of(inc: Incarnation, tl: Timeline, results: Dict[Key, Optional[dict]], final_status: Dict[Key, Optional[dict]], work_at_kill: Sequence[Dict[str, Any]]) -> Tuple[Dict[str, int], str]:
    """An incarnation's work counters and where they came from."""
    last = tl.incs[inc.key][-1] is inc
    src: Optional[dict] = None
    how = "none"
    if inc.code == 0 and last and (results.get(inc.key) or {}).get("work"):
        src, how = results[inc.key]["work"], "result"  # type: ignore[index]
    elif inc.last_status is not None:
        src, how = inc.last_status, "exit status"
    elif inc.end is None and last and final_status.get(inc.key) is not None:
        src, how = final_status[inc.key], "status at the end"
    else:
        w = [w for w in work_at_kill if tuple(w["key"]) == inc.key and w.get("pid") == inc.pid]
        if w:
            src, how = w[-1], "status before the kill"
    return {k: int((src or {}).get(k) or 0) for k in WORK_KEYS}, how


def account_work(
    tl: Timeline,
    results: Dict[Key, Optional[dict]],
    consistent: bool,
    final_status: Optional[Dict[Key, Optional[dict]]] = None,
    work_at_kill: Sequence[Dict[str, Any]] = (),
    tokens_per_step: int = 1,
) -> Dict[str, Any]:
    """Steps run and kept over every incarnation (see the module docstring for the rules)."""
    final_status = final_status or {}
    dead = {id(i) for o in tl.outages for i in o.dead}
    work = {id(i): work_of(i, tl, results, final_status, work_at_kill) for incs in tl.incs.values() for i in incs}
    lost = {"rolled_back_or_weight0": 0, "uncommitted_at_death": 0, "with_lost_cluster": 0, "at_outer_weight0": 0,
            "with_lost_state": 0, "unmerged_at_end": 0}
    losses = tl.state_lost()
    t_lost = losses[-1].t if losses else None
    gone = {id(i) for o in tl.outages if t_lost is not None and o.t <= t_lost for i in o.dead}  # not in the final model
    run = at_end = 0
    sources: Dict[str, int] = {}
    for incs in tl.incs.values():
        for i in incs:
            w, how = work[id(i)]
            sources[how] = sources.get(how, 0) + 1
            run += w["steps_run"]
            lost["rolled_back_or_weight0"] += w["steps_discarded"]
            if id(i) in dead:
                lost["uncommitted_at_death"] += w["steps_since_commit"]  # its steps_since_outer: below
                if id(i) in gone:
                    lost["with_lost_state"] += w["steps_run"] - w["steps_discarded"] - w["steps_since_commit"]
            else:
                at_end += w["steps_since_commit"] + w["steps_since_outer"]

    # A dead incarnation's inner-committed steps ride on its cluster's model: kept at the
    # cluster's next outer commit with non-zero weight, lost with the cluster or at weight 0.
    clusters = sorted({k[0] for k in tl.incs})
    for c in clusters:
        after = -float("inf") if t_lost is None else t_lost  # before: counted as lost with the state
        items: List[Tuple[float, int, Any]] = [(o.t, 0, o) for o in tl.outages if o.t > after and any(k[0] == c for k in o.keys)]
        for key in [k for k in tl.incs if k[0] == c]:
            items += [(e["t"], 1, e) for e in tl.events.get(key, []) if e["t"] > after
                      and is_commit(e, "inner") and e.get("outer")]
        pending = 0
        for t, kind, item in sorted(items, key=lambda x: (x[0], x[1])):
            if kind == 0:
                mine = sum(work[id(i)][0]["steps_since_outer"] for i in item.dead if i.key[0] == c)
                if not tl.holders(t, item.keys, cluster=c):
                    lost["with_lost_cluster"] += pending + mine
                    pending = 0
                else:
                    pending += mine
            elif pending:
                weight = item.get("cluster_weight")
                if weight is None or float(weight) > 0:
                    pass  # kept
                else:
                    lost["at_outer_weight0"] += pending
                pending = 0
        at_end += pending
    if not consistent:
        lost["unmerged_at_end"] = at_end
    kept = run - sum(lost.values())
    return {
        "steps_run": run,
        "steps_kept": kept,
        "steps_discarded": run - kept,
        "steps_lost": lost,
        "steps_in_final_model_since_last_outer_commit": at_end if consistent else 0,
        "goodput": kept / run if run else None,
        "process_efficiency": (run - lost["rolled_back_or_weight0"] - lost["uncommitted_at_death"]) / run if run else None,
        "tokens_per_step": tokens_per_step,
        "tokens_run": run * tokens_per_step,
        "tokens_kept": kept * tokens_per_step,
        "work_sources": sources,
    }


def hangs_of(tl: Timeline, t0: float) -> Dict[str, List[Dict[str, Any]]]:
    """Timeouts and watchdog exits, from what the processes wrote and the launcher recorded."""
    timeouts, watchdog = [], []
    for key, evs in tl.events.items():
        for e in evs:
            if e["kind"] == "timeout":
                timeouts.append({"t": e["t"] - t0, "target": name(key), "level": e.get("level"), "op": e.get("op"), "phase": e.get("phase")})
            elif e["kind"] == "watchdog":
                watchdog.append({"t": e["t"] - t0, "target": name(key), "reason": e.get("reason"), "source": "event"})
    for incs in tl.incs.values():
        for i in incs:
            if i.code == 3 and not any(e["kind"] == "watchdog" for e in tl.of(i)):
                watchdog.append({"t": (i.end or i.start) - t0, "target": name(i.key), "reason": "exit code 3", "source": "launcher"})
    return {"timeouts": sorted(timeouts, key=lambda x: x["t"]), "watchdog_exits": sorted(watchdog, key=lambda x: x["t"])}


def evidence(
    history: Sequence[Dict[str, Any]],
    events: Dict[Key, List[Dict[str, Any]]],
    kills: Sequence[Dict[str, Any]],
    results: Dict[Key, Optional[dict]],
    consistent: bool,
    t0: float,
    final_status: Optional[Dict[Key, Optional[dict]]] = None,
    work_at_kill: Sequence[Dict[str, Any]] = (),
    tokens_per_step: int = 1,
) -> Dict[str, Any]:
    """Kills with their next commit and recovery, restarts with their heal, work, hangs —
    from the launcher's history, the processes' events and results only."""
    tl = Timeline(history, events, kills)
    kill_out, restarts = [], []
    for o in tl.outages:
        lost = tl.lost_clusters(o)
        healed = {}
        for key in o.keys:
            restart, dt = heal_s(tl, o, key)
            healed[key] = dt
            restarts.append({"target": name(key), "cause": o.cause, "outage_t": o.t - t0, "lost_cluster": key[0] in lost,
                             "t": None if restart is None else restart.start - t0, "time_to_heal_s": dt})
        if o.kill is not None:
            k = {kk: v for kk, v in o.kill.items() if kk not in ("t_abs", "pids")}
            k["lost_clusters"] = lost
            k["time_to_next_commit_s"] = next_commit_s(tl, o)
            k["time_to_heal_s"] = {name(key): healed[key] for key in o.keys}
            k["recovered"] = all(healed[key] is not None for key in o.keys)
            kill_out.append(k)
    out = {
        "kills": kill_out,
        "restarts": restarts,
        "recovered": sum(1 for k in kill_out if k["recovered"]),
        "time_to_next_commit_s": [k["time_to_next_commit_s"] for k in kill_out],
        "time_to_heal_s": [r["time_to_heal_s"] for r in restarts],
        "self_exits": [{"t": o.t - t0, "target": name(o.keys[0]), "cause": o.cause} for o in tl.outages if o.cause.startswith("exit")],
        "state_lost": [{"t": o.t - t0, "targets": [name(k) for k in o.keys], "cause": o.cause} for o in tl.state_lost()],
    }
    out.update(account_work(tl, results, consistent, final_status, work_at_kill, tokens_per_step))
    out["hangs_detail"] = hangs_of(tl, t0)
    return out


def analyse(cfg: Config, job: LocalJob, monkey: ChaosMonkey, wall_s: float, baseline: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    keys = job.keys()
    events = {k: read_events(replica_dir(job.run_dir, *k) / "events.jsonl") for k in keys}
    summary = summarize(cfg, job, wall_s)
    tr = cfg.train
    ev = evidence(
        job.history, events, monkey.kills,
        results={k: job.result(k) for k in keys},
        consistent=bool(summary["consistent"]),
        t0=monkey.t0,
        final_status={k: job.last_status(k) for k in keys},
        work_at_kill=monkey.work_at_kill,
        tokens_per_step=tr.batch_size * tr.seq_len * cfg.topology.ranks_per_replica,
    )
    monkey.stall.finish()
    hd = dict(ev.pop("hangs_detail"), stalls=list(monkey.stall.stalls))
    ev["faults"] = fault_evidence(monkey.faults, events, job.history, cfg.topology.clusters)
    finished = summary["steps"] >= tr.steps
    retained = None
    if baseline and finished and baseline.get("steps", 0) >= tr.steps and wall_s > 0:
        retained = baseline["wall_s"] / wall_s
    return {
        "topology": summary["topology"],
        "model": summary["model"],
        "steps_target": tr.steps,
        "steps_reached": summary["steps"],
        "chaos": {"seed": cfg.chaos.seed, "kill_every_s": cfg.chaos.kill_every_s, "roles": list(cfg.chaos.roles), "restart_delay_s": cfg.chaos.restart_delay_s,
                  "kinds": list(monkey.kinds), "hang_s": cfg.chaos.hang_s, "lighthouse_down_s": cfg.chaos.lighthouse_down_s, "partition_s": cfg.chaos.partition_s},
        "mode": cfg.sync.mode,
        **ev,
        "hangs": sum(len(v) for v in hd.values()),
        "hangs_detail": hd,
        "throughput_retained": retained,
        "consistent": summary["consistent"],
        "final_eval_loss": summary["final_eval_loss"],
        "entropy_floor": summary["entropy_floor"],
        "exit_codes": summary["exit_codes"],
        "wall_s": wall_s,
    }


def _run(cfg: Config, overrides: List[str], subdir: str, chaos: bool) -> Tuple[LocalJob, Optional[ChaosMonkey], float]:
    job = LocalJob(cfg, overrides, free_ports=True, run_dir_override=Path(cfg.run.dir) / subdir)
    monkey = ChaosMonkey(job, cfg) if chaos else None
    t0 = time.time()
    try:
        job.start_lighthouses()
        job.start_all()
        if monkey is not None:
            monkey.t0 = monkey.stall.t0 = monkey.stall.last_progress = time.time()
            monkey.next_kill = monkey.t0 + monkey.interval()
        job.wait(cfg.chaos.timeout_s, tick=monkey, tick_every_s=0.2, restart=chaos, restart_delay_s=cfg.chaos.restart_delay_s)
    finally:
        if monkey is not None:
            monkey.finish()
        job.stop()
    return job, monkey, time.time() - t0


def human(report: Dict[str, Any]) -> str:
    def f(x: Any, n: int = 2) -> str:
        return "-" if x is None else f"{x:.{n}f}"

    hd = report["hangs_detail"]
    lost = report["steps_lost"]
    lines = [
        f"chaos: {len(report['kills'])} kills ({', '.join(k['role'] for k in report['kills'])}), "
        f"{report['recovered']} recovered, {report['hangs']} hangs "
        f"({len(hd['timeouts'])} timeouts, {len(hd['watchdog_exits'])} watchdog exits, {len(hd['stalls'])} stalls), "
        f"{len(report['self_exits'])} non-zero exits on their own, consistent: {report['consistent']}",
        f"  time to survivors' next commit (s; outer commit when a cluster was lost): {[f(x) for x in report['time_to_next_commit_s']]}",
        f"  time to heal per restart (s): {[f(x) for x in report['time_to_heal_s']]}",
        f"  steps run {report['steps_run']}, kept {report['steps_kept']}; lost: "
        + ", ".join(f"{k} {v}" for k, v in lost.items()),
        f"  goodput (tokens in the final model / tokens computed) {f(report['goodput'], 3)}; "
        f"processes' own count {f(report['process_efficiency'], 3)}",
        f"  throughput retained (failure-free wall / chaos wall, {report['steps_target']} steps) {f(report['throughput_retained'], 3)}",
        f"  final eval loss {f(report['final_eval_loss'], 4)}"
        + (f" vs failure-free {f(report['baseline']['final_eval_loss'], 4)}" if report.get("baseline") else ""),
        f"  wall {report['wall_s']:.1f} s" + (f" vs failure-free {report['baseline']['wall_s']:.1f} s" if report.get("baseline") else ""),
    ]
    for k in report["kills"]:
        if k.get("kind", "kill") != "kill":
            lines.append(f"  {k['kind']} {'+'.join(k['targets'])} in {k['phase']}" + (f" (armed for {k['armed_phase']}, hit: {k['phase_hit']})" if k.get("armed_phase") else "")
                         + f": recovered {k['recovered']}")
    for fl in report.get("faults", []):
        ev = {x: fl.get(x) for x in ("abandoned_after_s", "rejoined_after_s", "exited", "back_after_s", "commits_resumed_s", "replica_restarts") if x in fl}
        lines.append(f"  {fl['kind']} {fl['target']} at {fl['t']:.0f}s for {fl['duration_s']:g}s: recovered {fl['recovered']} "
                     + ", ".join(f"{x} {f(v) if isinstance(v, float) else v}" for x, v in ev.items()))
    return "\n".join(lines)


def _chaos_report(cfg: Config, overrides: List[str], label: str) -> Dict[str, Any]:
    """A failure-free run (with chaos.baseline) and a chaos run of one configuration."""
    baseline = None
    sub = "" if label == "hier" or cfg.sync.mode == "hier" else f"{label}_"
    if cfg.chaos.baseline:
        print(f"chaos [{label}]: failure-free run with the same seed first", flush=True)
        bjob, _, bwall = _run(cfg, overrides, f"{sub}baseline", chaos=False)
        bs = summarize(cfg, bjob, bwall)
        baseline = {"final_eval_loss": bs["final_eval_loss"], "consistent": bs["consistent"], "wall_s": bwall, "steps": bs["steps"]}
        print(f"chaos [{label}]: failure-free final eval loss {baseline['final_eval_loss']}", flush=True)
    print(f"chaos [{label}]: run with faults", flush=True)
    job, monkey, wall = _run(cfg, overrides, f"{sub}chaos", chaos=True)
    assert monkey is not None
    report = analyse(cfg, job, monkey, wall, baseline)
    report["baseline"] = baseline
    if baseline and report["final_eval_loss"] is not None and baseline["final_eval_loss"]:
        report["final_loss_vs_baseline"] = report["final_eval_loss"] / baseline["final_eval_loss"] - 1.0
    return report


def _prepare(cfg: Config) -> Config:
    """The chaos run's own settings: a killed lighthouse stays down chaos.lighthouse_down_s;
    partitions need network namespaces (said once, then left out)."""
    cfg.lighthouse.supervise = True
    cfg.lighthouse.restart_delay_s = cfg.chaos.lighthouse_down_s
    if "partition" in cfg.chaos.kinds and not getattr(cfg.run, "netns", False):
        why = "they need run.netns=true (each cluster in its own network namespace)"
        try:
            from hier_localsgd.launch import netns

            reason = netns.available()
            if reason is None:
                cfg.run.netns = True  # type: ignore[attr-defined]
                return cfg
            why = reason
        except ImportError:
            why = "network namespaces are not supported by this version"
        print(f"chaos: partition faults skipped: {why}", flush=True)
        cfg.chaos.kinds = [k for k in cfg.chaos.kinds if k != "partition"]
    return cfg


def run_chaos(cfg: Config, overrides: List[str]) -> int:
    compare = cfg.chaos.compare_flat and cfg.sync.mode == "hier"
    # The flat side's configuration is checked before anything runs (one line, exit 2).
    fcfg = load_config([*overrides, "sync.mode=flat"], validate_for="chaos") if compare else None
    cfg = _prepare(cfg)
    report = _chaos_report(cfg, overrides, cfg.sync.mode)
    path = Path(cfg.chaos.report or Path(cfg.run.dir) / "chaos_report.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))  # kept even if the flat part fails
    if fcfg is not None:
        from dataclasses import replace

        fcfg = _prepare(fcfg)
        fcfg.chaos = replace(fcfg.chaos, kinds=[k for k in cfg.chaos.kinds])
        flat = _chaos_report(fcfg, [*overrides, "sync.mode=flat"], "flat")
        report["flat"] = flat
        report["vs_flat"] = {"goodput": (report["goodput"], flat["goodput"]),
                             "throughput_retained": (report["throughput_retained"], flat["throughput_retained"])}
    path.write_text(json.dumps(report, indent=2, default=str))
    print(human(report))
    if "flat" in report:
        print("same schedule, flat torchft DiLoCo:")
        print(human(report["flat"]))
        print(f"goodput hier {report['vs_flat']['goodput'][0]} vs flat {report['vs_flat']['goodput'][1]}; "
              f"throughput retained hier {report['vs_flat']['throughput_retained'][0]} vs flat {report['vs_flat']['throughput_retained'][1]}")
    print(f"report written to {path}")
    reports = [report] + ([report["flat"]] if "flat" in report else [])
    ok = all(r["consistent"] and all(c == 0 for c in r["exit_codes"].values()) for r in reports)
    return 0 if ok else 1
