"""One bare-loop process of ``hier-localsgd bench`` (the loop: hier_localsgd/train/bare.py).

    python -m hier_localsgd.experiments.bare [overrides...] bare.out=PATH

Writes ``{"step_s": mean step time, "steps": n}`` to ``bare.out``.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("RUST_LOG", "warn")


def main(argv: list[str]) -> int:
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("bare.out=")), None)
    overrides = [a for a in argv if not a.startswith("bare.out=")]
    if out is None:
        print("bare: bare.out=PATH is required", file=sys.stderr)
        return 2
    from hier_localsgd.config import load_config
    from hier_localsgd.train.bare import bare_loop

    result = bare_loop(load_config(overrides, validate_for="train"))
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
