"""The built-in training loop of one replica-group process — read this first.

``hier-localsgd train`` is one user of the public API (hier_localsgd/api.py), as any
user's program is: it builds the data shard, the model and the inner optimizer the config
names, hands them to :class:`~hier_localsgd.HierarchicalDiLoCo` and runs the loop. The
sync owns the counters, so a replica group that heals from a peer resumes at the peer's
step (and its data position, since batches are addressed by step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from hier_localsgd import HierarchicalDiLoCo, Topology
from hier_localsgd.train.data import ByteTextData, DeviceData, MarkovChain, MarkovData
from hier_localsgd.train.model import build_model, evaluate, lm_loss, param_dtype, shard_model

if TYPE_CHECKING:
    from hier_localsgd import Config

__all__ = ["train", "build_data", "build_trainee"]


def build_data(cfg: Config, rank: int = 0, device: Optional[torch.device] = None):  # type: ignore[no-untyped-def]
    """The rank's data shard; with ``device``, feeding tensors on that device."""
    d, tr = cfg.data, cfg.train
    if d.kind == "markov":
        chain = MarkovChain(d.states, d.branching, d.seed, d.concentration)
        src = MarkovData(chain, d.seed, cfg.shard(rank), tr.batch_size, tr.seq_len, tr.eval_batches, d.stream)
    else:
        src = ByteTextData(d.path, d.kind, d.text_column, d.seed, cfg.shard(rank), cfg.num_shards, tr.batch_size, tr.seq_len, tr.eval_batches, d.eval_fraction,
                           d.tokenizer, d.bpe_vocab)
    return src if device is None else DeviceData(src, device)


@dataclass
class Built:
    """What the loop trains: the model (``fwd`` wraps it for the forward pass: DDP inside a
    multi-rank group, torch.compile), the inner optimizer, and this rank's TP group
    (group.parallel=tp)."""

    model: torch.nn.Module
    fwd: torch.nn.Module
    opt: torch.optim.Optimizer
    tp: Any = None


def build_trainee(cfg: Config, grp: Any, device: torch.device, vocab_size: int) -> Built:
    """Model and inner optimizer, built on the CPU from the seed (identical everywhere),
    then moved to train.device in train.param_dtype (fp32 master weights); inside a group of
    several ranks sharded (FSDP2, TP) or wrapped in DDP for the forward pass."""
    tr = cfg.train
    tp = None
    model = build_model(cfg.model.name, vocab_size, tr.seq_len, cfg.model.dim, tr.seed).to(device=device, dtype=param_dtype(tr.param_dtype))
    if cfg.group.parallel == "tp":
        from hier_localsgd.train.tp import group_tp, shard_llama3

        tp = group_tp(cfg, grp.pg, grp.rank, grp.size)
        shard_llama3(model, tp, cfg.group.tp_variant)
    fsdp = grp.pg is not None and tp is None and cfg.group.sharding == "fsdp"
    if fsdp:  # FSDP2 inside the group; each rank syncs its own shard (core/tensors/fsdp.py)
        shard_model(model, grp.pg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=(tr.beta1, tr.beta2), weight_decay=tr.weight_decay)
    # Data parallel inside a multi-rank replica group: torch DDP over the group's own process
    # group (bucketed gradient averaging overlapped with backward), never across the
    # fault-tolerant dimension.
    fwd: torch.nn.Module = model
    if grp.pg is not None and tp is None and not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        fwd = DistributedDataParallel(model, process_group=grp.pg, forward_sync_buffers=False,
                                      device_ids=[device.index] if device.type == "cuda" else None)
    if tr.compile:
        fwd = torch.compile(fwd)  # type: ignore[assignment]
    return Built(model, fwd, opt, tp)


def train(topology: Topology) -> None:
    """Trains one replica group (or one rank of it) to ``train.steps`` and publishes its
    result. One function on purpose: a newcomer reads the whole training of a replica group
    here in one sitting, as in nanoGPT."""
    cfg, tr, grp, device = topology.config, topology.config.train, topology.group, topology.device
    # -- data, model, inner optimizer -------------------------------------------
    data = build_data(cfg, 0 if cfg.group.parallel == "tp" else grp.rank, device)  # TP ranks share their group's batches
    b = build_trainee(cfg, grp, device, data.vocab_size)
    eval_set = data.eval_batches()
    floor = data.entropy_floor
    # -- the sync (hier / flat / ddp), in the optimizer's step hooks -----------------
    # The sync's view of the parameters first: FSDP2 re-creates them at the first forward.
    sync = HierarchicalDiLoCo(b.model, b.opt, topology)
    eval_start = evaluate(b.model, eval_set, tr.precision)  # the model from the seed: a resume or heal comes at `with`
    sync.record_eval(eval_start, floor=floor, step=0)
    with sync:  # the join round: a restarted group heals here, before its first step
        for step in sync.steps():  # from the healed step after a restart
            x, y = data.batch(step)
            loss = lm_loss(b.fwd, x, y, tr.precision)
            loss.backward()  # with G > 1 ranks, DDP has averaged the gradients across the group on return
            sync.record_loss(loss)
            if b.tp is not None:
                sync.extra_status["tp"] = b.tp.stats()
            b.opt.step()  # a sync round at round boundaries (ddp: every step, its all-reduce first)
            b.opt.zero_grad(set_to_none=cfg.sync.mode != "ddp")  # ddp: its flat gradient buffer stays (core/tensors/flat_params.py)
            if tr.eval_every and sync.step_count % tr.eval_every == tr.eval_offset and sync.step_count < tr.steps:
                t_eval = time.perf_counter()
                sync.record_eval(evaluate(b.model, eval_set, tr.precision), floor=floor, eval_s=time.perf_counter() - t_eval)
                if tr.eval_global:  # also the one model the clusters share (differs from the live one when overlapped)
                    t_eval = time.perf_counter()  # the swap in and out is evaluation time too
                    with sync.global_model() as held:
                        if held:
                            sync.record_eval(evaluate(b.model, eval_set, tr.precision), eval_s=time.perf_counter() - t_eval, model="global")
        sync.finish()
        final = evaluate(b.model, eval_set, tr.precision)
        sync.record_eval(final, floor=floor)
        sync.publish_result(
            eval_loss_start=eval_start, eval_loss=final, entropy_floor=floor,
            tokens_per_step=tr.batch_size * tr.seq_len,  # per rank
            precision=tr.precision,
            **({"tp": b.tp.stats(), "tp_variant": cfg.group.tp_variant} if b.tp is not None else {}),
        )
