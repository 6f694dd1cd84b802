"""One bare-loop process of ``hier-localsgd bench`` (the loop: hier_localsgd/train/bare.py).

    python -m hier_localsgd.experiments.bare [overrides...] bare.out=PATH [bare.pilot=GROUPS]

Writes ``{"step_s": mean step time, "steps": n}`` to ``bare.out``; with ``bare.pilot`` the
pilot's result instead (train/bare.py ``pilot_loop``: one process, GROUPS x the batch).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("RUST_LOG", "warn")


def main(argv: list[str]) -> int:
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("bare.out=")), None)
    pilot = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("bare.pilot=")), 0)
    overrides = [a for a in argv if not a.startswith(("bare.out=", "bare.pilot="))]
    if out is None:
        print("bare: bare.out=PATH is required", file=sys.stderr)
        return 2
    from hier_localsgd.config import load_config
    from hier_localsgd.train.bare import bare_loop, pilot_loop

    cfg = load_config(overrides, validate_for="train")
    result = pilot_loop(cfg, pilot) if pilot else bare_loop(cfg)
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
