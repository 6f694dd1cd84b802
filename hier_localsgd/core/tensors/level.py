"""One level of the hierarchy: its committed backup, its outer optimizer, its algorithm.

Both algorithms are "outer SGD on a pseudo-gradient" over the level's backup:

* the pseudo-gradient of a member is ``backup - live`` (how far its local work
  moved it since the level last committed);
* members all-reduce the weighted average of their pseudo-gradients;
* ``diloco`` steps an SGD with Nesterov momentum (default lr 0.7, momentum 0.9,
  as in the DiLoCo paper); ``localsgd`` steps plain SGD with lr 1, which is
  exactly the parameter average: ``backup - mean(backup - live) = mean(live)``.

Every level owns its backup tensor and its momentum buffer (invariant I2: they are
never the model's parameters and never another level's tensors).

Placement (core/runtime/device.py): the backup and the momentum live in host memory, pinned
when the model is on CUDA, whatever device the model is on; they cost no device memory.
:meth:`Level.pseudo_grad` computes ``backup - live`` on ``live``'s device (the
collective's tensor), :meth:`Level.stage` the update on the host.

Updates are *staged*: :meth:`Level.stage` computes the new backup and momentum
into fresh tensors without touching the committed ones, and :meth:`Level.commit`
adopts them only after the level's commit vote succeeds. A failed round therefore
leaves the committed state untouched; rolling back is just ``model <- backup``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from hier_localsgd.core.runtime.choices import ALGORITHMS, DILOCO_LR, DILOCO_MOMENTUM
from hier_localsgd.core.runtime.device import host_copy, wants_pinned
from hier_localsgd.core.tensors.flat_params import checksum_int
from hier_localsgd.core.tensors.fragments import Ranges, gather, scatter_


@dataclass(frozen=True)
class LevelAlgorithm:
    """Configuration of one level's outer update."""

    name: str = "diloco"
    lr: float = DILOCO_LR
    momentum: float = DILOCO_MOMENTUM
    nesterov: bool = True

    @classmethod
    def build(cls, name: str, lr: float = DILOCO_LR, momentum: float = DILOCO_MOMENTUM, nesterov: bool = True) -> "LevelAlgorithm":
        if name not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {name!r} (expected one of {ALGORITHMS})")
        if name == "localsgd":
            # Parameter averaging is outer SGD with lr 1 and no momentum.
            return cls(name=name, lr=1.0, momentum=0.0, nesterov=False)
        return cls(name=name, lr=lr, momentum=momentum, nesterov=nesterov)


