"""``hier-localsgd chaos``: kill processes on a seeded schedule and measure the recovery.

Runs the configured topology on this machine (as the demo does), and while it trains
SIGKILLs processes by role — a ``non_leader`` replica group, a cluster's ``leader``, or a
whole ``cluster`` — at exponentially distributed intervals with mean
``chaos.kill_every_s`` (seeded by ``chaos.seed``). Killed processes are restarted after
``chaos.restart_delay_s``, as the launch script or torchelastic would; they rejoin and
heal. No kills happen after ``chaos.stop_kills_at`` of the steps, so the run can end
consistent. With ``chaos.baseline``, a failure-free run with the same seed goes first.

The report (``chaos.report``, default ``<run.dir>/chaos_report.json``, plus a human
summary) is computed from what the processes published and from the launcher's own
record of kills, exits and restarts:

* ``kills``: time, role, targets, each target's phase and step when killed;
* ``time_to_next_commit_s`` per kill: from the kill to the next commit by a survivor of
  the same cluster (by any other cluster for a whole-cluster kill);
* ``time_to_heal_s`` per restart: from the restart to the restarted process's first
  commit whose model checksum equals a peer's at the same step;
* ``recovered``: kills whose every target restarted and healed;
* ``hangs``: waits that ran into a timeout (collectives, quorums) plus watchdog exits;
* ``steps_run``, ``steps_discarded`` and ``efficiency`` = steps kept / steps run, over
  every incarnation of every process (a killed incarnation's count is read from its
  status just before the kill; steps since its last commit count as discarded);
* ``consistent`` (identical final checksums) and the final eval loss next to the
  failure-free run's.
"""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hier_localsgd.config import Config
from hier_localsgd.demo import summarize
from hier_localsgd.launcher import Key, LocalJob
from hier_localsgd.status import read_events, replica_dir

ROLES = ("non_leader", "leader", "cluster")


class ChaosMonkey:
    """Picks and kills targets on the seeded schedule; records what it did."""

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

    def _running(self) -> Dict[Key, dict]:
        out = {}
        for key, proc in self.job.replicas.items():
            st = self.job.status(key) or {}
            if proc.popen.poll() is None and st.get("state") == "running" and st.get("pid") == proc.popen.pid:
                out[key] = st
        return out

    def _pick(self, role: str, running: Dict[Key, dict]) -> Optional[List[Key]]:
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
        return self.rng.choice(cands) if cands else None

    def __call__(self) -> None:
        now = time.time()
        if now < self.next_kill:
            return
        running = self._running()
        if not running or min(int(st.get("step", 0)) for st in running.values()) >= self.stop_at_step:
            self.next_kill = float("inf")
            return
        roles = self.roles[:]
        self.rng.shuffle(roles)
        for role in roles:
            targets = self._pick(role, running)
            if targets:
                break
        else:
            self.next_kill = now + 1.0  # nothing eligible right now (restarting); try again soon
            return
        record = {"t": now - self.t0, "t_abs": now, "role": role, "targets": [f"c{c}r{r}" for c, r in targets], "phase": {}, "step": {}}
        for key in targets:
            st = running[key]
            record["phase"][f"c{key[0]}r{key[1]}"] = st.get("phase")
            record["step"][f"c{key[0]}r{key[1]}"] = st.get("step")
            self.work_at_kill.append({k: st.get(k, 0) for k in ("steps_run", "steps_discarded", "steps_since_commit")})
            self.job.kill(key, signal.SIGKILL)
        self.kills.append(record)
        self.next_kill = now + self.rng.expovariate(1.0 / self.mean)


def _commits(events: Dict[Key, List[dict]]) -> List[Tuple[float, Key, dict]]:
    out = []
    for key, evs in events.items():
        for e in evs:
            if e["kind"] == "commit":
                out.append((e["t"], key, e))
    return sorted(out, key=lambda x: x[0])


