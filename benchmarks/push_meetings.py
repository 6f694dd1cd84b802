"""Whether the asynchronous outer level's pushes met (issue #33, match_pace), read from a
run's logs: per run directory, the versions the global model server made, how many merged
both clusters fresh (``staleness [0, 0]``), and for each push of cluster 1 the seconds
between it and cluster 0's nearest push (the leaders' phase lines ``OUTER_QUORUM ->
OUTER_REDUCE``: when each push went out; negative: cluster 1 pushed first). Two clusters,
cluster 0 the faster; cluster 1's pushes after cluster 0's last one (it trains alone then)
are left out.

    python benchmarks/push_meetings.py RUN_DIR [RUN_DIR ...]
    (a bench's run: .../bench/runs/hier_async)
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import Dict, List

PUSH = "OUTER_QUORUM -> OUTER_REDUCE"


def push_times(log: Path) -> List[float]:
    """When the leader's pushes went out (its log's timestamps, seconds)."""
    return [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for line in log.read_text().splitlines() if PUSH in line]


def meetings(run: Path) -> Dict[str, object]:
    fast, slow = push_times(run / "logs" / "c0r0.log"), push_times(run / "logs" / "c1r0.log")
    if not fast or not slow:
        raise SystemExit(f"{run}: no pushes of cluster 0 or 1 in logs/c0r0.log, logs/c1r0.log")
    gaps = [round(min((s - f for f in fast), key=abs), 2) for s in slow if s <= fast[-1]]
    versions = [line for line in (run / "logs" / "lighthouse_global.log").read_text().splitlines() if " from clusters " in line]
    return {"versions": len(versions), "both_fresh": sum("staleness [0, 0]" in line for line in versions), "gaps_s": gaps}


def main(argv: List[str]) -> None:
    if not argv:
        raise SystemExit(__doc__)
    for d in argv:
        m = meetings(Path(d))
        print(f"{d}: {m['versions']} versions, {m['both_fresh']} with both clusters fresh; "
              f"cluster 1's pushes minus cluster 0's nearest (s): {m['gaps_s']}")


if __name__ == "__main__":
    main(sys.argv[1:])
