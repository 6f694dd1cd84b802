"""The chaos command's monkey: which process it kills, hangs or cuts off, and when.

:class:`ChaosMonkey` runs in the launcher's loop (chaos.py wires it to a :class:`LocalJob`):
it draws faults on the schedule ``chaos.*`` sets (seeded wall-clock intervals, training
progress, or a plan fixed before the run, chaos_plan.py), picks each fault's target by role
among the running processes, never leaves the job without a *continuous* process
(:func:`keeps_continuous`), arms phase kills through the target's inbox, and records every
fault it fires and ends for the evidence (chaos_evidence.py, chaos_faults.py).
"""

from __future__ import annotations

import random
import signal
import time
from typing import Any, Dict, List, Optional, Sequence, Set

from hier_localsgd.config import Config
from hier_localsgd.experiments.chaos_evidence import WORK_KEYS, Incarnation, Timeline, name
from hier_localsgd.experiments.chaos_faults import FAULT_KINDS, POISON, PendingFaults, signal_group
from hier_localsgd.experiments.chaos_plan import BASELINE_PHASE, PlannedFault, draw_plan
from hier_localsgd.experiments.chaos_stall import StallWatch, stall_limit_s
from hier_localsgd.launch.local import Key, LocalJob
from hier_localsgd.core.runtime.faults import SYNC_FAULT_PHASES, deliver, phase_inbox
from hier_localsgd.core.runtime.status import inbox_path, read_events, replica_dir

# A group freed from a hang is held out of phase kills until it commits again, but not
# longer than this: one that never does would hold a planned fault back for good.
FREED_HELD_MAX_S = 120.0


