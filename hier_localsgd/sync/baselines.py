"""Baselines in the same trainer, for comparisons: ``ddp`` and ``flat``.

Both put every replica group of every cluster behind the global lighthouse with one
torchft Manager each (no hierarchy, no leaders):

* ``ddp`` — fault-tolerant data parallelism: every step forms a quorum (healing a
  restarted group before its forward pass), all-reduces the gradients, and steps
  the optimizer only if the commit vote succeeds.
* ``flat`` — torchft's own ``DiLoCo`` (outer Nesterov SGD; with ``sync.flat.fragments`` its
  streaming variant, one fragment every ``every/F`` steps) or ``LocalSGD``
  (parameter average) every ``sync.flat.every`` steps, used as torchft ships it, with
  DiLoCo's bucketization on (the whole model in one all-reduce per sync, like the
  hierarchy's flat buffer; torchft's LocalSGD has no such option and all-reduces each
  parameter separately, paying a link's latency once per tensor).

They expose the same interface as :class:`hier_localsgd.sync.hier.HierarchicalSync`
(``start``, ``before_forward``, ``before_optimizer_step``, ``after_optimizer_step``,
``counters``, ``link_stats``, ``close``).

``flat`` also keeps the hierarchy's work accounting and evidence, so a chaos run scores
both the same way (chaos.py): ``work_counters()`` (steps run, discarded by a failed sync
or replaced by a heal, run since the last commit; ``steps_since_outer`` is always 0, its
one level being global), a ``commit`` event with ``level="flat"`` and the model's checksum
after every committed sync, and a ``rollback`` event after every failed one. Its single
level stands for both of the hierarchy's: chaos counts a flat commit as an inner and an
outer commit, and a flat heal as an inner heal.
"""

from __future__ import annotations

import copy
import logging
from typing import Dict, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from hier_localsgd.core.security.secret import Key

from hier_localsgd.core.ft.comm import LevelComm
from hier_localsgd.core.tensors.flat_params import FlatParams, checksum
from hier_localsgd.core.tensors.fragments import Fragment, fragment_parameters, split_fragments
from hier_localsgd.core.runtime.invariants import CollectiveGate
from hier_localsgd.core.runtime.device import host_copy, host_state
from hier_localsgd.core.links.stats import PAYLOAD
from hier_localsgd.core.links.link import LinkProcessGroup
from hier_localsgd.core.links.lossy import LinkSpec
from hier_localsgd.core.ft.managers import LevelManager, QuorumFailed
from hier_localsgd.core.runtime.phases import Phase, PhaseTracker
from hier_localsgd.sync.common import Counters, EventSink, FatalSyncError, Identity
from hier_localsgd.core.runtime.timeouts import Timeouts
from hier_localsgd.sync.user_state import UserState

logger = logging.getLogger(__name__)


def _fragment_module(model: nn.Module, fragment: Fragment) -> nn.Module:
    """A module holding (not copying) the fragment's parameters, for torchft's DiLoCo."""
    m = nn.Module()
    m.params = nn.ParameterList(fragment_parameters(model, fragment))
    return m


def baseline_replica_id(identity: Identity, replicas_per_cluster: int) -> str:
    # One lighthouse for all groups: the trailing digits must be unique job-wide.
    g = identity.cluster * replicas_per_cluster + identity.replica
    return f"c{identity.cluster}_r{identity.replica}_g{g:04d}"


