"""Builds a sync strategy from the configuration: the one place that maps the config's
fields onto a strategy's settings (``hier``: :class:`HierSettings`; ``flat``/``ddp``: the
baselines' arguments)."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from hier_localsgd.core.runtime.choices import resolve_backend
from hier_localsgd.core.runtime.faults import FaultPlan
from hier_localsgd.core.tensors.flat_params import FlatParams
from hier_localsgd.core.tensors.fragments import flat_ranges, split_fragments
from hier_localsgd.core.tensors.level import LevelAlgorithm
from hier_localsgd.core.runtime.phases import PhaseTracker
from hier_localsgd.core.runtime.status import job_finished
from hier_localsgd.core.security.secret import Key, global_model_key, heal_key
from hier_localsgd.errors import fail
from hier_localsgd.sync.async_outer import AsyncOuterSettings
from hier_localsgd.sync.common import EventSink, SyncStrategy
from hier_localsgd.sync.sections import NONE
from hier_localsgd.sync.hier import HierarchicalSync, HierSettings, Identity
from hier_localsgd.sync.user_state import UserState

if TYPE_CHECKING:
    from hier_localsgd.config import Config


@dataclass(frozen=True)
class GroupPlace:
    """This process's place in its replica group (several ranks: launched by torchrun).
    One rank: rank 0 of 1, no group."""

    rank: int = 0
    size: int = 1
    pg: Optional[Any] = None  # the group's own process group: gradients every step, never FT traffic
    store: Optional[Any] = None  # torchrun's store: where rank 0 publishes its Managers' stores


def job_done_check(cfg: Config, identity: Identity) -> Callable[[], Optional[str]]:
    """Whether the job finished without this replica group (status.job_finished)."""
    t = cfg.topology
    others = [(c, r) for c in range(t.clusters) for r in range(t.replicas_per_cluster) if (c, r) != (identity.cluster, identity.replica)]
    return lambda: job_finished(cfg.run.dir, others, cfg.train.steps)


def job_heal_key(cfg: Config) -> Optional[Key]:
    """The job's heal key (core/security/secret.py); None without a job secret (each
    Manager then says its heals are not authenticated, managers.py)."""
    return heal_key(cfg.security)


def async_outer_settings(cfg: Config) -> Optional[AsyncOuterSettings]:
    """``sync.async_outer`` for a leader's pushes (None when off)."""
    a = cfg.sync.async_outer
    if not a.enabled:
        return None
    key = global_model_key(cfg.security)
    return AsyncOuterSettings(url=a.addr, key=None if key is None else key.bytes(), grace=timedelta(seconds=a.grace_s),
                              match_pace=a.match_pace, compress_down=a.compress_down and cfg.sync.outer.compression != NONE)


def outer_fragment_ranges(model: torch.nn.Module, flat: FlatParams, fragments: int) -> tuple:
    """``sync.outer.fragments`` as ranges of the flat vector (core/tensors/fragments.py): the model
    split by layer into contiguous fragments of balanced size; () for one fragment."""
    if fragments <= 1:
        return ()
    try:
        frags = split_fragments(model, fragments)
    except ValueError as e:
        fail("sync.outer.fragments", f"{fragments} — {e}")
    return tuple(flat_ranges(model, flat.params, frags))


