"""The sync layer's shared vocabulary: modes, the topology and sync config sections.

``sync.mode`` picks the strategy (``hier``: :mod:`hier_localsgd.sync.hier`; ``flat``
and ``ddp``: :mod:`hier_localsgd.sync.baselines`); :data:`MODES` is the one list of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from hier_localsgd.core.runtime.addresses import parse_address
from hier_localsgd.core.runtime.choices import (ALGORITHMS, DEFAULT_BLOCK, DEFAULT_TOPK, DILOCO_LR, DILOCO_MOMENTUM, FORMATS, MAX_CHUNK,
                                        TOPK2, FormatUnavailable)
from hier_localsgd.core.tensors.fragments import outer_period
from hier_localsgd.errors import fail

NONE = "none"  # sync.outer.compression: the payload as it is
COMPRESSIONS = (NONE, *FORMATS, TOPK2)

MODES = ("hier", "flat", "ddp")


def padded_step_s(compute_s: float, min_step_s: float, speed: float) -> float:
    """How long a local step lasts with emulated compute: at least ``train.min_step_time_s``,
    then divided by the cluster's speed (``topology.cluster_speed``)."""
    return max(compute_s, min_step_s) / speed
FAILED_ROUND = ("rollback", "keep_local")


@dataclass
class TopologyConfig:
    clusters: int = 2
    replicas_per_cluster: int = 2
    ranks_per_replica: int = 1
    # Each cluster's compute speed relative to the fastest (heterogeneous deployments, issue
    # #33): a step of cluster c takes max(its compute, train.min_step_time_s) / speed[c], the
    # rest a sleep. Empty: every cluster at 1.0. Every process applies its own cluster's.
    cluster_speed: List[float] = field(default_factory=list)

    def speed(self, cluster: int) -> float:
        return float(self.cluster_speed[cluster]) if self.cluster_speed else 1.0

    def check(self, mode: str, runs: bool = True) -> None:
        """``runs=False`` (plan, simulate: a model of a deployment) skips what only this
        trainer restricts: several ranks per replica group need ``hier`` here."""
        if self.clusters < 1:
            fail("topology.clusters", f"{self.clusters} — need at least one cluster (empty topology)")
        if self.replicas_per_cluster < 1:
            fail("topology.replicas_per_cluster", f"{self.replicas_per_cluster} — need at least one replica group per cluster (empty topology)")
        if self.ranks_per_replica < 1:
            fail("topology.ranks_per_replica", f"{self.ranks_per_replica} — need at least one rank per replica group")
        if self.cluster_speed and len(self.cluster_speed) != self.clusters:
            fail("topology.cluster_speed", f"{list(self.cluster_speed)} — one speed per cluster (topology.clusters={self.clusters}), or [] for all 1.0")
        for c, v in enumerate(self.cluster_speed):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1:
                fail("topology.cluster_speed", f"{list(self.cluster_speed)} — cluster {c}'s {v!r} must be a number in (0, 1] (relative to the fastest)")
        if mode != "hier" and any(v != 1 for v in self.cluster_speed):
            # flat's and ddp's sync runs inside the optimizer step (the padding would slow it
            # too), and the simulator runs them as one lockstep group
            fail("topology.cluster_speed", f"{list(self.cluster_speed)} — clusters of different speeds need sync.mode=hier (got {mode!r})")
        if runs and self.ranks_per_replica > 1 and mode != "hier":
            fail("topology.ranks_per_replica", f"{self.ranks_per_replica} — several ranks per replica group need sync.mode=hier (got {mode!r})")


