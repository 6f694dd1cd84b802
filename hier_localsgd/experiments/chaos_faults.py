"""Faults other than a plain SIGKILL for ``hier-localsgd chaos``, and their evidence.

Kinds (``chaos.kinds``; the schedule draws one per fault, seeded by ``chaos.seed``):

* ``kill`` — SIGKILL a ``non_leader``, a ``leader`` or a whole ``cluster`` (chaos_monkey.py);
* ``phase_kill`` — SIGKILL a role as it enters a phase (``chaos.phase_targets``, e.g. a
  leader in OUTER_REDUCE): armed at the scheduled time for one target (a planned fault's
  own, else the role's first process); in a hierarchical job the target is handed a
  ``stop`` for that phase through its inbox (core/runtime/faults.py ``phase_inbox``): it
  SIGSTOPs itself as the phase starts, however short the phase, and the driver kills it
  there (its ``fault`` event says so; the record's ``stop_sent`` and ``stopped_itself``).
  A drawn one that finds no process to take (the role's all restarting or held by a hang)
  waits up to ``chaos.phase_arm_s`` for one; a target that is gone, or withdrawn as the last
  process continuing from the start, gives way to the next eligible one, which is handed
  the stop (``retargeted``, ``stop_withdrawn`` in the record). A baseline has no
  fault points: there it fires when the target's status shows the phase (the driver polls
  every 0.2 s, so a shorter phase can be missed). After ``chaos.phase_arm_s`` it fires in
  whatever phase the target is in, and the record says which phase it hit;
* ``multi_kill`` — SIGKILL two replica groups of different clusters at the same instant
  (a leader of one and a non-leader of another where there are);
* ``hang`` — SIGSTOP one replica group (every thread, heartbeats included) for
  ``chaos.hang_s``, then SIGCONT. Its peers abandon any collective with it within the
  heartbeat timeout (peers.py); it rejoins and heals, or its watchdog ends it and it
  restarts;
* ``lighthouse`` — SIGKILL a cluster lighthouse or the global one; the launcher's
  supervisor restarts it at its address after ``lighthouse.restart_delay_s`` (the chaos
  command sets it to ``chaos.lighthouse_down_s``); no replica process should restart;
* ``partition`` — cut a whole cluster (its processes and lighthouse, in their own network
  namespace) off the network for ``chaos.partition_s``; needs ``run.netns`` (netns.py);
* ``poison`` — a replica group's model goes bad (a NaN in every 64th value, as a diverging
  optimizer or a bit flip would leave it): handed over through its inbox
  (``run.fault_inbox``, core/runtime/faults.py), it fires at the group's next step; the poison
  screen (core/tensors/guard.py) must keep it out of every other group's model.

Kills of every kind are kill records (chaos.py's accounting applies to them). The other
kinds are *fault* records with their own evidence of recovery, computed here from the
launcher's history and the processes' events only:

* ``hang``: ``abandoned_after_s`` — from the stop to the first ``peer_lapsed`` event of a
  peer (None if no peer was waiting for it); ``recovered`` — after the SIGCONT the stopped
  incarnation committed an inner round at a step > 0 after a heal or resync, or matched
  a peer's checksum at the same step; or it exited and its restart healed (chaos.py);
* ``lighthouse``: ``back_after_s`` (kill to the supervisor's ``up`` record),
  ``commits_resumed_s`` (from ``up`` to the first commit at that level: an outer commit
  for the global lighthouse, an inner commit in the cluster otherwise),
  split into ``round_begun_s`` (until the level's next round had begun in every cluster,
  or every group of the cluster: an outer round comes only every ``inner.every *
  outer.every`` steps) and ``first_round_s`` (from then to that commit: what the outage
  still costs the round), from the processes' ``phase`` events;
  ``replica_restarts`` (replica processes started during the outage, up to 5 s after the
  lighthouse is back, other than the restarts of the monkey's own kills; 0 expected),
  ``recovered`` = commits resumed and no replica restarted;
* ``partition``: ``rejoined_after_s`` — from the heal to the first outer commit whose
  participants include every cluster; ``recovered`` = that happened;
* ``poison``: ``fired_step`` (the target's own ``fault`` event), ``excluded_after_s`` (from
  then to the first ``excluded`` event naming it, from any group), ``healthy_nonfinite``
  (evaluations of the other groups with a non-finite loss after it fired: must stay
  empty), ``recovered`` = excluded, then committed an inner round (it took the shared
  model and trained on), and no other group ever evaluated non-finite; or its incarnation
  ended (a kill) before its round, with no other group non-finite (``gone_before_round``).
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

Key = Tuple[int, int]
KILL_KINDS = ("kill", "phase_kill", "multi_kill")
FAULT_KINDS = ("hang", "lighthouse", "partition", "poison")
POISON = {"action": "poison", "how": "nan"}  # what the chaos command hands a group (core/runtime/faults.py)
KINDS = KILL_KINDS + FAULT_KINDS


FLAT = "flat"  # a flat baseline's one global level stands for both of the hierarchy's (baselines.py)


def at_level(e: Dict[str, Any], level: str) -> bool:
    """Whether event ``e`` is of ``level`` ("inner" / "outer"), a flat baseline's counting as both."""
    return e.get("level") in (level, FLAT)