def build_strategy(cfg: Config, identity: Identity, flat: FlatParams, model: torch.nn.Module, opt: torch.optim.Optimizer, tracker: PhaseTracker,
                   events: EventSink, grp: GroupPlace = GroupPlace(), faults: Optional[FaultPlan] = None,
                   user_state: Optional[UserState] = None) -> SyncStrategy:
    """The sync strategy ``sync.mode`` names, built from the config; ``faults`` is the
    process's one fault plan (its sync-phase faults fire inside hier's phases);
    ``user_state`` the user's objects that heal and checkpoint with the model."""
    s, t = cfg.sync, cfg.timeouts_obj()
    if s.mode == "hier":
        return HierarchicalSync(hier_settings(cfg, identity, flat, model, grp), identity, t, flat, opt, tracker, events, faults,
                                group=grp.pg, group_store=grp.store, job_done=job_done_check(cfg, identity), user_state=user_state,
                                async_outer=async_outer_settings(cfg))

    from hier_localsgd.sync.baselines import DDPSync, FlatSync

    common = dict(
        identity=identity,
        replicas_per_cluster=cfg.topology.replicas_per_cluster,
        timeouts=t,
        flat=flat,
        optimizer=opt,
        tracker=tracker,
        events=events,
        global_lighthouse=cfg.lighthouse.global_addr,
        hostname=cfg.run.hostname or socket.gethostname(),
        max_quorum_failures=s.max_quorum_failures,
        max_commit_failures=s.max_commit_failures,
        link_spec=cfg.link_spec("outer"),
        backend=resolve_backend("outer", cfg.train.backends.outer, flat.data.device),
        user_state=user_state,
        heal_key=job_heal_key(cfg),
        bind=cfg.run.bind,
    )
    if s.mode == "ddp":
        return DDPSync(**common)
    f = s.flat
    return FlatSync(**common, model=model, algorithm=f.algorithm, every=f.every, lr=f.lr, momentum=f.momentum, nesterov=f.nesterov, delay=f.delay,
                    fragments=f.fragments)


def hier_settings(cfg: Config, identity: Identity, flat: FlatParams, model: torch.nn.Module, grp: GroupPlace = GroupPlace()) -> HierSettings:
    """The hierarchy's settings, from the config's own fields (the one place that maps them)."""
    s = cfg.sync
    return HierSettings(
        h_inner=s.inner.every,
        h_outer=s.outer.every,
        inner=LevelAlgorithm.build(s.inner.algorithm, s.inner.lr, s.inner.momentum, s.inner.nesterov),
        outer=LevelAlgorithm.build(s.outer.algorithm, s.outer.lr, s.outer.momentum, s.outer.nesterov),
        cluster_lighthouse=cfg.lighthouse.cluster_addrs[identity.cluster],
        cluster_lighthouse_field=f"lighthouse.cluster_addrs[{identity.cluster}]",
        global_lighthouse=cfg.lighthouse.global_addr,
        global_lighthouse_field="lighthouse.global_addr",
        min_replicas=s.min_replicas,
        min_clusters=s.min_clusters,
        max_quorum_failures=s.max_quorum_failures,
        max_commit_failures=s.max_commit_failures,
        hostname=cfg.run.hostname or socket.gethostname(),
        replicas_per_cluster=cfg.topology.replicas_per_cluster,
        inner_link=cfg.link_spec("inner"),
        outer_link=cfg.link_spec("outer"),
        group_rank=grp.rank,
        group_world_size=grp.size,
        group_shards=cfg.group.rank_shards(grp.size),
        quorum_slice=timedelta(milliseconds=cfg.lighthouse.heartbeat_timeout_ms),
        outage_limit=timedelta(seconds=s.outage_limit_s),
        final_wait=timedelta(seconds=s.final_wait_s),
        outer_delay=s.outer.delay,
        outer_eager=s.outer.eager,
        final_step=cfg.train.steps,
        outer_compression=s.outer.compression,
        outer_compression_block=s.outer.compression_block,
        outer_topk=s.outer.topk,
        outer_fragments=outer_fragment_ranges(model, flat, s.outer.fragments),
        # a group of several ranks votes on its quorum's slices on the training thread
        # (LevelManager.start_quorum): an early quorum runs on a thread of its own
        early_quorum=s.inner.early_quorum and grp.size == 1,
        outer_max_staleness=s.outer.max_staleness,
        heal_key=job_heal_key(cfg),
        bind=cfg.run.bind,
        inner_max_staleness=s.inner.max_staleness,
        keep_local=s.failed_round == "keep_local",
        poison=s.poison,
        inner_backend=resolve_backend("inner", cfg.train.backends.inner, flat.data.device),
        outer_backend=resolve_backend("outer", cfg.train.backends.outer, flat.data.device),
    )