@dataclass
class LevelConfig:
    algorithm: str = "diloco"
    every: int = 10  # inner: local steps per round; outer: inner rounds per outer round
    # outer: inner rounds between an outer round's launch and its result's application
    # (overlap.py; 0 = blocking). flat: torchft DiLoCo's fragment_sync_delay (local steps).
    delay: int = 0
    lr: float = DILOCO_LR
    momentum: float = DILOCO_MOMENTUM
    nesterov: bool = True
    # outer only: quantize the pseudo-gradient the leaders reduce (sync/compression.py):
    # none | int8 | fp8, one fp32 scale per block of compression_block elements
    compression: str = NONE
    compression_block: int = DEFAULT_BLOCK
    # outer: streaming fragments (core/tensors/fragments.py): the model split by layer into F
    # contiguous fragments, one synced per outer round every inner.every·every/F steps.
    # flat (DiLoCo): the same split handed to torchft's DiLoCo as its model_fragments, one
    # fragment synced every every/F steps (each parameter every `every` steps)
    fragments: int = 1
    # inner only: ask for a round's quorum during its last local step (sync/early.py)
    early_quorum: bool = False
    # outer only, with delay > 0: eager updates (overlap.py): at the launch every member
    # applies the outer step with its own cluster's pseudo-gradient in place of the global
    # one, and the apply round corrects it to the global step.
    eager: bool = False
    # outer only: the launcher measures the WAN and the step and picks compression, delay
    # and fragments with the planner's model (experiments/auto.py; local jobs: demo, bench)
    auto: bool = False
    # outer, with auto: while the job runs the launcher watches the rate the outer rounds see
    # and re-chooses when it leaves [1/f, f] of the rate the pick was made for (f this factor;
    # the groups restart from their durable checkpoints: experiments/auto_watch.py); 0 = never
    auto_rechoose: float = 2.0
    # A stale update (as in asynchronous Local SGD; docs/architecture.md): work measured
    # from the model it started from and applied to the newest one, instead of weight 0.
    # outer: a cluster whose global model is behind the quorum's by 1..max_staleness outer
    # rounds (its leader was dead or cut off when the others synced) still contributes its
    # work since its last outer commit. inner: a member that healed from a peer (back from
    # a cluster-lighthouse outage or a stop) still contributes its local steps since its
    # last commit if the healed state is at most max_staleness rounds of steps ahead of it.
    # 0: such work carries weight 0 and is lost.
    max_staleness: int = 0
    # compression=topk2 (outer level): elements kept per chunk of compression_block
    # (core/tensors/sparse.py; 4 of 256 keeps 1.6 %).
    topk: int = DEFAULT_TOPK

    def check(self, path: str) -> None:
        if self.algorithm not in ALGORITHMS:
            fail(f"{path}.algorithm", f"unknown algorithm {self.algorithm!r} (expected one of {ALGORITHMS})")
        if self.every < 1:
            fail(f"{path}.every", f"{self.every} — H must be at least 1")
        if self.lr <= 0:
            fail(f"{path}.lr", f"{self.lr} — must be positive")
        if not 0 <= self.momentum < 1:
            fail(f"{path}.momentum", f"{self.momentum} — must be in [0, 1)")
        if path == "sync.inner" and self.delay != 0:
            fail("sync.inner.delay", f"{self.delay} — only the outer level (and flat) can be overlapped")
        elif path == "sync.flat" and self.delay and self.algorithm != "diloco":
            fail("sync.flat.delay", f"{self.delay} — torchft's LocalSGD has no overlap; use sync.flat.algorithm=diloco")
        self._check_fragments(path)
        if self.early_quorum and path != "sync.inner":
            fail(f"{path}.early_quorum", "only the inner level asks for its quorum early (sync.inner.early_quorum)")
        if self.auto and path != "sync.outer":
            fail(f"{path}.auto", "only the outer level's configuration picks itself (sync.outer.auto)")
        if path == "sync.outer" and (isinstance(self.auto_rechoose, bool) or not isinstance(self.auto_rechoose, (int, float))
                                     or not (self.auto_rechoose == 0 or self.auto_rechoose > 1)):
            fail(f"{path}.auto_rechoose", f"{self.auto_rechoose!r} — a factor above 1 (the rate's change that re-chooses), or 0 for never")
        if self.eager and (path != "sync.outer" or (self.delay == 0 and not self.auto)):
            fail(f"{path}.eager", "eager updates need an overlapped outer level (sync.outer.delay > 0, or sync.outer.auto)")
        rounds = self.every // self.fragments  # inner rounds between (fragment) outer rounds
        if not 0 <= self.delay < rounds:
            per = f"{path}.every/{path}.fragments={rounds}" if self.fragments > 1 else f"{path}.every={self.every}"
            fail(f"{path}.delay", f"{self.delay} — must be in [0, {per}): a round's result is applied before the next round starts")
        self._check_compression(path)
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            fail(f"{path}.max_staleness", f"{self.max_staleness!r} — must be an integer of at least 0 (rounds)")
        if self.max_staleness and path == "sync.flat":
            fail(f"{path}.max_staleness", f"{self.max_staleness} — only the hierarchy's levels take stale contributions (sync.inner / sync.outer.max_staleness)")

    def _check_fragments(self, path: str) -> None:
        if isinstance(self.fragments, bool) or not isinstance(self.fragments, int) or self.fragments < 1:
            fail(f"{path}.fragments", f"{self.fragments!r} — must be an integer of at least 1")
        if self.fragments > 1 and path not in ("sync.outer", "sync.flat"):
            fail(f"{path}.fragments", f"{self.fragments} — only the outer level (and flat DiLoCo) streams fragments")
        if self.fragments > 1 and path == "sync.flat" and self.algorithm != "diloco":
            fail(f"{path}.fragments", f"{self.fragments} — torchft streams fragments with DiLoCo only; use sync.flat.algorithm=diloco")
        if self.every % self.fragments:
            fail(f"{path}.fragments", f"{self.fragments} — {path}.every={self.every} must be a multiple of it (one fragment syncs every every/fragments rounds)")

    def _check_compression(self, path: str) -> None:
        if self.compression not in COMPRESSIONS:
            fail(f"{path}.compression", f"unknown compression {self.compression!r} (expected one of {COMPRESSIONS})")
        if self.compression != NONE and path != "sync.outer":
            fail(f"{path}.compression", f"{self.compression!r} — only the outer level's payload (sync.outer.compression) can be compressed")
        if isinstance(self.compression_block, bool) or self.compression_block < 1:
            fail(f"{path}.compression_block", f"{self.compression_block} — must be at least 1 element")
        if self.compression == TOPK2:
            if self.compression_block > MAX_CHUNK:
                fail(f"{path}.compression_block", f"{self.compression_block} — topk2 chunks hold at most {MAX_CHUNK} elements (a position is one byte)")
            if isinstance(self.topk, bool) or not isinstance(self.topk, int) or not 1 <= self.topk <= self.compression_block:
                fail(f"{path}.topk", f"{self.topk!r} — must be an integer between 1 and {path}.compression_block={self.compression_block}")

    def prove_compression(self, path: str) -> None:
        """That an int8 or fp8 payload works with this torch build (fp8: a cast on the CPU
        and back); one line naming the field. Run by the commands that train here (config.py),
        not by a lighthouse, which would import torch for it."""
        if self.compression not in FORMATS:
            return
        from hier_localsgd.core.tensors.compress import check_format

        try:
            check_format(self.compression, self.compression_block)
        except FormatUnavailable as e:
            fail(f"{path}.compression", f"{self.compression!r} — {e}")


