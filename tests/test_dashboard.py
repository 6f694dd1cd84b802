"""The dashboard: its aggregation of a run directory (unit tests on synthetic files),
its HTTP endpoints (Flask test client), and the live page in headless Chromium over a
real 2x2 job (lighthouses + 4 replica-group processes, a kill from the page).

The browser tests drive Debian's chromium through Playwright (``pip install playwright``;
``playwright install`` is never needed: the system browser is launched by path). Without
the browser they are skipped, except under CI (``CI`` set), where they fail.

``HIER_DASHBOARD_SCREENSHOT=docs/dashboard.png`` makes the live test save a full-page
screenshot after the kill, once the killed replica group is back.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List

import pytest

from hier_localsgd.tools.dashboard import reader as dash_reader, server as dash_server
from hier_localsgd.config import ConfigError
from hier_localsgd.tools.dashboard.config import DashboardConfig
from hier_localsgd.tools.dashboard.server import start_in_thread
from hier_localsgd.tools.dashboard.state import read_state
from hier_localsgd.core.runtime.status import read_json

NOW = 1_800_000_000.0
CHROMIUM = os.environ.get("HIER_DASHBOARD_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"]


# -----------------------------------------------------------------------------
# A synthetic run directory


def lh(i: int) -> str:
    return f"http://127.0.0.1:{29511 + i}"


def status(c: int, r: int, **over: Any) -> Dict[str, Any]:
    leader = r == 0
    st: Dict[str, Any] = {
        "cluster": c, "replica": r, "mode": "hier", "steps_total": 100,
        "lighthouses": {"global": "http://127.0.0.1:29510", "cluster": lh(c)},
        "topology": {"clusters": 2, "replicas_per_cluster": 2},
        "pid": 1000 + 10 * c + r, "state": "running", "started_at": NOW - 60, "updated_at": NOW - 0.5,
        "entropy_floor": 0.85, "model_params": 20672,
        "phase": "LOCAL", "phase_entered": NOW - 0.2, "phase_deadline": NOW + 100,
        "step": 42, "inner_round": 8, "outer_round": 4, "leader": leader,
        "last_commit_at": NOW - 1.5, "last_commit_level": "inner", "last_commit_round": 8,
        "loss": 1.25, "loss_step": 42,
        "inner": {"replica_id": f"c{c}_r{r:04d}:uuid-{c}{r}", "lighthouse": lh(c), "quorum_id": 3, "quorum_size": 2, "manager_step": 8},
        "outer": ({"replica_id": f"cluster{c:04d}:uuid-{c}", "lighthouse": "http://127.0.0.1:29510", "quorum_id": 5, "quorum_size": 2, "manager_step": 4} if leader else None),
        "link": {"inner": {"sent_bytes": {"payload": 2e6, "control": 100.0}, "sent_bytes_total": 2000100.0, "tensor_bytes": {}, "calls": {"allreduce/payload": 8}, "injected_failures": 0}},
    }
    st.update(over)
    return st


def write_run(root: Path, statuses: Dict[tuple, Dict[str, Any]], events: Dict[tuple, List[Dict[str, Any]]] = {}, job: List[Dict[str, Any]] = (), dashboard: List[Dict[str, Any]] = ()) -> Path:  # noqa: B006
    for (c, r), st in statuses.items():
        d = root / "replicas" / f"c{c}r{r}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "status.json").write_text(json.dumps(st))
    for (c, r), evs in events.items():
        d = root / "replicas" / f"c{c}r{r}"
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "events.jsonl", "a") as f:
            for e in evs:
                f.write(json.dumps({"cluster": c, "replica": r, **e}) + "\n")
    if job:
        with open(root / "job_events.jsonl", "a") as f:
            for j in job:
                f.write(json.dumps(j) + "\n")
    if dashboard:
        with open(root / "dashboard_events.jsonl", "a") as f:
            for d in dashboard:
                f.write(json.dumps(d) + "\n")
    return root


def all4(**over: Any) -> Dict[tuple, Dict[str, Any]]:
    return {(c, r): status(c, r, **over) for c in range(2) for r in range(2)}


def row(state: Dict[str, Any], name: str) -> Dict[str, Any]:
    return next(r for c in state["clusters"] for r in c["replicas"] if r["name"] == name)


# -----------------------------------------------------------------------------
# Aggregation (no browser)


def test_state_has_the_tree_roles_phases_and_quorums(tmp_path):
    sts = all4()
    sts[(1, 1)] = status(1, 1, phase="INNER_REDUCE", inner={"replica_id": "c1_r0001:x", "lighthouse": lh(1), "quorum_id": 2, "quorum_size": 2, "manager_step": 7})
    s = read_state(write_run(tmp_path, sts), now=NOW)
    assert json.loads(json.dumps(s)) == s  # plain JSON
    assert [c["cluster"] for c in s["clusters"]] == [0, 1]
    assert [[r["name"] for r in c["replicas"]] for c in s["clusters"]] == [["c0r0", "c0r1"], ["c1r0", "c1r1"]]
    assert [c["leader"] for c in s["clusters"]] == ["c0r0", "c1r0"]
    assert row(s, "c0r0")["role"] == "leader" and row(s, "c0r1")["role"] == "member"
    assert row(s, "c1r1")["phase"] == "INNER_REDUCE"
    r = row(s, "c0r1")
    assert r["health"] == "live" and r["step"] == 42 and (r["inner_round"], r["outer_round"]) == (8, 4)
    assert r["last_commit_age_s"] == pytest.approx(1.5) and r["last_seen_s"] == pytest.approx(0.5)
    assert r["excess"] == pytest.approx(0.40) and r["replica_id"] == "c0_r0001:uuid-01"
    assert r["link"]["inner"]["sent_bytes_total"] == 2000100.0 and r["link"]["inner"]["calls"] == 8
    assert r["kill"] is False  # not allowed
    # Cluster lighthouse: the newest quorum id its replica groups report; participants report it.
    q1 = s["clusters"][1]["lighthouse"]
    assert q1["address"] == lh(1) and q1["quorum_id"] == 3 and q1["participants"] == ["c1r0"]
    assert s["clusters"][0]["lighthouse"]["participants"] == ["c0r0", "c0r1"]
    # Global lighthouse: the leaders' outer blocks.
    assert s["global"] == {"address": "http://127.0.0.1:29510", "quorum_id": 5, "quorum_size": 2, "participants": ["c0r0", "c1r0"]}
    assert s["run"]["live"] == 4 and s["run"]["inner_round"] == 8 and s["run"]["entropy_floor"] == 0.85
    assert row(read_state(tmp_path, now=NOW, allow_kill=True), "c0r1")["kill"] is True


def test_each_cluster_shows_its_step_rate_and_its_share_of_time_in_sync(tmp_path):
    """api.py's pace fields (loop_s, loop_steps, sync_s) per group -> per-group and
    per-cluster steps/s and share in sync (mean of the live groups)."""
    sts = {(0, 0): status(0, 0, loop_s=10.0, loop_steps=100, sync_s=5.0), (0, 1): status(0, 1, loop_s=10.0, loop_steps=100, sync_s=4.0),
           (1, 0): status(1, 0, loop_s=10.0, loop_steps=50, sync_s=0.5), (1, 1): status(1, 1)}  # (1, 1): no loop yet
    s = read_state(write_run(tmp_path, sts), now=NOW)
    assert row(s, "c0r1")["step_rate"] == 10.0 and row(s, "c0r1")["sync_share"] == 0.4
    assert row(s, "c1r1")["step_rate"] is None and row(s, "c1r1")["sync_share"] is None
    c0, c1 = s["clusters"]
    assert c0["step_rate"] == 10.0 and c0["sync_share"] == pytest.approx(0.45)
    assert c1["step_rate"] == 5.0 and c1["sync_share"] == 0.05


def test_each_cluster_shows_its_leaders_share_of_time_waiting_for_other_clusters(tmp_path):
    """sync/state.py's outer_wait_s (a leader's global quorums, or its asynchronous pushes'
    batches at the server) over the loop's seconds: the cluster shows its leader's share, a
    member's missing count is no zero, and a cluster whose leader has not waited yet shows none."""
    sts = {(0, 0): status(0, 0, loop_s=10.0, loop_steps=100, sync_s=5.0, outer_wait_s=4.5),
           (0, 1): status(0, 1, loop_s=10.0, loop_steps=100, sync_s=4.8),
           (1, 0): status(1, 0, loop_s=20.0, loop_steps=100, sync_s=1.0, outer_wait_s=0.4), (1, 1): status(1, 1, loop_s=20.0, loop_steps=100)}
    s = read_state(write_run(tmp_path, sts), now=NOW)
    assert row(s, "c0r0")["outer_wait_s"] == 4.5 and row(s, "c0r0")["wait_share"] == 0.45
    assert row(s, "c0r1")["wait_share"] is None
    c0, c1 = s["clusters"]
    assert (c0["wait_share"], c1["wait_share"]) == (0.45, 0.02)
    none_yet = read_state(write_run(tmp_path / "b", {k: status(*k, loop_s=5.0, loop_steps=10) for k in sts}), now=NOW)
    assert [c["wait_share"] for c in none_yet["clusters"]] == [None, None]


