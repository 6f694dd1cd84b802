"""``hier-localsgd simulate``: a discrete-event simulation of a large deployment with failures.

What it predicts, for C clusters x R replica groups running ``hier`` (or the ``flat`` and
``ddp`` baselines) with given step time, networks, H values, failure rates, restart and
heal times and timeouts:

* **goodput**: compute that ends in committed outer rounds (``flat``/``ddp``: committed
  rounds) / compute time available, ``C R T`` replica-group-seconds over the run. With no
  failures it equals ``1 - sync / (compute + sync)``, the communication fraction of
  :mod:`hier_localsgd.tools.plan.planner` (tests/test_simulate.py checks the equality);
* where the rest went: sync, waits (quorums, the global barrier, heals), downtime, and
  compute that was computed but lost (rolled back, or discarded at weight 0);
* **time lost per failure, by role** (non-leader, leader, whole cluster), attributed to
  the failure that caused it;
* **slow-link traffic** (bytes crossing clusters: outer all-reduces and heals from another
  cluster; for ``flat``/``ddp`` the C cluster-crossing edges of their ring);
* the chaos command's own figure, ``efficiency`` = steps kept / steps run, counted as
  sync/hier.py and chaos.py count it, for validation against ``hier-localsgd chaos``;
* the **sensitivity** of goodput to the failure rate (the rates scaled by each factor of
  ``sensitivity``).

Model (docs/architecture.md, "Failure semantics" and "Recovery order"). Time advances
through a heap of timestamped events (``heapq``, ties broken by insertion order); random
draws come from one seeded ``random.Random`` in event order, so a seed reproduces a run
exactly. The replica groups of a cluster run in lockstep: an inner round is
``H_inner`` local steps of ``step_s`` each (times ``1 + N(0, step_jitter)`` per cluster
and round, from its own seeded stream), then

1. INNER_QUORUM at the cluster lighthouse, with torchft's rule
   (:func:`lighthouse_forms_at`): at once if every member of the last quorum joined
   ("fast quorum"); otherwise once more than half of the heartbeating participants joined
   and either all of them did or ``join_s`` passed since the first one. A crashed member
   heartbeats for ``heartbeat_s`` after its death; a hung one until its watchdog ends it.
   Restarted replica groups waiting at the lighthouse join here. Past ``inner_quorum_s``
   the round fails (rollback);
2. the round's collectives: heals of the joiners (``heal_s``, everyone waits),
   ``reconfigure_s`` if the membership changed, the inner all-reduce (ring bound on the
   LAN, tools/plan/planner.py);
3. every ``H_inner x H_outer`` steps, the leader (lowest live replica group) joins the
   global lighthouse with its cluster Manager (one Manager id per leader incarnation, as
   torchft appends a uuid). The same rule forms the outer quorum; a leader that waits
   more than ``outer_quorum_s`` gives up the outer round (INNER_ONLY: its cluster commits
   the inner round and goes on). Then: heals over the WAN of new or stale cluster
   Managers (``outer_heal_s``), the outer all-reduce over the WAN, the broadcast inside
   each cluster (LAN), and the inner commit.

A cluster whose model derives from an older global model than the current one (it missed
a committed outer round, or it restarted from scratch) contributes weight 0 at its next
outer round and adopts the global model and step: its work since its last outer commit is
discarded (sync/hier.py ``moved``). A leader change alone costs a heal of the new cluster
manager over the WAN, and the work only if the global model moved meanwhile.

Failures:

* a replica group that crashes loses its steps since its last inner commit; if it dies
  while its cluster's collectives run, the round fails for the survivors at once (Gloo
  connections close) and they roll back; it restarts after ``restart_s`` and joins at
  its cluster's next quorum (healing, weight 0 there), contributing from the next round;
* a leader that crashes during the outer round fails that outer round for every cluster
  (the others' inner rounds commit: their work is kept for the next outer round); a
  non-leader that crashes while its leader is in the outer round breaks its cluster's
  round, but the outer result (which holds the cluster's work) stands;
* a whole cluster lost: its uncommitted work is lost; the others continue (with
  ``min_clusters``); its replica groups restart together (start-up barrier, at most
  ``startup_s``) from scratch and train until their first outer round, where they heal
  from another cluster at weight 0;
* a hang (``hang_fraction`` of failures): the replica group stops but keeps heartbeating:
  a collective it is part of fails at the phase timeout (``inner_reduce_s``,
  ``outer_reduce_s``), quorums give up on it after ``join_s``; its watchdog ends it
  ``local_step_s + watchdog_grace_s`` after it hung, then it restarts as after a crash.

Failure processes: ``independent`` (per replica group, exponential with mean ``mtbf_s``;
whole clusters with ``cluster_mtbf_s``), ``chaos`` (the chaos command's schedule: one
job-wide exponential clock with mean ``kill_every_s``, the role drawn as chaos.py draws
it, no kills after ``stop_kills_at``), and an explicit ``kills`` list to replay a run:
``"t:c"`` kills cluster c at t seconds, ``"t:c:r"`` replica group r of cluster c;
``"sK:c"`` / ``"sK:c:r"`` kill while cluster c runs its local step K+1 (K steps done, as
the chaos report gives the step of each kill).

``flat`` and ``ddp`` run as one level over all C R replica groups (one "cluster" whose
ring is WAN-bound when C > 1); a total loss there resumes from the last commit.

A run ends at the first commit that closes an outer round after ``duration_s`` (or when
every replica group has done ``steps``). A run that cannot get there (the outer level
stopped committing: docs/planner.md, "out of step") is stopped at three times its length
and reported as truncated.

Not modelled: jitter inside a round (only between rounds and clusters), the lighthouse's
quorum tick, link loss, concurrent heals competing for bandwidth, a restarted replica
group's start-up join rounds, and ``max_quorum_failures`` exits.

Layout: config.py (the sections), params.py (a config resolved into one run's figures),
engine.py (this: the event loop), report.py (many runs, the report, validation set-ups).
:class:`Simulation` stays one class (~830 lines): its event handlers share the whole
state of the run (clusters, members, the event queue, the counters), and splitting it by
event kind would hand that state around rather than simplify it.
"""