@dataclass
class PoisonConfig:
    """The screen of contributions at both levels (core/tensors/guard.py ``screen``; issue #30)."""

    # A contribution whose norm exceeds this multiple of the reference (the median of the
    # other contributors' norms, per round of work at the inner level) is excluded from the
    # round. A contribution that holds a NaN or an infinity is excluded whatever this is;
    # 0 turns the norm check off.
    norm_ratio: float = 25.0
    # A replica group excluded this many times within `window` of its own rounds gives
    # up: one line, exit code 2 (its launcher does not restart it). 0: never.
    max_offences: int = 3
    window: int = 20

    def check(self) -> None:
        if not self.norm_ratio >= 0 or self.norm_ratio in (float("inf"),) or 0 < self.norm_ratio <= 1:
            fail("sync.poison.norm_ratio", f"{self.norm_ratio} — must be 0 (off) or a finite number above 1 (a multiple of the median norm)")
        if isinstance(self.max_offences, bool) or self.max_offences < 0:
            fail("sync.poison.max_offences", f"{self.max_offences} — must be at least 0 (0: never give up)")
        if isinstance(self.window, bool) or self.window < 1:
            fail("sync.poison.window", f"{self.window} — must be at least 1 (rounds)")
        if self.max_offences > self.window:
            fail("sync.poison.max_offences", f"{self.max_offences} — more than sync.poison.window={self.window} rounds can hold")


