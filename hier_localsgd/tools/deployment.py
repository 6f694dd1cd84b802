"""One deployment, described once: what ``plan`` and ``simulate`` read from the shared sections.

Both tools model the deployment every other command runs: ``topology`` (C x R x G),
``sync`` (mode, H values, algorithms, ``min_replicas``/``min_clusters``), ``links``
(``inner`` is the LAN inside a cluster, ``outer`` the WAN between clusters and the ring of
the flat and ddp baselines; only ``latency_ms`` and ``bandwidth_gbps`` count, loss is not
modelled, a bandwidth of 0 is unlimited as for the emulation) and ``train`` (``batch_size``
sequences of ``seq_len`` tokens per rank and step). The simulator also reads ``timeouts``
(core/runtime/timeouts.py) and the lighthouse's heartbeat and join timeouts. Their own sections
(``plan.*``, ``simulate.*``) hold only what is theirs: the model flavor, precision,
hardware and scaling law; failure rates and the run's horizon.

These are checked by the sections' own checks (a :class:`~hier_localsgd.errors.ConfigError`,
a ValueError, naming the field), with ``runs=False``: the restrictions of what this
trainer can run (``train.steps`` a multiple of ``sync.flat.every`` in flat, several ranks per group
only in ``hier``) do not bind a model of a deployment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Tuple

from hier_localsgd.core.links.lossy import LinkSpec

if TYPE_CHECKING:
    from hier_localsgd.config import Config

MODEL_COMMANDS = ("plan", "simulate")  # commands that model a deployment and run nothing


def check_shared(cfg: "Config") -> None:
    """Checks the shared sections the tools read; raises ConfigError naming the field."""
    cfg.topology.check(cfg.sync.mode, runs=False)
    cfg.sync.check(cfg.topology)
    cfg.train.check(cfg.sync, runs=False)
    links(cfg)


def links(cfg: "Config") -> Tuple[LinkSpec, LinkSpec]:
    """(LAN, WAN) = ``links.inner``, ``links.outer`` as validated specs (ValueError naming the field)."""
    return cfg.link_spec("inner"), cfg.link_spec("outer")


def unlimited(spec: LinkSpec) -> bool:
    """A link the tools cannot cost: no bandwidth given (0 = unlimited, the emulation's default)."""
    return spec.bandwidth_Bps <= 0


def moved_to(key: str, table: Dict[str, str]) -> Optional[str]:
    """Where an override's key went, by the longest prefix of ``table`` that matches it
    (the rest of the key kept when the new home is one field path); None if it did not move."""
    for old in sorted(table, key=len, reverse=True):
        if key == old or key.startswith(old + "."):
            new = table[old]
            rest = key[len(old):]
            return new + rest if rest and " " not in new else new
    return None
