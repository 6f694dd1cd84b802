"""The asynchronous outer level's global model: versions, batches, the merge rule
(issue #33; the server around it is global_server.py, the leaders' side async_outer.py).

With ``sync.async_outer.enabled`` no cluster waits for another at its outer round: its
leader sends the cluster's pseudo-gradient ``Δ = θ_base − θ_cluster`` (measured from the
global model of version ``base`` it last adopted), with the tokens it represents, and gets
back the newest global model. :class:`GlobalModel` owns that model, its version and the
outer optimizer's momentum; contributions that arrive within one batch (the grace window,
global_server.py) are merged into one outer step, so the version advances by one per batch.

The merge rule (a batch B of contributions i, hand-checked in tests/test_async_outer.py)::

    s_i = version − base_i                         staleness, in versions
    λ(s) = 1 / (1 + s)   if s <= max_staleness,    else 0 (not merged: the cluster rebases)
    a_i = min(1, n_i / n_full) · λ(s_i)            n_i: the group-steps the cluster's work holds
    g   = Σ a_i Δ_i / max(Σ a_i, C)                n_full: one full cluster's outer period (sync.outer.every)
                                                   C: the job's clusters
    θ, m ← outer SGD step (lr, momentum, Nesterov) of θ with gradient g,
           as w = min(1, Σ a_i / C) of a round (Momentum, below);  version += 1

Why this rule: each contribution moves the model by its share of a synchronous round's
tokens (C clusters' full periods). With every cluster fresh (s = 0) and whole (n_i = n_full)
a batch of all C clusters is ``mean Δ_i``: the synchronous outer round, step for step, so
equal speeds with a grace window that catches every cluster train as the synchronous mode
does. A batch worth less than a round is scaled down, never normalised up: a lone fresh
contribution moves the model by 1/C of its pseudo-gradient, as its share of a synchronous
mean would; a stale one (λ = 1/2 for s = 1) or a partial one (a cluster with half its
groups) by that fraction again. A contribution holding more than a full period (pushes that
failed meanwhile: a server outage) counts one period: its pseudo-gradient already holds the
drift of all its steps, so it moves the model by 1/C of it, as a synchronous round of that
length would. (Uncapped, a lone push of 8.4 periods after an outage took its whole
pseudo-gradient, and the other cluster's of 6.8 periods, one version later, half of its:
the final eval loss of a chaos run went from about 0.90 to 1.14.) (The first rule normalised a batch to at least 1, not C: a
lone fast cluster then stepped the model by its whole pseudo-gradient at every push, and on
the demo workload beside a half-speed cluster the global model reached the target 2.4×
later than synchronous rounds: docs/benchmarks.md.) λ(s) = 1/s-style damping is the
staleness-aware rule of asynchronous SGD (Zhang et al., IJCAI 2016); the bound keeps a
cluster back from a long partition from pulling the model toward where it was long ago.

With ``sync.async_outer.match_pace`` (dynamic local updates, Liu et al. 2024) a slower
cluster pushes after fewer steps, ``r_k = push_in_k / (H_inner · H_outer)`` of a period
(global_server.py ``_push_in``), so its fresh pushes arrive with the fastest cluster's, into one batch. Its
``n_i`` is that smaller period's group-steps, so each cluster's work counts by the tokens it
holds, none is stale, and no cluster waits. The floor stays ``C``: a batch of every cluster
on schedule, ``Σ a_i = Σ r_k < C``, moves the model by ``Σ n_i Δ_i / (C · n_full)``, the
tokens it holds as a share of a synchronous round's, so the outer step per token is the
synchronous level's. (A floor of ``Σ_k r_k`` made such a batch the full token-weighted
mean, a synchronous round's step on fewer tokens: on the demo workload beside a half-speed
cluster its global model stalled at 0.94–0.97 while the synchronous one fell to 0.93, and it
reached the target 0.58–0.88× as fast as synchronous rounds, against 0.90–1.18× with ``C``:
docs/benchmarks.md.)

Momentum: one outer step per version, whoever contributed to it: the buffer is the
global model's own (HALoS keeps momentum at the global server for the same reason), so
it is well defined whatever order contributions arrive in. Each step is the batch's share
of a round, ``w = min(1, Σ a_i / C)``, momentum included (core/tensors/level.py
``OuterSGD.stage``)::

    m ← μ^w m + g;   θ ← θ − lr (g + w μ m)          (Nesterov, lr and μ of sync.outer)

A batch of every cluster fresh and whole (``w = 1``) is the synchronous round's step
exactly; ``k`` batches of ``1/k`` of a round move the model about as one round does. (With a
whole momentum step per version, a lone push of a few steps at the end of a run, weight
0.03, moved the model by most of a round through the momentum alone: with equal speeds the
final eval loss rose from 0.916 to 0.935 in one seed: docs/benchmarks.md.)

**Compressed updates down** (``down``: sync.async_outer.compress_down with
``sync.outer.compression``, compression.py ``down_format``): each version's outer step
``u_v`` is quantized with the server's own error feedback ``e`` (``q_v = Q(u_v + e)``,
``e ← u_v + e − D(q_v)``) and the model *is* the sum of the decoded steps::

    θ_v = θ_{v−1} + D(q_v)          (fp32, element by element, :func:`apply_update`)

so a leader holding version ``b`` gets ``q_{b+1} … q_v`` (a quarter of the model each in
int8) instead of the model, and adds them in order with the same function: the same bits
as the server's (an fp32 addition of the same operands), which a CRC-32 of ``θ_v`` in the
answer confirms. A chain is kept only while its bytes are under the model's (:meth:`chain`);
a leader further behind, or from another server life, gets the model. The momentum steps
on ``g`` as without it; what the quantization leaves is ``e``, delivered with later
versions (at most one quantization step per element behind the fp32 sequence).

A contribution holding a non-finite value is refused (weight 0, logged): one diverged cluster
never turns the global model to NaN; the cluster adopts the newest version instead.

Failure semantics: the state is in memory. A server that restarts has no model until a
leader sends its own copy of the global model (version ``base``): it adopts the highest
version any leader brings (:meth:`adopt`) with its momentum reset to zero (logged; the
leaders do not hold the server's momentum). Nothing here blocks or does I/O.
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Optional, Tuple

import torch

from hier_localsgd.core.tensors.compress import Quantized, dequantize, quantize
from hier_localsgd.core.tensors.level import Level, LevelAlgorithm


def staleness_factor(staleness: int, max_staleness: int) -> float:
    """λ(s) of the module doc: 1/(1+s) within the bound, 0 beyond it (or for s < 0)."""
    if staleness < 0 or staleness > max_staleness:
        return 0.0
    return 1.0 / (1.0 + staleness)


def contribution_weight(tokens: float, full_tokens: float, staleness: int, max_staleness: int) -> float:
    """``a_i = min(1, n_i / n_full) · λ(s_i)`` of the module doc (0 for ``n_full <= 0``)."""
    if full_tokens <= 0:
        return 0.0
    return min(1.0, max(0.0, float(tokens)) / full_tokens) * staleness_factor(staleness, max_staleness)


def batch_share(total_weight: float, clusters: int) -> float:
    """``w = min(1, Σ a_i / C)`` of the module doc: a batch's share of a synchronous round."""
    return min(1.0, total_weight / clusters)