@dataclass
class AsyncOuterConfig:
    """``sync.async_outer``: the asynchronous outer level (sync/global_model.py,
    global_server.py, async_outer.py). Off: every outer round is synchronous."""

    enabled: bool = False
    # Where the global model server listens (run by the global lighthouse's process).
    addr: str = "http://127.0.0.1:29509"
    # The longest a batch waits for other clusters after its first contribution; it waits
    # only for clusters expected within it (global_server.py). 2 s: above the pushes' skew
    # of equal-speed clusters (under 0.5 s in the runs of docs/benchmarks.md), under one
    # outer period of the demo.
    grace_s: float = 2.0
    # Contributors a batch waits for (within grace_s): 1, a lone cluster never waits.
    min_clusters: int = 1
    # Versions a contribution may be behind and still merge (down-weighted 1/(1+s)); a
    # cluster twice as slow as another is two versions behind at each of its pushes.
    max_staleness: int = 4
    # Dynamic local updates (Liu et al. 2024, arXiv 2401.09135): the fastest cluster pushes
    # every H_inner·H_outer steps; each slower one is told, with each answer, the steps to
    # train so that its next push meets the fastest's next push (global_server.py _push_in),
    # so clusters of different speeds push together, fresh, into one batch. Off: every
    # cluster pushes every H_inner·H_outer steps.
    match_pace: bool = False
    # With sync.outer.compression (int8, fp8, topk2): the global model comes down as the
    # quantized steps since the leader's version (int8; fp8 with fp8), a quarter of the
    # model's bytes each, instead of the model in fp32 (sync/global_model.py). Off: fp32.
    compress_down: bool = True

    def check(self, mode: str, outer: LevelConfig, t: TopologyConfig) -> None:
        if not self.enabled:
            return
        if mode != "hier":
            fail("sync.async_outer.enabled", f"an asynchronous outer level needs sync.mode=hier (got {mode!r})")
        for bad, why in ((outer.delay > 1, f"sync.outer.delay={outer.delay}: a push applied more than one round later"),
                         (outer.eager, "sync.outer.eager: eager updates"),
                         (outer.fragments != 1, f"sync.outer.fragments={outer.fragments}: streaming fragments"),
                         (outer.auto, "sync.outer.auto: a configuration picked for synchronous rounds"),
                         (t.ranks_per_replica != 1, f"topology.ranks_per_replica={t.ranks_per_replica}: groups of several ranks")):
            if bad:
                fail("sync.async_outer.enabled", f"not combined with {why} (not built yet)")
        try:
            parse_address("sync.async_outer.addr", self.addr)
        except ValueError as e:
            fail("sync.async_outer.addr", str(e).split(": ", 1)[1])
        if not self.grace_s >= 0:
            fail("sync.async_outer.grace_s", f"{self.grace_s} — must be at least 0 (seconds)")
        if not 1 <= self.min_clusters <= t.clusters:
            fail("sync.async_outer.min_clusters", f"{self.min_clusters} — must be in [1, topology.clusters={t.clusters}]")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            fail("sync.async_outer.max_staleness", f"{self.max_staleness!r} — must be an integer of at least 0 (versions)")
        if not isinstance(self.match_pace, bool):
            fail("sync.async_outer.match_pace", f"{self.match_pace!r} — must be true or false")
        if not isinstance(self.compress_down, bool):
            fail("sync.async_outer.compress_down", f"{self.compress_down!r} — must be true or false")


