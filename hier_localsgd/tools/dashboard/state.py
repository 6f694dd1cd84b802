"""Aggregation: a run directory's files -> one plain dict for the page (:func:`build_state`)."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

from hier_localsgd.tools.dashboard.config import Key
from hier_localsgd.tools.dashboard.reader import RunFiles, RunReader, age, number, name_of
from hier_localsgd.tools.dashboard.timeline import build_timeline


def _health(key: Key, st: Optional[Dict[str, Any]], job: List[Dict[str, Any]], dash: List[Dict[str, Any]], now: float, stale_after_s: float) -> Tuple[str, str]:
    """The replica group's process state: (health, detail).

    health: absent | starting | live | waiting | stale | kill sent | killed |
    exited | restarting | finished | failed.
    """
    last_job = job[-1] if job else None
    if st is None:
        if last_job is not None and last_job.get("kind") in ("start", "restart"):
            return "starting", f"process {last_job.get('pid')} started, no status yet"
        return "absent", "no status published yet"
    pid = st.get("pid")
    state = str(st.get("state", ""))
    if last_job is not None:
        kind, jpid = last_job.get("kind"), last_job.get("pid")
        if kind in ("start", "restart") and jpid is not None and jpid != pid:
            return "restarting", f"process {jpid} started, not yet published"
        if kind == "exit" and (jpid is None or jpid == pid):
            code = last_job.get("code")
            if code == 0:
                return "finished", "exited with code 0"
            return "exited", f"exited with code {code}"
        if kind == "kill" and (jpid is None or jpid == pid) and state not in ("finished", "done"):
            return "killed", f"killed by the launcher ({last_job.get('signal', 'signal')})"
    if state in ("finished", "done"):
        return "finished", state
    if state.startswith("failed"):
        return "failed", state
    seen = age(now, st.get("updated_at"))
    started = number(st.get("started_at")) or 0.0
    kills = [d for d in dash if d.get("kind") == "kill" and d.get("ok") and (number(d.get("t")) or 0.0) >= started]
    if kills:
        tk = number(kills[-1].get("t")) or 0.0
        if (number(st.get("updated_at")) or 0.0) <= tk + 5.0:  # still publishing 5 s after the kill: it did not take
            if seen is not None and seen > 2.0:
                return "killed", "killed from the dashboard; no status update since"
            return "kill sent", "kill requested from the dashboard"
    if state in ("starting", "ready"):
        if seen is not None and seen > max(stale_after_s, 60.0):
            return "stale", f"{state}, no status update for {seen:.0f} s"
        return "starting", state
    if seen is not None and seen > stale_after_s:
        deadline = number(st.get("phase_deadline"))
        if st.get("phase") not in (None, "LOCAL") and deadline is not None and now < deadline:
            return "waiting", f"in {st.get('phase')}, deadline in {deadline - now:.0f} s"
        return "stale", f"no status update for {seen:.0f} s"
    return "live", state or "running"


def _flatten(prefix: str, v: Any, out: List[Tuple[str, Any]], depth: int = 0) -> None:
    if isinstance(v, dict) and depth < 2:
        for k, x in v.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), x, out, depth + 1)
    else:
        out.append((prefix, v))


def _link_view(link: Any) -> Dict[str, Any]:
    """Per level: bytes sent, collectives, and every other key flattened (lossy-link stats included)."""
    if not isinstance(link, dict):
        return {}
    out: Dict[str, Any] = {}
    for level, stats in link.items():
        if not isinstance(stats, dict):
            continue
        calls = stats.get("calls")
        sent = stats.get("sent_bytes") if isinstance(stats.get("sent_bytes"), dict) else {}
        extra: List[Tuple[str, Any]] = []
        for k, v in stats.items():
            if k in ("sent_bytes_total", "tensor_bytes", "calls"):
                continue
            _flatten(k, v, extra)
        loss = stats.get("loss") if isinstance(stats.get("loss"), dict) else None
        out[str(level)] = {
            "sent_bytes_total": number(stats.get("sent_bytes_total")) if stats.get("sent_bytes_total") is not None else number(sum(v for v in sent.values() if number(v) is not None)),
            "payload_bytes": number(sent.get("payload")),
            "calls": int(sum(v for v in calls.values() if isinstance(v, (int, float)))) if isinstance(calls, dict) else None,
            "injected_failures": stats.get("injected_failures"),
            "loss_rate": number(loss.get("observed_loss_rate")) if loss else None,
            "details": [[k, v] for k, v in extra],
        }
    return out


def _replica_view(key: Key, st: Optional[Dict[str, Any]], job: List[Dict[str, Any]], dash: List[Dict[str, Any]], now: float, stale_after_s: float, allow_kill: bool) -> Dict[str, Any]:
    health, detail = _health(key, st, job, dash, now, stale_after_s)
    restarts = sum(1 for j in job if j.get("kind") == "restart")
    view: Dict[str, Any] = {"name": name_of(key), "cluster": key[0], "replica": key[1], "health": health, "health_detail": detail, "restarts": restarts, "published": st is not None}
    if st is None:
        view["kill"] = False
        return view
    inner = st.get("inner") if isinstance(st.get("inner"), dict) else None
    outer = st.get("outer") if isinstance(st.get("outer"), dict) else None
    floor = number(st.get("entropy_floor"))
    loss = number(st.get("loss"))
    lighthouses = st.get("lighthouses") if isinstance(st.get("lighthouses"), dict) else {}
    deadline = number(st.get("phase_deadline"))
    view.update(
        role="leader" if st.get("leader") else "member",
        leader=bool(st.get("leader")),
        state=st.get("state"),
        pid=st.get("pid"),
        phase=st.get("phase"),
        phase_age_s=age(now, st.get("phase_entered")),
        phase_deadline_in_s=None if deadline is None else deadline - now,
        step=st.get("step"),
        steps_total=st.get("steps_total"),
        inner_round=st.get("inner_round"),
        outer_round=st.get("outer_round"),
        last_commit_level=st.get("last_commit_level"),
        last_commit_round=st.get("last_commit_round"),
        last_commit_age_s=age(now, st.get("last_commit_at")),
        loss=loss,
        loss_step=st.get("loss_step"),
        excess=None if loss is None or floor is None else loss - floor,
        eval_loss=number(st.get("eval_loss")),
        eval_step=st.get("eval_step"),
        last_seen_s=age(now, st.get("updated_at")),
        uptime_s=age(now, st.get("started_at")),
        steps_run=st.get("steps_run"),
        steps_discarded=st.get("steps_discarded"),
        excluded=st.get("excluded"),  # its contributions the poison screen excluded (sync/poison.py)
        asynchronous=bool(st.get("asynchronous")),  # sync.async_outer: outer_round counts global versions
        version_lag=st.get("version_lag"),  # the leader's last push: versions behind the newest (async)
        steps_since_commit=st.get("steps_since_commit"),
        **_pace_view(st),
        replica_id=inner.get("replica_id") if inner else None,
        inner=inner,
        outer=outer,
        lighthouse=(inner or {}).get("lighthouse") or lighthouses.get("cluster"),
        link=_link_view(st.get("link")),
        # per level whose lighthouse is not answering: since, for_s, retries (outage.py)
        outage=st.get("outage") if isinstance(st.get("outage"), dict) else None,
    )
    view["kill"] = bool(allow_kill and view["replica_id"] and view["lighthouse"] and health in ("live", "waiting", "stale", "starting"))
    return view


def _quorum(members: List[Tuple[str, Optional[Dict[str, Any]], bool]]) -> Dict[str, Any]:
    """Quorum of one lighthouse from its members' status blocks: (name, block, alive)."""
    ids = [b.get("quorum_id") for _, b, alive in members if b and alive and isinstance(b.get("quorum_id"), int)]
    if not ids:
        ids = [b.get("quorum_id") for _, b, _ in members if b and isinstance(b.get("quorum_id"), int)]
    if not ids:
        return {"quorum_id": None, "quorum_size": None, "participants": []}
    qid = max(ids)
    # Participants: live members reporting it (a dead member's last status still names it).
    parts = [n for n, b, alive in members if b and alive and b.get("quorum_id") == qid] or [n for n, b, _ in members if b and b.get("quorum_id") == qid]
    sizes = [b.get("quorum_size") for _, b, _ in members if b and b.get("quorum_id") == qid and isinstance(b.get("quorum_size"), int)]
    return {"quorum_id": qid, "quorum_size": max(sizes) if sizes else len(parts), "participants": parts}