from __future__ import annotations

import heapq
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from hier_localsgd import costs
from hier_localsgd.tools.plan.network import comm_fraction
from hier_localsgd.tools.simulate.config import INF
from hier_localsgd.tools.simulate.params import SimParams


# ----------------------------------------------------------------------------- the lighthouse rule
def lighthouse_forms_at(now: float, first_joined: float, joined: int, waiting_for: Sequence[float], join_s: float, fast: bool, min_joined: int = 1) -> float:
    """When torchft's lighthouse forms a quorum (``quorum_compute``), if nobody else joins.

    ``waiting_for``: for each healthy participant that has not joined, the time its
    heartbeat stops counting (``inf`` for a live one). The lighthouse forms at once if
    every member of the previous quorum has joined (``fast``, "Fast quorum found");
    otherwise once ``joined > healthy // 2`` (no split brain) and either every healthy
    participant has joined or ``join_s`` has passed since the first joined. Returns
    ``inf`` if only a new join (or nothing) can form it.
    """
    if joined < min_joined:
        return INF
    if fast:
        return now
    deadline = first_joined + join_s
    cands = sorted({now, *[g for g in waiting_for if now < g < INF], *([deadline] if deadline > now else [])})
    for tc in cands:
        b = sum(1 for g in waiting_for if g > tc)
        if joined > (joined + b) // 2 and (b == 0 or tc >= deadline):
            return tc
    return INF


# ----------------------------------------------------------------------------- state
# Event kinds, in the heap as (time, seq, kind, a, b, token).
COMPUTE_DONE, QUORUM, SYNC_DONE, COMMIT, OUTER_DONE, BARRIER, FAIL, CLUSTER_FAIL, KILL, RESTART, WATCHDOG, ABORT, CLUSTER_START, OUTER_TIMEOUT = range(14)

# Cluster states.
S_COMPUTE, S_QUORUM, S_SYNC, S_OUTER, S_COMMIT, S_DOWN, S_DONE = "compute", "quorum", "sync", "outer", "commit", "down", "done"


class Member:
    """One replica group."""

    __slots__ = ("r", "alive", "hung", "joining", "fid", "down_at", "back_at", "acc0", "gen")

    def __init__(self, r: int) -> None:
        self.r = r
        self.alive = True
        self.hung = False
        self.joining = False  # restarted, waiting at its cluster's lighthouse
        self.fid = -1  # the failure that took it down
        self.down_at = 0.0
        self.back_at = 0.0
        self.acc0 = 0  # cluster.outer_acc when it joined (its since-outer steps = outer_acc - acc0)
        self.gen = 0  # invalidates its scheduled failure after a restart


class Cluster:
    """A cluster's replica groups, which run in lockstep, and its level state."""

    def __init__(self, idx: int, replicas: int) -> None:
        self.idx = idx
        self.members = [Member(r) for r in range(replicas)]
        self.active: Set[int] = set(range(replicas))  # the last quorum's live members (they compute)
        self.blockers: Dict[int, Tuple[float, int]] = {}  # r -> (until when the lighthouse waits for it, fid)
        self.joiners: List[int] = []
        self.state = S_COMPUTE
        self.epoch = 0
        self.round_start = 0.0
        self.round_step_s = 0.0
        self.phase_start = 0.0
        self.step = 0
        self.leader = 0
        self.inner_rounds = 0
        # outer level
        self.base = 0  # the global outer round its model derives from
        self.mgr_id = idx  # its leader's cluster Manager at the global lighthouse (-1: none)
        self.mgr_new = False  # that Manager has not been in a global quorum yet (it heals there)
        self.mgr_cause = -1  # the failure that made the leader change
        self.stale_cause = -1
        self.delay_cause = -1
        self.broken = False  # a non-leader died during the outer phase
        self.outer_weight = 0.0  # this cluster's weight in the outer round in flight
        self.outer_outcome: Optional[str] = None  # "committed" | "inner_only" for the pending commit
        # work (compute replica-seconds)
        self.pending = 0.0  # inner-committed since the last outer commit
        self.round_compute = 0.0  # the current round's, once computed
        self.round_joiners = 0
        # time categories
        self.cat = "compute"
        self.cat_since = 0.0
        # chaos-style step accounting
        self.outer_acc = 0
        self.acc0_sum = 0
        # restart of a lost cluster
        self.restart_cause = -1
        self.first_back = INF


@dataclass
class RunResult:
    """One simulation's figures (JSON-ready through :func:`dataclasses.asdict`)."""

    seed: int
    end_s: float
    capacity: float  # replica-group-seconds
    goodput: float
    expected_no_failure_goodput: float
    committed: float
    compute: float
    lost: Dict[str, float]
    uncommitted_at_end: float
    sync: float
    wait: float
    down: float
    balance_error: float
    failures: List[Dict[str, Any]]
    by_role: Dict[str, Dict[str, float]]
    unattributed_stall: float
    slow_link_bytes: float
    steps_run: int
    steps_discarded: int
    efficiency: Optional[float]
    outer_rounds: int
    failed_outer_rounds: int
    inner_rounds: int
    final_step: int
    truncated: bool = False  # stopped by the safety net (the configuration cannot finish)


