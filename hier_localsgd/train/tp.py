"""Lossy tensor parallelism inside a replica group (issue #16).

A replica group of G ranks can split the torchtitan Llama3 model by tensors instead of
replicating it (``group.parallel=tp``). Two layouts (``group.tp_variant``):

* ``megatron`` — attention: ``wq``/``wk``/``wv`` column-parallel (each rank holds
  ``n_heads/G`` query heads and ``n_kv_heads/G`` key/value heads), ``wo`` row-parallel;
  feed-forward: ``w1``/``w3`` column-parallel, ``w2`` row-parallel. Each block's input
  goes through ``f`` (identity forward, all-reduce of the input gradient backward) and
  its output through ``g`` (all-reduce of the partial outputs forward, identity
  backward): per layer 2 all-reduces forward and 2 backward, each of the activation's
  size.
* ``naive`` — every linear split on its output dimension, the outputs all-gathered after
  each (seed 002); attention and the SwiGLU product run replicated on every rank. The
  backward needs an all-reduce of each replicated input's gradient (every rank holds a
  partial ``W_kᵀ·grad_k``): one per block input (shared by ``wq``/``wk``/``wv``, and by
  ``w1``/``w3``) and one per ``wo`` and ``w2`` input.

Embeddings, norms and the output projection stay replicated; with loss off every rank
computes them identically (their gradients are equal without communication).

Every TP collective is an explicit autograd function over the group's
``torch.distributed`` process group (:class:`CopyToTP` = f, :class:`ReduceFromTP` = g,
:class:`GatherFromTP`), tagged with its operation — ``attn_fwd``, ``attn_bwd``,
``mlp_fwd``, ``mlp_bwd`` — and routed through that operation's emulated link
(:class:`hier_localsgd.lossy.LinkEmulation`: loss model, fill, latency/bandwidth,
statistics). Loss semantics are lossy.py's: an all-reduce loses packets of partial sums
(``zero``: the contribution is missing; ``stale``: the receiver's own partial stands in;
``rescale``: the packet's arrived sum scaled to G contributions); an all-gather loses
packets of a peer's shard (``zero``, or ``stale``: the value this site received on its
previous call; ``rescale`` does not apply to gathers). ``per_sender`` keeps every rank
identical (a lost packet is lost for all, the sender included); ``per_receiver`` lets
the ranks' replicated activations diverge, as independent receivers would.

Randomness: each operation's emulation has its own level code (``tp_attn_fwd`` ...), so
its streams are seeded by (seed, operation, sender id[, receiver id]): independent per
rank, per operation and per direction, never reseeded, deterministic for a seed and a
sequence of steps. Sender ids are stable identities (:attr:`TPGroup.ids`), so replica
groups can be given distinct streams.

Failure semantics: the collectives are blocking gloo calls bounded by the process
group's timeout (``timeout`` when the group is created with :func:`init_group`); a dead
peer makes the next collective raise (or time out) on every other rank, and the error
propagates out of forward or backward — a dead rank takes its group down, as for data
parallel groups. Nothing is retried here.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hier_localsgd.costs import ring_allreduce_bytes
from hier_localsgd.core.links.lossy import LinkEmulation, LinkSpec
from hier_localsgd.train.sections import VARIANTS

OPS = ("attn_fwd", "attn_bwd", "mlp_fwd", "mlp_bwd")


# ----------------------------------------------------------------------------- group
class TPGroup:
    """A TP group's process group, with one emulated link per operation.

    Args:
        pg: the group's process group (gloo); None with ``world == 1``.
        rank, world: this rank in the group and the group's size.
        specs: operation (one of :data:`OPS`) -> link spec; a missing or inactive spec
            is a reliable, unthrottled link (the collective is still counted).
        ids: a stable identity per group rank, the sender/receiver ids of the loss
            streams (default ``range(world)``).

    The collectives block; each is bounded by ``pg``'s timeout and raises on a failed
    or timed-out peer (nothing is retried).
    """

    def __init__(self, pg: Optional[Any], rank: int, world: int, specs: Optional[Dict[str, Optional[LinkSpec]]] = None,
                 ids: Optional[List[int]] = None) -> None:
        self.pg, self.rank, self.world = pg, rank, world
        self.ids = list(ids) if ids is not None else list(range(world))
        if len(self.ids) != world:
            raise ValueError(f"ids: {len(self.ids)} ids for a group of {world}")
        self.emu: Dict[str, Optional[LinkEmulation]] = {}
        for op, spec in (specs or {}).items():
            if op not in OPS:
                raise ValueError(f"unknown TP operation {op!r} (expected one of {OPS})")
            self.emu[op] = LinkEmulation(spec, f"tp_{op}") if spec is not None and spec.active else None
        self.calls: Dict[str, int] = defaultdict(int)
        self.tensor_bytes: Dict[str, int] = defaultdict(int)
        self.sent_bytes: Dict[str, float] = defaultdict(float)  # ring model, this rank
        self._prev: Dict[str, List[torch.Tensor]] = {}  # all-gather stale fill, per site
        self._replays: Dict[str, LinkEmulation] = {}

    # -- collectives --------------------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, op: str) -> None:
        """Sums ``t`` (contiguous) over the group in place, through ``op``'s link."""
        n = t.numel() * t.element_size()
        self.calls[op] += 1
        self.tensor_bytes[op] += n
        self.sent_bytes[op] += ring_allreduce_bytes(n, self.world)
        if self.world == 1:
            return
        emu = self.emu.get(op)
        if emu is None:
            dist.all_reduce(t, group=self.pg)
            return
        started = time.time()
        if emu.spec.model.enabled:
            per, npk = emu.packets(t.numel(), t.element_size())
            if emu.spec.where == "per_sender":
                # on t's device: the group's backend (NCCL on CUDA) reduces the masks too
                lost = torch.from_numpy(emu.stream(self.ids[self.rank]).sample(npk)).to(t.device)
                arrived = (~lost).to(torch.int32)
                dist.all_reduce(arrived, group=self.pg)  # emulation machinery, not counted
                saved = emu.save_rows(t, arrived, self.world, per)
                emu.zero_packets(t, lost, per)
                dist.all_reduce(t, group=self.pg)
                emu.fill_per_sender(t, arrived, self.world, per, saved)
            else:
                parts = [torch.empty_like(t) for _ in range(self.world)]
                dist.all_gather(parts, t, group=self.pg)
                emu.reduce_per_receiver(parts, self.rank, self.ids, t)
            emu.payload_bytes_sent += n
            emu.collectives += 1
        else:
            dist.all_reduce(t, group=self.pg)
        emu.pad(started, emu.spec.allreduce_time(n, self.world))

    def all_gather(self, t: torch.Tensor, op: str, site: str) -> torch.Tensor:
        """Concatenates every rank's ``t`` along the last dimension, through ``op``'s link.

        A lost packet of a shard is zero, or (``stale``) the value ``site`` held there
        after its previous call (zero on the first). ``per_sender``: a sender's lost packet
        is lost in every rank's copy, its own included (every receiver replays the
        sender's stream: same seed words), so all ranks agree; ``per_receiver``: each
        receiver loses each peer's packets independently and keeps its own shard."""
        n = t.numel() * t.element_size()
        self.calls[op] += 1
        self.tensor_bytes[op] += n
        self.sent_bytes[op] += float((self.world - 1) * n)
        if self.world == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)]
        emu = self.emu.get(op)
        started = time.time()
        dist.all_gather(parts, t, group=self.pg)
        if emu is not None and emu.spec.model.enabled:
            per, npk = emu.packets(t.numel(), t.element_size())
            prev = self._prev.get(site)
            per_sender = emu.spec.where == "per_sender"
            for j in range(self.world):
                sender = self.ids[j]
                if j == self.rank:
                    if not per_sender:
                        continue  # a receiver's own shard never crosses the link
                    stream = emu.stream(sender)
                elif per_sender:
                    stream = self._replay(op).stream(sender)
                else:
                    stream = emu.stream(sender, self.ids[self.rank])
                lost = torch.from_numpy(stream.sample(npk)).to(parts[j].device)
                if not bool(lost.any()):
                    continue
                if emu.spec.fill == "stale" and prev is not None and prev[j].shape == t.shape:
                    for (rows, sl), (old, _) in zip(emu.packet_rows(parts[j], per), emu.packet_rows(prev[j], per)):
                        rows[lost[sl]] = old[lost[sl]]
                else:
                    emu.zero_packets(parts[j], lost, per)
            if emu.spec.fill == "stale":
                self._prev[site] = [p.clone() for p in parts]
            emu.payload_bytes_sent += n
            emu.collectives += 1
        if emu is not None:
            emu.pad(started, emu.spec.allgather_time(n, self.world))
        return torch.cat(parts, dim=-1)

    def _replay(self, op: str) -> LinkEmulation:
        """Copies of the other senders' streams (same seed words, so the same fates), sampled
        by this receiver so that a per_sender loss in an all-gather hits every rank's copy
        alike; not counted (each sender counts its own packets)."""
        rep = self._replays.get(op)
        if rep is None:
            emu = self.emu[op]
            assert emu is not None
            rep = self._replays[op] = LinkEmulation(emu.spec, emu.level)
        return rep

    # -- statistics ---------------------------------------------------------------------
    def stats(self) -> Dict[str, Dict[str, Any]]:
        """Per operation: calls, tensor bytes, bytes this rank sent (ring model), and the
        emulation's loss statistics (packets, lost, observed rate, burst histogram)."""
        out: Dict[str, Dict[str, Any]] = {}
        for op in OPS:
            st: Dict[str, Any] = {"calls": self.calls.get(op, 0), "tensor_bytes": self.tensor_bytes.get(op, 0),
                                  "sent_bytes": self.sent_bytes.get(op, 0.0)}
            emu = self.emu.get(op)
            if emu is not None:
                st["loss"] = emu.stats()
            out[op] = st
        return out


