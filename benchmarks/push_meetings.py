"""Whether the asynchronous outer level's pushes met (issue #33, match_pace), read from a
run's logs: per run directory, the versions the global model server made, how many merged
both clusters fresh (``staleness [0, 0]``), and for each push of cluster 1 the seconds
between it and cluster 0's nearest push (the ``phase`` events ``OUTER_QUORUM ->
OUTER_REDUCE`` in each group's events.jsonl, which only a leader takes: when each push went
out, whichever group led; negative: cluster 1 pushed first). Two clusters,
cluster 0 the faster; cluster 1's pushes after cluster 0's last one (it trains alone then)
are left out.

    python benchmarks/push_meetings.py RUN_DIR [RUN_DIR ...]
    (a bench's run: .../bench/runs/hier_async)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List

from hier_localsgd.core.runtime.status import read_events


def push_times(run: Path, cluster: int) -> List[float]:
    """When the cluster's leaders sent their pushes (event times, seconds), in order."""
    return sorted(e["t"] for d in sorted((run / "replicas").glob(f"c{cluster}r*")) for e in read_events(d / "events.jsonl")
                  if e.get("kind") == "phase" and e.get("src") == "OUTER_QUORUM" and e.get("dst") == "OUTER_REDUCE")


def meetings(run: Path) -> Dict[str, object]:
    fast, slow = push_times(run, 0), push_times(run, 1)
    if not fast or not slow:
        raise SystemExit(f"{run}: no pushes of cluster 0 or 1 in replicas/c*r*/events.jsonl")
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
