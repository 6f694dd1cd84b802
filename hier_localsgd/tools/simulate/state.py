"""The simulator's state: torchft's lighthouse rule, the event kinds, a cluster and its
replica groups, and one run's result (the model: engine.py's docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from hier_localsgd.tools.simulate.config import INF


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
(COMPUTE_DONE, QUORUM, SYNC_DONE, COMMIT, OUTER_DONE, BARRIER, FAIL, CLUSTER_FAIL, KILL, RESTART, WATCHDOG, ABORT, CLUSTER_START, OUTER_TIMEOUT, PUSH_DONE,
 PUSH_ARRIVE, APPLY, PUSH_UP, BATCH_END) = range(19)

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
        self.round_len = 0  # steps in the current round (H_inner; with match_pace, to its next sync step)
        # match_pace (engine.py): the push schedule (async_outer.py: from step `due` on, every
        # `push_period` steps) and where the cluster's period began (its last adoption)
        self.due = self.push_period = 0
        self.period_t0, self.period_step0, self.push_start = 0.0, 0, 0.0
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
        self.early_broken = -1  # a member that failed in the round's last local step, in its early quorum (fid)
        self.early_hang = False  # ... and it hung rather than died
        self.outer_join = False  # restarted whole: its join round is an outer round of weight 0
        self.pushed_step = 0  # asynchronous: the furthest step it pushed at (restarted whole, it resumes there)
        # asynchronous, blocking: whether the server merged its push (decided as it arrived),
        # and the push_in of its answer (match_pace; 0: none), applied when the answer is back
        self.push_merged = False
        self.push_arrived = False  # ... and whether this round's push reached the server
        # The server's side: the base of this cluster's last merged push. A push from the same
        # base again (its leader died after the server merged the first) is refused: the
        # server merges a cluster's work from one base once (global_server.py ``push``).
        self.merged_base = -1
        # Its push round failed after the server merged the push: the real cluster rolls back
        # its step count and trains that round again, then pushes (a repeat); the simulated
        # step count moves on, so its next round is the push (pushes.py ``server_holds_push``).
        self.push_again = False
        self.push_repeat = False  # this round's push is such a repeat: refused, its steps held by the first
        self.answer_push_in = 0
        self.answer_version = -1  # the version of an answer not adopted yet (-1: none; engine.py adopt)
        # asynchronous, overlapped (engine.py launch): the push in flight, or None. Keys: id,
        # t, step, base, work (replica-seconds it carries), steps (group-steps), period_t0,
        # period_step0, answer (when its answer is back; None until the server answered), lost (its upload died with its
        # leader), arrived (at the server), version (the server's, once its batch closed or it
        # was refused; None before), push_in, apply_epoch (an apply round waits for its answer).
        self.flight: Optional[Dict[str, Any]] = None
        self.carried_steps = 0  # group-steps of a dropped push that ride on the next one
        self.armed: List[Tuple[int, str]] = []  # replayed kills of this round's sync phases: (replica or -1, phase)
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

    def group_steps(self, pending_round: int = 0) -> int:
        """The group-steps of work its model holds since it last adopted one (the ``tokens``
        of its push: every active member's steps since it joined, and a dropped push's
        carried along); ``pending_round``: the steps of a round not committed yet (a blocking
        push leaves before its round's commit)."""
        return len(self.active) * (self.outer_acc + pending_round) - self.acc0_sum + self.carried_steps


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
    cluster_end_s: Tuple[float, ...] = ()  # when each cluster finished its steps (inf: it did not)
    target_rounds: float = 0.0  # simulate.target_rounds (0: no target)
    target_s: Optional[float] = None  # when the global model reached simulate.target_rounds (target.py); None: not reached, or none set
    progress_rounds: float = 0.0  # the global model's merged work at the end, in synchronous rounds (target.py)