def analyse(cfg: Config, job: LocalJob, monkey: ChaosMonkey, wall_s: float) -> Dict[str, Any]:
    keys = job.keys()
    events = {k: read_events(replica_dir(job.run_dir, *k) / "events.jsonl") for k in keys}
    commits = _commits(events)
    summary = summarize(cfg, job, wall_s)

    # survivors' next commit after each kill
    for kill in monkey.kills:
        victims = {tuple(int(x) for x in t[1:].split("r")) for t in kill["targets"]}
        clusters = {c for c, _ in victims}
        same = [k for k in keys if k not in victims and k[0] in clusters]
        survivors = same or [k for k in keys if k not in victims]
        nxt = [t for t, k, e in commits if k in survivors and t > kill["t_abs"]]
        kill["time_to_next_commit_s"] = (min(nxt) - kill["t_abs"]) if nxt else None

    # time to heal per restart: first commit matching a peer's checksum at the same step
    by_step: Dict[Tuple[int, str], set] = {}
    for _, k, e in commits:
        if e["level"] == "inner":
            by_step.setdefault((e["step"], e["checksum"]), set()).add(k)
    restarts = []
    for h in job.history:
        if h["event"] != "restart":
            continue
        key, t = h["key"], h["t"]
        healed = None
        for tc, k, e in commits:
            if k == key and tc > t and e["level"] == "inner" and len(by_step.get((e["step"], e["checksum"]), set()) - {key}) > 0:
                healed = tc - t
                break
        restarts.append({"target": f"c{key[0]}r{key[1]}", "t": t - monkey.t0, "time_to_heal_s": healed})
    for kill in monkey.kills:
        later = [r for r in restarts if r["target"] in kill["targets"] and r["t"] >= kill["t"]]
        got = {r["target"] for r in later if r["time_to_heal_s"] is not None}
        kill["recovered"] = set(kill["targets"]) <= got

    # work accounting over every incarnation
    finals = [job.result(k) or {} for k in keys]
    run = sum(w["steps_run"] for w in monkey.work_at_kill) + sum(r.get("work", {}).get("steps_run", 0) for r in finals)
    discarded = sum(w["steps_discarded"] + w["steps_since_commit"] for w in monkey.work_at_kill) + sum(
        r.get("work", {}).get("steps_discarded", 0) for r in finals
    )
    timeouts = sum(1 for k in keys for e in events[k] if e["kind"] == "timeout")
    watchdog = sum(1 for h in job.history if h["event"] == "exit" and h.get("code") == 3)

    return {
        "topology": summary["topology"],
        "model": summary["model"],
        "steps_target": cfg.train.steps,
        "chaos": {"seed": cfg.chaos.seed, "kill_every_s": cfg.chaos.kill_every_s, "roles": list(cfg.chaos.roles), "restart_delay_s": cfg.chaos.restart_delay_s},
        "kills": [{k: v for k, v in kill.items() if k != "t_abs"} for kill in monkey.kills],
        "restarts": restarts,
        "recovered": sum(1 for k in monkey.kills if k["recovered"]),
        "hangs": timeouts + watchdog,
        "hangs_detail": {"timeouts": timeouts, "watchdog_exits": watchdog},
        "time_to_next_commit_s": [k["time_to_next_commit_s"] for k in monkey.kills],
        "time_to_heal_s": [r["time_to_heal_s"] for r in restarts],
        "steps_run": run,
        "steps_discarded": discarded,
        "efficiency": (run - discarded) / run if run else None,
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
            monkey.t0 = time.time()
            monkey.next_kill = monkey.t0 + monkey.rng.expovariate(1.0 / monkey.mean)
        job.wait(cfg.chaos.timeout_s, tick=monkey, tick_every_s=0.2, restart=chaos, restart_delay_s=cfg.chaos.restart_delay_s)
    finally:
        job.stop()
    return job, monkey, time.time() - t0


def human(report: Dict[str, Any]) -> str:
    def f(x: Any, n: int = 2) -> str:
        return "-" if x is None else f"{x:.{n}f}"

    lines = [
        f"chaos: {len(report['kills'])} kills ({', '.join(k['role'] for k in report['kills'])}), "
        f"{report['recovered']} recovered, {report['hangs']} hangs, consistent: {report['consistent']}",
        f"  time to survivors' next commit (s): {[f(x) for x in report['time_to_next_commit_s']]}",
        f"  time to heal per restart (s): {[f(x) for x in report['time_to_heal_s']]}",
        f"  steps run {report['steps_run']}, discarded {report['steps_discarded']}, efficiency {f(report['efficiency'], 3)}",
        f"  final eval loss {f(report['final_eval_loss'], 4)}"
        + (f" vs failure-free {f(report['baseline']['final_eval_loss'], 4)}" if report.get("baseline") else ""),
        f"  wall {report['wall_s']:.1f} s",
    ]
    return "\n".join(lines)


def run_chaos(cfg: Config, overrides: List[str]) -> int:
    baseline = None
    if cfg.chaos.baseline:
        print("chaos: failure-free run with the same seed first", flush=True)
        bjob, _, bwall = _run(cfg, overrides, "baseline", chaos=False)
        bs = summarize(cfg, bjob, bwall)
        baseline = {"final_eval_loss": bs["final_eval_loss"], "consistent": bs["consistent"], "wall_s": bwall, "steps": bs["steps"]}
        print(f"chaos: failure-free final eval loss {baseline['final_eval_loss']}", flush=True)
    print("chaos: run with kills", flush=True)
    job, monkey, wall = _run(cfg, overrides, "chaos", chaos=True)
    assert monkey is not None
    report = analyse(cfg, job, monkey, wall)
    report["baseline"] = baseline
    if baseline and report["final_eval_loss"] is not None and baseline["final_eval_loss"]:
        report["final_loss_vs_baseline"] = report["final_eval_loss"] / baseline["final_eval_loss"] - 1.0
    path = Path(cfg.chaos.report or Path(cfg.run.dir) / "chaos_report.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(human(report))
    print(f"report written to {path}")
    ok = report["consistent"] and all(c == 0 for c in report["exit_codes"].values())
    return 0 if ok else 1
