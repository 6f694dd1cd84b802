"""A fault schedule fixed in advance (``chaos.draw=plan``): the same faults, at the same
points of training, on the same replica groups, whatever the run does.

Why: with ``chaos.draw=random`` or ``cycle`` the monkey picks each fault's target from the
job's state at that moment (who leads, who is running), drawing from one random stream; two
runs (hier and flat torchft DiLoCo, issue #14 §4) then part after their first difference,
and their goodputs compare different fault sequences. Here the seed, the topology and the
``chaos.*`` settings alone give the list, before anything runs; both runs get that list.

Each planned fault has ``at`` (the furthest replica group's step with
``chaos.kill_every_steps``, else seconds from the start; intervals exponential with that
mean, drawn from the seed), a kind drawn from ``chaos.kinds`` and concrete targets:

* ``kill``: role ``leader`` is group ``(c, 0)`` (it leads cluster c whenever it runs:
  torchft ranks a quorum by replica id; a flat baseline has no leaders, and the same group
  is killed), ``non_leader`` a group ``(c, r)`` with r >= 1, ``cluster`` every group of c;
* ``phase_kill``: one phase target (role and phase) on the group of that role in cluster c;
  a baseline (flat) has one level, whose phases are named INNER_*: an outer phase waits for
  the same phase of that level, BROADCAST (hier's alone) for its commit (``BASELINE_PHASE``);
* ``multi_kill``: ``(c1, 0)`` and ``(c2, r)``, r >= 1 where there is one, c1 != c2;
* ``hang``, ``poison``: a group ``(c, r)``; ``partition``: cluster c;
* ``lighthouse``: ``global`` or ``cluster<i>`` (a mode without that lighthouse, flat,
  records the fault as skipped: it cannot have it).

A fault fires once due and its targets are eligible under the monkey's rules (running and
healed; never the last processes whose model continues from the job's start; never the last
whole cluster; one non-kill fault at a time). Until then it waits, and the later ones wait
behind it (behind an armed phase_kill too, until it fired), so the order never changes; the
record says at which step it fired (``progress``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from hier_localsgd.experiments.chaos_evidence import Key, name


# A planned phase_kill's phase in a baseline's one level (sync/baselines.py publishes INNER_*).
BASELINE_PHASE = {"OUTER_QUORUM": "INNER_QUORUM", "OUTER_REDUCE": "INNER_REDUCE", "OUTER_COMMIT": "INNER_COMMIT",
                  "BROADCAST": "INNER_COMMIT"}


@dataclass
class PlannedFault:
    """One fault of the plan: when (``at``), what (``kind``) and on which groups,
    lighthouse or cluster (module doc)."""

    index: int
    at: float  # steps of the furthest group (kill_every_steps) or seconds from the start
    kind: str
    targets: List[Key] = field(default_factory=list)  # replica groups (kills, hang)
    role: str = ""  # kill / phase_kill: the role the targets stand for
    phase: str = ""  # phase_kill: the phase it waits for
    cluster: Optional[int] = None  # partition
    lighthouse: str = ""  # lighthouse: global | cluster<i>

    def as_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        d["targets"] = [name(k) for k in self.targets]
        return {k: v for k, v in d.items() if v not in ("", None, [])}


def _kinds_possible(kinds: Sequence[str], clusters: int, replicas: int, roles: Sequence[str], phase_targets: Sequence[str]) -> List[str]:
    """The kinds this topology can have (a double kill needs two clusters, ...)."""
    out = []
    for k in kinds:
        if k == "multi_kill" and clusters < 2:
            continue
        if k == "kill" and not _roles_possible(roles, clusters, replicas):
            continue
        if k == "phase_kill" and not [p for p in phase_targets if _roles_possible([p.split(":")[0]], clusters, replicas)]:
            continue
        out.append(k)
    return out


def _roles_possible(roles: Sequence[str], clusters: int, replicas: int) -> List[str]:
    """The kill roles this topology has (a non-leader needs two groups per cluster, a
    whole-cluster kill two clusters: the last one standing is never killed)."""
    return [r for r in roles if not (r == "non_leader" and replicas < 2) and not (r == "cluster" and clusters < 2)]


def draw_plan(
    seed: int, kinds: Sequence[str], clusters: int, replicas: int, roles: Sequence[str], phase_targets: Sequence[str],
    mean: float, until: float, step_based: bool,
) -> List[PlannedFault]:
    """The schedule: faults at exponential intervals of mean ``mean`` (steps if
    ``step_based``, else seconds) up to ``until``, each drawn as the module doc says.
    Depends on its arguments only (its own random stream)."""
    rng = random.Random(f"chaos-plan/{seed}")
    kinds = _kinds_possible(kinds, clusters, replicas, roles, phase_targets)
    roles = _roles_possible(roles, clusters, replicas)
    out: List[PlannedFault] = []
    at = 0.0
    while kinds:
        gap = rng.expovariate(1.0 / mean)
        at += max(1, round(gap)) if step_based else gap
        if at >= until:
            break
        kind = rng.choice(kinds)
        c = rng.randrange(clusters)
        f = PlannedFault(index=len(out), at=at, kind=kind)

        def member(cluster: int, role: str) -> Key:
            return (cluster, 0) if role == "leader" else (cluster, rng.randrange(1, replicas))

        if kind == "kill":
            f.role = rng.choice(roles)
            f.targets = [(c, r) for r in range(replicas)] if f.role == "cluster" else [member(c, f.role)]
        elif kind == "phase_kill":
            pt = rng.choice([p for p in phase_targets if _roles_possible([p.split(":")[0]], clusters, replicas)])
            f.role, f.phase = pt.split(":")
            f.targets = [member(c, f.role)]
        elif kind == "multi_kill":
            c2 = rng.choice([x for x in range(clusters) if x != c])
            f.role = "multi"
            f.targets = [(c, 0), (c2, rng.randrange(1, replicas) if replicas > 1 else 0)]
        elif kind in ("hang", "poison"):
            f.targets = [(c, rng.randrange(replicas))]
        elif kind == "partition":
            f.cluster = c
        else:  # lighthouse
            f.lighthouse = rng.choice(["global", *(f"cluster{i}" for i in range(clusters))])
        out.append(f)
    return out


def fired(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A chaos report's planned faults that fired (kills and other faults; not the skipped
    ones), in plan order."""
    recs = [*report.get("kills", []), *report.get("faults", [])]
    return sorted((r for r in recs if "planned" in r), key=lambda r: r["planned"])