def checksum(params: torch.Tensor) -> int:
    """CRC-32 of an fp32 host model's bytes: a leader's check that the updates it added
    gave the server's model bit for bit (not a security check: the answer is MAC'ed)."""
    return zlib.crc32(params.detach().contiguous().numpy().data)


@torch.no_grad()
def apply_update(params: torch.Tensor, step: torch.Tensor) -> None:
    """``params += step`` (fp32: a decoded ``D(q)``): the one way the server and the
    leaders take a step down, so both get the same bits."""
    params.add_(step)


@dataclass
class Contribution:
    """One cluster's work in a batch, as merged (``weight`` is ``a_i``)."""

    cluster: int
    base: int
    staleness: int
    tokens: float
    weight: float
    delta: Optional[torch.Tensor] = field(default=None, repr=False)
    refused: str = ""  # why a contribution with a delta was not merged ("" = merged, or nothing to merge)
    applied: bool = False  # its batch was applied (a batch dropped by adopt() never is)


class GlobalModel:
    """The global model of the asynchronous outer level (module doc).

    Args:
        algorithm: the outer optimizer (``sync.outer``'s lr, momentum, Nesterov).
        full_tokens: ``n_full``, the group-steps of one whole cluster's outer period.
        max_staleness: the bound on ``s`` (versions).
        clusters: ``C``, the job's clusters (a synchronous round's worth is ``C``).
        init: the global model of version ``version``.
        down: ``(fmt, block)`` of the updates down (module doc); None: the model in fp32.
    """

    def __init__(self, algorithm: LevelAlgorithm, full_tokens: float, max_staleness: int, init: torch.Tensor, version: int,
                 clusters: int = 1, down: Optional[Tuple[str, int]] = None) -> None:
        if full_tokens <= 0 or clusters < 1:
            raise ValueError(f"full_tokens={full_tokens}, clusters={clusters}: must be positive")
        self.algorithm, self.full_tokens, self.max_staleness = algorithm, float(full_tokens), max_staleness
        self.clusters = clusters
        self.level = Level("global", algorithm, init.detach().to("cpu", torch.float32), pin=False)
        self.version = version
        self.pending: List[Contribution] = []  # the open batch
        self.history: List[Dict[str, object]] = []  # per version: who contributed, with what weight
        self.down = down
        self.residual = torch.zeros_like(self.params) if down is not None else None  # e of the module doc
        self.updates: Deque[Tuple[int, Quantized]] = deque()  # (version, q_version), oldest first
        self.checksum = checksum(self.params) if down is not None else 0

    @property
    def params(self) -> torch.Tensor:
        return self.level.backup

    def weigh(self, cluster: int, base: int, tokens: float) -> Contribution:
        """``a_i`` for a contribution from ``base`` worth ``tokens`` group-steps, now."""
        s = self.version - base
        return Contribution(cluster, base, s, float(tokens), contribution_weight(tokens, self.full_tokens, s, self.max_staleness))

    def add(self, cluster: int, base: int, tokens: float, delta: Optional[torch.Tensor]) -> Contribution:
        """Weighs a contribution and, if its weight is positive, puts it in the open batch."""
        c = self.weigh(cluster, base, tokens)
        if delta is not None and delta.shape != self.params.shape:
            raise ValueError(f"contribution of cluster {cluster}: {tuple(delta.shape)} elements, the global model has {tuple(self.params.shape)}")
        if delta is not None and c.weight > 0 and not bool(torch.isfinite(delta).all()):
            c.refused = "non-finite values"  # a diverged cluster never reaches the global model
        elif delta is not None and c.weight <= 0:
            c.refused = f"{c.staleness} versions stale (bound {self.max_staleness})" if c.staleness > self.max_staleness else "no tokens"
        if delta is not None and c.weight > 0 and not c.refused:
            c.delta = delta.detach().to("cpu", torch.float32)
            self.pending.append(c)
        else:
            c.weight = 0.0
        return c

    @torch.no_grad()
    def apply(self) -> bool:
        """Closes the open batch: one outer step with ``g`` of the module doc; returns whether
        the version advanced (False for an empty batch)."""
        batch, self.pending = self.pending, []
        if not batch:
            return False
        total = sum(c.weight for c in batch)
        g = torch.zeros_like(self.params)
        for c in batch:
            assert c.delta is not None
            g.add_(c.delta, alpha=c.weight)
        g.div_(max(total, float(self.clusters)))
        share = batch_share(total, self.clusters)
        for c in batch:
            c.applied = True
        prev = self.params.clone() if self.down is not None else None
        self.level.commit(self.level.stage(g, share=share))
        self.version += 1
        if prev is not None:
            self._quantize_step(prev)
        self.history.append({"version": self.version, "clusters": [c.cluster for c in batch],
                             "weights": [round(c.weight, 6) for c in batch], "staleness": [c.staleness for c in batch],
                             "share": round(share, 6)})
        return True

    @torch.no_grad()
    def _quantize_step(self, prev: torch.Tensor) -> None:
        """The step just taken, ``θ − prev``, goes down quantized (module doc): the model
        becomes ``prev + D(q)`` and the error feedback keeps the rest."""
        assert self.down is not None and self.residual is not None
        fmt, block = self.down
        u = self.params.sub(prev).add_(self.residual)
        q = quantize(u, fmt, block)
        d = dequantize(q)
        self.params.copy_(prev)
        apply_update(self.params, d)
        self.residual.copy_(u.sub_(d))
        self.checksum = checksum(self.params)
        self.updates.append((self.version, q))
        limit = self.params.numel() * self.params.element_size()
        while sum(x.nbytes for _, x in self.updates) >= limit:  # a chain never outweighs the model
            self.updates.popleft()

    def chain(self, base: int) -> Optional[List[Quantized]]:
        """The updates from version ``base`` to the current one, in order ([] at the current
        version); None if they are not all kept (or updates do not go down): send the model."""
        if self.down is None or base > self.version:
            return None
        if base == self.version:
            return []
        kept = [q for v, q in self.updates if v > base]
        return kept if len(kept) == self.version - base else None

    @torch.no_grad()
    def adopt(self, params: torch.Tensor, version: int) -> None:
        """A leader's copy of the global model of a higher ``version`` (after a restart):
        becomes the model, and the momentum starts again from zero. The open batch stays,
        each contribution weighed again against the new version (its base is now that much
        staler): one within the staleness bound is merged on top of it, one beyond it is
        refused (its ``refused`` says so). Dropping them lost every push that reached a
        restarted server before the leader holding the newest version did, with all the
        work its cluster did while the server was down (250 group-steps in one chaos run)."""
        self.level.set_backup(params.detach().to("cpu", torch.float32))
        if self.level.momentum is not None:
            self.level.momentum.zero_()
        self.version = version
        kept = []
        for c in self.pending:  # the same objects the waiting pushes read their answers from
            w = self.weigh(c.cluster, c.base, c.tokens)
            c.staleness, c.weight = w.staleness, w.weight
            if c.weight > 0:
                kept.append(c)
            else:
                c.refused = f"{c.staleness} versions stale (bound {self.max_staleness}) after the server took a newer version"
        self.pending = kept
        self.updates.clear()  # no chain reaches across an adoption
        if self.residual is not None:
            self.residual.zero_()
            self.checksum = checksum(self.params)