@dataclass
class SyncConfig:
    mode: str = "hier"
    inner: LevelConfig = field(default_factory=lambda: LevelConfig(every=10, algorithm="localsgd", early_quorum=True, max_staleness=32))  # as configs/config.yaml
    outer: LevelConfig = field(default_factory=lambda: LevelConfig(every=3, max_staleness=1))
    flat: LevelConfig = field(default_factory=lambda: LevelConfig(every=30))
    min_replicas: int = 1
    min_clusters: int = 2
    max_quorum_failures: int = 3
    max_commit_failures: int = 5
    # A level whose lighthouse does not answer skips its rounds and trains on; past this
    # many seconds of outage the process gives up (hier mode; core/ft/outage.py).
    outage_limit_s: float = 600.0
    # The run's last round skipped for a cluster lighthouse outage: wait this long for the
    # lighthouse and the cluster's quorum, so its groups end on one model (sync/final.py).
    final_wait_s: float = 60.0
    # What a replica group does when an inner round fails while nothing it committed moved
    # (a peer died or stalled, a quorum failed): rollback (restore the last commit,
    # torchft's rule) | keep_local (keep the local steps; the next round's pseudo-gradient
    # carries them). sync/committed.py, docs/architecture.md "Failure semantics".
    failed_round: str = "rollback"
    # Contributions screened for non-finite or outsized values (core/tensors/guard.py).
    poison: PoisonConfig = field(default_factory=PoisonConfig)
    async_outer: AsyncOuterConfig = field(default_factory=AsyncOuterConfig)

    @property
    def outer_period(self) -> int:
        """Local steps between the hierarchy's outer rounds (the whole model; one fragment
        of ``outer.fragments`` every outer_period / fragments)."""
        return outer_period(self.inner.every, self.outer.every)

    def check(self, topology: TopologyConfig) -> None:
        t = topology
        self.poison.check()
        self.async_outer.check(self.mode, self.outer, t)
        if self.mode not in MODES:
            fail("sync.mode", f"unknown mode {self.mode!r} (expected one of {MODES})")
        for name in ("inner", "outer", "flat"):
            getattr(self, name).check(f"sync.{name}")
        if self.mode != "hier" and self.outer.auto:
            fail("sync.outer.auto", f"picks the hierarchy's outer configuration; needs sync.mode=hier (got {self.mode!r})")
        if self.outer.auto and t.clusters < 2:
            fail("sync.outer.auto", f"measures the WAN between clusters; needs topology.clusters >= 2 (got {t.clusters})")
        if self.mode != "hier" and self.outer.compression != NONE:
            fail("sync.outer.compression", f"{self.outer.compression!r} — compresses the hierarchy's outer reduce; needs sync.mode=hier (got {self.mode!r})")
        if not 1 <= self.min_replicas <= t.replicas_per_cluster:
            fail("sync.min_replicas", f"{self.min_replicas} — must be in [1, topology.replicas_per_cluster={t.replicas_per_cluster}]")
        if not 1 <= self.min_clusters <= t.clusters:
            fail("sync.min_clusters", f"{self.min_clusters} — must be in [1, topology.clusters={t.clusters}]")
        if self.max_quorum_failures < 1:
            fail("sync.max_quorum_failures", f"{self.max_quorum_failures} — must be at least 1")
        if self.max_commit_failures < 0:
            fail("sync.max_commit_failures", f"{self.max_commit_failures} — must be at least 0")
        if self.outage_limit_s <= 0:
            fail("sync.outage_limit_s", f"{self.outage_limit_s} — must be positive (seconds)")
        if self.final_wait_s < 0:
            fail("sync.final_wait_s", f"{self.final_wait_s} — must be at least 0 (seconds; 0: no wait)")
        if self.failed_round not in FAILED_ROUND:
            fail("sync.failed_round", f"unknown policy {self.failed_round!r} (expected one of {FAILED_ROUND})")
        if self.failed_round == "keep_local" and (self.mode != "hier" or t.ranks_per_replica != 1):
            fail("sync.failed_round", "keep_local needs sync.mode=hier and topology.ranks_per_replica=1 "
                 f"(got {self.mode!r}, {t.ranks_per_replica}): flat and ddp roll back as torchft does, and a group of several ranks restores its committed slices together")