# ----------------------------------------------------------------------------- autograd
class CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of the gradient backward (operation ``op``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPGroup, op: str) -> torch.Tensor:  # type: ignore[override]
        ctx.tp, ctx.op = tp, op
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None]:  # type: ignore[override]
        g = grad.contiguous().clone()
        ctx.tp.all_reduce(g, ctx.op)
        return g, None, None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce of the partial outputs forward (operation ``op``); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPGroup, op: str) -> torch.Tensor:  # type: ignore[override]
        y = x.contiguous().clone()
        tp.all_reduce(y, op)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None]:  # type: ignore[override]
        return grad, None, None


class GatherFromTP(torch.autograd.Function):
    """All-gather along the last dimension forward (operation ``op``); backward keeps this
    rank's slice of the gradient (the consumers run replicated, so every rank holds the
    whole gradient already — no communication)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, tp: TPGroup, op: str, site: str) -> torch.Tensor:  # type: ignore[override]
        ctx.tp, ctx.width = tp, x.shape[-1]
        return tp.all_gather(x, op, site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:  # type: ignore[override]
        k, w = ctx.tp.rank, ctx.width
        return grad[..., k * w : (k + 1) * w].contiguous(), None, None, None


# The TP operations run outside torch.compile's graphs (train.compile): they sample losses
# with numpy, call collectives and update dicts, which dynamo cannot trace (on torch 2.13 it
# failed inside dynamo: "Argument ... does not belong to this Graph"). The model's compute
# between them is still compiled; each operation is a graph break.
@torch.compiler.disable
def copy_to_tp(x: torch.Tensor, tp: TPGroup, op: str) -> torch.Tensor:
    return CopyToTP.apply(x, tp, op)


@torch.compiler.disable
def reduce_from_tp(x: torch.Tensor, tp: TPGroup, op: str) -> torch.Tensor:
    return ReduceFromTP.apply(x, tp, op)


@torch.compiler.disable
def gather_from_tp(x: torch.Tensor, tp: TPGroup, op: str, site: str) -> torch.Tensor:
    return GatherFromTP.apply(x, tp, op, site)


class GatheredLinear(nn.Linear):
    """A linear layer holding rows ``[k·out/G, (k+1)·out/G)`` of the full weight; its
    output is all-gathered (``fwd_op``). With ``bwd_op`` its input first goes through f
    (the input's gradient is all-reduced)."""

    def __init__(self, weight: torch.Tensor, tp: TPGroup, site: str, fwd_op: str, bwd_op: Optional[str]) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.weight.copy_(weight)
        self.tp, self.site, self.fwd_op, self.bwd_op = tp, site, fwd_op, bwd_op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bwd_op is not None:
            x = copy_to_tp(x, self.tp, self.bwd_op)
        return gather_from_tp(F.linear(x, self.weight), self.tp, self.fwd_op, self.site)


# ----------------------------------------------------------------------------- sharding
@dataclass
class TPShards:
    """Where each parameter of a sharded model comes from: name -> (dim, start, stop) of
    the full parameter (absent: replicated whole)."""

    variant: str
    world: int
    rank: int
    slices: Dict[str, Tuple[int, int, int]] = field(default_factory=dict)

    def take(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor ``full`` of parameter ``name``."""
        if name not in self.slices:
            return full
        dim, a, b = self.slices[name]
        return full.narrow(dim, a, b - a)


def _linear(weight: torch.Tensor) -> nn.Linear:
    # on the shard's device and in its dtype (a model already on the GPU, or bf16 weights)
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
    return lin


def _pre_f(tp: TPGroup, op: str) -> Callable[..., Any]:
    def hook(_module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        return (copy_to_tp(args[0], tp, op), *args[1:])

    return hook


def _post_g(tp: TPGroup, op: str) -> Callable[..., Any]:
    def hook(_module: nn.Module, _args: Tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(out, tp, op)

    return hook


def check_shardable(model: nn.Module, world: int) -> None:
    """Raises ValueError (one line naming the dimension) if ``model``'s layers do not split
    evenly over ``world`` ranks."""
    for name, block in model.layers.items():  # type: ignore[union-attr]
        a, ff = block.attention, block.feed_forward
        dims = {"n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads, "ffn hidden": ff.w1.weight.shape[0],
                "dim": a.wo.weight.shape[0]}
        for what, v in dims.items():
            if v % world:
                raise ValueError(f"group.tp_degree: {world} does not divide the model's {what} ({v}, layer {name})")


def shard_llama3(model: nn.Module, tp: TPGroup, variant: str) -> TPShards:
    """Shards a torchtitan Llama3 ``Transformer`` in place for rank ``tp.rank`` of
    ``tp.world`` (layouts in the module docstring). Every rank must start from the same
    full weights (:func:`hier_localsgd.model.build_model` with one seed). Returns where each
    parameter's shard comes from, so a full model can be reassembled or compared."""
    if variant not in VARIANTS:
        raise ValueError(f"group.tp_variant: {variant!r} — expected one of {VARIANTS}")
    G, k = tp.world, tp.rank
    check_shardable(model, G)
    shards = TPShards(variant, G, k)

    def rows(w: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int, int]]:
        n = w.shape[0] // G
        return w[k * n : (k + 1) * n].detach().clone(), (0, k * n, (k + 1) * n)

    def cols(w: torch.Tensor) -> Tuple[torch.Tensor, Tuple[int, int, int]]:
        n = w.shape[1] // G
        return w[:, k * n : (k + 1) * n].detach().clone(), (1, k * n, (k + 1) * n)

    for lname, block in model.layers.items():  # type: ignore[union-attr]
        a, ff = block.attention, block.feed_forward
        pa, pf = f"layers.{lname}.attention", f"layers.{lname}.feed_forward"
        if variant == "megatron":
            for proj, split in (("wq", rows), ("wk", rows), ("wv", rows), ("wo", cols)):
                w, where = split(getattr(a, proj).weight)
                setattr(a, proj, _linear(w))
                shards.slices[f"{pa}.{proj}.weight"] = where
            a.n_heads //= G
            a.n_kv_heads //= G
            for proj, split in (("w1", rows), ("w3", rows), ("w2", cols)):
                w, where = split(getattr(ff, proj).weight)
                setattr(ff, proj, _linear(w))
                shards.slices[f"{pf}.{proj}.weight"] = where
            a.register_forward_pre_hook(_pre_f(tp, "attn_bwd"))
            a.register_forward_hook(_post_g(tp, "attn_fwd"))
            ff.register_forward_pre_hook(_pre_f(tp, "mlp_bwd"))
            ff.register_forward_hook(_post_g(tp, "mlp_fwd"))
        else:
            # one f per block input (shared by wq/wk/wv, by w1/w3); wo and w2 carry their own
            for mod, prefix, fwd, bwd, projs in ((a, pa, "attn_fwd", "attn_bwd", ("wq", "wk", "wv", "wo")),
                                                 (ff, pf, "mlp_fwd", "mlp_bwd", ("w1", "w3", "w2"))):
                for proj in projs:
                    w, where = rows(getattr(mod, proj).weight)
                    own_f = bwd if proj in ("wo", "w2") else None
                    setattr(mod, proj, GatheredLinear(w, tp, f"{prefix}.{proj}", fwd, own_f))
                    shards.slices[f"{prefix}.{proj}.weight"] = where
                mod.register_forward_pre_hook(_pre_f(tp, bwd))
    return shards


def build_tp_model(name: str, vocab_size: int, seq_len: int, seed: int, tp: TPGroup, variant: str,
                   n_layers: int = 0, dim: int = 0, exact_vocab: bool = False) -> Tuple[nn.Module, TPShards]:
    """Builds the full ``llama3_<flavor>`` model from ``seed`` (optionally smaller: see
    :func:`build_llama3`) and shards it for ``tp``'s rank."""
    model = build_llama3(name, vocab_size, seq_len, seed, n_layers=n_layers, dim=dim, exact_vocab=exact_vocab)
    return model, shard_llama3(model, tp, variant)


def build_llama3(name: str, vocab_size: int, seq_len: int, seed: int, n_layers: int = 0, dim: int = 0,
                 exact_vocab: bool = False) -> nn.Module:
    """:func:`hier_localsgd.model.build_model` for a ``llama3_<flavor>``, with ``n_layers`` /
    ``dim`` overriding the flavor's when non-zero and, with ``exact_vocab``, the data's
    vocabulary instead of the flavor's larger one (a smaller transformer for sweeps)."""
    from hier_localsgd.train.model import LLAMA3_PREFIX, build_model

    if not name.startswith(LLAMA3_PREFIX):
        raise ValueError(f"model.name={name!r}: tensor parallelism shards a llama3_<flavor> model")
    if not n_layers and not dim and not exact_vocab:
        return build_model(name, vocab_size, seq_len, 0, seed)
    from torchtitan.models.llama3 import Transformer

    from hier_localsgd.train.model import llama3_flavor_args

    args = llama3_flavor_args(name[len(LLAMA3_PREFIX):])
    if n_layers:
        args.n_layers = n_layers
    if dim:
        args.dim = dim
    args.max_seq_len = seq_len
    args.vocab_size = vocab_size if exact_vocab else max(args.vocab_size, vocab_size)
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


# ----------------------------------------------------------------------------- volume
def tp_comm_volume(dims: Any, tokens: int, world: int, variant: str, bytes_per_value: int = 4) -> Dict[str, Dict[str, float]]:
    """Bytes one rank sends per layer and per training step on the TP links, by operation
    (seed 002's analysis, with the ring models of :mod:`hier_localsgd.link`).

    ``dims``: a :class:`hier_localsgd.tools.plan.model.ModelDims`; ``tokens``: tokens per step and
    rank (batch × sequence; TP ranks share the batch). With activation size A = tokens ·
    dim values, Q = tokens · (n_heads + 2 n_kv_heads) · head_dim, F = tokens · ffn_dim:

    * megatron: forward 1 all-reduce of A per block, backward 1 of A per block;
    * naive: forward all-gathers of Q and A (attention), 2F and A (MLP) — a rank sends
      its 1/G shard to the G-1 others, (G-1)/G of the gathered size; backward all-reduces
      of A and A (attention input, ``wo`` input), A and F (MLP input, ``w2`` input).

    An all-reduce of S bytes sends 2(G-1)/G · S per rank. Returns
    ``{"per_layer": {op: bytes}, "per_step": {op: bytes, "total": bytes}}``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} — expected one of {VARIANTS}")
    b = bytes_per_value
    A = tokens * dims.dim * b
    Q = tokens * (dims.n_heads + 2 * dims.n_kv_heads) * dims.head_dim * b
    Fh = tokens * dims.ffn_dim * b

    def ar(s: float) -> float:
        return ring_allreduce_bytes(int(s), world)

    def ag(s: float) -> float:
        return (world - 1) / world * s if world > 1 else 0.0

    if variant == "megatron":
        layer = {"attn_fwd": ar(A), "attn_bwd": ar(A), "mlp_fwd": ar(A), "mlp_bwd": ar(A)}
    else:
        layer = {"attn_fwd": ag(Q) + ag(A), "attn_bwd": 2 * ar(A), "mlp_fwd": ag(2 * Fh) + ag(A), "mlp_bwd": ar(A) + ar(Fh)}
    step = {op: v * dims.n_layers for op, v in layer.items()}
    step["total"] = sum(step.values())
    return {"per_layer": layer, "per_step": step}


# ----------------------------------------------------------------------------- processes
def init_group(store_path: str, rank: int, world: int, timeout: timedelta = timedelta(seconds=60)) -> Any:
    """Joins a gloo group of ``world`` processes through a FileStore at ``store_path``
    (one machine; tests and the sweep). Every collective is bounded by ``timeout``."""
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.group.WORLD


def _spawn_entry(rank: int, fn: Callable[..., Any], world: int, store_path: str, out_dir: str, timeout_s: float,
                 args: Tuple[Any, ...]) -> None:
    torch.set_num_threads(1)
    pg = init_group(store_path, rank, world, timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world, pg, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_group(fn: Callable[..., Any], world: int, work_dir: str, args: Tuple[Any, ...] = (),
                timeout: timedelta = timedelta(seconds=120)) -> List[Any]:
    """Runs ``fn(rank, world, pg, *args)`` in ``world`` spawned processes joined in a gloo
    group; returns the ranks' return values (torch-saved). ``fn`` must be importable by
    name. A rank that raises makes this raise (torch.multiprocessing's ProcessRaisedException,
    with the rank's traceback); its peers' collectives fail within ``timeout``."""
    import torch.multiprocessing as mp

    os.makedirs(work_dir, exist_ok=True)
    store_path = os.path.join(work_dir, "store")
    if os.path.exists(store_path):
        os.remove(store_path)
    mp.spawn(_spawn_entry, args=(fn, world, store_path, work_dir, timeout.total_seconds(), args), nprocs=world, join=True)
    return [torch.load(os.path.join(work_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


# ----------------------------------------------------------------------------- composition
def group_tp(cfg: Any, pg: Any, rank: int, world: int) -> TPGroup:
    """The TP group of this replica group's ranks (``group.parallel=tp``), its links from
    ``group.tp_links``. Loss-stream ids are global ranks (group index × G + rank), so
    replica groups draw independent losses."""
    t = cfg.topology
    index = cfg.run.cluster * t.replicas_per_cluster + cfg.run.replica
    return TPGroup(pg, rank, world, cfg.tp_link_specs(), ids=[index * world + r for r in range(world)])


def consistent_checksums(checksums: Dict[str, str], tp: bool) -> bool:
    """Whether the final checksums of a job agree: one value over every process, or, with
    tensor-parallel groups (each rank a different shard), one value per group rank — keys
    ``c<C>r<R>`` (rank 0) and ``c<C>r<R>g<k>``."""
    if not tp:
        return len(set(checksums.values())) == 1
    by_rank: Dict[str, set] = defaultdict(set)
    for key, value in checksums.items():
        _, _, g = key.partition("g")
        by_rank[g or "0"].add(value)
    return bool(by_rank) and all(len(v) == 1 for v in by_rank.values())