def test_with_the_asynchronous_outer_level_each_cluster_shows_its_version_and_lag(tmp_path):
    """sync.async_outer: outer_round counts global versions; a cluster's lag is the newest
    version any cluster holds minus its own. Synchronous runs show no version or lag."""
    sts = {(0, 0): status(0, 0, outer_round=9, asynchronous=True, version_lag=0), (0, 1): status(0, 1, outer_round=9, asynchronous=True),
           (1, 0): status(1, 0, outer_round=6, asynchronous=True, version_lag=2), (1, 1): status(1, 1, outer_round=6, asynchronous=True)}
    s = read_state(write_run(tmp_path, sts), now=NOW)
    c0, c1 = s["clusters"]
    assert (c0["version"], c0["version_lag"], c1["version"], c1["version_lag"]) == (9, 0, 6, 3)
    assert row(s, "c1r0")["version_lag"] == 2 and row(s, "c1r0")["asynchronous"] is True
    sync = read_state(write_run(tmp_path / "sync", all4()), now=NOW)
    assert [(c["asynchronous"], c["version_lag"]) for c in sync["clusters"]] == [(False, None), (False, None)]


def test_missing_replica_groups_still_have_a_slot(tmp_path):
    s = read_state(write_run(tmp_path, {(0, 0): status(0, 0)}, job=[{"t": NOW - 2, "kind": "start", "cluster": 1, "replica": 1, "pid": 77}]), now=NOW)
    assert [r["name"] for c in s["clusters"] for r in c["replicas"]] == ["c0r0", "c0r1", "c1r0", "c1r1"]
    assert row(s, "c0r1")["health"] == "absent" and row(s, "c1r1")["health"] == "starting"
    empty = read_state(tmp_path / "nothing-yet", now=NOW)
    assert empty["run"]["found"] is False and empty["clusters"] == []