def schedule_match(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, Any]:
    """Which planned faults two runs (hier and flat) both met, with the same kind and
    targets (``same``: their plan indices; the order is the plan's in both by
    construction), the steps at which each run met them (``progress``: the furthest
    group's step), and the faults each run skipped (one it cannot have). ``identical``:
    both met exactly the same faults and skipped none."""
    fa = {r["planned"]: r for r in fired(a)}
    fb = {r["planned"]: r for r in fired(b)}

    def key(rec: Dict[str, Any]) -> tuple:
        return (rec.get("kind"), tuple(rec.get("targets") or [rec.get("target")]))

    same = [i for i in sorted(set(fa) & set(fb)) if key(fa[i]) == key(fb[i])]
    skipped = [[r["planned"] for r in a.get("skipped", [])], [r["planned"] for r in b.get("skipped", [])]]
    return {"planned": len(a.get("plan", [])), "fired": [len(fa), len(fb)], "same": len(same), "same_indices": same,
            "identical": len(same) == len(fa) == len(fb) and not skipped[0] and not skipped[1],
            "steps": [[fa[i].get("progress") for i in same], [fb[i].get("progress") for i in same]], "skipped": skipped}


def describe_match(sm: Dict[str, Any]) -> str:
    """One line of a :func:`schedule_match` result (chaos's printout, the bench's table)."""
    return (f"chaos.draw=plan: {sm['planned']} faults planned; fired hier {sm['fired'][0]}, flat {sm['fired'][1]}; "
            f"the same in both, in order: {sm['same']}" + (f"; at steps hier {sm['steps'][0]}, flat {sm['steps'][1]}" if sm["same"] else ""))
