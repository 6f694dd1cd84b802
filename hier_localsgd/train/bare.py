"""A bare training loop: the same model, data shard and optimizer as ``train``, nothing else.

No Managers, lighthouses, status files or sync: forward, backward, optimizer step. The
benchmark runs one per replica group, concurrently (the same CPU contention as a real
arm; hier_localsgd/experiments/bare.py is the process), and compares its mean step time
with the hierarchical arm's steps without a sync.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict

import torch

from hier_localsgd.core.device import DTYPES, memory_stats
from hier_localsgd.train.model import build_model, lm_loss
from hier_localsgd.train.trainer import build_data, process_device, trimmed_mean

if TYPE_CHECKING:
    from hier_localsgd.config import Config


def bare_loop(cfg: Config) -> Dict[str, Any]:
    """Trains ``train.steps`` steps; returns the mean step time (warm-up skipped) and the count."""
    tr = cfg.train
    torch.set_num_threads(tr.threads)
    device = process_device(cfg)
    data = build_data(cfg, device=device)
    model = build_model(cfg.model.name, data.vocab_size, tr.seq_len, cfg.model.dim, tr.seed).to(device=device, dtype=DTYPES[tr.param_dtype])
    fwd = torch.compile(model) if tr.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=(tr.beta1, tr.beta2), weight_decay=tr.weight_decay)
    times = []
    for step in range(tr.steps):
        t0 = time.perf_counter()
        x, y = data.batch(step)
        loss = lm_loss(fwd, x, y, tr.precision)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if tr.min_step_time_s > 0:
            time.sleep(max(0.0, tr.min_step_time_s - (time.perf_counter() - t0)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return {"step_s": trimmed_mean(times), "steps": len(times), "device": str(device), **memory_stats(device)}