@pytest.mark.parametrize(
    "over,job,dashboard_ev,health",
    [
        ({}, [], [], "live"),
        ({"updated_at": NOW - 30}, [], [], "stale"),
        ({"updated_at": NOW - 30, "phase": "OUTER_QUORUM", "phase_deadline": NOW + 20}, [], [], "waiting"),
        ({"state": "finished"}, [], [], "finished"),
        ({"state": "failed (watchdog)"}, [], [], "failed"),
        ({}, [{"kind": "exit", "pid": 1001, "code": 1}], [], "exited"),
        ({}, [{"kind": "exit", "pid": 1001, "code": 0}], [], "finished"),
        ({}, [{"kind": "kill", "pid": 1001, "signal": "SIGKILL"}], [], "killed"),
        ({}, [{"kind": "exit", "pid": 1001, "code": 1}, {"kind": "restart", "pid": 2002}], [], "restarting"),
        ({"updated_at": NOW - 3}, [], [{"kind": "kill", "ok": True, "t": NOW - 4}], "killed"),
        ({}, [], [{"kind": "kill", "ok": True, "t": NOW - 0.2}], "kill sent"),
        ({}, [], [{"kind": "kill", "ok": True, "t": NOW - 100}], "live"),  # before this process started
        ({}, [], [{"kind": "kill", "ok": False, "t": NOW - 1}], "live"),
        ({"updated_at": NOW - 0.1}, [], [{"kind": "kill", "ok": True, "t": NOW - 10}], "live"),  # it did not take
    ],
)
def test_process_health(tmp_path, over, job, dashboard_ev, health):
    job = [{"t": NOW - 1, "cluster": 0, "replica": 1, **j} for j in job]
    dashboard_ev = [{"cluster": 0, "replica": 1, **d} for d in dashboard_ev]
    s = read_state(write_run(tmp_path, {**all4(), (0, 1): status(0, 1, **over)}, job=job, dashboard=dashboard_ev), now=NOW)
    assert row(s, "c0r1")["health"] == health
    assert s["run"]["live"] == 3 + (health in ("live", "waiting", "kill sent"))


def commit(t: float, level: str, rnd: int, participants: int = 2, **kw: Any) -> Dict[str, Any]:
    key = "outer_round" if level == "outer" else "inner_round"
    return {"t": t, "kind": "commit", "level": level, key: rnd, "step": 5 * rnd, "participants": participants, "checksum": "x", **kw}


def test_timeline_merges_commits_and_shows_quorum_changes_kills_and_heals(tmp_path):
    ev: Dict[tuple, List[Dict[str, Any]]] = {(0, 0): [], (0, 1): []}
    for k in ev:  # rounds 1..3 with both replica groups; the same commit is reported twice
        ev[k] += [commit(NOW - 50 + i, "inner", i) for i in (1, 2, 3)]
    ev[(0, 0)] += [{"t": NOW - 45, "kind": "leader", "leader": True, "step": 15}]
    ev[(0, 0)] += [commit(NOW - 40 + i, "inner", 3 + i, participants=1) for i in (1, 2)]
    ev[(0, 1)] += [{"t": NOW - 20, "kind": "heal", "level": "inner", "step": 30}, commit(NOW - 19, "inner", 6)]
    ev[(0, 0)] += [commit(NOW - 19, "inner", 6), {"t": NOW - 18, "kind": "rollback", "level": "inner", "reason": "commit vote failed", "step": 30},
                   {"t": NOW - 17, "kind": "loss", "step": 30, "loss": 1.0}, {"t": NOW - 17, "kind": "phase", "src": "LOCAL", "dst": "INNER_QUORUM"}]
    job = [{"t": NOW - 30, "kind": "exit", "cluster": 0, "replica": 1, "pid": 1001, "code": 1}, {"t": NOW - 28, "kind": "restart", "cluster": 0, "replica": 1, "pid": 1002}]
    dash_ev = [{"t": NOW - 31, "kind": "kill", "cluster": 0, "replica": 1, "source": "dashboard", "ok": True, "lighthouse": lh(0)}]
    s = read_state(write_run(tmp_path, {(0, 0): status(0, 0), (0, 1): status(0, 1, pid=1002, started_at=NOW - 27)}, ev, job, dash_ev), now=NOW)
    tl = [(e["kind"], e["text"]) for e in s["timeline"]]
    assert [k for k, _ in tl] == ["commit", "leader", "quorum", "commit", "kill", "exit", "restart", "heal", "quorum", "commit", "rollback"]
    assert tl[0][1] == "inner commit in cluster 0, rounds 1–3 (3 commits), 2 participants"
    assert tl[2][1] == "inner quorum in cluster 0: 2 → 1 participant"
    assert tl[3][1] == "inner commit in cluster 0, rounds 4–5 (2 commits), 1 participant"
    assert "killed from the dashboard" in tl[4][1] and "code 1" in tl[5][1] and "healed" in tl[7][1]
    assert tl[8][1] == "inner quorum in cluster 0: 1 → 2 participants"
    assert s["timeline"][4]["severity"] == "bad" and s["timeline"][7]["severity"] == "good"
    assert s["counts"]["commit"] == 6 and s["counts"]["kill"] == 1 and s["counts"]["exit_nonzero"] == 1
    assert [e["kind"] for e in read_state(tmp_path, now=NOW, timeline_limit=2)["timeline"]] == ["commit", "rollback"]


