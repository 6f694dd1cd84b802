"""The ``train`` config section and its check.

Apart from trainer.py so that composing the configuration (every command, ``plan``
included) does not import torchft through the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from hier_localsgd.schema import fail
from hier_localsgd.sync.types import SyncConfig


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
    log_every: int = 10
    threads: int = 1
    seed: int = 0
    min_step_time_s: float = 0.0  # pad each local step to this duration (emulates a bigger model)

    def check(self, sync: SyncConfig) -> None:
        for name in ("steps", "batch_size", "eval_batches", "log_every", "threads"):
            if getattr(self, name) < 1:
                fail(f"train.{name}", f"{getattr(self, name)} — must be at least 1")
        if self.seq_len < 2:
            fail("train.seq_len", f"{self.seq_len} — must be at least 2")
        if self.lr <= 0:
            fail("train.lr", f"{self.lr} — must be positive")
        if self.eval_every < 0:
            fail("train.eval_every", f"{self.eval_every} — must be 0 (start and end only) or positive")
        s = sync
        if s.mode == "hier":
            period = s.inner.every * s.outer.every
            if self.steps % period:
                fail("train.steps", f"{self.steps} must be a multiple of sync.inner.every*sync.outer.every={period} so the run ends on an outer sync")
        elif s.mode == "flat" and self.steps % s.flat.every:
            fail("train.steps", f"{self.steps} must be a multiple of sync.flat.every={s.flat.every} so the run ends on a sync")
