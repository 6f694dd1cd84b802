"""A bare training loop: the same model, data shard and optimizer as ``train``, nothing else.

    python -m hier_localsgd.bare [overrides...] bare.out=PATH

No Managers, lighthouses, status files or sync: forward, backward, optimizer step. The
benchmark runs one per replica group, concurrently (the same CPU contention as a real
arm), and compares its mean step time with the hierarchical arm's steps without a sync.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("RUST_LOG", "warn")


def main(argv: list[str]) -> int:
    out = next((a.split("=", 1)[1] for a in argv if a.startswith("bare.out=")), None)
    overrides = [a for a in argv if not a.startswith("bare.out=")]
    if out is None:
        print("bare: bare.out=PATH is required", file=sys.stderr)
        return 2
    import torch

    from hier_localsgd.config import load_config
    from hier_localsgd.model import build_model, lm_loss
    from hier_localsgd.trainer import _trimmed_mean, build_data

    cfg = load_config(overrides, validate_for="train")
    tr = cfg.train
    torch.set_num_threads(tr.threads)
    data = build_data(cfg)
    model = build_model(cfg.model.name, data.vocab_size, tr.seq_len, cfg.model.dim, tr.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=(tr.beta1, tr.beta2), weight_decay=tr.weight_decay)
    times = []
    for step in range(tr.steps):
        t0 = time.perf_counter()
        x, y = data.batch(step)
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if tr.min_step_time_s > 0:
            time.sleep(max(0.0, tr.min_step_time_s - (time.perf_counter() - t0)))
        times.append(time.perf_counter() - t0)
    with open(out, "w") as f:
        json.dump({"step_s": _trimmed_mean(times), "steps": len(times)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
