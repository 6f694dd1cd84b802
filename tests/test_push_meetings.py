"""benchmarks/push_meetings.py on a hand-written run directory: the versions, the fresh
merges of both clusters, and each slower push's distance to the fastest's nearest."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import push_meetings  # noqa: E402


def _line(t: str, text: str) -> str:
    return f"2026-11-30 {t} INFO [x] hier_localsgd.core.runtime.phases: {text}\n"


def test_push_meetings_pairs_each_slower_push_with_the_nearest_fastest_one(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    push = "c phase OUTER_QUORUM -> OUTER_REDUCE step=30"
    (logs / "c0r0.log").write_text(_line("10:00:10,000", push) + _line("10:00:20,000", "c phase LOCAL -> INNER_QUORUM")
                                   + _line("10:00:30,000", push))
    # 2.5 s after the first, 1.25 s before the second, then one after cluster 0's last push (left out)
    (logs / "c1r0.log").write_text(_line("10:00:12,500", push) + _line("10:00:28,750", push) + _line("10:00:45,000", push))
    (logs / "lighthouse_global.log").write_text(
        "x version 1 from clusters [0] (weights [1.0], staleness [0])\n"
        "x version 2 from clusters [1, 0] (weights [0.5, 1.0], staleness [0, 0])\n"
        "x version 3 from clusters [0, 1] (weights [1.0, 0.25], staleness [0, 1])\n"
        "x final version 3 (clusters final: [0, 1])\n")
    assert push_meetings.meetings(tmp_path) == {"versions": 3, "both_fresh": 1, "gaps_s": [2.5, -1.25]}
