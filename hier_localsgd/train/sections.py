"""The ``train``, ``model`` and ``data`` config sections and their checks.

Apart from trainer.py, model.py and data.py so that composing the configuration (every
command, a lighthouse and ``plan`` included) imports neither torch nor torchft.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

from hier_localsgd.core.runtime.choices import PARAM_DTYPES, PRECISIONS, SHARDINGS, check_device_name, resolve_backend
from hier_localsgd.core.links.lossy import LinkConfig, LinkSpec
from hier_localsgd.errors import ConfigError, fail
from hier_localsgd.sync.sections import SyncConfig


@dataclass
class BackendsConfig:
    """Process-group backend per level (core/runtime/device.py): ``auto`` = NCCL inside a replica
    group and at the inner level on CUDA, Gloo on CPU; the outer (WAN) level Gloo over
    pinned host buffers. ``nccl`` at the inner/outer level is torchft's
    ProcessGroupBabyNCCL (survives an abort: NCCL runs in a subprocess), ``nccl_inproc``
    its in-process ProcessGroupNCCL."""

    group: str = "auto"  # auto | gloo | nccl   (torch.distributed inside a replica group)
    inner: str = "auto"  # auto | gloo | nccl | nccl_inproc
    outer: str = "auto"  # auto | gloo | nccl | nccl_inproc


@dataclass
class TrainConfig:
    steps: int = 300
    batch_size: int = 4
    seq_len: int = 64
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    eval_batches: int = 8
    eval_every: int = 0
    eval_offset: int = 0  # evaluate at steps offset + k*eval_every (bench: an overlapped arm's merge steps)
    eval_global: bool = False  # hier: at each of those evals, also evaluate the last global model (api.py global_model)
    log_every: int = 10
    threads: int = 1
    seed: int = 0
    min_step_time_s: float = 0.0  # pad each local step to this duration (emulates a bigger model)
    device: str = "auto"  # auto | cpu | cuda (auto: cuda when available)
    backends: BackendsConfig = field(default_factory=BackendsConfig)
    precision: str = "fp32"  # fp32 | bf16 (autocast of forward and backward)
    param_dtype: str = "fp32"  # the master weights (and the levels' backups): fp32 | bf16
    compile: bool = False  # torch.compile the model
    gpu_slot: int = -1  # this replica group's index among the groups on its host: rank k takes GPU slot*G+k (-1: GPU k)
    share_gpus: bool = False  # a host with fewer GPUs than its processes: share them round robin instead of refusing

    def check_device(self, trains: bool) -> None:
        """``train.device``, ``train.backends.*``, ``train.precision``, ``train.param_dtype``;
        one line naming the field. ``trains``: this command trains here, so ``cuda`` (also
        what ``auto`` and an NCCL backend need) must be available."""
        if self.precision not in PRECISIONS:
            fail("train.precision", f"{self.precision!r} — expected one of {PRECISIONS}")
        if self.param_dtype not in PARAM_DTYPES:
            fail("train.param_dtype", f"{self.param_dtype!r} — expected one of {PARAM_DTYPES}")
        if self.gpu_slot < -1:
            fail("train.gpu_slot", f"{self.gpu_slot} — expected -1 (unset) or a group's index on its host (0, 1, ...)")
        try:  # the resolvers' messages start with the field
            check_device_name(self.device)
            if trains:
                from hier_localsgd.core.runtime.device import resolve_device  # torch: only where it trains

                device = resolve_device(self.device).type
            else:  # a command that does not train here (plan, lighthouse) may name cuda, or auto, for elsewhere
                device = "cpu" if self.device == "cpu" else "cuda"
            for level in ("group", "inner", "outer"):
                resolve_backend(level, getattr(self.backends, level), device)
        except ValueError as e:
            raise ConfigError(str(e)) from e

    def check(self, sync: SyncConfig, runs: bool = True) -> None:
        """``runs=False`` (plan, simulate: a model of a deployment) skips the rule that a flat
        run ends on a sync (``steps`` a multiple of sync.flat.every), which only a real run needs."""
        for name in ("steps", "batch_size", "eval_batches", "log_every", "threads"):
            if getattr(self, name) < 1:
                fail(f"train.{name}", f"{getattr(self, name)} — must be at least 1")
        if self.seq_len < 2:
            fail("train.seq_len", f"{self.seq_len} — must be at least 2")
        if self.lr <= 0:
            fail("train.lr", f"{self.lr} — must be positive")
        if self.eval_every < 0:
            fail("train.eval_every", f"{self.eval_every} — must be 0 (start and end only) or positive")
        if self.eval_offset < 0 or (self.eval_every and self.eval_offset >= self.eval_every):
            fail("train.eval_offset", f"{self.eval_offset} — must be in [0, train.eval_every)")
        s = sync
        if self.eval_global and s.mode != "hier":
            fail("train.eval_global", f"needs sync.mode=hier (sync.mode={s.mode} holds no global model apart from the live one)")
        if not runs:
            return
        # hier: any number; the last step ends a round that carries the outer level (a final
        # partial round, sync/hier.py is_sync_step). flat: torchft's DiLoCo syncs on its own
        # schedule, every sync.flat.every steps, so the run ends on a sync only at a multiple.
        if s.mode == "flat" and self.steps % s.flat.every:
            fail("train.steps", f"{self.steps} must be a multiple of sync.flat.every={s.flat.every} so the run ends on a sync "
                 "(torchft's DiLoCo syncs every sync.flat.every steps; sync.mode=hier takes any number)")


VARIANTS = ("megatron", "naive")  # group.tp_variant (train/tp.py)
PARALLEL = ("dp", "tp")  # group.parallel

TP_OPS = ("attn_fwd", "attn_bwd", "mlp_fwd", "mlp_bwd")  # the TP collectives with a link each (train/tp.py)


@dataclass
class TPLinksConfig:
    """group.parallel=tp: the emulated link of each TP operation (train/tp.py), as links.<level>."""

    attn_fwd: LinkConfig = field(default_factory=LinkConfig)
    attn_bwd: LinkConfig = field(default_factory=LinkConfig)
    mlp_fwd: LinkConfig = field(default_factory=LinkConfig)
    mlp_bwd: LinkConfig = field(default_factory=LinkConfig)

    def specs(self) -> Dict[str, LinkSpec]:
        """The validated link spec of each TP operation."""
        return {op: getattr(self, op).spec(f"group.tp_links.{op}") for op in TP_OPS}


@dataclass
class GroupConfig:
    """Inside a replica group of topology.ranks_per_replica ranks."""

    parallel: str = "dp"  # dp: every rank a whole replica on its own data | tp: the model split over the ranks (train/tp.py)
    tp_variant: str = "megatron"  # megatron | naive
    tp_links: TPLinksConfig = field(default_factory=TPLinksConfig)
    sharding: str = "ddp"  # parallel=dp with several ranks: ddp (whole replica per rank) | fsdp (FSDP2 shards, core/tensors/fsdp.py)

    def rank_shards(self, ranks_per_replica: int) -> bool:
        """Whether each rank of a group holds its own shard of the model (tp, or fsdp with
        several ranks): it syncs all of it with rank k of the other groups, and final
        checksums agree per rank, not across a group's ranks."""
        return self.parallel == "tp" or (ranks_per_replica > 1 and self.sharding == "fsdp")

    def check(self, ranks_per_replica: int, model_name: str, command: str, mode: str = "hier") -> None:
        """Checks ``group.*`` (and the TP links) against the topology and model; one line naming the field."""
        if self.sharding not in SHARDINGS:
            fail("group.sharding", f"{self.sharding!r} — expected one of {SHARDINGS}")
        if self.sharding == "fsdp":
            if self.parallel != "dp":
                fail("group.sharding", "fsdp shards a data-parallel group (group.parallel=dp)")
            if mode != "hier":
                fail("group.sharding", f"fsdp needs sync.mode=hier (got {mode!r}: the baselines sync whole replicas)")

        if self.parallel not in PARALLEL:
            fail("group.parallel", f"{self.parallel!r} — expected one of {PARALLEL}")
        if self.tp_variant not in VARIANTS:
            fail("group.tp_variant", f"{self.tp_variant!r} — expected one of {VARIANTS}")
        try:
            specs = self.tp_links.specs()
        except ValueError as e:  # the message starts with the field's path
            raise ConfigError(str(e)) from e
        for op, spec in specs.items():
            if self.tp_variant == "naive" and op.endswith("_fwd") and spec.fill == "rescale":
                fail(f"group.tp_links.{op}.fill", "rescale applies to all-reduces only; tp_variant=naive all-gathers in the forward (use zero or stale)")
        if self.parallel == "tp":
            if command == "train" and ranks_per_replica < 2:
                fail("group.parallel", f"tp needs topology.ranks_per_replica >= 2 (got {ranks_per_replica})")
            if not model_name.startswith("llama3_"):
                fail("group.parallel", f"tp shards a llama3_<flavor> model (model.name={model_name!r})")


