"""The dashboard's timeline: commits grouped across replica groups, evals, faults and recoveries, newest first."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

from hier_localsgd.tools.dashboard.config import Key, SEVERITY
from hier_localsgd.tools.dashboard.reader import RunFiles, number, plural, name_of


def _replica_entry(key: Key, e: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """A timeline entry for one replica event (None: not a timeline event)."""
    kind = e.get("kind")
    who = name_of(key)
    level = e.get("level")
    step = e.get("step")
    at = f" at step {step}" if step is not None else ""
    if kind in ("loss", "phase", "commit", "eval"):
        return None  # loss: the charts; phase: status.json; commit and eval: merged across replica groups
    if kind == "leader":
        text = f"{who} became the leader of cluster {key[0]}" if e.get("leader") else f"{who} stopped leading cluster {key[0]}"
    elif kind == "heal":
        text = f"{who} healed its {level} state from a peer{at}"
    elif kind == "resync":
        text = f"{who} {level} resync from rank {e.get('source')}{at}" + (" (diverged)" if e.get("diverged") else "")
    elif kind == "rollback":
        text = f"{who} rolled back ({level}){at}: {e.get('reason', '')}"
    elif kind == "keep_local":
        text = f"{who} kept its local steps after a failed round ({level}){at}: {e.get('reason', '')}"
    elif kind in ("timeout", "quorum_failed"):
        text = f"{who} {level} {e.get('op', '')} {'timed out' if kind == 'timeout' else 'failed'} in {e.get('phase')}: {e.get('detail', '')}"
    elif kind == "fault":
        text = f"{who} injected fault {e.get('action')} in {e.get('phase')}{at}"
    elif kind == "excluded":
        if not e.get("mine"):
            return None  # every member of the level records it; the excluded group's own record stands for all
        text = f"{who}'s {level} contribution excluded by the poison screen{at}: {e.get('reason', '')}"
    elif kind == "optimizer_restored":
        text = f"{who} restored its inner optimizer ({e.get('how')}){at}"
    else:
        fields = {k: v for k, v in e.items() if k not in ("t", "kind", "cluster", "replica")}
        text = f"{who} {kind} {json.dumps(fields, default=str)[:200]}"
    return {"t": e.get("t"), "kind": kind, "who": who, "cluster": key[0], "level": level, "text": text}


def _commit_groups(events: Dict[Key, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One record per committed round: the replica groups' identical commit events merged."""
    groups: Dict[Tuple[Any, ...], Dict[str, Any]] = {}
    for key, evs in events.items():
        for e in evs:
            if e.get("kind") != "commit" or number(e.get("t")) is None:
                continue
            level = e.get("level")
            rnd = e.get("outer_round") if level == "outer" else e.get("inner_round")
            scope = None if level == "outer" else key[0]
            gk = (level, scope, rnd, e.get("step"))
            g = groups.get(gk)
            if g is not None and abs(e["t"] - g["t_first"]) > 30:
                gk = gk + (e["t"],)  # the same round number again (a whole cluster restarted)
                g = None
            if g is None:
                g = groups[gk] = {"t_first": e["t"], "t": e["t"], "level": level, "cluster": scope, "round": rnd, "step": e.get("step"),
                                  "participants": e.get("participants"), "outer": bool(e.get("outer")), "who": []}
            g["t"] = max(g["t"], e["t"])
            g["t_first"] = min(g["t_first"], e["t"])
            g["who"].append(name_of(key))
    return sorted(groups.values(), key=lambda g: g["t_first"])