def test_a_round_that_kept_its_local_steps_is_on_the_timeline(tmp_path):
    ev: Dict[tuple, List[Dict[str, Any]]] = {(0, 0): [commit(NOW - 10, "inner", 1)], (0, 1): []}
    ev[(0, 0)].append({"t": NOW - 5, "kind": "keep_local", "level": "inner", "reason": "inner commit vote failed", "step": 10})
    s = read_state(write_run(tmp_path, {(0, 0): status(0, 0), (0, 1): status(0, 1)}, ev, [], []), now=NOW)
    (kept,) = [e for e in s["timeline"] if e["kind"] == "keep_local"]
    assert kept["severity"] == "warn"
    assert kept["text"] == "c0r0 kept its local steps after a failed round (inner) at step 10: inner commit vote failed"


def test_an_excluded_contribution_is_on_the_timeline_once_and_counted_on_its_row(tmp_path):
    """Every member of a level records an exclusion (sync/poison.py); the timeline shows the
    excluded group's own record only, and its row counts its exclusions."""
    ex = {"kind": "excluded", "level": "inner", "member": "c0r1", "reason": "non-finite values", "step": 15}
    ev: Dict[tuple, List[Dict[str, Any]]] = {(0, 0): [{"t": NOW - 5, **ex, "mine": False}],
                                             (0, 1): [{"t": NOW - 5, **ex, "mine": True},
                                                      {"t": NOW - 4, "kind": "optimizer_restored", "how": "last commit", "step": 15}]}
    s = read_state(write_run(tmp_path, {(0, 0): status(0, 0), (0, 1): status(0, 1, excluded=1)}, ev, [], []), now=NOW)
    (entry,) = [e for e in s["timeline"] if e["kind"] == "excluded"]
    assert entry["severity"] == "bad"
    assert entry["text"] == "c0r1's inner contribution excluded by the poison screen at step 15: non-finite values"
    (restored,) = [e for e in s["timeline"] if e["kind"] == "optimizer_restored"]
    assert restored["text"] == "c0r1 restored its inner optimizer (last commit) at step 15"
    assert row(s, "c0r1")["excluded"] == 1 and row(s, "c0r0")["excluded"] is None


def test_an_event_splits_only_the_commit_runs_it_concerns(tmp_path):
    ev = {(1, 0): [commit(NOW - 10 + i, "inner", i) for i in range(1, 7)], (0, 0): [commit(NOW - 10 + i, "outer", i) for i in range(1, 7)]}
    dash_ev = [{"t": NOW - 6.5, "kind": "kill", "cluster": 0, "replica": 1, "ok": True, "lighthouse": lh(0)}]
    job = [{"t": NOW - 5.5, "kind": "exit", "cluster": 0, "replica": 1, "pid": 1001, "code": 1}]
    ev[(0, 0)].insert(4, {"t": NOW - 5.2, "kind": "leader", "leader": False, "step": 20})
    s = read_state(write_run(tmp_path, {(0, 0): status(0, 0), (1, 0): status(1, 0)}, ev, job, dash_ev), now=NOW)
    assert [e["text"].split(",")[0] + ("" if e["kind"] != "commit" else e["text"].split(",")[1]) for e in s["timeline"]] == [
        "c0r1 killed from the dashboard (via its lighthouse http://127.0.0.1:29511)",  # cluster 0: neither run is closed
        "outer commit across clusters rounds 1–4 (4 commits)",  # closed by the leader change, shown at its last commit
        "c0r1 exited with code 1 (pid 1001)",
        "c0r0 stopped leading cluster 0",
        "inner commit in cluster 1 rounds 1–6 (6 commits)",  # one span across cluster 0's events
        "outer commit across clusters rounds 5–6 (2 commits)",
    ]


def test_a_restarted_process_evaluating_again_is_a_new_eval_entry(tmp_path):
    ev = {(0, 0): [{"t": NOW - 50, "kind": "eval", "step": 0, "loss": 4.9, "floor": 0.85}],
          (0, 1): [{"t": NOW - 50, "kind": "eval", "step": 0, "loss": 4.9, "floor": 0.85}, {"t": NOW - 20, "kind": "eval", "step": 0, "loss": 4.9, "floor": 0.85}]}
    s = read_state(write_run(tmp_path, {(0, 0): status(0, 0)}, ev), now=NOW)
    assert [(e["t"], e["text"]) for e in s["timeline"]] == [
        (NOW - 50, "eval at step 0: loss 4.9000, excess over the entropy floor 4.0500 [c0r0, c0r1]"),
        (NOW - 20, "c0r1 eval at step 0: loss 4.9000, excess over the entropy floor 4.0500"),
    ]


def test_outer_commits_are_one_entry_per_round_across_leaders(tmp_path):
    ev = {(c, 0): [commit(NOW - 10 + i, "outer", i) for i in (1, 2)] for c in range(2)}
    s = read_state(write_run(tmp_path, {(0, 0): status(0, 0), (1, 0): status(1, 0)}, ev), now=NOW)
    assert [e["text"] for e in s["timeline"]] == ["outer commit across clusters, rounds 1–2 (2 commits), 2 participants"]