class _Baseline:
    level = "baseline"

    leader: bool = False  # a baseline's groups are peers: none leads a cluster

    def __init__(
        self,
        identity: Identity,
        replicas_per_cluster: int,
        timeouts: Timeouts,
        flat: FlatParams,
        optimizer: Optimizer,
        tracker: PhaseTracker,
        events: EventSink,
        global_lighthouse: str,
        hostname: str,
        max_quorum_failures: int,
        max_commit_failures: Optional[int],
        link_spec: Optional[LinkSpec] = None,
        backend: str = "gloo",
        user_state: Optional[UserState] = None,
        heal_key: Optional[Key] = None,
        bind: str = "",
    ) -> None:
        """``backend``: the process group's (core/runtime/device.py); a baseline's ring spans the
        clusters, so it takes the outer level's (``train.backends.outer``)."""
        self.id, self.timeouts, self.flat, self.opt = identity, timeouts, flat, optimizer
        self.tracker, self.events = tracker, events
        tracker.budgets = timeouts  # every phase's deadline, named once (Timeouts.phase)
        self.counters = Counters()
        self.user = user_state or UserState()  # served and loaded with heals (taken by api.py at loop boundaries)
        self.leader = False
        self._max_quorum_failures = max_quorum_failures
        self._quorum_failures = 0
        # Every baseline ring spans the clusters, so it runs at the slow links' speed.
        self.link = LinkProcessGroup(self.level, timeouts.inner_pg, emulation=link_spec, backend=backend)
        self.mgr = LevelManager(
            level=self.level,
            replica_id=baseline_replica_id(identity, replicas_per_cluster),
            lighthouse_addr=global_lighthouse,
            lighthouse_field="lighthouse.global_addr",
            pg=self.link,
            state_dict=self._state_dict,
            load_state_dict=self._load_state,
            min_replicas=1,
            timeouts=timeouts,  # a baseline's one level keeps the inner level's timeouts
            hostname=hostname,
            max_commit_failures=max_commit_failures,
            heal_key=heal_key,
            bind=bind,
        )

    def _state_dict(self) -> Dict[str, object]:
        c = self.counters
        return {
            "model": host_copy(self.flat.data),  # served from the host (core/runtime/device.py)
            "optimizer": host_state(self.opt.state_dict()),
            "counters": {"step": c.step, "inner_round": c.inner_round, "outer_round": c.outer_round},
            "user": self.user.served(),
        }

    def _load_state(self, sd: Dict[str, object]) -> None:
        self.flat.load_(sd["model"])  # type: ignore[arg-type]
        self.opt.load_state_dict(copy.deepcopy(sd["optimizer"]))  # type: ignore[arg-type]
        counters = sd["counters"]
        assert isinstance(counters, dict)
        self.user.load(sd.get("user"), "the healing donor", step=int(counters["step"]))  # type: ignore[arg-type]
        self.counters.step = int(counters["step"])
        self.counters.inner_round = int(counters["inner_round"])
        self.tracker.set_counters(step=self.counters.step, inner_round=self.counters.inner_round)
        self._healed()
        self.events("heal", level=self.level, step=self.counters.step)

    def _healed(self) -> None:
        """Work accounting hook: the state a heal replaced is discarded."""

    def _quorum_failed(self, e: Exception) -> None:
        self._quorum_failures += 1
        logger.warning("%s %s quorum failed (%d in a row): %s", self.id, self.level, self._quorum_failures, e)
        if self._quorum_failures >= self._max_quorum_failures:
            raise FatalSyncError(f"{self.level} quorum failed {self._quorum_failures} times in a row (last: {e})") from e

    def start(self) -> None:
        self.tracker.enter(Phase.LOCAL)

    def before_forward(self) -> None:
        pass

    def before_optimizer_step(self) -> bool:
        return True

    def after_optimizer_step(self) -> bool:
        self.tracker.set_counters(step=self.counters.step, inner_round=self.counters.inner_round)
        return True  # ddp: every step synced

    def finish(self) -> None:
        """Nothing: a baseline's one level has no lighthouse of its own to wait for (sync/final.py is the hierarchy's)."""

    def work_counters(self) -> Dict[str, int]:
        """ddp keeps no work accounting (every step is one sync); FlatSync counts rounds."""
        return {}

    def global_model(self) -> Optional[torch.Tensor]:
        return None  # torchft's LocalSGD/DiLoCo keep theirs inside (the live model after each sync)

    def link_stats(self) -> Dict[str, Dict[str, object]]:
        return {self.level: self.link.stats.as_dict()}

    def close(self) -> None:
        self.mgr.shutdown()


class DDPSync(_Baseline):
    """Gradient all-reduce every step across all replica groups (see module docstring)."""

    level = "ddp"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if self.flat.grad is None:
            raise ValueError("ddp needs FlatParams(flat_grads=True)")
        self.comm = LevelComm(self.mgr, self.link, self.tracker, CollectiveGate())
        self._size = 1
        self._in_quorum = False

    def before_forward(self) -> None:
        t = self.timeouts
        self.tracker.enter(Phase.INNER_QUORUM)
        try:
            q = self.mgr.start_quorum(self.tracker.remaining())
        except QuorumFailed as e:
            self._quorum_failed(e)
            self._in_quorum = False
            self.tracker.enter(Phase.ROLLBACK, None, reason=str(e))
            self.tracker.enter(Phase.LOCAL)
            return
        self._quorum_failures = 0
        self._size, self._in_quorum = q.size, True
        # forward and backward run inside this phase's budget too
        self.tracker.enter(Phase.INNER_REDUCE, t.local_step + t.inner_reduce)

    def before_optimizer_step(self) -> bool:
        if not self._in_quorum:
            return False
        self.comm.allreduce_sum(self.flat.grad, PAYLOAD)  # type: ignore[arg-type]
        self.flat.grad.div_(self._size)  # type: ignore[union-attr]
        self.tracker.enter(Phase.INNER_COMMIT)
        ok = self.mgr.should_commit(self.tracker.remaining())
        if ok:
            self.counters.inner_round += 1
        else:
            self.events("rollback", level=self.level, reason="commit vote failed", step=self.counters.step)
        self.tracker.enter(Phase.LOCAL)
        return ok