# -- model (train/model.py builds it) ----------------------------------------------------
TINY = "tiny"
LLAMA3_PREFIX = "llama3_"


@dataclass
class ModelConfig:
    name: str = "llama3_debugmodel"
    dim: int = 64

    def check(self) -> None:
        if self.name != TINY and not self.name.startswith(LLAMA3_PREFIX):
            fail("model.name", f"unknown model {self.name!r} (expected 'tiny' or 'llama3_<flavor>', e.g. llama3_debugmodel)")
        if self.dim < 1:
            fail("model.dim", f"{self.dim} — must be positive")


# -- data (train/data.py) -----------------------------------------------------------------
DATA_KINDS = ("markov", "text", "parquet")
TOKENIZERS = ("bytes", "bpe")


@dataclass
class DataConfig:
    kind: str = "markov"
    states: int = 128
    branching: int = 4
    concentration: float = 0.5
    seed: int = 1234
    stream: int = 0  # markov: another order of training samples from the same chain (eval set unchanged)
    path: str = ""
    text_column: str = "text"
    eval_fraction: float = 0.05
    # text/parquet: bytes (UTF-8 bytes, vocabulary 256) | bpe (a byte-level BPE that the
    # `tokenizers` library trains on the file at start-up, bpe_vocab tokens; deterministic,
    # so every replica group gets the same vocabulary)
    tokenizer: str = "bytes"
    bpe_vocab: int = 512

    def check(self, seq_len: int, num_shards: int, read_input: bool) -> None:
        """``read_input``: also vet a text or parquet file itself (:func:`check_input`)."""
        if self.kind not in DATA_KINDS:
            fail("data.kind", f"unknown data kind {self.kind!r} (expected one of {DATA_KINDS})")
        if self.tokenizer not in TOKENIZERS:
            fail("data.tokenizer", f"unknown tokenizer {self.tokenizer!r} (expected one of {TOKENIZERS})")
        if self.tokenizer == "bpe" and self.kind == "markov":
            fail("data.tokenizer", "bpe tokenizes a text or parquet file (data.kind=text|parquet); the markov corpus is tokens already")
        if isinstance(self.bpe_vocab, bool) or not 257 <= self.bpe_vocab <= 65536:
            fail("data.bpe_vocab", f"{self.bpe_vocab} — must be in [257, 65536] (256 byte tokens plus merges)")
        if self.kind == "markov":
            if self.states < 2:
                fail("data.states", f"{self.states} — need at least 2")
            if not 1 <= self.branching <= self.states:
                fail("data.branching", f"{self.branching} — must be in [1, data.states={self.states}]")
            if self.concentration <= 0:
                fail("data.concentration", f"{self.concentration} — must be positive")
            return
        if self.stream:
            fail("data.stream", f"{self.stream} — only the markov corpus has sample streams")
        if not 0 < self.eval_fraction < 1:
            fail("data.eval_fraction", f"{self.eval_fraction} — must be in (0, 1)")
        if read_input:
            from hier_localsgd.train.data import check_input  # numpy, torch: only where a file is vetted

            try:
                check_input(self, seq_len, num_shards)
            except ValueError as e:
                raise ConfigError(str(e)) from e
