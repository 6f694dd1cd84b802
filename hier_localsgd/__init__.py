"""hier_localsgd: fault-tolerant hierarchical LocalSGD/DiLoCo training on torchft.

The public API (docs/api.md)::

    from hier_localsgd import HierarchicalDiLoCo, Topology, run

    def main(topology: Topology) -> None:
        model, opt = ..., ...                       # yours, on topology.device
        with HierarchicalDiLoCo(model, opt, topology, state={"scheduler": sched}) as sync:
            for step in sync.steps():
                loss = ...; loss.backward()
                opt.step(); opt.zero_grad()         # a sync round at round boundaries

    run(main)  # launched by launch/replica.sh ... -- python my_train.py (or hier-localsgd demo run.program=...)

Everything else in the package is internal. docs/architecture.md maps it; the built-in
``hier-localsgd train`` loop (hier_localsgd/train/trainer.py) is one user of this API.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "HierarchicalDiLoCo", "Topology", "run", "config_from_env", "load_config", "Config", "ConfigError", "SyncConfig",
    "LevelConfig", "Stateful", "JobFinished", "FatalSyncError", "OVERRIDES_ENV",
]

# Imported on first use: ``import hier_localsgd`` stays light (the CLI's plan and simulate
# commands do not import torch.distributed or torchft).
_HOMES = {
    "HierarchicalDiLoCo": "hier_localsgd.api",
    "Topology": "hier_localsgd.job", "run": "hier_localsgd.job", "config_from_env": "hier_localsgd.job",
    "OVERRIDES_ENV": "hier_localsgd.core.runtime.runtime",
    "load_config": "hier_localsgd.config", "Config": "hier_localsgd.config",
    "ConfigError": "hier_localsgd.errors",
    "SyncConfig": "hier_localsgd.sync.sections", "LevelConfig": "hier_localsgd.sync.sections",
    "Stateful": "hier_localsgd.sync.user_state",
    "JobFinished": "hier_localsgd.sync.common", "FatalSyncError": "hier_localsgd.sync.common",
}

if TYPE_CHECKING:
    from hier_localsgd.api import HierarchicalDiLoCo
    from hier_localsgd.config import Config, load_config
    from hier_localsgd.core.runtime.runtime import OVERRIDES_ENV
    from hier_localsgd.job import Topology, config_from_env, run
    from hier_localsgd.errors import ConfigError
    from hier_localsgd.sync.common import FatalSyncError, JobFinished
    from hier_localsgd.sync.sections import LevelConfig, SyncConfig
    from hier_localsgd.sync.user_state import Stateful


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'hier_localsgd' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_HOMES[name]), name)