def test_loss_series_per_cluster_and_eval_points(tmp_path):
    ev = {
        (0, 0): [{"t": NOW - 9, "kind": "loss", "step": 10, "loss": 3.0}, {"t": NOW - 8, "kind": "loss", "step": 20, "loss": 2.0}, {"t": NOW - 50, "kind": "eval", "step": 0, "loss": 4.9, "floor": 0.85}],
        (0, 1): [{"t": NOW - 9, "kind": "loss", "step": 10, "loss": 2.0}, {"t": NOW - 8, "kind": "loss", "step": 20, "loss": 1.0}, {"t": NOW - 50, "kind": "eval", "step": 0, "loss": 4.9, "floor": 0.85}],
        (1, 0): [{"t": NOW - 9, "kind": "loss", "step": 10, "loss": float("nan")}, {"t": NOW - 8, "kind": "loss", "step": 20, "loss": 1.5}],
    }
    s = read_state(write_run(tmp_path, all4(), ev), now=NOW)
    assert s["losses"]["train"] == {"0": [[10, 2.5], [20, 1.5]], "1": [[20, 1.5]]}
    assert s["losses"]["eval"] == {"0": [[0, 4.9]], "1": []} and s["losses"]["floor"] == 0.85
    evals = [e for e in s["timeline"] if e["kind"] == "eval"]
    assert len(evals) == 1 and "loss 4.9000" in evals[0]["text"] and "excess over the entropy floor 4.0500" in evals[0]["text"]
    many = {(0, 0): [{"t": NOW, "kind": "loss", "step": i, "loss": 1.0} for i in range(1000)]}
    pts = read_state(write_run(tmp_path / "long", {(0, 0): status(0, 0)}, many), now=NOW, series_points=100)["losses"]["train"]["0"]
    assert len(pts) <= 101 and pts[0][0] == 0 and pts[-1][0] == 999


def test_lossy_link_statistics_are_shown_generically(tmp_path):
    link = {"outer": {"sent_bytes": {"payload": 10.0}, "sent_bytes_total": 10.0, "calls": {"allreduce/payload": 1}, "injected_failures": 2,
                      "loss": {"model": "gilbert", "observed_loss_rate": 0.0125, "burst_histogram": {"1": 3}}, "brand_new": 7}}
    s = read_state(write_run(tmp_path, {(0, 0): status(0, 0, link=link)}), now=NOW)
    v = row(s, "c0r0")["link"]["outer"]
    assert v["loss_rate"] == 0.0125 and v["injected_failures"] == 2
    assert ["loss.observed_loss_rate", 0.0125] in v["details"] and ["loss.burst_histogram.1", 3] in v["details"] and ["brand_new", 7] in v["details"]


def test_reader_tolerates_partial_and_corrupt_lines_and_half_written_status(tmp_path):
    write_run(tmp_path, {(0, 0): status(0, 0)})
    events = tmp_path / "replicas" / "c0r0" / "events.jsonl"
    events.write_text(json.dumps({"t": NOW, "kind": "heal", "level": "inner"}) + "\n{not json}\n" + '{"t": 1, "kind": "lea')
    reader = dash_reader.RunReader(tmp_path)
    assert [e["kind"] for e in reader.read().events[(0, 0)]] == ["heal"]
    with open(events, "a") as f:  # the line being written is finished
        f.write('der", "leader": true}\n')
    assert [e["kind"] for e in reader.read().events[(0, 0)]] == ["heal", "leader"]
    events.write_text(json.dumps({"t": NOW, "kind": "resync"}) + "\n")  # replaced by a shorter file
    assert [e["kind"] for e in reader.read().events[(0, 0)]] == ["resync"]
    (tmp_path / "replicas" / "c0r0" / "status.json").write_text('{"cluster": 0, "repl')  # a non-atomic writer
    assert reader.read().statuses[(0, 0)]["step"] == 42  # the last good copy
    (tmp_path / "replicas" / "not-a-replica").mkdir()
    assert set(reader.read().statuses) == {(0, 0)}


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"^dashboard\.run_dir: required"):
        start_in_thread(DashboardConfig())
    with pytest.raises(ConfigError, match=r"^dashboard\.run_dir: '.*nope': no such directory"):
        start_in_thread(DashboardConfig(run_dir=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match=r"^dashboard\.port: 70000"):
        start_in_thread(DashboardConfig(run_dir=str(tmp_path), port=70000))
    with pytest.raises(ConfigError, match=r"^dashboard\.refresh_ms"):
        start_in_thread(DashboardConfig(run_dir=str(tmp_path), refresh_ms=10))
    url, stop = start_in_thread(DashboardConfig(run_dir=str(tmp_path), port=0))
    try:
        assert url.startswith("http://127.0.0.1:")
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        with pytest.raises(ConfigError, match=rf"^dashboard\.port: cannot serve on 127\.0\.0\.1:{port}"):
            start_in_thread(DashboardConfig(run_dir=str(tmp_path), port=port))
        with urllib.request.urlopen(url + "api/health", timeout=5) as r:
            assert json.load(r) == {"ok": True, "run_dir": str(tmp_path), "allow_kill": False}
    finally:
        stop()
    from omegaconf import OmegaConf  # the config section composes like the others

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DashboardConfig), OmegaConf.from_dotlist(["allow_kill=true", "port=9000"])))
    assert cfg == DashboardConfig(allow_kill=True, port=9000)