def keeps_continuous(targets: Sequence[Key], continuous: Sequence["Incarnation"]) -> bool:
    """Whether killing ``targets`` leaves a process whose model continues from the job's
    start (module doc): never kill the last ones, nothing could recover the job's state."""
    return any(i.key not in targets for i in continuous)


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
        # chaos.kill_every_steps: faults fall on training progress (the furthest group's
        # step), so runs of different speed (hier and flat) meet them at the same steps.
        self.step_mean = ch.kill_every_steps
        self.next_kill = self.t0 + self.rng.expovariate(1.0 / self.mean)
        self.next_step = 0
        self.kills: List[Dict[str, Any]] = []
        self.work_at_kill: List[Dict[str, Any]] = []
        self.stall = StallWatch(job, stall_limit_s(cfg), cfg.train.steps, self.t0)
        # Kinds other than plain kills (chaos_faults.py); partitions only where the job
        # runs in network namespaces.
        self.kinds = [k for k in ch.kinds if k != "partition" or job.netns is not None]
        # The baselines have no poison screen: a poisoned flat job turns NaN whole and compares
        # nothing. Drawn at random, they skip the kind; planned, the fault is recorded skipped.
        self.poisonable = cfg.sync.mode == "hier"
        draw_kinds = self.kinds if self.poisonable else [k for k in self.kinds if k != "poison"]
        self.faults: List[Dict[str, Any]] = []
        self.pending = PendingFaults()
        self._freed: Dict[int, float] = {}  # a hung process's pid -> when its SIGCONT went (:meth:`_hung`)
        self.armed: Optional[Dict[str, Any]] = None  # a phase_kill waiting for its phase
        self.unarmed_since: Optional[float] = None  # a drawn phase_kill waiting for a target
        self._events: Dict[Key, List[Dict[str, Any]]] = {}  # the processes' events at the last read
        self.kinds_done: List[str] = []
        # chaos.draw=plan: the whole schedule drawn now (chaos_plan.py), fired in order.
        self.plan: Optional[List[PlannedFault]] = None
        self.plan_next, self.retry_at = 0, 0.0
        self.skipped: List[Dict[str, Any]] = []  # planned faults this mode cannot have
        if ch.draw != "plan":
            self.kinds = draw_kinds
        if ch.draw == "plan":
            t = cfg.topology
            self.plan = draw_plan(ch.seed, self.kinds, t.clusters, t.replicas_per_cluster, self.roles, ch.phase_targets,
                                  self.step_mean or self.mean, self.stop_at_step if self.step_mean else ch.timeout_s, bool(self.step_mean))

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
        self._events = events  # (an armed phase kill looks for its target's stop in them)
        return Timeline(self.job.history, events, self.kills).continuous(time.time())

    def _arm(self, role: str, phase: str, now: float, target: Optional[Key], **extra: Any) -> None:
        """Arms a phase_kill of ``target`` (else any process of ``role``) in ``phase``. With a
        target, a hierarchical job and the processes' inboxes, the target is also handed a
        ``stop`` for that phase (core/runtime/faults.py ``phase_inbox``): it stops itself as
        the phase starts, however short the phase, and :meth:`_phase_kill` kills it there."""
        self.armed = {"role": role, "phase": phase, "since": now, **({"target": target} if target is not None else {}), **extra}
        self._send_stop(self.armed, now)

    def _stops(self, phase: str) -> bool:
        """Whether a phase kill in ``phase`` hands its target a stop (a hierarchical job with
        inboxes, a phase with a fault point)."""
        return self.cfg.sync.mode == "hier" and bool(self.cfg.run.fault_inbox) and phase in SYNC_FAULT_PHASES

    def _send_stop(self, arm: Dict[str, Any], now: float) -> None:
        """Hands the arm's target a stop for the arm's phase (:meth:`_arm`), for its current
        process only (its pid: a restart of the group drops it). The arm's clock restarts: a
        stop taken before (then withdrawn) is no evidence for this one."""
        tgt = arm.get("target")
        pid = (self.job.status(tgt) or {}).get("pid") if tgt is not None else None
        if pid is not None and self._stops(arm["phase"]):
            deliver(phase_inbox(inbox_path(self.job.run_dir, *tgt)), {"action": "stop", "phase": arm["phase"], "pid": pid})  # type: ignore[misc]
            arm["stop_sent"], arm["since"] = True, now

    def _hung(self, now: float) -> Set[Key]:
        """Replica groups a hang holds stopped now (their SIGCONT still pending), or held until
        lately and not back in the rounds yet (no commit since their SIGCONT: a leader freed
        after 5 s was seen rejoining for 18 s, longer than ``chaos.phase_arm_s``, so a phase
        kill armed on it fell back to a plain kill in a CI run). A hang and a phase kill never
        share a target: a phase stop cannot fire in a stopped process, a kill would cut the
        hang short, and a SIGCONT would free a process that stopped itself."""
        pids = {arg for _, action, arg in self.pending.items if action == "cont"}
        out = set()
        for k, r in self.job.replicas.items():
            freed = self._freed.get(r.popen.pid)
            if freed is not None and now - freed > FREED_HELD_MAX_S:
                freed = None  # never back in the rounds: no longer held out (a planned fault would wait forever)
            if r.popen.pid in pids or (freed is not None and float((self.job.status(k) or {}).get("last_commit_at") or 0.0) < freed):
                out.add(k)
        return out

    def _disarm_stop(self, key: Key) -> None:
        """Takes back a phase stop ``key`` has not taken yet: a restart must never take it."""
        phase_inbox(inbox_path(self.job.run_dir, *key)).unlink(missing_ok=True)

    def _stopped(self, key: Key, arm: Dict[str, Any]) -> bool:
        """Whether ``key`` stopped itself at the armed phase (its ``fault`` event, since the arm)."""
        return bool(arm.get("stop_sent")) and any(
            e.get("kind") == "fault" and e.get("action") == "stop" and e.get("phase") == arm["phase"] and e["t"] >= arm["since"]
            for e in self._events.get(key, []))

    @staticmethod
    def _of_role(role: str, running: Dict[Key, dict], continuous: Sequence["Incarnation"], hung: Set[Key]) -> List[Key]:
        """The processes a drawn phase kill of ``role`` may take: running, of the role, not
        the last continuous one, not held by a hang."""
        return sorted(k for k, st in running.items() if bool(st.get("leader")) == (role == "leader")
                      and keeps_continuous([k], continuous) and k not in hung)

    def _draw_phase_kill(self, running: Dict[Key, dict], continuous: Sequence["Incarnation"], now: float) -> bool:
        """Arms a drawn phase kill on the role's first eligible process. With stops, one that
        finds none (the role's processes restarting or held by a hang) waits, drawn again
        each retry, up to ``chaos.phase_arm_s`` for one to hand the stop to (a status poll
        alone misses a short phase, and shows no evidence that the kill met it: a CI run
        killed a leader on a poll, with no stop handed); then it arms without, and :meth:`_phase_kill` takes the first that becomes
        eligible. Returns whether it armed."""
        role, phase = self.rng.choice(list(self.cfg.chaos.phase_targets)).split(":")
        of_role = self._of_role(role, running, continuous, self._hung(now))
        if self.unarmed_since is None:
            self.unarmed_since = now
        if of_role or not self._stops(phase) or now - self.unarmed_since > self.cfg.chaos.phase_arm_s:
            self._arm(role, phase, now, of_role[0] if of_role else None)
            self.unarmed_since = None
            return True
        return False

    def _armed_target(self) -> Optional[Key]:
        """The armed phase kill's target, which no other fault takes meanwhile: a kill would
        take its phase stop with it (the stop is for that pid), and the arm would end in a
        plain kill in whatever phase (a CI run: a multi_kill took it 4.5 s before)."""
        return None if self.armed is None else self.armed.get("target")

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
        cands = [ts for ts in cands if keeps_continuous(ts, continuous) and self._armed_target() not in ts]
        return self.rng.choice(cands) if cands else None

    def __call__(self) -> None:
        self.stall()
        now = time.time()
        for action, arg in self.pending.due(now):
            self._end(action, arg, now)
        if self.armed is not None:
            self._phase_kill(now)
        if self.plan is not None:
            self._planned(now)
            return
        if not self.kinds:  # every kind left out for this mode (poison alone, with a baseline)
            self.next_kill = float("inf")
        if now < self.next_kill or (self.step_mean and self.progress() < self.next_step):
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
            done = self._draw_phase_kill(running, continuous, now)
        elif kind == "multi_kill":
            done = self._multi_kill(running, continuous, now)
        elif kind is not None:
            done = self._fault(kind, running, now)
        if not done:
            self.next_kill = now + 1.0  # nothing eligible right now (restarting); try again soon
            return
        self.kinds_done.append(kind)
        self.unarmed_since = None  # (a wait for a phase kill's target ends with any fault drawn)
        self.schedule_next(now)

    def interval(self) -> float:
        """Time (or, with chaos.kill_every_steps, local steps) to the next fault: exponential
        with mean chaos.kill_every_s (kill_every_steps), or exactly that with
        chaos.draw=cycle (a fixed, reproducible schedule)."""
        mean = self.step_mean or self.mean
        return mean if self.cfg.chaos.draw == "cycle" else self.rng.expovariate(1.0 / mean)

    def progress(self) -> int:
        """The furthest replica group's step (its status file)."""
        return max((int((self.job.status(k) or {}).get("step", 0)) for k in self.job.keys()), default=0)

    def schedule_next(self, now: float, at_least: bool = False) -> None:
        """The next fault one interval from now: in seconds, or in steps from the current
        progress (``at_least``: never earlier than already scheduled)."""
        if self.step_mean:
            nxt = self.progress() + max(1, round(self.interval()))
            self.next_step = max(self.next_step, nxt) if at_least else nxt
            self.next_kill = now
        else:
            nxt_t = now + self.interval()
            self.next_kill = max(self.next_kill, nxt_t) if at_least else nxt_t

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
        # A target that stopped itself at the phase is killed there, continuous or not (stopped,
        # it could never heal).
        tgt = arm.get("target")
        stopped = [tgt] if tgt is not None and self._stopped(tgt, arm) and self.job.replicas[tgt].popen.poll() is None else []
        if stopped and tgt not in running:
            running = {**running, tgt: self.job.status(tgt) or {}}
        if stopped and not keeps_continuous(stopped, continuous):
            # the last process whose model continues from the start: never killed; let it go
            # on, and hand it the stop again once another process continues (below)
            signal_group(self.job.replicas[tgt].popen.pid, signal.SIGCONT)  # type: ignore[index]
            arm["stop_sent"], stopped = False, []
            arm["withdrawn"] = arm.get("withdrawn", 0) + 1
        hung = self._hung(now)
        if tgt is not None and "planned" not in arm and tgt not in running and now - arm["since"] > self.cfg.chaos.phase_arm_s:
            # a drawn (not planned) arm whose target is gone: another process of the role
            if arm.pop("stop_sent", False):
                self._disarm_stop(tgt)
            del arm["target"]
            tgt = None
        if self._stops(arm["phase"]) and "planned" not in arm and tgt is None:
            # a drawn arm without a target takes the role's first eligible process (a status
            # poll alone misses a short phase: the stop makes the hit certain)
            of_role = self._of_role(arm["role"], running, continuous, hung)
            if of_role:
                arm["target"] = tgt = of_role[0]
                arm["retargeted"] = arm.get("retargeted", 0) + 1
        if tgt is not None and not arm.get("stop_sent") and tgt in running and tgt not in hung and keeps_continuous([tgt], continuous):
            self._send_stop(arm, now)
        cands = sorted(k for k, st in running.items() if (k == arm["target"] if "target" in arm else bool(st.get("leader")) == (arm["role"] == "leader"))
                       and keeps_continuous([k], continuous) and k not in hung)
        phase = arm.get("phase_as", arm["phase"])  # a planned one in a mode with other phase names
        # A target handed a stop is killed once it stopped itself: its status can show the
        # phase a poll before its ``fault`` event is read (a kill then would race the stop).
        hits = stopped or ([] if arm.get("stop_sent") else [k for k in cands if running[k].get("phase") == phase])
        if hits or (cands and now - arm["since"] > self.cfg.chaos.phase_arm_s):
            target = (hits or cands)[0]
            if arm.get("stop_sent"):
                self._disarm_stop(target)
            extra = {k: arm[k] for k in ("planned", "planned_at", "phase_as") if k in arm}
            if "planned" in arm:
                extra.update(progress=self.progress(), armed_at_progress=arm["progress"])
            # what became of the stop: the evidence that the kill met its phase by itself
            extra.update(stop_sent=bool(arm.get("stop_sent")), stopped_itself=bool(stopped),
                         stop_withdrawn=arm.get("withdrawn", 0), retargeted=arm.get("retargeted", 0))
            self._kill([target], running, now, arm["role"], kind="phase_kill", armed_phase=arm["phase"], phase_hit=bool(hits), **extra)
            if stopped:  # its status may show the training thread's phase (an overlapped push stops on its stage thread)
                self.kills[-1]["phase"][name(target)] = phase
            self.armed = None

    def _multi_kill(self, running: Dict[Key, dict], continuous: Sequence["Incarnation"], now: float) -> bool:
        """Two replica groups of different clusters at once (a leader and a non-leader where there are)."""
        by_cluster: Dict[int, List[Key]] = {}
        for k in running:
            if k != self._armed_target():
                by_cluster.setdefault(k[0], []).append(k)
        if len(by_cluster) < 2:
            return False
        c1, c2 = self.rng.sample(sorted(by_cluster), 2)
        first = [k for k in by_cluster[c1] if running[k].get("leader")] or by_cluster[c1]
        second = [k for k in by_cluster[c2] if not running[k].get("leader")] or by_cluster[c2]
        targets = [self.rng.choice(first), self.rng.choice(second)]
        if not keeps_continuous(targets, continuous):
            return False
        self._kill(targets, running, now, "multi", kind="multi_kill")
        return True

    def _fault(self, kind: str, running: Dict[Key, dict], now: float, target: Any = None, **extra: Any) -> bool:
        """A non-kill fault; ``target`` (a planned fault's group, lighthouse or cluster), else drawn."""
        ch = self.cfg.chaos
        rec: Dict[str, Any] = {"t": now - self.t0, "t_abs": now, "kind": kind, **extra}
        if kind in ("hang", "poison") and target is None:
            drawable = sorted(k for k in running if k != self._armed_target())  # (and :meth:`_hung`)
            if not drawable:
                return False
            target = self.rng.choice(drawable)
        if kind == "hang":
            key = target
            st = running[key]
            rec.update(target=name(key), phase=st.get("phase"), step=st.get("step"), leader=st.get("leader"), duration_s=ch.hang_s)
            signal_group(self.job.replicas[key].popen.pid, signal.SIGSTOP)
            self.pending.add(now + ch.hang_s, "cont", self.job.replicas[key].popen.pid)
        elif kind == "poison":
            key = target
            st = running[key]
            rec.update(target=name(key), phase=st.get("phase"), step=st.get("step"), leader=st.get("leader"), duration_s=0.0)
            deliver(inbox_path(self.job.run_dir, *key), POISON)  # fires at the group's next step
        elif kind == "lighthouse":
            role = self.rng.choice(sorted(self.job.lighthouses)) if target is None else target
            rec.update(target=role, duration_s=self.cfg.lighthouse.restart_delay_s)
            self.job.kill_lighthouse(role)  # the launcher's supervisor brings it back
        else:  # partition
            c = self.rng.randrange(self.cfg.topology.clusters) if target is None else target
            rec.update(target=f"cluster{c}", duration_s=ch.partition_s)
            self.job.partition(c)  # type: ignore[attr-defined]
            self.pending.add(now + ch.partition_s, "heal", c)
        self.faults.append(rec)
        return True

    def _end(self, action: str, arg: Any, now: float) -> None:
        if action == "cont":
            signal_group(arg, signal.SIGCONT)
            self._freed[arg] = now  # recovering until its next commit (:meth:`_hung`)
        elif action == "heal":
            self.job.heal(arg)  # type: ignore[attr-defined]
        self.after_end(now)

    def after_end(self, now: float) -> None:
        """When a fault with a duration ended at ``now``. On the wall clock, faults start one
        interval apart, start to start (so ``chaos.kill_every_s`` is the fault rate), but the
        next never starts sooner than one lighthouse heartbeat timeout after this one
        ended: back-to-back partitions left a cluster no time to rejoin. (Waiting a whole
        interval after each end, as before, made a 30 s mean give 1 fault per 42 s.) On
        training progress, the next fault is at least one interval of steps away."""
        gap = self.cfg.lighthouse.heartbeat_timeout_ms / 1000.0
        if self.plan is not None:  # the plan keeps its points; none starts right after an end
            self.retry_at = max(self.retry_at, now + gap)
        elif self.step_mean:
            self.schedule_next(now, at_least=True)
        else:
            self.next_kill = max(self.next_kill, now + gap)

    def _planned(self, now: float) -> None:
        """chaos.draw=plan: fires the next planned fault once due and eligible (module doc
        of chaos_plan.py); an ineligible one is tried again every second, in order."""
        assert self.plan is not None
        if self.plan_next >= len(self.plan) or now < self.retry_at or self.armed is not None:
            return  # (an armed phase_kill holds the later faults: the order stays the plan's)
        f = self.plan[self.plan_next]
        progress = self.progress()
        if (progress if self.step_mean else now - self.t0) < f.at:
            return
        continuous = self._continuous_now()
        running = self._running(continuous)
        if not running or min(int(st.get("step", 0)) for st in running.values()) >= self.stop_at_step:
            self.plan_next = len(self.plan)  # past the last fault's step: the rest never fire
            return
        if self._fire_planned(f, running, continuous, now, progress):
            self.plan_next += 1
        # a fault that waited fires, and the next (perhaps overdue) comes a second later at the earliest
        self.retry_at = max(self.retry_at, now + 1.0)

    def _fire_planned(self, f: PlannedFault, running: Dict[Key, dict], continuous: Sequence["Incarnation"], now: float, progress: int) -> bool:
        """Fires ``f`` if its targets are eligible now (chaos_plan.py); False: not yet."""
        extra = {"planned": f.index, "planned_at": f.at, "progress": progress}
        if f.kind in FAULT_KINDS:
            if self.pending.busy:
                return False
            if f.kind == "poison" and not self.poisonable:
                self.skipped.append({"t": now - self.t0, "kind": f.kind, "target": name(f.targets[0]), **extra,
                                     "why": f"sync.mode={self.cfg.sync.mode} has no poison screen"})
                return True
            if f.kind in ("hang", "poison"):
                if f.targets[0] not in running:
                    return False
                return self._fault(f.kind, running, now, target=f.targets[0], **extra)
            if f.kind == "partition":
                return self._fault("partition", running, now, target=f.cluster, **extra)
            if f.lighthouse not in self.job.lighthouses:
                self.skipped.append({"t": now - self.t0, "kind": f.kind, "target": f.lighthouse, **extra,
                                     "why": f"no {f.lighthouse} lighthouse in sync.mode={self.cfg.sync.mode}"})
                return True
            proc = self.job.lighthouses[f.lighthouse]
            if proc is not None and proc.popen.poll() is not None:
                return False  # still down from an earlier fault: the supervisor brings it back
            return self._fault("lighthouse", running, now, target=f.lighthouse, **extra)
        if not all(k in running for k in f.targets) or not keeps_continuous(f.targets, continuous):
            return False
        if f.role == "cluster":
            c = f.targets[0][0]
            R = self.cfg.topology.replicas_per_cluster
            others = [x for x in range(self.cfg.topology.clusters) if x != c and all((x, r) in running for r in range(R))]
            if not others:  # never the last cluster standing
                return False
        if f.kind == "phase_kill":
            if f.targets[0] in self._hung(now):
                return False  # a hang holds it stopped: armed once it runs again (:meth:`_hung`)
            self._arm(f.role, f.phase, now, f.targets[0], **extra)
            if self.cfg.sync.mode != "hier" and f.phase in BASELINE_PHASE:
                self.armed["phase_as"] = BASELINE_PHASE[f.phase]  # type: ignore[index]
            return True
        was = {name(k): bool(running[k].get("leader")) for k in f.targets}
        self._kill(list(f.targets), running, now, f.role, kind=f.kind, was_leader=was, **extra)
        return True

    def finish(self) -> None:
        """Ends every fault still in progress (a stopped process, a cut cluster)."""
        now = time.time()
        if self.armed is not None and self.armed.get("stop_sent"):
            self._disarm_stop(self.armed["target"])
        for action, arg in self.pending.due(now, force=True):
            self._end(action, arg, now)
