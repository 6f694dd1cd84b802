"""Per-process step time, tokens/s and device memory of finished runs (benchmarks/gpu_check.sh).

    python benchmarks/gpu_report.py RUN_DIR [RUN_DIR ...]

Reads every ``<run>/replicas/c<C>r<R>[/rank<k>]/result.json`` the trainer wrote and prints
one row per process: the mode, device, precision, mean step time over the whole loop
(syncs included), the mean of the steps without a sync, tokens/s from each (per rank:
``train.batch_size x train.seq_len`` tokens a step) and ``torch.cuda.max_memory_allocated``
(none on CPU). Nothing is computed that the processes did not measure.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(run: Path) -> list:
    out = []
    for path in sorted(run.glob("replicas/c*r*/result.json")) + sorted(run.glob("replicas/c*r*/rank*/result.json")):
        r = json.loads(path.read_text())
        tok = r.get("tokens_per_step")
        step, local = r.get("step_s"), r.get("local_step_s")
        mem = r.get("max_memory_allocated")
        out.append([
            run.name, r.get("mode"), path.parent.relative_to(run / "replicas").as_posix(), r.get("device"), r.get("precision"),
            f"{step * 1e3:.1f}" if step else "-", f"{tok / step:,.0f}" if step and tok else "-",
            f"{local * 1e3:.1f}" if local else "-", f"{tok / local:,.0f}" if local and tok else "-",
            f"{mem / 2**20:,.0f}" if mem is not None else "-", f"{r.get('eval_loss', float('nan')):.4f}",
        ])
    return out


def main(argv: list) -> int:
    head = ["run", "mode", "process", "device", "precision", "step ms", "tokens/s", "local step ms", "local tokens/s", "max alloc MiB", "eval loss"]
    table = [head] + [row for a in argv for row in rows(Path(a))]
    if len(table) == 1:
        print("no result.json under", " ".join(argv))
        return 1
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        print("  ".join(str(c).rjust(w) if j >= 5 else str(c).ljust(w) for j, (c, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