class FakeLighthouse:
    """Records ``POST /replica/<id>/kill`` like torchft's lighthouse (which then calls the Manager's Kill RPC)."""

    def __init__(self) -> None:
        from flask import Flask
        from werkzeug.serving import make_server

        self.kills: List[str] = []
        app = Flask("fake-lighthouse")

        @app.post("/replica/<replica_id>/kill")
        def kill(replica_id: str):  # type: ignore[no-untyped-def]
            self.kills.append(replica_id)
            if replica_id.startswith("c0_r0001"):
                # What torchft's lighthouse answers when the Manager exits on Kill before replying.
                return 'Something went wrong: status: Unknown, message: "transport error", details: []', 500
            if replica_id.startswith("c1_r0001"):
                return "Something went wrong: status: NotFound, message: \"replica not found\"", 500
            return "ok"

        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.addr = f"http://127.0.0.1:{self.server.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def test_kill_endpoint(tmp_path):
    fake = FakeLighthouse()
    try:
        inner = {"replica_id": "c0_r0001:abc-123", "lighthouse": fake.addr, "quorum_id": 1, "quorum_size": 2, "manager_step": 3}
        live = dict(started_at=time.time() - 60, updated_at=time.time())
        write_run(tmp_path, {(0, 1): status(0, 1, inner=inner, **live), (0, 0): status(0, 0, inner=dict(inner, lighthouse="http://127.0.0.1:9"), **live),
                             (1, 1): status(1, 1, inner=dict(inner, replica_id="c1_r0001:x"), **live), (1, 0): status(1, 0, inner=dict(inner, replica_id="c1_r0000:y"), **live)})
        off = dash_server.create_app(DashboardConfig(run_dir=str(tmp_path))).test_client()
        r = off.post("/api/replicas/0/1/kill", json={})
        assert r.status_code == 403 and "allow_kill" in r.get_json()["error"]
        assert fake.kills == [] and not (tmp_path / "dashboard_events.jsonl").exists()

        on = dash_server.create_app(DashboardConfig(run_dir=str(tmp_path), allow_kill=True)).test_client()
        assert on.post("/api/replicas/0/1/kill", data="x").status_code == 415  # a plain form post (CSRF) is refused
        assert on.post("/api/replicas/0/1/kill", json={}, headers={"Origin": "http://evil.example"}).status_code == 403
        assert on.post("/api/replicas/1/2/kill", json={}).status_code == 404
        assert fake.kills == []
        r = on.post("/api/replicas/0/1/kill", json={}, headers={"Origin": "http://localhost"})
        assert r.status_code == 200 and r.get_json()["ok"] is True, r.get_json()
        assert fake.kills == ["c0_r0001:abc-123"]
        r = on.post("/api/replicas/0/0/kill", json={})  # its lighthouse is unreachable
        assert r.status_code == 502 and "unreachable" in r.get_json()["detail"]
        r = on.post("/api/replicas/1/1/kill", json={})  # the lighthouse does not know it
        assert r.status_code == 502 and "replica not found" in r.get_json()["detail"]
        r = on.post("/api/replicas/1/0/kill", json={})  # a plain success
        assert r.status_code == 200 and r.get_json()["ok"] is True
        recs = [json.loads(x) for x in (tmp_path / "dashboard_events.jsonl").read_text().splitlines()]
        assert [(x["kind"], x["cluster"], x["replica"], x["source"], x["ok"]) for x in recs] == [
            ("kill", 0, 1, "dashboard", True), ("kill", 0, 0, "dashboard", False), ("kill", 1, 1, "dashboard", False), ("kill", 1, 0, "dashboard", True)]
        assert recs[0]["replica_id"] == "c0_r0001:abc-123" and recs[0]["lighthouse"] == fake.addr
        s = on.get("/api/state").get_json()
        assert row(s, "c0r1")["health"] in ("kill sent", "killed") and [e["kind"] for e in s["timeline"]][-4:] == ["kill"] * 4
        assert row(s, "c1r1")["health"] == "live"  # the kill failed
        assert on.get("/").status_code == 200 and on.get("/static/dashboard.js").status_code == 200
    finally:
        fake.close()


# -----------------------------------------------------------------------------
# The page in headless Chromium, over a live 2x2 job


def _browser_missing() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install playwright)"
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        return f"{CHROMIUM} not found (apt-get install chromium)"
    return ""


@pytest.fixture(scope="module")
def browser():
    missing = _browser_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"browser tests need a browser under CI: {missing}")
        pytest.skip(missing)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class LiveJob:
    """A real 2x2 tiny job whose killed replica groups are restarted (as launch/replica.sh does)."""

    def __init__(self, run_dir: Path) -> None:
        from harness import FAST_JOB, WAIT_FOR_RESTART

        from hier_localsgd.config import load_config
        from hier_localsgd.launch.local import LocalJob

        # WAIT_FOR_RESTART: a killed group's cluster waits for its restart, however slow
        overrides = [*FAST_JOB, *WAIT_FOR_RESTART, "train.steps=1000", "sync.inner.every=5", "sync.outer.every=2", "train.min_step_time_s=0.1", f"run.dir={run_dir}"]
        self.run_dir = run_dir
        self.job = LocalJob(load_config(overrides, validate_for="demo"), overrides)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._wait, name="live-job", daemon=True)

    class _Stop(Exception):
        pass

    def _tick(self) -> None:
        if self._stop.is_set():
            raise LiveJob._Stop()

    def _wait(self) -> None:
        try:
            self.job.wait(600, tick=self._tick, tick_every_s=0.2, restart=True, restart_delay_s=0.5)
        except LiveJob._Stop:
            pass

    def start(self) -> "LiveJob":
        self.job.start_lighthouses()
        self.job.start_all()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.job.stop(grace_s=5)