class FlatSync(_Baseline):
    """torchft's own DiLoCo/LocalSGD across all replica groups (see module docstring)."""

    level = "flat"

    def __init__(
        self,
        *args: object,
        model: nn.Module,
        algorithm: str,
        every: int,
        lr: float,
        momentum: float,
        nesterov: bool,
        delay: int = 0,
        fragments: int = 1,
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        from torchft.local_sgd import DiLoCo, LocalSGD

        manager = self.mgr.manager
        if algorithm == "diloco":
            # Streaming DiLoCo as torchft ships it: its model_fragments synced in turn, one every
            # sync_every/F steps (torchft divides), each parameter every `every` steps. The split
            # is the hierarchy's (core/tensors/fragments.py), each fragment a module sharing the model's
            # parameters (torchft reads only its named_parameters) with an outer optimizer of its own.
            parts = [model] if fragments == 1 else [_fragment_module(model, f) for f in split_fragments(model, fragments)]
            outer = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum, nesterov=nesterov) for m in parts]
            # One bucket (torchft's default cap, 1 GiB) per sync, as the hierarchy sends one flat
            # buffer: per-parameter all-reduces would pay the WAN latency once per tensor.
            self.algo = DiLoCo(
                manager, parts, self.opt, outer if fragments > 1 else outer[0], sync_every=every, backup_device=torch.device("cpu"),
                pin_memory=self.flat.data.is_cuda, use_bucketization=True,
                # torchft's own overlap (Streaming DiLoCo's tau): the all-reduce starts `delay`
                # local steps before the sync point and is waited for at it.
                fragment_sync_delay=delay,
            )
        else:
            if delay:
                raise ValueError("sync.flat.delay: torchft's LocalSGD has no overlap; use sync.flat.algorithm=diloco")
            self.algo = LocalSGD(manager, model, self.opt, sync_every=every)
        self.algo.__enter__()  # registers the optimizer hooks that run the syncs
        self.work = {"steps_run": 0, "steps_discarded": 0, "steps_since_commit": 0}
        # torchft's syncs run inside optimizer.step(): the LOCAL budget covers one.
        self._budget = self.timeouts.local_step + self.timeouts.inner_quorum + self.timeouts.inner_reduce + self.timeouts.inner_commit

    def start(self) -> None:
        self.tracker.enter(Phase.LOCAL, self._budget)

    def _healed(self) -> None:
        self.work["steps_discarded"] += self.work["steps_since_commit"]
        self.work["steps_since_commit"] = 0

    def work_counters(self) -> Dict[str, int]:
        """Steps run, discarded and since the last commit (module docstring)."""
        return {**self.work, "steps_since_outer": 0}

    def after_optimizer_step(self) -> bool:
        synced = self.mgr.step != self.counters.inner_round  # torchft synced inside optimizer.step()
        attempted = self.algo._local_step == 0  # torchft resets its local step count at every sync
        self.counters.inner_round = self.mgr.step
        self.work["steps_run"] += 1
        self.work["steps_since_commit"] += 1
        c = self.counters
        if synced:
            self.work["steps_since_commit"] = 0
            self.tracker.mark_commit(self.level, c.inner_round)
            self.events("commit", level=self.level, inner_round=c.inner_round, step=c.step, outer=True,
                        participants=self.mgr.manager.num_participants(), checksum=checksum(self.flat.data))
        elif attempted:  # torchft restored the last global parameters: this sync's local steps are gone
            self.events("rollback", level=self.level, reason="flat sync did not commit", step=c.step,
                        discarded=self.work["steps_since_commit"])
            self.work["steps_discarded"] += self.work["steps_since_commit"]
            self.work["steps_since_commit"] = 0
        super().after_optimizer_step()
        self.tracker.enter(Phase.LOCAL, self._budget)
        return synced

    def close(self) -> None:
        self.algo.__exit__(None, None, None)
        super().close()
