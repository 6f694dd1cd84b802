"""Evidence for ``hier-localsgd chaos``: incarnations, outages, heals, work accounting.

Computed from the launcher's history (starts, kills, exits with each process's last
status, restarts) and the processes' own events only; the driver (chaos.py) collects
them and reports what this module finds. A figure without evidence is ``None``.

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
  outer ``heal`` event alone is not evidence: the identical commit is). With the
  asynchronous outer level clusters adopt a global version at different steps of their
  own, so its outer commits are matched by (version, checksum of the version's model)
  instead; a commit without a checksum is no evidence (:func:`model_key`).
* ``recovered``: kills whose every target came back healed through its own restarts: the
  first restart of that target after the kill healed, or, where that restart exited on
  its own before it healed, a later one the supervisor started for it did (before any
  later kill of that target; ``incarnations_to_heal`` per restart counts them, and each
  such exit is also listed in ``self_exits`` as an outage of its own). A restart that
  follows a later kill answers that kill.
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
  non-zero cluster weight (sync/hier.py discards what a live process loses at weight 0; an
  asynchronous push refused as a repeat of a merged one keeps what the first carried), or it
  is in the final model: work since the last outer commit at the end of the run counts
  as kept only if the run ended consistent (one final model), else it is
  ``unmerged_at_end``. Lost, in ``steps_lost``: ``rolled_back_or_weight0`` (the processes'
  own counters; ``discarded_by`` splits them by the reason in the processes' ``discard``
  events), ``uncommitted_at_death`` (a dead incarnation's steps since its last inner
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

from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from hier_localsgd.experiments.chaos_faults import at_level, is_commit
from hier_localsgd.launch.local import Key


WORK_KEYS = ("steps_run", "steps_discarded", "steps_since_commit", "steps_since_outer")


def model_key(e: Dict[str, Any]) -> Optional[Tuple[Any, ...]]:
    """What a commit event says its model is, comparable across incarnations, or None where
    it is no evidence. A commit without a checksum says nothing (two such commits at one
    step are not one model). The asynchronous outer level's commits are keyed by the global
    model's version and checksum: clusters adopt one version at different steps of their
    own. Step 0 and version 0 are everyone's initial model."""
    if not e.get("checksum"):
        return None
    if e.get("asynchronous") and at_level(e, "outer"):
        v = e.get("outer_round")
        return ("version", v, e["checksum"]) if type(v) is int and v > 0 else None
    return (e["step"], e["checksum"]) if e.get("step", 0) > 0 else None


def name(key: Key) -> str:
    return f"c{key[0]}r{key[1]}"


def parse_name(s: str) -> Key:
    c, r = s[1:].split("r")
    return int(c), int(r)





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
    warm: bool = False  # a restart run in a warm spare (LocalJob.warm_spares)

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
                self.incs.setdefault(key, []).append(Incarnation(key, h.get("pid"), h["t"], h["event"] == "restart", warm=bool(h.get("warm"))))
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
        """When each restarted incarnation healed (by ``id``): its first commit whose model
        (:func:`model_key`: step > 0 and checksum; for the asynchronous outer level, version
        > 0 and checksum) equals a commit made after its predecessor died by another
        *continuous* incarnation (one of the job's first processes, or a restarted one from
        its own heal on). Inner and outer commits both count (equal checksums: equal models):
        with the overlapped outer sync or streaming fragments, clusters never commit equal
        *inner* models, and a whole cluster restarted together shows it holds the job's
        state only by its leader's outer commit, the global model every cluster's leader
        commits alike; its members then match their healed leader's inner commits. Step 0
        is everyone's initial model; a commit from before the death could be matched by a
        cluster that retrained from step 0 on the same batches; and a whole cluster
        restarted together only matches itself until it adopts a global model, which
        continuous incarnations of other clusters also commit."""
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
                    for e in self._model_commits(i):
                        if model_key(e) is not None and e["t"] >= since:
                            made.setdefault(model_key(e), []).append((e["t"], id(i)))
            for r in restarts:
                if id(r) in healed:
                    continue
                p = prev.get(id(r))
                died = (p.death if p is not None else None) or r.start
                for e in self._model_commits(r):
                    if model_key(e) is not None and any(t > died and who != id(r) for t, who in made.get(model_key(e), [])):
                        healed[id(r)] = e["t"]
                        changed = True
                        break
        return healed

    def _model_commits(self, inc: Incarnation) -> List[Dict[str, Any]]:
        """``inc``'s inner and outer commits, in time order (a flat baseline's once), and
        its leader's adoptions of an overlapped push's answer (``adopt``: the asynchronous
        level's commit event of such a push is ``pending``, without a checksum: its apply
        round may drop it)."""
        return [e for e in self.of(inc) if is_commit(e, "inner") or is_commit(e, "outer") or (e["kind"] == "adopt" and at_level(e, "outer"))]

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


def heal_s(tl: Timeline, o: Outage, key: Key) -> Tuple[Optional[Incarnation], Optional[float], int]:
    """``key``'s own restart after the outage (its first incarnation started after it),
    seconds from that restart to the heal (:meth:`Timeline.healed_at`) of the first of
    ``key``'s incarnations since then that healed, or None, and how many incarnations that
    took. A restart that exits on its own before it healed (its heal source died under
    it, say) is followed by the supervisor's next restart, which still answers this
    outage; a restart that follows a *later kill* of ``key`` answers that kill, not this
    one, so the search stops there."""
    restart = tl.restart_of(key, o.t)
    if restart is None:
        return None, None, 0
    later_kills = [x.t for x in tl.outages if x.t > o.t and key in x.keys and not x.cause.startswith("exit")]
    stop = min(later_kills, default=float("inf"))
    chain = [i for i in tl.incs.get(key, []) if restart.start <= i.start < stop]
    for n, inc in enumerate(chain, 1):
        t = tl.healed_at.get(id(inc))
        if t is not None:
            return restart, t - restart.start, n
    return restart, None, len(chain)


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
                if weight is None or float(weight) > 0 or item.get("held_to") is not None:
                    pass  # kept (held_to: a repeat push whose first, merged, carried them: sync/committed.py)
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


def discarded_by(events: Dict[Key, List[Dict[str, Any]]]) -> Dict[str, int]:
    """Steps the processes discarded, by level and reason (their ``discard`` events:
    sync/committed.py), e.g. ``inner:rollback``, ``inner:heal``, ``inner:resync``,
    ``outer:cluster_weight0``."""
    out: Dict[str, int] = {}
    for evs in events.values():
        for e in evs:
            if e["kind"] == "discard":
                k = f"{e.get('level')}:{e.get('reason')}"
                out[k] = out.get(k, 0) + int(e.get("steps") or 0)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


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
            restart, dt, tries = heal_s(tl, o, key)
            healed[key] = dt
            restarts.append({"target": name(key), "cause": o.cause, "outage_t": o.t - t0, "lost_cluster": key[0] in lost,
                             "t": None if restart is None else restart.start - t0, "time_to_heal_s": dt,
                             "incarnations_to_heal": tries, "warm": bool(restart is not None and restart.warm)})
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
    out["discarded_by"] = discarded_by(events)
    out["hangs_detail"] = hangs_of(tl, t0)
    return out