@pytest.fixture(scope="module")
def live_job(tmp_path_factory, browser):
    job = LiveJob(tmp_path_factory.mktemp("dashboard-live")).start()
    try:
        yield job
    finally:
        job.stop()


def open_page(browser, url: str):
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    errors: List[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(url)
    return page, errors


def health_of(page, name: str) -> str:
    return page.get_attribute(f'tr.rg-row[data-replica="{name}"]', "data-health") or ""


@pytest.mark.slow
def test_live_page_shows_the_hierarchy_updates_and_kills(live_job, browser):
    from playwright.sync_api import expect

    url, stop = start_in_thread(DashboardConfig(run_dir=str(live_job.run_dir), port=0, allow_kill=True, refresh_ms=500))
    page, errors = open_page(browser, url)
    try:
        rows = page.locator("tr.rg-row")
        expect(page.locator(".cluster")).to_have_count(2, timeout=10_000)
        expect(rows).to_have_count(4)
        expect(page.locator('tr.rg-row[data-health="live"]')).to_have_count(4, timeout=60_000)
        for c in range(2):
            cluster = page.locator(f'.cluster[data-cluster="{c}"]')
            expect(cluster.locator("tr.rg-row")).to_have_count(2)
            expect(cluster.locator(".c-role .role-leader")).to_have_count(1)
            expect(cluster.locator(".c-role .role-member")).to_have_count(1)
            expect(cluster.locator(".cluster-head")).to_contain_text("quorum #")
            expect(cluster.locator(".cluster-head .pace")).to_contain_text("in sync", timeout=30_000)  # hier: its pace
        phases = page.locator("tr.rg-row .c-phase .phase").all_inner_texts()
        assert len(phases) == 4 and all(p in dash_phases() for p in phases), phases
        expect(page.locator(".lh-global")).to_contain_text("quorum #")
        expect(page.locator(".lh-global a")).to_have_attribute("href", f"{live_job.job.global_addr}/")

        # It updates after a commit: the inner round shown grows.
        first = int(page.inner_text('tr.rg-row[data-replica="c0r0"] .c-inner'))
        page.wait_for_function("n => +document.querySelector('tr.rg-row[data-replica=\"c0r0\"] .c-inner').textContent > n", arg=first, timeout=20_000)
        expect(page.locator('#timeline li[data-kind="commit"]').first).to_be_visible()
        expect(page.locator("#chart-loss svg path").first).to_be_visible(timeout=10_000)

        shot = os.environ.get("HIER_DASHBOARD_SCREENSHOT")
        if shot:  # for the docs: a longer run before the kill, so the loss curves show something
            wait_for_step(live_job.run_dir, 120, 60)

        # Kill the non-leader of cluster 0 from the page.
        victim = page.locator('.cluster[data-cluster="0"] tr.rg-row:has(.role-member)')
        name = victim.get_attribute("data-replica")
        pid_before = (json.loads((live_job.run_dir / "replicas" / name / "status.json").read_text()))["pid"]
        page.once("dialog", lambda d: d.accept())
        victim.locator("button.kill").click()
        expect(page.locator(f'#timeline li[data-kind="kill"][data-who="{name}"]')).to_have_count(1, timeout=10_000)
        expect(page.locator(f'#timeline li[data-kind="kill"][data-who="{name}"]')).to_contain_text("killed from the dashboard")
        page.wait_for_function(f"() => ['killed','exited','restarting','kill sent'].includes(document.querySelector('tr.rg-row[data-replica=\"{name}\"]').dataset.health)", timeout=10_000)
        seen = {health_of(page, name)}
        # ...it exits (the launcher records it) and comes back: restarted, healed, live again
        # (a cold start: seconds, up to a minute under a CI load).
        deadline = time.time() + 180
        while time.time() < deadline:
            seen.add(health_of(page, name))
            status = json.loads((live_job.run_dir / "replicas" / name / "status.json").read_text())
            if status["pid"] != pid_before and health_of(page, name) == "live":
                break
            time.sleep(0.2)
        assert health_of(page, name) == "live", (seen, health_of(page, name))
        assert seen & {"killed", "exited", "restarting"}, seen
        # torchft's Kill exits with code 1; its exit races the Python threads and now and then ends in SIGSEGV (-11).
        expect(page.locator(f'#timeline li[data-kind="exit"][data-who="{name}"]')).to_contain_text("exited with code")
        expect(page.locator(f'#timeline li[data-kind="exit"][data-who="{name}"]')).not_to_contain_text("code 0 ")
        expect(page.locator(f'#timeline li[data-kind="restart"][data-who="{name}"]')).to_have_count(1)
        expect(page.locator(f'tr.rg-row[data-replica="{name}"] .c-health')).to_contain_text("↻1")
        if shot:
            wait_for_step(live_job.run_dir, 300, 90)
            page.wait_for_timeout(1500)
            page.screenshot(path=shot, full_page=True)
        assert errors == []
    finally:
        page.close()
        stop()


def wait_for_step(run_dir: Path, step: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        st = read_json(run_dir / "replicas" / "c0r0" / "status.json") or {}
        if int(st.get("step", 0)) >= step:
            return
        time.sleep(0.5)


def dash_phases() -> set:
    from hier_localsgd.core.runtime.phases import Phase

    return {p.value for p in Phase}


def test_the_page_shows_what_outer_auto_measured_and_picked(tmp_path, browser):
    """sync.outer.auto's record (<run.dir>/auto.json, experiments/auto.py) in the page's header."""
    from playwright.sync_api import expect

    rec = {"inputs": {"wan_bandwidth_Bps": 1.25e6, "wan_latency_s": 0.02, "step_s": 0.031},
           "pick": {"hides": True, "outer_round_s": 0.11, "time_factor": 2.0667},
           "overrides": ["sync.outer.compression=topk2", "sync.outer.delay=1", "sync.outer.fragments=1", "sync.outer.auto=false"]}
    (tmp_path / "auto.json").write_text(json.dumps(rec))
    url, stop = start_in_thread(DashboardConfig(run_dir=str(tmp_path), port=0, refresh_ms=500))
    page, errors = open_page(browser, url)
    try:
        shown = page.locator("#outer-auto")
        expect(shown).to_contain_text("WAN 10.0 Mbit/s 20.0 ms, step 31 ms", timeout=10_000)
        expect(shown).to_contain_text("sync.outer.compression=topk2 sync.outer.delay=1")
        expect(shown).to_contain_text("(hides, modelled time 2.067×)")
        expect(shown).not_to_contain_text("re-chosen")
        # After a re-choice for a changed link (auto_watch.py): the newest pick at the top, and the count.
        rec["history"] = [{"reason": "start", "step": None}, {"reason": "link", "step": 98}]
        rec["overrides"][0] = "sync.outer.compression=int8"
        (tmp_path / "auto.json").write_text(json.dumps(rec))
        expect(shown).to_contain_text("sync.outer.compression=int8 sync.outer.delay=1", timeout=10_000)
        expect(shown).to_contain_text("re-chosen for the link 1× (last at step 98)")
        assert errors == []
    finally:
        page.close()
        stop()


def test_the_page_shows_each_clusters_steps_per_second_and_shares_in_sync_and_waiting(tmp_path, browser):
    from playwright.sync_api import expect

    sts = {(0, 0): status(0, 0, loop_s=10.0, loop_steps=100, sync_s=5.0, outer_wait_s=3.0), (0, 1): status(0, 1, loop_s=10.0, loop_steps=100, sync_s=4.0),
           (1, 0): status(1, 0, loop_s=10.0, loop_steps=50, sync_s=0.5), (1, 1): status(1, 1, loop_s=10.0, loop_steps=50, sync_s=0.5)}
    url, stop = start_in_thread(DashboardConfig(run_dir=str(write_run(tmp_path, sts)), port=0, refresh_ms=500))
    page, errors = open_page(browser, url)
    try:
        expect(page.locator('.cluster[data-cluster="0"] .cluster-head .pace')).to_have_text("steps/s 10.00 in sync 45% waiting 30%", timeout=10_000)
        expect(page.locator('.cluster[data-cluster="1"] .cluster-head .pace')).to_have_text("steps/s 5.00 in sync 5%")
        assert errors == []
    finally:
        page.close()
        stop()


@pytest.mark.slow
def test_without_the_flag_there_is_no_kill(live_job, browser):
    url, stop = start_in_thread(DashboardConfig(run_dir=str(live_job.run_dir), port=0, refresh_ms=500))
    page, errors = open_page(browser, url)
    try:
        from playwright.sync_api import expect

        expect(page.locator("tr.rg-row")).to_have_count(4, timeout=10_000)
        assert page.locator("button.kill").count() == 0
        assert "kills enabled" not in page.inner_text("#conn")
        req = urllib.request.Request(url + "api/replicas/0/1/kill", data=b"{}", method="POST", headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 403
        assert errors == []
    finally:
        page.close()
        stop()


def test_a_request_naming_another_host_is_refused_dns_rebinding(tmp_path, caplog):
    """A page on evil.example whose name was rebound to 127.0.0.1 reaches the dashboard with
    ``Host: evil.example``: refused (403, one log line), kills included; the dashboard's own
    names, IP literals and dashboard.allowed_hosts pass."""
    write_run(tmp_path, {(0, 0): status(0, 0, started_at=time.time() - 5, updated_at=time.time())})
    app = dash_server.create_app(DashboardConfig(run_dir=str(tmp_path), allow_kill=True)).test_client()
    with caplog.at_level("WARNING"):
        for path in ("/", "/api/state"):
            r = app.get(path, headers={"Host": "evil.example:8265"})
            assert r.status_code == 403 and "not this dashboard" in r.get_json()["error"]
        assert app.post("/api/replicas/0/0/kill", json={}, headers={"Host": "evil.example"}).status_code == 403
    assert sum("refused" in r.getMessage() and "evil.example" in r.getMessage() for r in caplog.records) == 3
    for host in ("127.0.0.1:8265", "localhost:8265", "[::1]:8265", "10.1.2.3"):
        assert app.get("/api/state", headers={"Host": host}).status_code == 200, host
    named = dash_server.create_app(DashboardConfig(run_dir=str(tmp_path), host="0.0.0.0", allowed_hosts=["dash.example"])).test_client()
    assert named.get("/api/state", headers={"Host": "dash.example:8265"}).status_code == 200
    assert named.get("/api/state", headers={"Host": "localhost:8265"}).status_code == 403  # not loopback-bound: names must be listed
