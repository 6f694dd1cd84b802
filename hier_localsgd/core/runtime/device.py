"""Where tensors live and which backend each level's process group uses.

One home for the device concepts the issue (#15) names:

* ``train.device`` (``auto | cpu | cuda``; ``auto`` = cuda when available): the model,
  the inner optimizer and the live parameters live there, and the data pipeline feeds
  tensors there (:func:`resolve_device`).
* Per-level backends (``train.backends.{group,inner,outer}``, ``core/runtime/choices.py`` ``resolve_backend``):
  ``group`` (torch.distributed inside a replica group of several ranks: DDP/FSDP) and
  ``inner`` default to NCCL on CUDA and Gloo on CPU; ``outer`` (the slow WAN level)
  defaults to Gloo over pinned host buffers, NCCL selectable. For the fault-tolerant
  levels ``nccl`` is torchft's ``ProcessGroupBabyNCCL`` (NCCL in a subprocess: an abort
  or a hang kills the subprocess, never this process; ~1 GB more device memory for the
  subprocess's CUDA context) and ``nccl_inproc`` torchft's ``ProcessGroupNCCL``
  (in-process, non-blocking communicators aborted with ``ncclCommAbort`` on NCCL >= 2.25;
  its own docstring warns of deadlocks in NCCL's error handling).
* Host state (:func:`host_copy`, :func:`host_state`): level backups, the rollback
  snapshots, the outer momenta and the optimizer snapshot stay in host memory, pinned
  when the model is on CUDA (as torchft DiLoCo's ``backup_device``), so they cost no
  device memory. On CPU "pinned" is a no-op: a plain CPU tensor (pinning needs a CUDA
  build and would only cost page-locked memory).

A Gloo group can be handed device tensors: :class:`hier_localsgd.core.links.link.LinkProcessGroup`
copies them to pinned host buffers and back (:func:`comm_device`), and an NCCL group
handed host tensors stages them on the device the same way.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from hier_localsgd.core.runtime.choices import NCCL_BACKENDS, check_device_name

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cuda_available() -> bool:
    return torch.cuda.is_available()


def gpu_count() -> int:
    """The GPUs this process sees (0 without CUDA): the one place the count is read."""
    return torch.cuda.device_count() if cuda_available() else 0


def group_gpus(slot: int, ranks: int, gpus: int, share: bool = False) -> List[int]:
    """The GPUs of the replica group at ``slot`` on its host (its host's groups numbered 0,
    1, ...): rank ``k`` takes GPU ``slot·ranks + k``, every process a GPU of its own. With
    ``share``, GPUs are reused round robin when the host has fewer than its processes need
    (processes sharing a GPU cannot form an NCCL communicator with each other).

    Raises:
        ValueError: naming ``train.gpu_slot`` when the host has fewer GPUs than the slot's
            ranks need and ``share`` is off.
    """
    need = (slot + 1) * ranks
    if gpus < 1:
        raise ValueError("train.device: cuda needs a GPU; this host has none")
    if need > gpus and not share:
        raise ValueError(f"train.gpu_slot: {slot} — group slot {slot} of {ranks} rank(s) needs GPUs {slot * ranks}..{need - 1}, "
                         f"this host has {gpus}; run fewer groups on it, or set train.share_gpus=true")
    return [(slot * ranks + k) % gpus for k in range(ranks)]


def resolve_device(name: str, local_rank: int = 0, slot: int = -1, ranks: int = 1, share: bool = False) -> torch.device:
    """``auto`` -> ``cuda`` when available, else ``cpu``. On CUDA, rank ``k`` of the group at
    ``slot`` on its host takes :func:`group_gpus`'s ``k``-th GPU; without a slot (-1), GPU
    ``k mod count``.

    Raises:
        ValueError: naming ``train.device`` for an unknown value or cuda without CUDA, or
            ``train.gpu_slot`` (:func:`group_gpus`).
    """
    check_device_name(name)
    if name == "cpu" or (name == "auto" and not cuda_available()):
        return torch.device("cpu")
    if not cuda_available():
        raise ValueError(f"train.device: cuda requested but torch.cuda.is_available() is False (torch {torch.__version__}); use cpu or auto")
    if slot >= 0:
        return torch.device("cuda", group_gpus(slot, ranks, gpu_count(), share)[local_rank % ranks])
    return torch.device("cuda", local_rank % gpu_count())


def one_host_backends(device: str, backends: Dict[str, str], ranks_per_replica: int, groups: int = 0) -> Dict[str, str]:
    """Backends for ``auto`` levels when ``groups`` replica groups of a job run on this host
    (the local launcher; 0: as many as share GPUs). Each process takes a GPU of its own
    (:func:`group_gpus`) while there are enough; where there are not, processes share GPUs,
    and processes sharing a GPU cannot form an NCCL communicator: the inner and outer levels
    then use Gloo (device tensors staged through pinned host buffers), and the group level
    too when a group has more ranks than GPUs. Levels set explicitly are kept."""
    if resolve_device(device).type != "cuda":
        return {}
    gpus = gpu_count()
    out = {}
    if not groups or groups * ranks_per_replica > gpus:
        out = {lv: "gloo" for lv in ("inner", "outer") if backends.get(lv) == "auto"}
    if backends.get("group") == "auto" and ranks_per_replica > gpus:
        out["group"] = "gloo"
    return out


def comm_device(backend: str) -> torch.device:
    """Where a backend's collectives want their tensors: NCCL on the current CUDA device,
    Gloo on the host (Gloo handed device tensors: staged through pinned host buffers)."""
    if backend in NCCL_BACKENDS:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def carry_device() -> Callable[[], None]:
    """Captures this thread's current CUDA device; the returned function makes it current in
    another thread (CUDA's current device is per thread: a new thread starts on GPU 0, and
    torchft's quorum hands the current device to its NCCL subprocess). No-op without CUDA."""
    if not (cuda_available() and torch.cuda.is_initialized()):
        return lambda: None
    dev = torch.cuda.current_device()
    return lambda: torch.cuda.set_device(dev)


def settle(tensors: List[torch.Tensor]) -> None:
    """Waits until the device work on ``tensors`` is done (nothing to wait for on the host).
    torchft's baby NCCL ``wait()`` only orders the current stream after the collective: a
    timer read after it measures when the work was queued, not the transfer."""
    for dev in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(dev)


def wants_pinned(t: torch.Tensor) -> bool:
    """Host copies of ``t`` are pinned when ``t`` is on CUDA or already pinned (CPU-only
    builds: never; pinning there is a no-op this project skips)."""
    return cuda_available() and (t.is_cuda or (t.device.type == "cpu" and t.is_pinned()))


def host_copy(t: torch.Tensor, pin: Optional[bool] = None) -> torch.Tensor:
    """A host copy of ``t`` (pinned if ``pin``, by default :func:`wants_pinned`).

    The device-to-host copy is synchronous: the copy is complete on return, so the
    caller may read or send it at once."""
    pin = wants_pinned(t) if pin is None else (pin and cuda_available())
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    out.copy_(t.detach())
    return out


def host_state(obj: Any, pin: bool = False) -> Any:
    """A deep copy of a (nested) state dict with every tensor on the host (an
    optimizer's state for a rollback snapshot, a heal or a checkpoint). Non-tensor
    leaves are copied by :func:`copy.deepcopy`. DTensors (``group.sharding=fsdp``) are
    cloned where they are: on CUDA that snapshot (1/G of the optimizer state) stays on
    the device — a known gap."""
    import copy

    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "device_mesh"):  # a DTensor (FSDP2's optimizer state): a clone in place;
            return obj.detach().clone()  # from_local would move a host copy back to the mesh's device
        return host_copy(obj, pin=pin)
    if isinstance(obj, dict):
        return {k: host_state(v, pin) for k, v in obj.items()}
    if isinstance(obj, list):
        return [host_state(v, pin) for v in obj]
    if isinstance(obj, tuple):
        return tuple(host_state(v, pin) for v in obj)
    return copy.deepcopy(obj)


def host_state_finite(obj: Any) -> bool:
    """Whether every floating-point tensor of a (nested) state dict is finite (an
    optimizer snapshot before it is restored: the poison screen, sync/hier.py)."""
    if isinstance(obj, torch.Tensor):
        t = obj.to_local() if hasattr(obj, "to_local") else obj
        return not t.is_floating_point() or bool(torch.isfinite(t).all())
    if isinstance(obj, dict):
        return all(host_state_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(host_state_finite(v) for v in obj)
    return True


def memory_stats(device: torch.device) -> Dict[str, Optional[int]]:
    """Device memory figures for results (None on CPU: not tracked there)."""
    if device.type != "cuda":
        return {"max_memory_allocated": None, "memory_allocated": None}
    return {"max_memory_allocated": int(torch.cuda.max_memory_allocated(device)),
            "memory_allocated": int(torch.cuda.memory_allocated(device))}
