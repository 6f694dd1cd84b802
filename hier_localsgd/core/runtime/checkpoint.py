"""Durable checkpoints: periodic, asynchronous, atomic; resume after a full stop.

Healing covers processes that die while others live; a checkpoint covers the whole job
stopping (every process and lighthouse gone). Every ``checkpoint.every`` outer rounds,
right after the round commits (when every replica group holds the same global model),
each replica group writes its own checkpoint: the model, its inner optimizer (AdamW) state,
both levels' committed backups and outer-optimizer momenta, the step and round counters
(the step is also the data position: batches are addressed by step), and the RNG states.
Each group writes its own because each has its own inner optimizer state, which an
exact resume needs; with several ranks per group every rank writes its own too, since
each holds its slice of the levels' state.

Writing never stalls training: the state is snapshotted (cloned) in the training thread
and serialised by a background thread. A checkpoint becomes visible atomically: it is
written to a temporary name, fsynced, then renamed to ``ckpt_<step>.pt`` (a reader never
sees a partial file under a checkpoint's name). Each file carries a checksum of its
tensors; :meth:`Checkpointer.load_latest` skips, with a clear message, any file that does
not load or whose checksum does not match, and falls back to the previous one. The newest
``checkpoint.keep`` checkpoints are kept.

Devices: the snapshot holds host tensors only (sync.snapshot() serves from the host,
core/runtime/device.py) and loading maps every tensor to the CPU (``map_location``); the state is
then copied onto ``train.device``, so a checkpoint written on a GPU resumes on a CPU and
back. The CUDA RNG states travel too (restored when the resuming process has as many GPUs).
Each file records its layout (``ranks_per_replica``: one device per rank); a resume with
another layout is refused with :class:`LayoutMismatch` naming both, since each rank's
file holds its own slice of the levels' state and the slices differ with the rank count.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import numpy as np
import xxhash

from hier_localsgd.errors import fail

if TYPE_CHECKING:  # torch is imported where it is used: the configuration imports this module (core/runtime/choices.py)
    import torch

logger = logging.getLogger(__name__)

FORMAT = 1


@dataclass
class CheckpointConfig:
    dir: str = ""  # "" = <run.dir>/checkpoints
    every: int = 0  # outer rounds between checkpoints; 0 = off
    keep: int = 3
    resume: bool = False  # continue from the newest complete checkpoint

    def check(self, mode: str) -> None:
        if self.every < 0:
            fail("checkpoint.every", f"{self.every} — outer rounds between checkpoints, 0 to turn them off")
        if self.keep < 1:
            fail("checkpoint.keep", f"{self.keep} — keep at least one checkpoint")
        if (self.every or self.resume) and mode != "hier":
            fail("checkpoint.every", f"checkpoints need sync.mode=hier (got {mode!r})")
_NAME = re.compile(r"^ckpt_(\d{9})\.pt$")


def _tensors(obj: Any) -> List[torch.Tensor]:
    import torch

    out: List[torch.Tensor] = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            out.extend(_tensors(obj[k]))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            out.extend(_tensors(v))
    return out


def state_checksum(state: Dict[str, Any]) -> str:
    import torch

    h = xxhash.xxh3_64()
    for t in _tensors(state):
        h.update(memoryview(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()) if t.numel() else b"")
    return h.hexdigest()


def rng_state() -> Dict[str, Any]:
    import torch

    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {}),
    }


def set_rng_state(st: Dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(st["torch"])
    n = st["numpy"]
    np.random.set_state((n[0], n[1].numpy().astype(np.uint32), n[2], n[3], n[4]))
    p = st["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    cuda = st.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


class LayoutMismatch(RuntimeError):
    """A checkpoint written with another number of ranks (devices) per replica group."""


class Checkpointer:
    """The checkpoints of one replica group, under ``<root>/c<C>r<R>/``.

    Args:
        root: the checkpoint directory of the job.
        keep: how many of the newest checkpoints to keep.
        events: where to report writes and skipped files.
    """

    def __init__(self, root: str | Path, cluster: int, replica: int, keep: int, events: Callable[..., None], rank: int = 0,
                 layout: Optional[Dict[str, Any]] = None) -> None:
        """``layout``: written into every checkpoint and required of one to resume from
        (``ranks_per_replica``; ``device``, informative)."""
        self.layout = dict(layout or {})
        # every rank of a multi-rank group writes its own (its slice of the levels' state)
        self.dir = Path(root) / f"c{cluster}r{replica}" / (f"rank{rank}" if rank else "")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.events = events
        self._writer: Optional[threading.Thread] = None
        self.errors: List[str] = []

    # -- writing -----------------------------------------------------------------
    def save_async(self, step: int, state: Dict[str, Any]) -> None:
        """Writes ``state`` (already a snapshot: the caller cloned it) in the background."""
        self.wait()  # one write at a time; outer rounds are far apart
        payload = {"format": FORMAT, "step": step, "state": state, "checksum": state_checksum(state), "layout": self.layout}
        self._writer = threading.Thread(target=self._write, args=(step, payload), name="checkpoint-writer", daemon=True)
        self._writer.start()

    def wait(self, timeout_s: float = 600.0) -> None:
        if self._writer is not None:
            self._writer.join(timeout_s)
            self._writer = None

    def _write(self, step: int, payload: Dict[str, Any]) -> None:
        import torch

        final = self.dir / f"ckpt_{step:09d}.pt"
        tmp = self.dir / f".ckpt_{step:09d}.pt.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            self.events("checkpoint", step=step, path=str(final), bytes=final.stat().st_size)
            logger.info("checkpoint written: %s", final)
            self._prune()
        except Exception as e:  # a failed write must not take training down
            self.errors.append(str(e))
            logger.exception("checkpoint at step %d failed", step)
            tmp.unlink(missing_ok=True)

    def _prune(self) -> None:
        for old in self.list()[self.keep :]:
            old.unlink(missing_ok=True)

    # -- reading -------------------------------------------------------------------
    def list(self) -> List[Path]:
        """Checkpoint files, newest first (temporary files are never listed)."""
        return sorted((p for p in self.dir.iterdir() if _NAME.match(p.name)), reverse=True)

    def load_latest(self) -> Optional[Dict[str, Any]]:
        """The newest checkpoint that loads and verifies, or None. Skips bad ones loudly."""
        import torch

        for path in self.list():
            try:
                payload = torch.load(path, map_location="cpu", weights_only=True)
                if not isinstance(payload, dict) or payload.get("format") != FORMAT:
                    raise ValueError(f"not a checkpoint of format {FORMAT}")
                if state_checksum(payload["state"]) != payload["checksum"]:
                    raise ValueError("checksum mismatch (corrupt file)")
            except Exception as e:  # partial, corrupt, foreign: try the previous one
                msg = f"skipping checkpoint {path}: {e.__class__.__name__}: {e}"
                logger.warning(msg)
                self.events("checkpoint_skipped", path=str(path), reason=str(e)[:300])
                continue
            self._check_layout(path, payload.get("layout") or {})
            logger.info("resuming from checkpoint %s (step %d)", path, payload["step"])
            self.events("resume", path=str(path), step=payload["step"])
            return payload
        return None

    def _check_layout(self, path: Path, saved: Dict[str, Any]) -> None:
        """Refuses a checkpoint of another ranks-per-replica layout (one line, both values)."""
        want, got = self.layout.get("ranks_per_replica"), saved.get("ranks_per_replica")
        if want is not None and got is not None and want != got:
            raise LayoutMismatch(
                f"checkpoint {path} was written with topology.ranks_per_replica={got} (one device per rank) but this "
                f"job has {want}: each rank's file holds its slice of the levels' state, so resume with "
                f"ranks_per_replica={got} or start fresh (checkpoint.resume=false)")
        if saved.get("device") and self.layout.get("device") and saved["device"] != self.layout["device"]:
            logger.info("checkpoint %s was written on %s; loading it onto %s", path, saved["device"], self.layout["device"])