def _downsample(points: List[List[float]], limit: int) -> List[List[float]]:
    if len(points) <= limit:
        return points
    stride = math.ceil(len(points) / limit)
    out = points[::stride]
    if out[-1] is not points[-1]:
        out.append(points[-1])
    return out


def _series(events: Dict[Key, List[Dict[str, Any]]], kind: str, clusters: Iterable[int], limit: int) -> Dict[str, List[List[float]]]:
    """Per cluster: [step, mean over its replica groups of their latest ``kind`` loss at that step]."""
    per: Dict[int, Dict[int, Dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for (c, r), evs in events.items():
        for e in evs:
            if e.get("kind") != kind:
                continue
            step, loss = e.get("step"), number(e.get("loss"))
            if isinstance(step, int) and loss is not None:
                per[c][step][r] = loss
    out = {}
    for c in clusters:
        pts = [[s, sum(v.values()) / len(v)] for s, v in sorted(per[c].items())]
        out[str(c)] = _downsample(pts, limit)
    return out


def build_state(files: RunFiles, now: Optional[float] = None, *, allow_kill: bool = False, refresh_ms: int = 1000,
                stale_after_s: float = 10.0, timeline_limit: int = 300, series_points: int = 400) -> Dict[str, Any]:
    """The whole page's data as one JSON-serialisable dict; a pure function of ``files`` and ``now``.

    Keys: ``run`` (topology, mode, progress, floor), ``global`` (lighthouse,
    quorum), ``clusters`` (lighthouse, quorum, leader, replica groups — one per
    topology slot, published or not), ``losses`` (per-cluster train and eval
    series as [step, loss]), ``timeline`` (chronological), ``counts``.
    """
    now = time.time() if now is None else now
    st = files.statuses
    C, R, keys = _slots(files)
    job_by_key = _by_replica(files.job_events)
    dash_by_key = _by_replica(files.dashboard_events)
    replicas = {k: _replica_view(k, st.get(k), job_by_key[k], dash_by_key[k], now, stale_after_s, allow_kill) for k in sorted(keys)}
    alive = {k: v["health"] in ("live", "waiting", "starting", "kill sent") for k, v in replicas.items()}
    lighthouses = next((s["lighthouses"] for s in st.values() if isinstance(s.get("lighthouses"), dict)), {})
    floor = next((number(s.get("entropy_floor")) for s in st.values() if number(s.get("entropy_floor")) is not None), None)
    clusters = [_cluster_view(c, files, keys, replicas, alive) for c in sorted({k[0] for k in keys})]
    version_lags(clusters)

    leaders = [v for v in replicas.values() if v.get("outer")]
    g = _quorum([(v["name"], v.get("outer"), alive[(v["cluster"], v["replica"])]) for v in leaders])
    global_addr = lighthouses.get("global") or next((v["outer"].get("lighthouse") for v in leaders if v["outer"].get("lighthouse")), None)
    timeline, counts = build_timeline(files, timeline_limit)
    return {
        "now": now,
        "run_dir": files.run_dir,
        "config": {"allow_kill": allow_kill, "refresh_ms": refresh_ms, "stale_after_s": stale_after_s},
        "run": {**_run_view(st, replicas, alive, C, R, floor, now), "outer_auto": _auto_view(files.auto)},
        "global": {"address": global_addr, **g},
        "clusters": clusters,
        "losses": {
            "floor": floor,
            "train": _series(files.events, "loss", [c["cluster"] for c in clusters], series_points),
            "eval": _series(files.events, "eval", [c["cluster"] for c in clusters], series_points),
        },
        "timeline": timeline,
        "counts": counts,
    }


def _slots(files: RunFiles) -> Tuple[int, int, Set[Key]]:
    """(C, R, every replica-group key): the published topology's slots, or what the files show."""
    st = files.statuses
    topo = next((s["topology"] for s in st.values() if isinstance(s.get("topology"), dict)), None)
    keys = set(st) | set(files.events)
    if topo and isinstance(topo.get("clusters"), int) and isinstance(topo.get("replicas_per_cluster"), int):
        C, R = topo["clusters"], topo["replicas_per_cluster"]
    else:
        C = max((c for c, _ in keys), default=-1) + 1
        R = max((r for _, r in keys), default=-1) + 1
    keys |= {(c, r) for c in range(C) for r in range(R)}
    return C, R, keys


def _by_replica(events: List[Dict[str, Any]]) -> Dict[Key, List[Dict[str, Any]]]:
    """Launcher or dashboard events that name one replica group, by its key."""
    out: Dict[Key, List[Dict[str, Any]]] = defaultdict(list)
    for e in events:
        if isinstance(e.get("cluster"), int) and isinstance(e.get("replica"), int):
            out[(e["cluster"], e["replica"])].append(e)
    return out


def _pace_view(st: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """Since its loop began (api.py _pace): steps per second, the share of the time spent
    in sync rounds (waiting for peers, communicating), and a leader's share spent waiting
    for other clusters (``outer_wait_s``, sync/state.py): a cluster held back by a slower
    one shows a low rate and high shares."""
    loop_s, steps, sync_s = number(st.get("loop_s")), number(st.get("loop_steps")), number(st.get("sync_s"))
    wait_s = number(st.get("outer_wait_s"))
    if not loop_s or loop_s <= 0 or steps is None:
        return {"step_rate": None, "sync_share": None, "outer_wait_s": wait_s, "wait_share": None}
    return {"step_rate": steps / loop_s, "sync_share": None if sync_s is None else min(1.0, sync_s / loop_s),
            "outer_wait_s": wait_s, "wait_share": None if wait_s is None else min(1.0, wait_s / loop_s)}


def _mean(xs: List[Optional[float]]) -> Optional[float]:
    v = [x for x in xs if x is not None]
    return sum(v) / len(v) if v else None


def _leaders_share(members: List[Dict[str, Any]]) -> Optional[float]:
    shares = [m["wait_share"] for m in members if m.get("wait_share") is not None]
    return max(shares) if shares else None


def _cluster_view(c: int, files: RunFiles, keys: Set[Key], replicas: Dict[Key, Dict[str, Any]], alive: Dict[Key, bool]) -> Dict[str, Any]:
    """One cluster: its lighthouse and quorum, leader, mean loss of the live groups, members."""
    st = files.statuses
    members = [replicas[k] for k in sorted(keys) if k[0] == c]
    addr = next((m.get("lighthouse") for m in members if m.get("lighthouse")), None)
    if addr is None:
        addr = next((st[k]["lighthouses"].get("cluster") for k in st if k[0] == c and isinstance(st[k].get("lighthouses"), dict)), None)
    q = _quorum([(m["name"], m.get("inner"), alive[(m["cluster"], m["replica"])]) for m in members])
    leaders = [m["name"] for m in members if m.get("leader") and alive[(m["cluster"], m["replica"])]] or [m["name"] for m in members if m.get("leader")]
    paced = [m for m in members if alive[(m["cluster"], m["replica"])]] or members
    losses = [m["loss"] for m in members if m.get("loss") is not None and alive[(m["cluster"], m["replica"])]] or [m["loss"] for m in members if m.get("loss") is not None]
    return {
        "cluster": c,
        "lighthouse": {"address": addr, **q},
        "leader": leaders[0] if leaders else None,
        "loss": sum(losses) / len(losses) if losses else None,
        # its groups' mean pace, the live ones' while any is (a heterogeneous deployment: topology.cluster_speed)
        "step_rate": _mean([m.get("step_rate") for m in paced]),
        "sync_share": _mean([m.get("sync_share") for m in paced]),
        # its leader's (members never wait for other clusters): the live leader's, else any's
        "wait_share": _leaders_share([m for m in paced if m.get("leader")] or paced),
        # sync.async_outer: the global version the cluster holds (lag: set by _version_lags)
        "version": max((m["outer_round"] for m in paced if isinstance(m.get("outer_round"), int)), default=None),
        "asynchronous": any(m.get("asynchronous") for m in members),
        "live": sum(1 for m in members if alive[(m["cluster"], m["replica"])]),
        "replicas": members,
    }


def version_lags(clusters: List[Dict[str, Any]]) -> None:
    """The asynchronous outer level: each cluster's lag, in versions, behind the newest
    version any cluster holds (the server's newest, as far as the statuses know)."""
    held = [c["version"] for c in clusters if isinstance(c.get("version"), int)]
    for c in clusters:
        c["version_lag"] = max(held) - c["version"] if held and c.get("asynchronous") and isinstance(c.get("version"), int) else None


def _run_view(st: Dict[Key, Dict[str, Any]], replicas: Dict[Key, Dict[str, Any]], alive: Dict[Key, bool], C: int, R: int,
              floor: Optional[float], now: float) -> Dict[str, Any]:
    """The run as a whole: topology, mode, progress (steps, rounds), live groups, model."""
    published = [v for v in replicas.values() if v["published"]]
    steps = [v["step"] for v in published if isinstance(v.get("step"), int)]
    return {
        "found": bool(published),
        "mode": next((s.get("mode") for s in st.values() if s.get("mode")), None),
        "clusters": C,
        "replicas_per_cluster": R,
        "steps_total": next((s.get("steps_total") for s in st.values() if s.get("steps_total")), None),
        "step_min": min(steps) if steps else None,
        "step_max": max(steps) if steps else None,
        "inner_round": max((v["inner_round"] for v in published if isinstance(v.get("inner_round"), int)), default=None),
        "outer_round": max((v["outer_round"] for v in published if isinstance(v.get("outer_round"), int)), default=None),
        "live": sum(1 for a in alive.values() if a),
        "replica_groups": len(replicas),
        "entropy_floor": floor,
        "model_params": next((s.get("model_params") for s in st.values() if s.get("model_params")), None),
        "started_at": min((number(s.get("started_at")) or now for s in st.values()), default=None),
    }


def _auto_view(rec: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """sync.outer.auto's pick and the measured inputs it was chosen from (None without one)."""
    if not rec or not isinstance(rec.get("inputs"), dict):
        return None
    inp, pick = rec["inputs"], rec.get("pick") or {}
    links = [h for h in rec.get("history") or [] if isinstance(h, dict) and h.get("reason") == "link"]

    def scaled(v: Any, k: float) -> Optional[float]:
        n = number(v)
        return None if n is None else n * k

    return {
        "overrides": rec.get("overrides") or [],
        "wan_mbit": scaled(inp.get("wan_bandwidth_Bps"), 8e-6),
        "wan_latency_ms": scaled(inp.get("wan_latency_s"), 1e3),
        "step_ms": scaled(inp.get("step_s"), 1e3),
        "hides": pick.get("hides"),
        "outer_round_s": number(pick.get("outer_round_s")),
        # modelled time to the target against an outer level that costs nothing (tools/plan/pick.py)
        "time_factor": number(pick.get("time_factor")),
        # re-choices for a changed link (experiments/auto_watch.py): how many, the last one's step
        "rechosen": len(links),
        "rechosen_at_step": links[-1].get("step") if links else None,
    }


def read_state(run_dir: str | Path, now: Optional[float] = None, **kwargs: Any) -> Dict[str, Any]:
    """:func:`build_state` of a run directory read once (tests, scripts)."""
    return build_state(RunReader(run_dir).read(), now, **kwargs)