class OuterSGD:
    """SGD with optional (Nesterov) momentum over one flat tensor, with staged steps.

    Matches ``torch.optim.SGD(lr, momentum, nesterov, dampening=0)`` step for step
    (tests/test_level.py checks it); the momentum buffer starts at zero, which gives
    the same first step as torch's lazily created buffer when dampening is 0.
    """

    def __init__(self, numel: int, lr: float, momentum: float, nesterov: bool, dtype: torch.dtype, pin: bool = False) -> None:
        if lr <= 0:
            raise ValueError(f"lr={lr}: must be positive")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum={momentum}: must be in [0, 1)")
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.buf: Optional[torch.Tensor] = torch.zeros(numel, dtype=dtype, pin_memory=pin) if momentum > 0 else None

    @torch.no_grad()
    def stage(
        self, param: torch.Tensor, grad: torch.Tensor, buf: Optional[torch.Tensor] = None, share: float = 1.0,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns (new_param, new_buf) without modifying ``param`` or the buffer.
        ``buf``: the momentum of ``param``'s elements when ``param`` is a part of the
        vector (default: the whole buffer).

        ``share`` (0, 1]: the step stands for that fraction of a round (an asynchronous
        batch holding part of a round's tokens, sync/global_model.py; ``grad`` is already
        scaled to it). The momentum then decays by ``μ^w`` and moves the model by ``w`` of
        its usual part, ``w = share``::

            m ← μ^w m + g;   θ ← θ − lr (g + w μ m)   (Nesterov; heavy ball: g + w μ^w m_old)

        so ``k`` steps of ``1/k`` of a round move the model about as one whole step does
        (both keep ``Σ``-momentum ``g/(1−μ)`` at a constant ``g``, to within ``−ln μ`` against
        ``1−μ``), and a step on a sliver of a round moves it by a sliver, momentum included.
        ``share = 1`` is torch's SGD exactly."""
        if not 0 < share <= 1:
            raise ValueError(f"share={share}: must be in (0, 1]")
        if self.buf is None:
            return param - self.lr * grad, None
        old = self.buf if buf is None else buf
        decay = self.momentum ** share  # share 1: μ, and every product below torch's own (same bits)
        buf = old * decay + grad
        update = grad + (share * self.momentum) * buf if self.nesterov else grad + (share * decay) * old
        return param - self.lr * update, buf

    def state_tensors(self) -> List[torch.Tensor]:
        return [] if self.buf is None else [self.buf]


@dataclass
class Staged:
    """A level's tentative new state (not yet committed)."""

    backup: torch.Tensor
    buf: Optional[torch.Tensor]


class Level:
    """The committed state of one level for one replica group.

    Args:
        name: "inner" or "outer".
        algorithm: the level's outer update.
        init: the initial model vector (copied to the host; the level owns its backup).
        pin: pin the host state (default: when ``init`` is on CUDA or pinned; a no-op
            without CUDA).
    """

    def __init__(self, name: str, algorithm: LevelAlgorithm, init: torch.Tensor, pin: Optional[bool] = None) -> None:
        self.name = name
        self.algorithm = algorithm
        pin = wants_pinned(init) if pin is None else pin
        self.backup = host_copy(init, pin=pin)
        self.opt = OuterSGD(init.numel(), algorithm.lr, algorithm.momentum, algorithm.nesterov, init.dtype, pin=pin and self.backup.is_pinned())
        # The median norm of the contributions the level's last committed round used: the
        # poison screen's reference when a round has one contributor (guard.screen).
        self.norm_ref = 0.0

    @torch.no_grad()
    def pseudo_grad(self, live: torch.Tensor, ranges: Optional[Ranges] = None, base: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``backup - live`` on ``live``'s device: a fresh tensor (safe to all-reduce in place).
        From pinned host memory the backup's copy to the device is non-blocking.
        ``ranges``: only those elements, gathered (an outer fragment, core/tensors/fragments.py).
        ``base``: measured from it instead of the backup (an older model of the same shape)."""
        backup = self.backup if base is None else base
        if ranges is not None:
            backup, live = gather(backup, ranges), gather(live, ranges)
        if live.device != backup.device:
            backup = backup.to(live.device, non_blocking=backup.is_pinned())
        return backup - live

    @torch.no_grad()
    def sum_of_squares(self, live: torch.Tensor, base: Optional[torch.Tensor] = None) -> float:
        """Of the whole pseudo-gradient ``backup - live`` (or from ``base``), in float64 on the
        host: NaN or inf when it holds one or overflows (the poison screen, guard.py)."""
        g = self.pseudo_grad(live, base=base)
        return float(torch.linalg.vector_norm(g, dtype=torch.float32).double() ** 2)

    def stage(self, avg_grad: torch.Tensor, ranges: Optional[Ranges] = None, share: float = 1.0) -> Staged:
        """The staged update, computed on the host from ``avg_grad`` (any device).
        ``ranges``: ``avg_grad`` covers only those elements; the rest of the backup and of
        the momentum stays as committed (a fragment's outer round). ``share``: the step
        stands for that fraction of a round (:meth:`OuterSGD.stage`; whole vectors only)."""
        grad = avg_grad.to(self.backup.device)
        if ranges is None:
            backup, buf = self.opt.stage(self.backup, grad, share=share)
            return Staged(backup=backup, buf=buf)
        part_buf = None if self.opt.buf is None else gather(self.opt.buf, ranges)
        part, new_buf = self.opt.stage(gather(self.backup, ranges), grad, part_buf)
        staged = self.unchanged()
        scatter_(staged.backup, ranges, part)
        if staged.buf is not None and new_buf is not None:
            scatter_(staged.buf, ranges, new_buf)
        return staged

    def unchanged(self) -> Staged:
        """A staged state equal to the committed one (a round with nothing to apply)."""
        return Staged(backup=self.backup.clone(), buf=None if self.opt.buf is None else self.opt.buf.clone())

    @torch.no_grad()
    def commit(self, staged: Staged) -> None:
        self.backup.copy_(staged.backup)
        if self.opt.buf is not None and staged.buf is not None:
            self.opt.buf.copy_(staged.buf)

    @torch.no_grad()
    def set_backup(self, value: torch.Tensor) -> None:
        self.backup.copy_(value)

    @property
    def momentum(self) -> Optional[torch.Tensor]:
        """The committed momentum buffer (None without momentum)."""
        return self.opt.buf

    @torch.no_grad()
    def set_momentum(self, value: torch.Tensor) -> None:
        if self.opt.buf is not None:
            self.opt.buf.copy_(value)

    # -- replication ---------------------------------------------------------
    def state_tensors(self) -> List[torch.Tensor]:
        """The committed tensors, in a fixed order (resync broadcasts pack these)."""
        return [self.backup] + self.opt.state_tensors()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Clones of the committed state: a donor serves only committed state."""
        out = {"backup": self.backup.clone(), "norm_ref": torch.tensor(self.norm_ref, dtype=torch.float64)}
        if self.opt.buf is not None:
            out["momentum"] = self.opt.buf.clone()
        return out

    @torch.no_grad()
    def load_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        self.backup.copy_(sd["backup"])
        if self.opt.buf is not None:
            self.opt.buf.copy_(sd["momentum"])
        if "norm_ref" in sd:  # checkpoints written before the poison screen have none
            self.norm_ref = float(sd["norm_ref"])

    def fingerprint(self) -> int:
        return checksum_int(*self.state_tensors())
