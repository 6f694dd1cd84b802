"""The names and defaults the configuration checks against, without torch.

The modules that implement them (core/tensors/compress.py, sparse.py, level.py,
core/runtime/device.py) import torch; the configuration (``hier_localsgd.config``) imports
only this module, so a process that just reads a configuration, a lighthouse above all,
starts in a fraction of a second instead of spending seconds importing torch (5 to 20 s
while jobs train on the same cores). Each name is defined here once and imported by its
implementation.
"""

from __future__ import annotations

from typing import Any

# -- where tensors live (core/runtime/device.py) ----------------------------------------
DEVICES = ("auto", "cpu", "cuda")
LEVEL_BACKENDS = ("auto", "gloo", "nccl", "nccl_inproc")  # the inner and outer (fault-tolerant) levels
GROUP_BACKENDS = ("auto", "gloo", "nccl")  # torch.distributed inside a replica group
NCCL_BACKENDS = ("nccl", "nccl_inproc")
PRECISIONS = ("fp32", "bf16")  # train.precision: autocast of forward/backward
PARAM_DTYPES = ("fp32", "bf16")  # train.param_dtype: the master weights' dtype


def check_device_name(name: str) -> None:
    """Raises ValueError naming ``train.device`` unless ``name`` is one of :data:`DEVICES`."""
    if name not in DEVICES:
        raise ValueError(f"train.device: {name!r} — expected one of {DEVICES}")


def resolve_backend(level: str, name: str, device: Any) -> str:
    """The backend of ``level`` (``group``, ``inner``, ``outer``) for ``device`` (a
    ``torch.device``, or its type: ``"cpu"``, ``"cuda"``).

    Raises:
        ValueError: naming ``train.backends.<level>``: unknown, or NCCL without a CUDA device.
    """
    kind = getattr(device, "type", device)
    allowed = GROUP_BACKENDS if level == "group" else LEVEL_BACKENDS
    if name not in allowed:
        raise ValueError(f"train.backends.{level}: {name!r} — expected one of {allowed}")
    if name == "auto":
        if kind != "cuda" or level == "outer":
            return "gloo"
        return "nccl"
    if name in NCCL_BACKENDS and kind != "cuda":
        raise ValueError(f"train.backends.{level}: {name} needs a CUDA device (train.device resolves to {kind} here)")
    return name


# -- how a replica group of several ranks holds the model (core/tensors/fsdp.py)
SHARDINGS = ("ddp", "fsdp")

# -- block quantization of the outer payload (core/tensors/compress.py) ------------------
INT8 = "int8"
FP8 = "fp8"
FORMATS = (INT8, FP8)
DEFAULT_BLOCK = 256


class FormatUnavailable(RuntimeError):
    """The compression format cannot run on this device with this torch build."""


# -- top-k + 2-bit sparsification (core/tensors/sparse.py) -------------------------------
TOPK2 = "topk2"
MAX_CHUNK = 256  # positions fit one byte
# Steps topk2 needs to the same loss as a multiple of fp32's (plan.topk2_step_cost, the outer
# pick's loss cost: tools/plan/pick.py; a calibration on the demo workload, docs/benchmarks.md).
TOPK2_STEP_COST = 2.0
DEFAULT_TOPK = 4  # kept per chunk: 1.6 % of a 256-element chunk

# -- a level's algorithm (core/tensors/level.py) -----------------------------------------
ALGORITHMS = ("localsgd", "diloco")
# DiLoCo's outer optimizer (Douillard et al.): the one home of these defaults.
DILOCO_LR = 0.7
DILOCO_MOMENTUM = 0.9