class Simulation:
    """One run. ``run()`` returns a :class:`RunResult`."""

    def __init__(self, p: SimParams, seed: int) -> None:
        self.p = p
        self.seed = seed
        self.rng = random.Random(seed)
        self.jitter_rng = random.Random(seed * 1_000_003 + 7)  # its own stream: jitter does not change the failure draws
        self.heap: List[Tuple[float, int, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.hier = p.mode == "hier"
        self.clusters = [Cluster(c, p.replicas) for c in range(p.clusters)]
        # global barrier (hier)
        self.arrived: Dict[int, float] = {}
        self.prev_quorum: Set[int] = set(range(p.clusters))  # cluster Manager ids of the last outer quorum
        self.next_mgr_id = p.clusters
        self.lingering: Dict[int, Tuple[float, int]] = {}  # dead or replaced Manager id -> (heartbeat stops counting, fid)
        self.round_no = 0
        self.global_step = 0
        self.in_flight: Optional[Dict[str, Any]] = None
        self.barrier_gen = 0
        self.first_arrival = INF
        self.outstanding: Set[int] = set()  # clusters whose commit closes the last global round
        self.stop_pending = False
        self.end: Optional[float] = None
        # accounting
        self.totals: Dict[str, float] = defaultdict(float)
        self.lost: Dict[str, float] = defaultdict(float)
        self.committed = 0.0
        self.ledger: Dict[int, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.failures: List[Dict[str, Any]] = []
        self.unattributed_stall = 0.0
        self.slow_bytes = 0.0
        self.steps_run = 0
        self.steps_discarded = 0
        self.outer_rounds = 0
        self.failed_outer = 0
        self.kills_stopped = False
        self.truncated = False
        self.step_kills: Dict[int, List[Tuple[int, int]]] = defaultdict(list)  # cluster -> [(step, replica)]

    # ------------------------------------------------------------------ events
    def push(self, t: float, kind: int, a: int = 0, b: int = 0, token: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, a, b, token))

    def run(self) -> RunResult:
        p = self.p
        for c in self.clusters:
            self.start_round(c, 0.0)
        self.schedule_failures()
        handlers: Dict[int, Callable[[float, int, int, int], None]] = {
            COMPUTE_DONE: self.on_compute_done, QUORUM: self.on_quorum, SYNC_DONE: self.on_sync_done,
            COMMIT: self.on_commit, OUTER_DONE: self.on_outer_done, BARRIER: self.on_barrier,
            FAIL: self.on_fail, CLUSTER_FAIL: self.on_cluster_fail, KILL: self.on_kill,
            RESTART: self.on_restart, WATCHDOG: self.on_watchdog, ABORT: self.on_abort,
            CLUSTER_START: self.on_cluster_start, OUTER_TIMEOUT: self.on_outer_timeout,
        }
        # A safety net for runs that cannot finish: the outer level stopped committing (see
        # docs/planner.md, "out of step"), or kills come faster than a restarted cluster
        # reaches its first outer round. Stop and flag the result as truncated.
        nominal = p.duration_s if p.steps == 0 else p.steps * (p.step_s + p.no_failure_sync_per_step())
        limit = 3 * nominal + 3600.0
        while self.heap and self.end is None:
            t, _, kind, a, b, token = heapq.heappop(self.heap)
            self.now = t
            if t > limit:
                self.end = t
                self.truncated = True
                break
            handlers[kind](t, a, b, token)
        if self.end is None:
            self.end = self.now
        return self.finish()

    def failures_active(self, t: float) -> bool:
        """No failures after ``stop_kills_at`` of the run (steps: of the slowest live cluster's steps)."""
        p = self.p
        if p.steps > 0:
            if self.kills_stopped:
                return False
            live = [c.step for c in self.clusters if c.state not in (S_DOWN, S_DONE)]
            return not live or min(live) < int(p.steps * p.stop_kills_at)
        return t < p.stop_kills_at * p.duration_s

    def schedule_failures(self) -> None:
        p = self.p
        if p.failure_model == "independent":
            if p.mtbf_s > 0:
                for c in self.clusters:
                    for m in c.members:
                        self.push(self.rng.expovariate(1.0 / p.mtbf_s), FAIL, c.idx, m.r, m.gen)
            if p.cluster_mtbf_s > 0:
                for c in self.clusters:
                    self.push(self.rng.expovariate(1.0 / p.cluster_mtbf_s), CLUSTER_FAIL, c.idx, 0, 0)
        elif p.failure_model == "chaos":
            self.push(self.rng.expovariate(1.0 / p.kill_every_s), KILL, 0, 0, 0)
        for t, c, r, step in p.kills:
            if step >= 0:
                self.step_kills[c].append((step, r))
                continue
            if r < 0:
                self.push(t, CLUSTER_FAIL, c, 0, -1)  # token -1: explicit, not rescheduled
            else:
                self.push(t, FAIL, c, r, -1)

    # ------------------------------------------------------------------ time categories
    def book(self, c: Cluster, t: float) -> None:
        """Books the active members' time since the last booking in the current category."""
        dt = t - c.cat_since
        if dt > 0 and c.active:
            self.totals[c.cat] += dt * len(c.active)
        c.cat_since = max(c.cat_since, t)

    def enter(self, c: Cluster, t: float, cat: str) -> None:
        self.book(c, t)
        c.cat = cat

    # ------------------------------------------------------------------ the round
    def start_round(self, c: Cluster, t: float) -> None:
        p = self.p
        if p.steps and c.step >= p.steps:
            self.cluster_done(c, t)
            return
        c.epoch += 1
        c.state = S_COMPUTE
        c.round_start = t
        c.round_compute = 0.0
        c.round_joiners = 0
        c.broken = False
        c.outer_outcome = None
        self.enter(c, t, "compute")
        c.round_step_s = p.step_s
        if p.step_jitter > 0:
            c.round_step_s = p.step_s * max(0.05, 1.0 + self.jitter_rng.gauss(0.0, p.step_jitter))
        self.push(t + p.h_inner * c.round_step_s, COMPUTE_DONE, c.idx, 0, c.epoch)
        kills = self.step_kills.get(c.idx)
        if kills:
            for k, r in [x for x in kills if c.step <= x[0] < c.step + p.h_inner]:
                kills.remove((k, r))
                at = t + (k - c.step + 0.5) * c.round_step_s  # half-way through local step k+1
                self.push(at, CLUSTER_FAIL if r < 0 else FAIL, c.idx, max(r, 0), -1)

    def on_compute_done(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_COMPUTE:
            return
        p = self.p
        n = len(c.active)
        c.step += p.h_inner
        c.round_compute = n * (t - c.round_start)
        self.steps_run += n * p.h_inner
        c.state = S_QUORUM
        c.phase_start = t
        self.enter(c, t, "wait")
        self.schedule_quorum(c, t)

    def quorum_time(self, c: Cluster, now: float) -> Tuple[float, int]:
        """When the cluster lighthouse forms the quorum the members requested at
        ``c.phase_start`` (the last quorum's live members, plus waiting joiners), and which
        failure decides it (-1: none). Blockers: the last quorum's dead or hung members."""
        joiners = [c.members[r] for r in c.joiners if c.members[r].alive and not c.members[r].hung]
        first = min([c.phase_start] + [m.back_at for m in joiners])
        waiting = [g for g, _ in c.blockers.values()]
        tq = lighthouse_forms_at(max(now, c.phase_start), first, len(c.active) + len(joiners), waiting,
                                 self.p.join_s, fast=not c.blockers, min_joined=self.p.min_replicas)
        cause = -1
        if c.blockers and tq > c.phase_start:
            # the blocker whose expiry formed it, else (join timeout) the latest one
            expired = [(g, fid) for g, fid in c.blockers.values() if g <= tq]
            cause = max(expired)[1] if expired else max(c.blockers.values())[1]
        return tq, cause

    def schedule_quorum(self, c: Cluster, t: float) -> None:
        c.epoch += 1
        tq, _ = self.quorum_time(c, t)
        self.push(max(t, min(tq, c.phase_start + self.p.inner_quorum_s)), QUORUM, c.idx, 0, c.epoch)

    def on_quorum(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_QUORUM:
            return
        p = self.p
        tq, cause = self.quorum_time(c, t)
        deadline = c.phase_start + p.inner_quorum_s
        if tq > deadline + 1e-12 and t >= deadline - 1e-12:
            # INNER_QUORUM timed out: the round fails (rollback), the next one starts
            self.book(c, t)
            if cause >= 0:
                self.ledger[cause]["stall"] += (t - c.phase_start) * len(c.active)
            self.abort(c, t, cause)
            return
        if tq > t + 1e-12:  # not yet (a blocker was added meanwhile)
            self.push(min(tq, deadline), QUORUM, c.idx, 0, c.epoch)
            return
        joiners = [r for r in c.joiners if c.members[r].alive and not c.members[r].hung]
        self.book(c, t)
        stall = t - c.phase_start
        if stall > 1e-12 and cause >= 0:
            self.ledger[cause]["stall"] += stall * len(c.active)
            c.delay_cause = cause
        changed = bool(c.blockers) or bool(joiners)
        c.blockers.clear()
        for r in joiners:
            m = c.members[r]
            m.joining = False
            self.totals["wait"] += t - m.back_at
            self.ledger[m.fid]["down"] += t - m.down_at
            m.acc0 = c.outer_acc + p.h_inner  # it computed nothing this round (weight 0)
            c.acc0_sum += m.acc0
            c.active.add(r)
        c.joiners = [r for r in c.joiners if r not in joiners and c.members[r].alive]
        c.round_joiners = len(joiners)
        if self.hier:
            leader = min(c.active)
            if leader != c.leader or c.mgr_id < 0:
                # A new leader starts a cluster Manager. A demoted one shuts its own down;
                # the global lighthouse counts it for one more heartbeat timeout.
                old = c.members[c.leader]
                why = old.fid if (not old.alive or old.hung) else c.members[leader].fid
                self.drop_manager(c, t + p.heartbeat_s, why)
                self.new_manager(c, why)
                c.leader = leader
        c.state = S_SYNC
        c.phase_start = t
        self.enter(c, t, "sync")
        heal = p.heal_s if joiners else 0.0
        reconf = p.reconfigure_s if changed else 0.0
        if heal + reconf > 0:
            fid = c.members[joiners[0]].fid if joiners else cause
            if fid >= 0:
                self.ledger[fid]["stall"] += (heal + reconf) * len(c.active)
                c.delay_cause = fid
            else:
                self.unattributed_stall += (heal + reconf) * len(c.active)
        if not self.hier and p.wide_clusters > 1:
            # the ring over every replica group crosses each cluster boundary once
            self.slow_bytes += p.ranks * (p.wide_clusters * costs.ring_factor(len(c.active)) * p.sync_bytes + len(joiners) * p.heal_bytes)
        self.push(t + heal + reconf + p.inner_time(len(c.active)), SYNC_DONE, c.idx, 0, c.epoch)

    def is_outer_round(self, c: Cluster) -> bool:
        return self.hier and c.step % self.p.period == 0

    def on_sync_done(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_SYNC:
            return
        if self.is_outer_round(c):
            c.state = S_OUTER
            c.phase_start = t
            self.enter(c, t, "wait")
            self.arrive(c, t)
        else:
            self.commit(c, t)

    def commit(self, c: Cluster, t: float) -> None:
        """INNER_COMMIT: adopt the round (and the outer outcome, if any); next round."""
        p = self.p
        n = len(c.active)
        outcome = c.outer_outcome
        if c.broken:
            # The cluster's inner round failed; an outer commit holding its work stands.
            self.steps_discarded += (n - c.round_joiners) * p.h_inner
            if outcome == "committed" and c.outer_weight > 0:
                self.committed += c.pending + c.round_compute
            elif outcome == "committed":
                self.lose("discarded", c.pending + c.round_compute, c.stale_cause)
            else:
                self.lose("rollback", c.round_compute, c.delay_cause)
            if outcome == "committed":
                c.pending = 0.0
                self.adopt(c)
        else:
            c.pending += c.round_compute
            c.outer_acc += p.h_inner
            c.inner_rounds += 1
            if not self.hier:
                self.committed += c.pending
                c.pending = 0.0
            elif outcome == "committed":
                if c.outer_weight > 0:
                    self.committed += c.pending
                else:
                    self.lose("discarded", c.pending, c.stale_cause)
                    self.steps_discarded += n * c.outer_acc - c.acc0_sum
                c.pending = 0.0
                self.adopt(c)
        c.round_compute = 0.0
        if c.idx in self.outstanding:
            self.outstanding.discard(c.idx)
        if not self.hier and self.stop_pending_check(t):
            return
        self.start_round(c, t)
        if self.hier and self.stop_pending and not self.outstanding:
            self.end = t

    def adopt(self, c: Cluster) -> None:
        """The cluster now holds the current global model and step."""
        c.base = self.round_no
        c.step = max(c.step, self.global_step)
        c.outer_acc = 0
        c.acc0_sum = 0
        for r in c.active:
            c.members[r].acc0 = 0
        c.stale_cause = -1

    def stop_pending_check(self, t: float) -> bool:
        """flat/ddp: end at the first commit after the horizon."""
        if self.p.steps == 0 and t >= self.p.duration_s:
            self.end = t
            return True
        return False

    def lose(self, reason: str, amount: float, cause: int) -> None:
        if amount <= 0:
            return
        self.lost[reason] += amount
        if cause >= 0:
            self.ledger[cause][reason] += amount

    # ------------------------------------------------------------------ global barrier (hier)
    def arrive(self, c: Cluster, t: float) -> None:
        self.arrived[c.idx] = t
        self.first_arrival = min(self.first_arrival, t)
        self.push(t + self.p.outer_quorum_s, OUTER_TIMEOUT, c.idx, 0, c.epoch)
        self.evaluate_barrier(t)

    def on_outer_timeout(self, t: float, ci: int, _b: int, epoch: int) -> None:
        """OUTER_QUORUM timed out: the leader gives up this outer round (INNER_ONLY); the
        cluster commits its inner round and goes on. It is stale if the others committed one."""
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_OUTER or ci not in self.arrived:
            return
        del self.arrived[ci]
        if not self.arrived:
            self.first_arrival = INF
        c.outer_outcome = "inner_only"
        c.state = S_COMMIT
        self.push(t + self.p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)
        self.evaluate_barrier(t)

    def new_manager(self, c: Cluster, cause: int) -> None:
        c.mgr_id = self.next_mgr_id
        self.next_mgr_id += 1
        c.mgr_new = True
        c.mgr_cause = cause

    def drop_manager(self, c: Cluster, gone_at: float, cause: int) -> None:
        """The cluster's Manager stops (dies, or is shut down): it counts until ``gone_at``."""
        if c.mgr_id >= 0:
            self.lingering[c.mgr_id] = (gone_at, cause)
            c.mgr_id = -1

    def evaluate_barrier(self, t: float) -> None:
        """The global lighthouse: form the outer quorum of the arrived leaders now, or
        schedule the next look (a heartbeat running out, the join timeout)."""
        if self.in_flight is not None or not self.arrived:
            return
        p = self.p
        for k in [k for k, (g, _) in self.lingering.items() if g <= t]:
            del self.lingering[k]
        joined = {self.clusters[ci].mgr_id for ci in self.arrived}
        waiting = [INF for c in self.clusters if c.mgr_id >= 0 and c.idx not in self.arrived]
        waiting += [g for g, _ in self.lingering.values()]
        at = lighthouse_forms_at(t, self.first_arrival, len(joined), waiting, p.join_s,
                                 fast=self.prev_quorum <= joined, min_joined=p.min_clusters)
        if at <= t:
            self.form_outer(t)
        elif at < INF:
            self.barrier_gen += 1
            self.push(at, BARRIER, 0, 0, self.barrier_gen)

    def on_barrier(self, t: float, _a: int, _b: int, gen: int) -> None:
        if gen == self.barrier_gen:
            self.evaluate_barrier(t)

    def form_outer(self, t: float) -> None:
        p = self.p
        parts = sorted(self.arrived)
        # who made the early arrivals wait: the last to arrive, or a Manager whose heartbeat ran out
        last = max(parts, key=lambda ci: self.arrived[ci])
        cause = self.clusters[last].delay_cause
        if self.arrived[last] < t - 1e-12:
            gone = [(g, fid) for g, fid in self.lingering.values() if g <= t + 1e-12]
            cause = max(gone)[1] if gone else -1
        for ci in parts:
            c = self.clusters[ci]
            wait = t - self.arrived[ci]
            if wait > 1e-12:
                # a cluster out of step because it restarted waits for the others' schedule: its own failure's cost
                k = c.stale_cause if (c.base != self.round_no and c.stale_cause >= 0) else cause
                if k >= 0:
                    self.ledger[k]["stall"] += wait * len(c.active)
                else:
                    self.unattributed_stall += wait * len(c.active)
        heal_needed = [ci for ci in parts if self.clusters[ci].mgr_new or self.clusters[ci].base != self.round_no]
        for ci in parts:
            c = self.clusters[ci]
            c.outer_weight = 1.0 if c.base == self.round_no else 0.0
            if c.outer_weight == 0 and c.stale_cause < 0:
                c.stale_cause = c.delay_cause
            self.enter(c, t, "sync")
            c.phase_start = t
            c.delay_cause = -1  # accounted for up to this barrier
        ids = {self.clusters[ci].mgr_id for ci in parts}
        changed = ids != self.prev_quorum
        for ci in parts:
            self.clusters[ci].mgr_new = False
        heal = p.outer_heal_s if heal_needed else 0.0
        reconf = p.reconfigure_s if changed else 0.0
        if heal + reconf > 0:
            hc = self.clusters[heal_needed[0]] if heal_needed else None
            fid = (hc.stale_cause if hc.stale_cause >= 0 else hc.mgr_cause) if hc else -1
            members = sum(len(self.clusters[ci].active) for ci in parts)
            if fid >= 0:
                self.ledger[fid]["stall"] += (heal + reconf) * members
            else:
                self.unattributed_stall += (heal + reconf) * members
        self.slow_bytes += p.ranks * (len(heal_needed) * p.outer_heal_bytes + len(parts) * costs.ring_factor(len(parts)) * p.sync_bytes)
        self.prev_quorum = ids
        self.arrived.clear()
        self.first_arrival = INF
        self.barrier_gen += 1
        self.in_flight = {"parts": parts, "ids": ids, "start": t, "gen": self.barrier_gen}
        self.push(t + heal + reconf + p.outer_time(len(parts)), OUTER_DONE, 0, 0, self.barrier_gen)

    def on_outer_done(self, t: float, _a: int, _b: int, gen: int) -> None:
        fl = self.in_flight
        if fl is None or fl["gen"] != gen or fl.get("hung"):
            return
        self.in_flight = None
        parts = [ci for ci in fl["parts"] if self.clusters[ci].state == S_OUTER]
        weight = sum(self.clusters[ci].outer_weight for ci in parts)
        self.global_step = max([self.clusters[ci].step for ci in parts if self.clusters[ci].outer_weight > 0] + [self.global_step])
        if weight > 0:
            self.round_no += 1
        self.outer_rounds += 1
        horizon = self.p.steps == 0 and t >= self.p.duration_s
        for ci in parts:
            c = self.clusters[ci]
            c.outer_outcome = "committed"
            c.state = S_COMMIT
            self.outstanding.add(ci)
            self.push(t + self.p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)
        if horizon:
            self.stop_pending = True
        self.evaluate_barrier(t)

    def fail_outer(self, t: float, dead: int, fid: int) -> None:
        """The outer round in flight failed (a participant's leader is gone): the others'
        inner rounds commit (INNER_ONLY); their work waits for the next outer round."""
        fl = self.in_flight
        assert fl is not None
        self.in_flight = None
        self.failed_outer += 1
        self.prev_quorum = set(fl["ids"])
        for ci in fl["parts"]:
            c = self.clusters[ci]
            if ci == dead or c.state != S_OUTER:
                continue
            self.ledger[fid]["stall"] += (t - fl["start"]) * len(c.active)
            c.outer_outcome = "inner_only"
            c.state = S_COMMIT
            c.delay_cause = fid
            self.push(t + self.p.broadcast_time(len(c.active)), COMMIT, ci, 0, c.epoch)
        self.evaluate_barrier(t)

    def on_commit(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_COMMIT:
            return
        self.commit(c, t)

    # ------------------------------------------------------------------ failures
    def new_failure(self, t: float, role: str, c: int, r: int, kind: str) -> int:
        fid = len(self.failures)
        self.failures.append({"id": fid, "t": t, "role": role, "cluster": c, "replica": r, "kind": kind})
        return fid

    def role_of(self, c: Cluster, r: int) -> str:
        return "leader" if self.hier and r == c.leader and r in c.active else "non_leader"

    def on_fail(self, t: float, ci: int, r: int, token: int) -> None:
        c = self.clusters[ci]
        m = c.members[r]
        p = self.p
        if token >= 0 and (token != m.gen or p.failure_model != "independent"):
            return
        if token >= 0 and not self.failures_active(t):
            return
        if not m.alive or m.hung or c.state in (S_DONE,):
            return
        hang = p.hang_fraction > 0 and self.rng.random() < p.hang_fraction
        fid = self.new_failure(t, self.role_of(c, r), ci, r, "hang" if hang else "crash")
        self.fail_member(c, r, t, fid, hang)

    def on_cluster_fail(self, t: float, ci: int, _b: int, token: int) -> None:
        c = self.clusters[ci]
        p = self.p
        if token >= 0:
            if p.cluster_mtbf_s > 0:
                self.push(t + self.rng.expovariate(1.0 / p.cluster_mtbf_s), CLUSTER_FAIL, ci, 0, 0)
            if not self.failures_active(t):
                return
        live = [r for r in range(p.replicas) if c.members[r].alive]
        if c.state in (S_DOWN, S_DONE) or not live:
            return
        fid = self.new_failure(t, "cluster", ci, -1, "crash")
        for r in live:
            self.fail_member(c, r, t, fid, hang=False)

    def on_kill(self, t: float, _a: int, _b: int, _t: int) -> None:
        """The chaos command's schedule (chaos.py ChaosMonkey)."""
        p = self.p
        if not self.failures_active(t):
            return
        running = [(c, m) for c in self.clusters for m in c.members if m.alive and not m.hung and c.state not in (S_DOWN, S_DONE)]
        if p.steps and running and min(c.step for c, _ in running) >= int(p.steps * p.stop_kills_at):
            self.kills_stopped = True
            return
        roles = list(p.roles)
        self.rng.shuffle(roles)
        for role in roles:
            cands = self.chaos_candidates(role, running)
            if cands:
                break
        else:
            self.push(t + 1.0, KILL)  # nothing eligible right now (restarting)
            return
        ci, r = self.rng.choice(cands)
        c = self.clusters[ci]
        if role == "cluster":
            fid = self.new_failure(t, "cluster", ci, -1, "crash")
            for rr in range(p.replicas):
                if c.members[rr].alive:
                    self.fail_member(c, rr, t, fid, hang=False)
        else:
            hang = p.hang_fraction > 0 and self.rng.random() < p.hang_fraction
            fid = self.new_failure(t, role, ci, r, "hang" if hang else "crash")
            self.fail_member(c, r, t, fid, hang)
        self.push(t + self.rng.expovariate(1.0 / p.kill_every_s), KILL)

    def chaos_candidates(self, role: str, running: List[Tuple[Cluster, Member]]) -> List[Tuple[int, int]]:
        if role == "leader":
            return [(c.idx, m.r) for c, m in running if self.hier and m.r == c.leader and m.r in c.active]
        if role == "non_leader":
            return [(c.idx, m.r) for c, m in running if not (self.hier and m.r == c.leader and m.r in c.active)]
        whole = [c.idx for c in self.clusters if c.state not in (S_DOWN, S_DONE) and all(m.alive and not m.hung for m in c.members)]
        return [(ci, -1) for ci in whole] if self.hier and len(whole) >= 2 else []

    def fail_member(self, c: Cluster, r: int, t: float, fid: int, hang: bool) -> None:
        """Replica group r of cluster c crashes (or hangs) at t."""
        p = self.p
        m = c.members[r]
        self.book(c, t)
        m.gen += 1
        was_active = r in c.active
        if m.joining or not was_active:
            # Waiting to rejoin, or hung (a cluster outage takes it too): nothing of the cluster's is lost.
            if m.hung:
                self.totals["down"] += t - m.down_at
                self.ledger[m.fid]["down"] += t - m.down_at
                m.hung = False
            if m.joining:
                self.totals["wait"] += t - m.back_at
                self.ledger[m.fid]["down"] += t - m.down_at
                m.joining = False
                if r in c.joiners:
                    c.joiners.remove(r)
            self.take_down(c, m, t, fid, hang=False)
            return
        # its own steps since the last inner commit
        if c.state == S_COMPUTE:
            k = int((t - c.round_start) / c.round_step_s + 1e-9)
            partial = t - c.round_start
            self.steps_run += k
            self.steps_discarded += k
            self.lose("own_work", partial, fid)
        else:
            # it finished computing the round; that round is not committed yet
            share = c.round_compute / len(c.active) if c.active else 0.0
            if not (c.state == S_COMMIT and c.outer_outcome == "committed"):
                self.steps_discarded += p.h_inner
                c.round_compute -= share
                self.lose("own_work", share, fid)
        c.active.discard(r)
        c.acc0_sum -= m.acc0
        leader = self.hier and r == c.leader
        if leader:  # its cluster Manager goes with it (a hung one heartbeats until the watchdog)
            self.drop_manager(c, t + (p.hang_watchdog_s if hang else 0.0) + p.heartbeat_s, fid)
        gone_at = t + p.hang_watchdog_s + p.heartbeat_s if hang else t + p.heartbeat_s
        c.blockers[r] = (gone_at, fid)
        self.take_down(c, m, t, fid, hang)
        if not c.active:
            self.cluster_lost(c, t, fid)
            return
        self.disrupt(c, t, fid, hang, leader)

    def take_down(self, c: Cluster, m: Member, t: float, fid: int, hang: bool) -> None:
        m.fid = fid
        m.down_at = t
        if hang:
            m.hung = True
            self.push(t + self.p.hang_watchdog_s, WATCHDOG, c.idx, m.r, m.gen)
        else:
            m.alive = False
            self.push(t + self.p.restart_s, RESTART, c.idx, m.r, m.gen)

    def disrupt(self, c: Cluster, t: float, fid: int, hang: bool, leader: bool) -> None:
        """What a member's failure does to its surviving peers, by the cluster's phase."""
        p = self.p
        if c.state == S_QUORUM:
            self.schedule_quorum(c, t)  # waits for the lighthouse to drop it
        elif c.state == S_SYNC:
            if hang:  # the collective waits for it until the phase timeout
                c.epoch += 1
                self.push(max(t, c.phase_start + p.inner_reduce_s), ABORT, c.idx, fid, c.epoch)
            else:  # its connections close: the others fail at once
                self.abort(c, t, fid)
        elif c.state == S_OUTER:
            fl = self.in_flight
            if leader:
                if fl is not None and c.idx in fl["parts"]:
                    if hang:
                        fl["hung"] = True  # the outer all-reduce cannot complete
                        self.push(max(t, fl["start"] + p.outer_reduce_s), ABORT, c.idx, fid, c.epoch)
                    else:
                        self.fail_outer(t, c.idx, fid)
                        self.abort(c, t, fid)
                else:
                    self.arrived.pop(c.idx, None)
                    if not self.arrived:
                        self.first_arrival = INF
                    self.abort(c, t, fid)
                    self.evaluate_barrier(t)
            else:
                c.broken = True
                c.delay_cause = fid

    def on_abort(self, t: float, ci: int, fid: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch:
            return
        if c.state == S_OUTER and self.in_flight is not None and ci in self.in_flight["parts"]:
            self.fail_outer(t, ci, fid)
        if c.state in (S_SYNC, S_OUTER):
            self.abort(c, t, fid)

    def abort(self, c: Cluster, t: float, fid: int) -> None:
        """The round failed for the cluster: roll back to the last commit, next round."""
        self.book(c, t)
        self.steps_discarded += (len(c.active) - c.round_joiners) * self.p.h_inner
        self.lose("rollback", c.round_compute, fid)
        c.round_compute = 0.0
        c.delay_cause = fid
        self.outstanding.discard(c.idx)
        self.start_round(c, t)
        if self.stop_pending and not self.outstanding:
            self.end = t

    def cluster_lost(self, c: Cluster, t: float, fid: int) -> None:
        """Every replica group of the cluster is down: its uncommitted work is gone."""
        self.lose("discarded", c.pending + c.round_compute, fid)
        c.pending = 0.0
        c.round_compute = 0.0
        c.epoch += 1
        c.blockers.clear()
        if self.hier:
            self.drop_manager(c, t + self.p.heartbeat_s, fid)
            if self.in_flight is not None and c.idx in self.in_flight["parts"] and c.state == S_OUTER:
                self.fail_outer(t, c.idx, fid)
            elif c.idx in self.arrived:
                del self.arrived[c.idx]
                if not self.arrived:
                    self.first_arrival = INF
            self.outstanding.discard(c.idx)
        c.state = S_DOWN
        c.restart_cause = fid
        c.first_back = INF
        back = [c.members[r].back_at for r in c.joiners if c.members[r].alive]
        if back:  # restarted replica groups already waiting start the cluster afresh
            c.first_back = min(back)
            self.push(max(t, c.first_back + self.p.startup_s), CLUSTER_START, c.idx, 0, c.epoch)
        if self.hier:
            self.evaluate_barrier(t)
        if self.stop_pending and not self.outstanding:
            self.end = t

    def on_watchdog(self, t: float, ci: int, r: int, gen: int) -> None:
        c = self.clusters[ci]
        m = c.members[r]
        if gen != m.gen or not m.hung:
            return
        m.hung = False
        m.alive = False
        self.push(t + self.p.restart_s, RESTART, ci, r, m.gen)

    def on_restart(self, t: float, ci: int, r: int, gen: int) -> None:
        c = self.clusters[ci]
        m = c.members[r]
        p = self.p
        if gen != m.gen or m.alive:
            return
        m.alive = True
        m.back_at = t
        m.gen += 1
        self.totals["down"] += t - m.down_at
        if p.failure_model == "independent" and p.mtbf_s > 0:
            self.push(t + self.rng.expovariate(1.0 / p.mtbf_s), FAIL, ci, r, m.gen)
        if c.state == S_DONE:
            self.book(c, t)
            c.active.add(r)  # idles (booked as wait) until the run ends
            return
        if c.state == S_DOWN:
            # Start-up barrier: the cluster starts when all are back, or startup_s after the first.
            m.joining = True
            c.joiners.append(r)
            if c.first_back == INF:
                c.first_back = t
                self.push(t + p.startup_s, CLUSTER_START, ci, 0, c.epoch)
            if all(mm.alive for mm in c.members):
                self.push(t, CLUSTER_START, ci, 0, c.epoch)
            return
        m.joining = True
        c.joiners.append(r)
        if c.state == S_QUORUM:
            self.schedule_quorum(c, t)

    def on_cluster_start(self, t: float, ci: int, _b: int, epoch: int) -> None:
        """A lost cluster restarts from scratch: step 0, initial weights, a new cluster Manager.
    (flat/ddp, where the one "cluster" is the whole job: from its last commit.)"""
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_DOWN:
            return
        back = [r for r in c.joiners if c.members[r].alive]
        if not back:  # they failed again meanwhile: the next one back starts the clock again
            c.first_back = INF
            return
        for r in back:
            m = c.members[r]
            m.joining = False
            self.totals["wait"] += t - m.back_at
            self.ledger[m.fid]["down"] += t - m.down_at
            m.acc0 = 0
        c.joiners = [r for r in c.joiners if r not in back]
        c.active = set(back)
        c.cat_since = t
        if self.hier:
            c.step = 0  # flat/ddp: a total loss resumes from the last commit (as from a checkpoint)
        c.pending = 0.0
        c.outer_acc = 0
        c.acc0_sum = 0
        c.base = -1  # derives from the initial weights: weight 0 at its first outer round
        c.stale_cause = c.restart_cause
        c.leader = min(back)
        self.new_manager(c, c.restart_cause)
        c.delay_cause = c.restart_cause
        self.start_round(c, t)

    def cluster_done(self, c: Cluster, t: float) -> None:
        self.book(c, t)
        c.state = S_DONE
        c.epoch += 1
        c.cat = "wait"  # finished replica groups idle until the run ends
        if all(cc.state == S_DONE for cc in self.clusters):
            self.end = t
        elif self.hier:
            if c.mgr_id >= 0:  # a clean exit: its Manager leaves at once
                self.prev_quorum.discard(c.mgr_id)
                c.mgr_id = -1
            self.evaluate_barrier(t)

    # ------------------------------------------------------------------ results
    def finish(self) -> RunResult:
        p = self.p
        end = self.end if self.end is not None else self.now
        uncommitted = 0.0
        for c in self.clusters:
            if c.state != S_DOWN:
                self.book(c, end)
                if c.state == S_COMPUTE:
                    # the round in progress: computed so far, not committed
                    uncommitted += len(c.active) * max(0.0, end - c.round_start)
                else:
                    uncommitted += c.round_compute
                uncommitted += c.pending
            for m in c.members:
                if not m.alive:
                    self.totals["down"] += end - m.down_at
                    self.ledger[m.fid]["down"] += end - m.down_at
                elif m.hung:
                    self.totals["down"] += end - m.down_at
                    self.ledger[m.fid]["down"] += end - m.down_at
                elif m.joining:
                    self.totals["wait"] += end - m.back_at
                    self.ledger[m.fid]["down"] += end - m.down_at
        capacity = p.clusters * p.replicas * end
        compute = self.totals["compute"]
        balance = capacity - (compute + self.totals["sync"] + self.totals["wait"] + self.totals["down"])
        balance_compute = compute - (self.committed + sum(self.lost.values()) + uncommitted)
        by_role: Dict[str, Dict[str, float]] = {}
        for f in self.failures:
            lg = self.ledger.get(f["id"], {})
            f["lost_replica_s"] = {k: v for k, v in lg.items()}
            f["lost_replica_s_total"] = sum(lg.values())
            agg = by_role.setdefault(f["role"], defaultdict(float))
            agg["count"] += 1
            for k, v in lg.items():
                agg[k] += v
            agg["total"] += sum(lg.values())
        for role, agg in by_role.items():
            n = agg["count"]
            by_role[role] = {"count": n, **{k: v / n for k, v in agg.items() if k != "count"}}
        sync = p.no_failure_sync_per_step()
        slow = self.slow_bytes
        return RunResult(
            seed=self.seed, end_s=end, capacity=capacity,
            goodput=self.committed / capacity if capacity else 0.0,
            expected_no_failure_goodput=1.0 - comm_fraction(p.step_s, sync),
            committed=self.committed, compute=compute, lost=dict(self.lost), uncommitted_at_end=uncommitted,
            sync=self.totals["sync"], wait=self.totals["wait"], down=self.totals["down"],
            balance_error=max(abs(balance), abs(balance_compute)) / capacity if capacity else 0.0,
            failures=self.failures, by_role=by_role, unattributed_stall=self.unattributed_stall,
            slow_link_bytes=slow, steps_run=self.steps_run, steps_discarded=self.steps_discarded,
            efficiency=(self.steps_run - self.steps_discarded) / self.steps_run if self.steps_run else None,
            outer_rounds=self.outer_rounds, failed_outer_rounds=self.failed_outer,
            inner_rounds=sum(c.inner_rounds for c in self.clusters), final_step=max(c.step for c in self.clusters),
            truncated=self.truncated,
        )


def simulate_once(p: SimParams, seed: int) -> RunResult:
    """One simulation of ``p`` with ``seed`` (reproducible)."""
    return Simulation(p, seed).run()


