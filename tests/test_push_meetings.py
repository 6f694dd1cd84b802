"""benchmarks/push_meetings.py on a hand-written run directory: the versions, the fresh
merges of both clusters, and each slower push's distance to the fastest's nearest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import push_meetings  # noqa: E402


def _events(run: Path, group: str, *pushes: float) -> None:
    """A group's events.jsonl: an inner round, then a push at each time."""
    d = run / "replicas" / group
    d.mkdir(parents=True)
    evs = [{"t": 1.0, "kind": "phase", "src": "LOCAL", "dst": "INNER_QUORUM"}]
    evs += [{"t": t, "kind": "phase", "src": "OUTER_QUORUM", "dst": "OUTER_REDUCE"} for t in pushes]
    (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evs))


def test_push_meetings_pairs_each_slower_push_with_the_nearest_fastest_one(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    _events(tmp_path, "c0r0", 10.0)
    _events(tmp_path, "c0r1", 30.0)  # a new leader of cluster 0
    # 2.5 s after the first, 1.25 s before the second, then one after cluster 0's last push (left out)
    _events(tmp_path, "c1r0", 12.5, 28.75, 45.0)
    (logs / "lighthouse_global.log").write_text(
        "x version 1 from clusters [0] (weights [1.0], staleness [0])\n"
        "x version 2 from clusters [1, 0] (weights [0.5, 1.0], staleness [0, 0])\n"
        "x version 3 from clusters [0, 1] (weights [1.0, 0.25], staleness [0, 1])\n"
        "x final version 3 (clusters final: [0, 1])\n")
    assert push_meetings.meetings(tmp_path) == {"versions": 3, "both_fresh": 1, "gaps_s": [2.5, -1.25]}