def is_commit(e: Dict[str, Any], level: str) -> bool:
    return e["kind"] == "commit" and at_level(e, level)


def name(key: Key) -> str:
    return f"c{key[0]}r{key[1]}"


def signal_group(pid: int, sig: int) -> None:
    """Signals a replica group's whole process group (torchrun and its ranks too)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


class PendingFaults:
    """Faults in progress (a stopped process, a cut cluster) and when each one ends."""

    def __init__(self) -> None:
        self.items: List[Tuple[float, str, Any]] = []  # (due, action, arg)

    def add(self, due: float, action: str, arg: Any) -> None:
        self.items.append((due, action, arg))

    @property
    def busy(self) -> bool:
        return bool(self.items)

    def due(self, now: float, force: bool = False) -> List[Tuple[str, Any]]:
        ready = [(a, x) for d, a, x in self.items if force or d <= now]
        self.items = [(d, a, x) for d, a, x in self.items if not (force or d <= now)]
        return ready


def _after(evs: Sequence[Dict[str, Any]], t: float, kind: str, **match: Any) -> List[Dict[str, Any]]:
    return [e for e in evs if e["kind"] == kind and e["t"] > t and all(e.get(k) == v for k, v in match.items())]


def hang_evidence(f: Dict[str, Any], events: Dict[Key, List[Dict[str, Any]]], history: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    key = tuple(int(x) for x in f["target"][1:].split("r"))
    t_stop, t_cont = f["t_abs"], f["t_abs"] + f["duration_s"]
    lapses = [e["t"] for k, evs in events.items() if k != key for e in _after(evs, t_stop, "peer_lapsed") if e["t"] <= t_cont + 1]
    mine = events.get(key, [])  # type: ignore[arg-type]
    killed = {h.get("pid") for h in history if h["event"] == "kill" and h["key"] == key}
    # exits of its own (a watchdog, an error): the monkey's later kills are judged as kills
    exits = [h for h in history if h["event"] == "exit" and h["key"] == key and h["t"] > t_stop and h.get("code") != 0 and h.get("pid") not in killed]
    first_exit = min((h["t"] for h in exits), default=None)
    rejoined = None
    healed = [e["t"] for e in mine if e["kind"] in ("heal", "resync") and e["t"] > t_cont]
    for e in mine:
        if not is_commit(e, "inner") or e["t"] <= t_cont or e.get("step", 0) <= 0:
            continue
        if first_exit is not None and e["t"] > first_exit:
            break  # a later incarnation: chaos.py's restart evidence covers it
        peers = {p["checksum"] for k, evs in events.items() if k != key for p in evs
                 if is_commit(p, "inner") and p.get("step") == e.get("step")}
        if e.get("checksum") in peers or any(t < e["t"] for t in healed):
            rejoined = e["t"] - t_cont
            break
    return {
        "abandoned_after_s": (min(lapses) - t_stop) if lapses else None,
        "rejoined_after_s": rejoined,
        "exited": None if first_exit is None else {"after_cont_s": first_exit - t_cont, "code": next(h.get("code") for h in exits)},
        "recovered": rejoined is not None,  # an exit is judged by its restart (kills/restarts)
    }


def _after_monkey_kill(restart: Dict[str, Any], history: Sequence[Dict[str, Any]]) -> bool:
    """Whether the exit this restart follows was the monkey's own kill (a kill fault that
    fell inside a lighthouse outage is not a restart the outage caused)."""
    exits = [h for h in history if h["event"] == "exit" and h["key"] == restart["key"] and h["t"] <= restart["t"]]
    if not exits:
        return False
    pid = max(exits, key=lambda h: h["t"]).get("pid")
    return any(h["event"] == "kill" and h["key"] == restart["key"] and h.get("pid") == pid for h in history)


def lighthouse_evidence(f: Dict[str, Any], events: Dict[Key, List[Dict[str, Any]]], history: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    role, t_kill = f["target"], f["t_abs"]
    up = min((h["t"] for h in history if h["event"] == "up" and h["key"] == role and h["t"] > t_kill), default=None)
    if role == "global":
        commits = [e["t"] for evs in events.values() for e in _after(evs, up or t_kill, "commit") if at_level(e, "outer")]
    else:
        c = int(role[len("cluster"):])
        commits = [e["t"] for k, evs in events.items() if k[0] == c for e in _after(evs, up or t_kill, "commit") if at_level(e, "inner")]
    resumed = (min(commits) - up) if up is not None and commits else None
    begun = None
    if resumed is not None and up is not None:
        keys = list(events) if role == "global" else [k for k in events if k[0] == c]
        begun = _round_begun(events, keys, "OUTER_QUORUM" if role == "global" else "INNER_QUORUM", up, min(commits))
    restarts = [h for h in history if h["event"] == "restart" and not isinstance(h["key"], str) and t_kill < h["t"] <= (up or t_kill) + 5
                and not _after_monkey_kill(h, history)]
    return {
        "back_after_s": None if up is None else up - t_kill,
        "commits_resumed_s": resumed,
        # commits_resumed_s split: the wait until the level's next round began (its schedule:
        # an outer round comes every inner.every * outer.every steps) and that round's own time
        "round_begun_s": None if begun is None else begun - up,
        "first_round_s": None if begun is None or resumed is None else up + resumed - begun,
        "replica_restarts": len(restarts),
        "recovered": resumed is not None and not restarts,
    }


def _round_begun(events: Dict[Key, List[Dict[str, Any]]], keys: Sequence[Key], phase: str, up: float, commit: float) -> Optional[float]:
    """When the first round at a level after a lighthouse's return (``up``) had begun in
    every cluster (global: a cluster's round begins when any of its groups, its leader,
    enters ``phase``) or every group of the cluster (its lighthouse) that entered one before
    ``commit``: a group already in ``phase`` at ``up`` began at ``up``. From the processes'
    ``phase`` events; None when no group entered ``phase`` around the return (unknown: an
    overlapped outer round runs on its stage's tracker, which writes no phase events)."""
    starts: Dict[Any, float] = {}
    for k in keys:
        evs = [e for e in events.get(k, []) if e["kind"] == "phase"]
        before = [e for e in evs if e["t"] <= up]
        if before and before[-1].get("dst") == phase:
            t = up
        else:
            t = min((e["t"] for e in evs if up < e["t"] <= commit and e.get("dst") == phase), default=None)
        if t is None:
            continue
        unit = k[0] if phase == "OUTER_QUORUM" else k
        starts[unit] = min(t, starts.get(unit, t))
    return max(starts.values()) if starts else None


def partition_evidence(f: Dict[str, Any], events: Dict[Key, List[Dict[str, Any]]], clusters: int) -> Dict[str, Any]:
    t_heal = f["t_abs"] + f["duration_s"]
    full = [e["t"] for evs in events.values() for e in _after(evs, t_heal, "commit") if at_level(e, "outer") and int(e.get("participants", 0)) >= clusters]
    rejoined = (min(full) - t_heal) if full else None
    return {"rejoined_after_s": rejoined, "recovered": rejoined is not None}


def poison_evidence(f: Dict[str, Any], events: Dict[Key, List[Dict[str, Any]]], history: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    key = tuple(int(x) for x in f["target"][1:].split("r"))
    mine = events.get(key, [])  # type: ignore[arg-type]
    fired = next((e for e in _after(mine, f["t_abs"] - 1.0, "fault", action="poison")), None)
    if fired is None:
        return {"fired_step": None, "excluded_after_s": None, "healthy_nonfinite": [], "recovered": False}
    t = fired["t"]
    excluded = min((e["t"] for evs in events.values() for e in _after(evs, t, "excluded", member=f["target"])), default=None)
    bad = [{"group": name(k), "step": e["step"]} for k, evs in events.items() if k != key for e in _after(evs, t, "eval")
           if not math.isfinite(float(e["loss"]))]
    ended = min((h["t"] for h in history if h["event"] == "exit" and h["key"] == key and h["t"] > t), default=None)
    commit = next((e["t"] for e in mine if is_commit(e, "inner") and excluded is not None and e["t"] > excluded), None)
    gone = excluded is None and ended is not None
    return {
        "fired_step": fired.get("step"),
        "excluded_after_s": None if excluded is None else excluded - t,
        "healthy_nonfinite": bad,
        "gone_before_round": gone,
        "recovered": not bad and ((excluded is not None and commit is not None) or gone),
    }


def fault_evidence(faults: Sequence[Dict[str, Any]], events: Dict[Key, List[Dict[str, Any]]], history: Sequence[Dict[str, Any]], clusters: int) -> List[Dict[str, Any]]:
    """Each non-kill fault with its evidence of recovery (module docstring)."""
    out = []
    for f in faults:
        if f["kind"] == "hang":
            ev = hang_evidence(f, events, history)
        elif f["kind"] == "poison":
            ev = poison_evidence(f, events, history)
        elif f["kind"] == "lighthouse":
            ev = lighthouse_evidence(f, events, history)
        else:
            ev = partition_evidence(f, events, clusters)
        out.append({**{k: v for k, v in f.items() if k != "t_abs"}, **ev})
    return out
