"""The sweep's chaos-under-load arm alone (experiments/bench_chaos.py) on one workload and WAN
rate: hier and flat torchft DiLoCo under one fault schedule, without the sweep's arms, pilot
and bare loops (docs/benchmarks.md, "The same fixed schedule on the debugmodel workload").

    python benchmarks/chaos_arm.py RUN_DIR GBPS TARGET STEPS [overrides...]

e.g. ``python benchmarks/chaos_arm.py runs/chaos_full_s1 0.1 0.9436 360 bench.mode=full chaos.seed=1
chaos.draw=plan chaos.kill_every_steps=40``. The overrides are the bench's (``bench.mode``
picks the workload) and ``chaos.*``; the WAN rate is emulated in user space, as the sweep's
chaos arm does. Writes ``RUN_DIR/bench/chaos_arm.json`` and prints the arm's table.
"""

import json
import sys
import time

from hier_localsgd.config import load_config
from hier_localsgd.experiments.bench import prepare
from hier_localsgd.experiments.bench_chaos import run_chaos_arm, table


def main(argv: list) -> int:
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    run_dir, gbps, target, steps, extra = argv[0], float(argv[1]), float(argv[2]), int(argv[3]), argv[4:]
    over = [f"run.dir={run_dir}", f"bench.target_loss={target}", *extra]
    prepared = prepare(load_config(over, validate_for="bench"), over)
    if prepared is None:
        return 2
    out, _, _, base = prepared
    t0 = time.time()
    res = run_chaos_arm([*base, f"links.outer.bandwidth_gbps={gbps}"], out, target, steps)
    (out / "chaos_arm.json").write_text(json.dumps(res, indent=1, default=str))
    print(table(res, gbps))
    print(f"took {time.time() - t0:.0f} s")
    return 0 if res.get("exit_code") == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
