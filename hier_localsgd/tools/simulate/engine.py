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
  ``sensitivity``);
* with ``target_rounds``, the **time to the target**, modelled as merged work (target.py).

Model (docs/architecture.md, "Failure semantics" and "Recovery order"). Time advances
through a heap of timestamped events (``heapq``, ties broken by insertion order); random
draws come from one seeded ``random.Random`` in event order, so a seed reproduces a run
exactly. The replica groups of a cluster run in lockstep: an inner round is
``H_inner`` local steps of ``step_s / speed`` each (``topology.cluster_speed``, 1.0 by
default; times ``1 + N(0, step_jitter)`` per cluster and round, from its own seeded
stream), then

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

With the asynchronous outer level (``sync.async_outer.enabled``) step 3 is instead a push:
the leader sends its pseudo-gradient to the global model server and gets the newest model
back (two WAN transfers, compressed as ``sync.outer.compression`` says, ``SimParams.push_time``:
the push reaches the server after its upload, ``upload_s``), and the cluster keeps its own step count. The push is merged if the cluster's
base is at most ``sync.async_outer.max_staleness`` versions behind when it arrives; beyond
that its work since its last push is discarded (sync/global_model.py) and it is answered
at once. A merged push waits in the server's open batch until the grace window closes it
(batches.py, with global_server.py's own rule: ``sync.async_outer.grace_s``, a tenth of a
contributor's period, the clusters expected inside the window, ``min_clusters``); a batch
is one version, and its pushes are answered then (pushes.py). With
``sync.async_outer.match_pace`` the server sets each cluster's push schedule as the real one
does (paces.py: the paces and transits learnt from the pushes, and each cluster's last push and answer,
with global_server.py's rules; the ``push_in`` of the answer, given when the server answers), and a
cluster's rounds end on the H_inner grid and at its push steps (async_outer.py
``next_round_step``). With ``sync.outer.delay`` > 0 the pushes are overlapped (pushes.py):
the cluster trains on while its push is out, and its next round merges the answer, waiting
for it if it is not back; the run's last push is blocking. Not modelled: the server's own
link (pushes do not compete for it), the end's wait for the final version, and the
synchronous level's overlap (its rounds run blocking). A blocking push whose leader dies
after the push reached the server stays merged (its earlier rounds' work committed); the
cluster trains one round again and pushes from the same base, which the server refuses as
the real one does (at most once per base, pushes.py ``merges``).

A cluster whose model derives from an older global model than the current one (it missed
a committed outer round, or it restarted from scratch) contributes weight 0 at its next
outer round and adopts the global model and step: its work since its last outer commit is
discarded (sync/hier.py ``moved``). A leader change alone costs a heal of the new cluster
manager over the WAN, and the work only if the global model moved meanwhile.

Failures:

* a replica group that crashes loses its steps since its last inner commit; if it dies
  while its cluster's collectives run, the round fails for the survivors at once (Gloo
  connections close) and they roll back; it restarts after ``restart_s`` and joins at
  its cluster's next quorum (healing, weight 0 there), contributing from the next round.
  With ``early_quorum`` (sync.inner.early_quorum) the round's quorum is asked for during
  its last local step, so a member that fails in that step is in the quorum: the round
  fails for the survivors (at once for a death, at ``inner_reduce_s`` for a hang);
* a leader that crashes during the outer round fails that outer round for every cluster
  (the others' inner rounds commit: their work is kept for the next outer round); a
  non-leader that crashes while its leader is in the outer round breaks its cluster's
  round, but the outer result (which holds the cluster's work) stands;
* a whole cluster lost: its uncommitted work is lost; the others continue (with
  ``min_clusters``); its replica groups restart together (start-up barrier, at most
  ``startup_s``) and, once the job has moved past step 0, their join round is an outer
  round of weight 0: the leader waits at the global lighthouse for the others' next outer
  round and the cluster takes the global model and step before its first local step
  (sync/outer_round.py ``join_wanted``). If that quorum times out, it trains from
  scratch until its first outer round and heals there at weight 0. With the asynchronous
  level the join round is a push of no work (once the server holds a version past 0): the
  cluster adopts the newest version and resumes its step count at its furthest push;
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

Layout: config.py (``simulate.*``), params.py (the shared deployment, ``plan.*`` and
``simulate.*`` resolved into one run's figures), state.py (the lighthouse rule, event kinds,
clusters, the result), engine.py (this: the event loop, the round, the time categories),
barrier.py (the outer barrier at the global lighthouse), failures.py (failure processes
and their consequences), pushes.py (the asynchronous level's pushes, blocking and
overlapped), batches.py (the server's grace window), paces.py (match_pace's push schedule),
target.py (the time to a target, as merged work), results.py (the books closed at the
run's end, the no-failure goodput), report.py (many runs, the report, validation set-ups). :class:`Simulation` is one class
whose outer-barrier, failure and push handlers come from the mixins of barrier.py,
failures.py and pushes.py: every handler works on the whole state of the run
(clusters, members, the event queue, the counters), so they share it through ``self``
rather than hand it around.
"""

from __future__ import annotations

import heapq
import random
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from hier_localsgd import costs
from hier_localsgd.sync.global_schedule import is_push_step, next_round_step
from hier_localsgd.tools.simulate.barrier import OuterBarrier
from hier_localsgd.tools.simulate.batches import Batches
from hier_localsgd.tools.simulate.config import INF
from hier_localsgd.tools.simulate.failures import Failures
from hier_localsgd.tools.simulate.paces import PaceServer
from hier_localsgd.tools.simulate.params import SimParams
from hier_localsgd.tools.simulate.pushes import Pushes
from hier_localsgd.tools.simulate.results import finish
from hier_localsgd.tools.simulate.target import Progress
from hier_localsgd.tools.simulate.state import (  # noqa: F401  (lighthouse_forms_at: re-exported)
    ABORT, APPLY, BARRIER, BATCH_END, CLUSTER_FAIL, CLUSTER_START, COMMIT, COMPUTE_DONE, FAIL, KILL, OUTER_DONE, OUTER_TIMEOUT, PUSH_ARRIVE, PUSH_DONE, PUSH_UP, QUORUM, RESTART,
    S_COMMIT, S_COMPUTE, S_DONE, S_OUTER, S_QUORUM, S_SYNC, SYNC_DONE, WATCHDOG, Cluster, RunResult, lighthouse_forms_at,
)


class Simulation(OuterBarrier, Failures, Pushes):
    """One run. ``run()`` returns a :class:`RunResult`. The outer barrier (barrier.py), the
    failures (failures.py) and the asynchronous level's pushes (pushes.py) are mixins working
    on this class's state."""

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
        self.step_kills: Dict[int, List[Tuple[int, int, str]]] = defaultdict(list)  # cluster -> [(step, replica, phase)]
        self.cluster_end = [INF] * p.clusters  # when each cluster finished its steps
        self.paces = PaceServer(p.period, p.h_inner)  # match_pace: the global model server's schedule
        self.batches = Batches(p.clusters, p.grace_s, p.async_min_clusters)  # its grace window
        self.pushes_at: Dict[int, List[float]] = defaultdict(list)  # the asynchronous level: when each cluster pushed
        self.batch_weights: Dict[int, float] = {}  # the open batch's pushes: a_i (pushes.py weigh)
        self.progress = Progress(p.target_rounds)  # the global model's merged work: time to the target (target.py)
        for c in self.clusters:
            self.reset_schedule(c, 0.0)

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
            CLUSTER_START: self.on_cluster_start, OUTER_TIMEOUT: self.on_outer_timeout, PUSH_DONE: self.on_push_done,
            PUSH_ARRIVE: self.on_push_arrive, APPLY: self.on_apply, PUSH_UP: self.on_push_up, BATCH_END: self.on_batch_end,
        }
        # A safety net for runs that cannot finish: the outer level stopped committing (see
        # docs/planner.md, "out of step"), or kills come faster than a restarted cluster
        # reaches its first outer round. Stop and flag the result as truncated.
        nominal = p.duration_s if p.steps == 0 else p.steps * (p.slowest_step_s + p.no_failure_sync_per_step())
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
        c.early_broken, c.early_hang = -1, False
        c.outer_join = False
        c.outer_outcome = None
        self.enter(c, t, "compute")
        c.round_step_s = p.step_s / p.speed(c.idx)  # topology.cluster_speed
        if p.step_jitter > 0:
            c.round_step_s *= max(0.05, 1.0 + self.jitter_rng.gauss(0.0, p.step_jitter))
        # match_pace: rounds end on the grid and at the cluster's push steps (async_outer.py)
        c.round_len = p.h_inner
        if p.match_pace:
            c.round_len = next_round_step(c.step, c.due, c.push_period, p.h_inner) - c.step
            if p.steps:
                c.round_len = min(c.round_len, p.steps - c.step)  # the run's last step ends a round
        self.push(t + c.round_len * c.round_step_s, COMPUTE_DONE, c.idx, 0, c.epoch)
        for r, _ in c.armed:  # armed for a sync phase the failed round never reached
            self.kill_at(c, t, r)
        c.armed = []
        kills = self.step_kills.get(c.idx)
        if kills:
            for k, r, ph in [x for x in kills if c.step <= x[0] < c.step + c.round_len and x[2] == "LOCAL"]:
                kills.remove((k, r, ph))
                self.kill_at(c, t + (k - c.step + 0.5) * c.round_step_s, r)  # half-way through local step k+1

    def on_compute_done(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_COMPUTE:
            return
        p = self.p
        n = len(c.active)
        c.step += c.round_len
        c.round_compute = n * (t - c.round_start)
        self.steps_run += n * c.round_len
        if c.early_broken >= 0:
            # A member failed during the last local step, after its early quorum request
            # joined the round's quorum (sync/early.py): the round's collectives fail and
            # the others roll back — at once for a death (its connections close), at the
            # reduce's timeout for a hang.
            self.arm(c)
            if c.early_hang:
                c.state, c.phase_start = S_SYNC, t
                self.enter(c, t, "sync")
                c.epoch += 1
                self.push(t + p.inner_reduce_s, ABORT, c.idx, c.early_broken, c.epoch)
            else:
                self.abort(c, t, c.early_broken)
            return
        c.state = S_QUORUM
        c.phase_start = t
        self.enter(c, t, "wait")
        self.arm(c)
        self.fire(c, t, ("INNER_QUORUM",))
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
            m.acc0 = c.outer_acc + c.round_len  # it computed nothing this round (weight 0)
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
        self.fire(c, t, ("INNER_REDUCE",))
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
        if c.push_again:  # its push round failed after the server merged the push (pushes.py server_holds_push)
            return True
        if self.p.match_pace:  # and the run's last step (hier.py is_outer_round)
            return is_push_step(c.step, c.due, c.push_period) or 0 < self.p.steps <= c.step
        return self.hier and c.step % self.p.period == 0

    def on_sync_done(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_SYNC:
            return
        if c.flight is not None:  # overlapped: this round first applies the push in flight (pushes.py)
            self.apply_round(c, t)
            return
        self.after_apply(c, t)

    def after_apply(self, c: Cluster, t: float) -> None:
        """The round's outer part, if any (a push, or the outer barrier), else its commit."""
        ci = c.idx
        p = self.p
        last = (p.steps > 0 and c.step >= p.steps) or (p.steps == 0 and t >= p.duration_s)
        if self.is_outer_round(c) and p.asynchronous and p.overlap and not last:
            c.outer_outcome = "launch"  # the run's last push is blocking (async_outer.py)
            self.commit(c, t)
        elif self.is_outer_round(c) and p.asynchronous:
            c.state = S_OUTER
            c.phase_start = c.push_start = t
            c.push_arrived = c.push_again = c.push_repeat = False
            self.pushes_at[ci].append(t)
            c.pushed_step = max(c.pushed_step, c.step)
            self.enter(c, t, "sync")
            self.fire(c, t, ("OUTER_QUORUM",))
            self.push(t + self.p.upload_s, PUSH_UP, c.idx, 0, c.epoch)  # the upload
        elif self.is_outer_round(c):
            c.state = S_OUTER
            c.phase_start = t
            self.enter(c, t, "wait")
            self.arrive(c, t)
            self.fire(c, t, ("OUTER_QUORUM",))
        else:
            self.commit(c, t)

    def commit(self, c: Cluster, t: float) -> None:
        """INNER_COMMIT: adopt the round (and the outer outcome, if any); next round."""
        n = len(c.active)
        outcome = c.outer_outcome
        if c.outer_join:  # a restarted cluster's join round: no work in it, nothing to discard
            c.outer_join = False
            if outcome == "committed":
                self.adopt(c)
            if c.idx in self.outstanding:
                self.outstanding.discard(c.idx)
            self.start_round(c, t)
            if self.stop_pending and not self.outstanding:
                self.end = t
            return
        # Replayed kills in INNER_COMMIT: the round's collectives are done, so the round
        # commits for everyone; the victim dies before its own commit, losing its round's
        # steps (as the chaos report counts them: uncommitted at its death).
        at_commit = [r for r, ph in c.armed if ph == "INNER_COMMIT"]
        c.armed = [x for x in c.armed if x[1] != "INNER_COMMIT"]
        if c.broken:
            # The cluster's inner round failed; an outer commit holding its work stands.
            self.steps_discarded += (n - c.round_joiners) * c.round_len
            if outcome == "committed" and (c.outer_weight > 0 or c.push_repeat):
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
            c.outer_acc += c.round_len
            c.inner_rounds += 1
            if not self.hier:
                self.committed += c.pending
                c.pending = 0.0
            elif outcome == "committed":
                if c.outer_weight > 0 or c.push_repeat:  # a repeat: the model holds its steps (pushes.py)
                    self.committed += c.pending
                else:
                    self.lose("discarded", c.pending, c.stale_cause)
                    self.steps_discarded += c.group_steps()
                c.pending = 0.0
                self.adopt(c)
            elif outcome == "launch":
                self.launch(c, t)
        c.round_compute = 0.0
        if c.idx in self.outstanding:
            self.outstanding.discard(c.idx)
        if not self.hier and self.stop_pending_check(t):
            return
        done = c.round_len  # the committed round's steps (start_round sets the next one's)
        self.start_round(c, t)
        for r in at_commit:
            self.steps_discarded += done * (len(c.active) if r < 0 else int(r in c.active))
            self.kill_at(c, t, r)
        if self.hier and self.stop_pending and not self.outstanding:
            self.end = t

    def running(self, ci: int) -> bool:
        """Whether cluster ``ci`` has steps left (match_pace waits for no finished cluster)."""
        return self.cluster_end[ci] == INF

    def reset_schedule(self, c: Cluster, t: float) -> None:
        """The default push schedule (every H_inner·H_outer steps from ``c.step``); a period from ``t``."""
        c.push_period, c.due = self.p.period, c.step + self.p.period
        c.period_t0, c.period_step0 = t, c.step

    def adopt(self, c: Cluster) -> None:
        """The cluster now holds the current global model and step (its period starts now)."""
        c.period_t0, c.period_step0 = self.now, c.step
        c.base = self.round_no if c.answer_version < 0 else c.answer_version  # an asynchronous answer's version
        c.answer_version = -1
        self.progress.adopted(self.now, c.base)
        c.step = max(c.step, c.pushed_step if self.p.asynchronous else self.global_step)
        c.outer_acc = 0
        c.acc0_sum = c.carried_steps = 0
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

    def on_commit(self, t: float, ci: int, _b: int, epoch: int) -> None:
        c = self.clusters[ci]
        if epoch != c.epoch or c.state != S_COMMIT:
            return
        self.commit(c, t)

    def cluster_done(self, c: Cluster, t: float) -> None:
        self.book(c, t)
        self.cluster_end[c.idx] = min(self.cluster_end[c.idx], t)
        c.state = S_DONE
        c.epoch += 1
        c.cat = "wait"  # finished replica groups idle until the run ends
        if all(cc.state == S_DONE for cc in self.clusters):
            self.end = t
        elif self.p.asynchronous:
            self.check_batch(t)  # a batch that waited for this cluster may close
        elif self.hier:
            if c.mgr_id >= 0:  # a clean exit: its Manager leaves at once
                self.prev_quorum.discard(c.mgr_id)
                c.mgr_id = -1
            self.evaluate_barrier(t)

    # ------------------------------------------------------------------ results
    def finish(self) -> RunResult:
        return finish(self)


def simulate_once(p: SimParams, seed: int) -> RunResult:
    """One simulation of ``p`` with ``seed`` (reproducible)."""
    return Simulation(p, seed).run()