def _eval_entries(events: Dict[Key, List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    """One entry per evaluation step: the replica groups' eval events at that step merged."""
    groups: Dict[Tuple[Any, ...], List[Tuple[Key, Dict[str, Any]]]] = {}
    for key, evs in events.items():
        for e in evs:
            if e.get("kind") == "eval" and number(e.get("t")) is not None and number(e.get("loss")) is not None:
                gk: Tuple[Any, ...] = (e.get("step"),)
                if gk in groups and (abs(e["t"] - groups[gk][0][1]["t"]) > 60 or key in {k for k, _ in groups[gk]}):
                    gk = (e.get("step"), key, e["t"])  # another evaluation at that step (a restarted process)
                groups.setdefault(gk, []).append((key, e))
    out = []
    for members in groups.values():
        losses = [float(e["loss"]) for _, e in members]
        floors = [float(e["floor"]) for _, e in members if number(e.get("floor")) is not None]
        mean = sum(losses) / len(losses)
        spread = f" (range {min(losses):.4f}–{max(losses):.4f})" if max(losses) - min(losses) > 5e-5 else ""
        excess = f", excess over the entropy floor {mean - floors[0]:.4f}" if floors else ""
        names = [name_of(k) for k, _ in sorted(members, key=lambda m: m[0])]
        step = members[0][1].get("step")
        text = f"eval at step {step}: loss {mean:.4f}{spread}{excess}"
        text = f"{names[0]} {text}" if len(names) == 1 else f"{text} [{', '.join(names)}]"
        out.append({"t": max(e["t"] for _, e in members), "kind": "eval", "who": names[0] if len(names) == 1 else f"{len(names)} replica groups",
                    "cluster": None, "level": None, "text": text})
    return out


def build_timeline(files: RunFiles, limit: int) -> Tuple[List[Dict[str, Any]], Dict[str, int]]:
    """Chronological timeline (the last ``limit`` entries) and counts per kind.

    Consecutive commits of one level (per cluster for inner) with the same
    number of participants collapse into one entry ("rounds a–b"), closed by
    any event that concerns it (an event of that cluster; for the outer level a
    leader change or an outer-level event); a change in the number of
    participants is a "quorum" entry.
    """
    singles: List[Dict[str, Any]] = []
    for key, evs in files.events.items():
        for e in evs:
            ent = _replica_entry(key, e)
            if ent is not None and number(ent["t"]) is not None:
                singles.append(ent)
    singles.extend(_eval_entries(files.events))
    singles.extend(_launcher_entries(files.job_events))
    singles.extend(_dashboard_entries(files.dashboard_events))
    commits = _commit_groups(files.events)
    counts = _counts(singles, commits)
    out = _merge(singles, commits)
    return out[-limit:], counts


def _launcher_entries(job_events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The launcher's events (starts, restarts, exits, kills, partitions) as timeline entries."""
    out = []
    for j in job_events:
        kind = j.get("kind")
        who = f"lighthouse {j['lighthouse']}" if j.get("lighthouse") else f"c{j.get('cluster')}r{j.get('replica')}"
        if j.get("replica") is None and isinstance(j.get("cluster"), int):  # partition / heal (run.netns)
            who = f"cluster {j['cluster']}'s network"
        if kind == "up":
            text = f"{who} answering"
        elif kind == "start":
            text = f"{who} started (pid {j.get('pid')})"
        elif kind == "restart":
            text = f"{who} restarted by the launcher (pid {j.get('pid')})"
        elif kind == "exit":
            text = f"{who} exited with code {j.get('code')} (pid {j.get('pid')})"
        elif kind == "kill":
            text = f"{who} killed by the launcher with {j.get('signal', 'a signal')} (pid {j.get('pid')})"
        else:
            text = f"{who} {kind}"
        if number(j.get("t")) is not None:
            out.append({"t": j["t"], "kind": kind, "who": who, "cluster": j.get("cluster"), "level": None, "text": text, "source": "launcher",
                        "severity": "info" if kind == "exit" and j.get("code") == 0 else None})
    return out


def _dashboard_entries(dashboard_events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Kills requested from the dashboard, done or failed, as timeline entries."""
    out = []
    for d in dashboard_events:
        who = f"c{d.get('cluster')}r{d.get('replica')}"
        if number(d.get("t")) is None:
            continue
        if d.get("ok"):
            text = f"{who} killed from the dashboard (via its lighthouse {d.get('lighthouse')})"
        else:
            text = f"kill of {who} from the dashboard failed: {d.get('detail', '')}"
        out.append({"t": d["t"], "kind": d.get("kind", "kill"), "who": who, "cluster": d.get("cluster"), "level": None, "text": text, "source": "dashboard"})
    return out


def _counts(singles: List[Dict[str, Any]], commits: List[Dict[str, Any]]) -> Dict[str, int]:
    """Entries per kind (``exit_nonzero``: exits that were not clean; ``commit``: commits)."""
    counts: Dict[str, int] = defaultdict(int)
    for s in singles:
        counts[str(s["kind"])] += 1
        if s["kind"] == "exit" and s.get("severity") != "info":
            counts["exit_nonzero"] += 1
    counts["commit"] = len(commits)
    return dict(counts)


def _merge(singles: List[Dict[str, Any]], commits: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Single events and commits in time order, runs of commits collapsed (see :func:`build_timeline`)."""
    stream = sorted([(s["t"], 1, s) for s in singles] + [(g["t_first"], 0, g) for g in commits], key=lambda x: (x[0], x[1]))
    out: List[Dict[str, Any]] = []
    open_runs: Dict[Tuple[Any, Any], Dict[str, Any]] = {}
    last_participants: Dict[Tuple[Any, Any], Any] = {}

    def close(pred: Callable[[Tuple[Any, Any]], bool]) -> None:
        for rk in [rk for rk in open_runs if pred(rk)]:
            out.append(open_runs.pop(rk))

    for t, is_single, item in stream:
        if is_single:
            # An event closes the commit runs it concerns: its cluster's inner run, and
            # the outer run for leader changes and outer-level events. The other
            # clusters' runs go on (they are spans: "rounds a–b").
            c, outer = item.get("cluster"), item["kind"] == "leader" or item.get("level") == "outer"
            if c is not None or outer:
                close(lambda rk, c=c, outer=outer: (rk[0] == "outer" and outer) or (rk[0] != "outer" and rk[1] == c))
            item.setdefault("severity", None)
            if item["severity"] is None:
                item["severity"] = SEVERITY.get(str(item["kind"]), "info")
            out.append(item)
            continue
        rk = (item["level"], item["cluster"])
        where = "across clusters" if item["level"] == "outer" else f"in cluster {item['cluster']}"
        prev = last_participants.get(rk)
        if prev is not None and prev != item["participants"]:
            close(lambda k, rk=rk: k == rk)
            out.append({"t": t, "kind": "quorum", "who": "global" if item["level"] == "outer" else f"cluster {item['cluster']}", "level": item["level"],
                        "cluster": item["cluster"], "text": f"{item['level']} quorum {where}: {prev} → {plural(item['participants'], 'participant')}", "severity": SEVERITY["quorum"]})
        last_participants[rk] = item["participants"]
        run = open_runs.get(rk)
        if run is None:
            run = open_runs[rk] = {"t": item["t"], "t_first": item["t_first"], "kind": "commit", "level": item["level"], "cluster": item["cluster"],
                                   "who": "global" if item["level"] == "outer" else f"cluster {item['cluster']}", "rounds": [item["round"], item["round"]],
                                   "count": 0, "participants": item["participants"], "severity": "info"}
        run["count"] += 1
        run["rounds"][1] = item["round"]
        run["t"] = item["t"]
        n, (a, b) = run["count"], run["rounds"]
        rounds = f"round {b}" if n == 1 else f"rounds {a}–{b} ({n} commits)"
        run["text"] = f"{item['level']} commit {where}, {rounds}, {plural(run['participants'], 'participant')}"
    close(lambda rk: True)
    out.sort(key=lambda x: x["t"])
    return out


