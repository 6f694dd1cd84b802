"""A bare training loop: the same model, data shard and optimizer as ``train``, nothing else.

No Managers, lighthouses, status files or sync: forward, backward, optimizer step. The
benchmark runs one per replica group, concurrently (the same CPU contention as a real
arm; hier_localsgd/experiments/bare.py is the process), and compares its mean step time
with the hierarchical arm's steps without a sync.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Dict

import torch

from hier_localsgd.core.runtime.device import DTYPES, memory_stats
from hier_localsgd.train.model import build_model, evaluate, lm_loss
from hier_localsgd.api import trimmed_mean
from hier_localsgd.job import process_device
from hier_localsgd.train.trainer import build_data

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
    return {"step_s": trimmed_mean(times), "steps": len(times), "device": str(device), "params": sum(p.numel() for p in model.parameters()),
            **memory_stats(device)}


def pilot_loop(cfg: Config, groups: int) -> Dict[str, Any]:
    """The pilot that fixes a benchmark's target loss without any arm's algorithm: one process,
    no sync, ``groups`` x ``train.batch_size`` sequences per step (the job's tokens per step)
    for ``train.steps`` steps (its token budget), evaluated on the arms' eval set. Returns the
    final eval loss and the eval curve (every ``train.eval_every`` steps, if set)."""
    tr = cfg.train
    torch.set_num_threads(tr.threads)
    big = dataclasses.replace(cfg, train=dataclasses.replace(tr, batch_size=tr.batch_size * groups))
    data, eval_set = build_data(big), build_data(cfg).eval_batches()
    model = build_model(cfg.model.name, data.vocab_size, tr.seq_len, cfg.model.dim, tr.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=(tr.beta1, tr.beta2), weight_decay=tr.weight_decay)
    curve = []
    for step in range(tr.steps):
        x, y = data.batch(step)
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        if tr.eval_every and (step + 1) % tr.eval_every == 0:
            curve.append({"step": step + 1, "loss": evaluate(model, eval_set)})
    final = curve[-1]["loss"] if curve and curve[-1]["step"] == tr.steps else evaluate(model, eval_set)
    return {"final_eval_loss": final, "curve": curve, "steps": tr.steps, "batch_size": tr.batch_size * groups, "entropy_floor": data.entropy_floor}
