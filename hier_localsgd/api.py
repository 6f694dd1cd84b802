"""``HierarchicalDiLoCo``: the sync around a training loop the user writes.

The user brings the model, the inner optimizer, the data and the loop; this object brings
the rest: the strategy ``sync.mode`` names (``hier``; the ``flat``/``ddp`` baselines) with
every option of the configuration, the status and event files the dashboard and the chaos
report read, durable checkpoints, planned faults, and the user's own state healing with
the model. As torchft's ``DiLoCo``, it runs inside ``inner_optimizer.step()`` (step hooks),
so the loop itself stays the user's::

    def main(topology: Topology) -> None:
        model = MyModel().to(topology.device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        with HierarchicalDiLoCo(model, opt, topology, state={"scheduler": sched}) as sync:
            for step in sync.steps():          # to train.steps; a heal may move it forward
                loss = model(batch(step)).loss
                loss.backward()
                opt.step()                     # a sync round at round boundaries, nothing otherwise
                opt.zero_grad()
                sync.record_loss(loss)

    hier_localsgd.run(main)                    # the process's exit path (job.py)

Failure semantics are the strategy's (docs/architecture.md, docs/api.md): a failed round
rolls the model and optimizer back (or keeps local work, ``sync.failed_round``); a restarted
group heals from a live peer before its first step, user state included; an error that the
sync cannot recover from raises out of ``opt.step()`` and, leaving the ``with`` block, ends
the process through the runtime (heartbeats stop first), so its launcher restarts it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional

import torch

from hier_localsgd.core.runtime.checkpoint import Checkpointer, rng_state, set_rng_state
from hier_localsgd.core.runtime.device import memory_stats
from hier_localsgd.core.runtime.faults import FaultPlan, fire
from hier_localsgd.core.tensors.flat_params import FlatParams, checksum
from hier_localsgd.core.runtime.phases import Phase, PhaseTracker
from hier_localsgd.core.runtime.runtime import EXIT_ERROR, EXIT_OK, EXIT_WATCHDOG, LOG_TAG
from hier_localsgd.core.runtime.status import ReplicaPublisher, inbox_path
from hier_localsgd.job import Topology, wait_for_gate, wait_for_lighthouse
from hier_localsgd.sync.build import build_strategy
from hier_localsgd.sync.common import JobFinished
from hier_localsgd.sync.sections import SyncConfig, padded_step_s
from hier_localsgd.sync.user_state import Stateful, UserState

logger = logging.getLogger("hier_localsgd.api")


class Scalars:
    """TensorBoard scalars of one replica group (``<run.dir>/tensorboard/c<C>r<R>``), or nothing."""

    def __init__(self, enabled: bool, path: str) -> None:
        self.w = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.w = SummaryWriter(path, flush_secs=10)

    def add(self, step: int, **values: Optional[float]) -> None:
        if self.w is not None:
            for tag, v in values.items():
                if v is not None:
                    self.w.add_scalar(tag.replace("__", "/"), v, step)

    def close(self) -> None:
        if self.w is not None:
            self.w.close()


def trimmed_mean(xs: List[float], warmup: int = 3) -> Optional[float]:
    """Mean step time, skipping the first steps (allocator and cache warm-up)."""
    xs = xs[warmup:]
    return sum(xs) / len(xs) if xs else None


class HierarchicalDiLoCo:
    """Fault-tolerant (hierarchical) DiLoCo/LocalSGD around the user's loop.

    Args:
        model: the module whose parameters are synced (its trainable parameters must share
            one dtype and device; they are rebound as views of one flat buffer, so build
            the optimizer before or after, either works). Wrappers the user applies for the
            forward pass (DDP over ``topology.group.pg``, ``torch.compile``) stay the
            user's; pass the module they wrap. FSDP2-sharded modules (``group.sharding=fsdp``)
            sync each rank's own shard.
        inner_optimizer: the optimizer the loop steps (torchft's name); the sync runs in its
            step hooks.
        topology: :meth:`Topology.from_env` (or what :func:`hier_localsgd.run` hands ``main``).
        sync: replaces the configuration's ``sync`` section (checked as the config's own).
        state: the user's objects with ``state_dict``/``load_state_dict`` (LR scheduler,
            data position, RNG holder) that heal and checkpoint with the model, by name;
            every replica group must register the same names (sync/user_state.py).

    Raises:
        ConfigError: ``sync`` is invalid, naming the field.
        TypeError: a ``state`` object lacks ``state_dict``/``load_state_dict``.
        LighthouseUnreachable: the lighthouse does not answer (a restarted group first
            waits up to ``sync.outage_limit_s``).

    Blocking: the constructor connects to the lighthouses (``timeouts.connect``); entering
    the ``with`` block waits at the local launcher's start gate (``timeouts.startup``) and
    runs the join round (a restarted group heals there; ``timeouts.startup`` at most).
    ``inner_optimizer.step()`` blocks for a round at round boundaries (each phase bounded
    by its ``timeouts.*``). Leaving the block runs the final reconciliation
    (``sync.final_wait_s`` at most) and publishes the result.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, topology: Topology,
                 sync: Optional[SyncConfig] = None, state: Optional[Mapping[str, Stateful]] = None) -> None:
        cfg = topology.config
        if sync is not None:  # the whole configuration checked again with it (cross-section checks too)
            from hier_localsgd.config import validate

            cfg = dataclasses.replace(cfg, sync=sync)
            validate(cfg, "train")
        self.topology, self.config, self.model, self.optimizer = topology, cfg, model, inner_optimizer
        ident, grp, rt = topology.identity, topology.group, topology.runtime
        self._t0 = time.time()
        self.user = UserState(state, optimizer=inner_optimizer)
        self.pub = self._publisher()
        LOG_TAG.set_role("member")
        self.tracker = PhaseTracker(
            describe=str(ident) + (f"g{grp.rank}" if grp.size > 1 else ""),
            listeners=[self.pub.on_transition, lambda tr, snap: LOG_TAG.set_role("leader" if snap.get("leader") else "member")],
        )
        rt.watch(self.tracker)
        torch.set_num_threads(cfg.train.threads)
        self.tb = Scalars(cfg.run.tensorboard, os.path.join(cfg.run.dir, "tensorboard", f"c{ident.cluster}r{ident.replica}"))
        rt.on_exit(lambda code, reason: self.tb.close())
        self.flat: Any = self._flat_params(model)
        self.pub.update(model_params=self.flat.numel, model_bytes=self.flat.nbytes)
        wait_for_lighthouse(cfg, ident, topology.ran_before)
        # The loop's and the sync phases' planned faults (this rank's), and the chaos inbox.
        self.faults = FaultPlan(cfg.fault_list(), ident.cluster, ident.replica, grp.rank,
                                inbox=inbox_path(cfg.run.dir, ident.cluster, ident.replica) if cfg.run.fault_inbox and grp.rank == 0 else None)
        self.strategy = build_strategy(cfg, ident, self.flat, model, inner_optimizer, self.tracker, self.pub.event, grp, self.faults, self.user)
        rt.add_closer(self.strategy.close)
        self.counters = self.strategy.counters
        self.ckpt = self._open_checkpoints()
        self._last_ckpt_round = self.counters.outer_round
        self._ckpt_due = False
        self._hooks = [inner_optimizer.register_step_pre_hook(self._pre_step), inner_optimizer.register_step_post_hook(self._post_step)]
        self._loss = float("nan")
        self.steps_without_state = 0  # steps adopted from another cluster without user state
        self._speed = self.config.topology.speed(ident.cluster)  # topology.cluster_speed: emulated heterogeneity
        self._sync_s = 0.0  # seconds inside sync rounds since the loop began (_pace)
        self.local_steps_run = 0  # optimizer steps this process ran in its loop
        self._step_start: Optional[float] = None
        self._forward_ready = False
        self.local_step_times: List[float] = []  # steps without a sync (overhead measurements)
        self._loop_start: Optional[tuple] = None
        self._loop_end: Optional[float] = None  # after the last step (finish)
        self._finished = False
        self._published: Optional[Dict[str, Any]] = None
        self.extra_status: Dict[str, Any] = {}  # fields added to every progress status (the built-in trainer: TP stats)

    # -- the loop --------------------------------------------------------------
    def __enter__(self) -> "HierarchicalDiLoCo":
        self._resume()  # checkpoint.resume: before the join round, after whatever the owner evaluated
        self.pub.update(state="ready")
        wait_for_gate(self.config.run.start_gate, self.config.timeouts_obj().startup.total_seconds())
        self.pub.update(state="running")
        with self._count_steps_without_state():
            self.strategy.start()  # join round: a restarted group heals here, before any local step
        self._loop_start = (time.perf_counter(), self.counters.step)
        return self

    @property
    def step_count(self) -> int:
        """Local steps taken by this replica group (a heal sets it to the donor's)."""
        return self.counters.step

    @property
    def total_steps(self) -> int:
        return self.config.train.steps

    @property
    def leader(self) -> bool:
        """This group leads its cluster now (crosses the slow links)."""
        return self.strategy.leader

    def steps(self) -> Iterator[int]:
        """The steps left, ``step_count`` each time (to ``train.steps``). Before each: ddp's
        quorum, the early inner quorum, and this step's planned faults. The loop may also
        be the user's own (``while sync.step_count < sync.total_steps``), except for ddp,
        whose quorum must precede the forward pass."""
        while self.counters.step < self.config.train.steps:
            self.before_forward()
            yield self.counters.step

    def before_forward(self) -> None:
        """What precedes a step's forward pass (:meth:`steps` calls it): a loop boundary,
        where the user's registered state is taken (user_state.py) and a due checkpoint
        written."""
        self.user.take()  # before the early inner quorum and ddp's quorum serve it
        self._save_due_checkpoint()
        self.strategy.before_forward()  # ddp: quorum (and heal) for this step
        self._loop_faults(self.counters.step)
        self._forward_ready = True
        self._step_start = time.perf_counter()

    def record_loss(self, loss: Any) -> None:
        """The step's training loss, for the status, log lines and TensorBoard (optional)."""
        self._loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)

    def record_eval(self, loss: float, floor: Optional[float] = None, eval_s: Optional[float] = None, step: Optional[int] = None,
                    model: str = "live") -> None:
        """An evaluation at ``step`` (default: the current step): an ``eval`` event (the bench
        and the dashboard read them), the status and TensorBoard. ``floor``: the data's
        entropy floor, if known. Step 0 is the run's starting loss. ``model="global"``: an
        evaluation of :meth:`global_model`: an ``eval_global`` event (the bench's global curve),
        its own status field and TensorBoard scalar."""
        step = self.counters.step if step is None else step
        if model not in ("live", "global"):
            raise ValueError(f"record_eval(model={model!r}): expected 'live' or 'global'")
        sent = {lv: st["sent_bytes_total"] for lv, st in self.strategy.link_stats().items()}
        self.pub.event("eval" if model == "live" else "eval_global", step=step, loss=loss, floor=floor, bytes=sent,
                       **({"eval_s": eval_s} if eval_s is not None else {}))
        if model == "global":
            self.pub.update(eval_loss_global=loss, eval_step_global=step)
            self.tb.add(step, eval__global_loss=loss)
            return
        if step == 0:
            self.pub.update(entropy_floor=floor, eval_loss_start=loss)
        self.pub.update(eval_loss=loss, eval_step=step)
        self.tb.add(step, eval__loss=loss, eval__excess=None if floor is None else loss - floor)

    @contextlib.contextmanager
    def global_model(self) -> Iterator[bool]:
        """Inside, the model's parameters hold the last global model this process applied
        (sync/hier.py ``global_model``) in place of the live one, which is back on exit, also
        on an exception. With overlapped outer rounds (``sync.outer.delay``) every cluster's
        live model is the global model plus its own progress since the round's launch, so
        the clusters differ; this is the one model they share. Yields False, the live model
        in place, where there is none apart from it (sync.mode flat/ddp; a replica group of
        several unsharded ranks). Call it between steps, on the training thread."""
        held = self.strategy.global_model()
        if held is None:
            yield False
            return
        live = self.flat.data.to("cpu", copy=True)  # in host memory: no second model on the accelerator
        try:
            self.flat.load_(held)  # load_, not data.copy_: FSDP's data is a fresh tensor each read
            yield True
        finally:
            self.flat.load_(live)

    # -- step hooks --------------------------------------------------------------
    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._forward_ready:  # a loop of the user's own, without before_forward: the nearest point to a boundary
            self.user.take()
            self._save_due_checkpoint()
        if self.config.sync.mode == "ddp":
            if not self._forward_ready:
                raise RuntimeError("sync.mode=ddp: iterate sync.steps() (or call sync.before_forward() before the forward pass): "
                                   "its quorum and heal precede the forward pass")
            self.flat.gather_grads()
            if not self.strategy.before_optimizer_step():  # gradient all-reduce + commit vote
                for p in self.flat.params:  # failed vote: torch optimizers skip parameters without a gradient
                    p.grad = None

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        tr = self.config.train
        if (tr.min_step_time_s > 0 or self._speed < 1) and self._step_start is not None:  # emulated compute: pad the step
            spent = time.perf_counter() - self._step_start
            time.sleep(max(0.0, padded_step_s(spent, tr.min_step_time_s, self._speed) - spent))
        c = self.counters
        c.step += 1  # every replica advances its own step counter (I5)
        self.local_steps_run += 1
        t_sync = time.perf_counter()
        with self._count_steps_without_state():
            synced = self.strategy.after_optimizer_step()  # hier/flat: a sync round at round boundaries
        self._sync_s += time.perf_counter() - t_sync
        if not synced and self._step_start is not None:
            if self.topology.device.type == "cuda":
                torch.cuda.synchronize(self.topology.device)  # the step's kernels, not just their launch
            self.local_step_times.append(time.perf_counter() - self._step_start)
        ck = self.config.checkpoint
        # A multiple of checkpoint.every crossed (the asynchronous outer level's versions jump).
        if self.ckpt is not None and ck.every and c.outer_round // ck.every > self._last_ckpt_round // ck.every:
            self._last_ckpt_round = c.outer_round  # right after the outer round committed ...
            self._ckpt_due = True  # ... written at the loop boundary that follows (the user's state complete)
        # Every step: a killed process's last status says how much work it had done.
        self.pub.update(step=c.step, loss=self._loss, loss_step=c.step, **self.strategy.work_counters(), **self._pace())
        if c.step % tr.log_every == 0 or c.step == tr.steps:
            self._log_progress()
        self._step_start, self._forward_ready = None, False

    def _pace(self) -> Dict[str, Any]:
        """The loop's seconds so far (to its last step once finished), the steps it ran (a
        heal's jump left out) and, for hier, the seconds inside sync rounds (waiting for
        peers and communicating; the rest is the steps: flat's and ddp's sync runs inside
        the optimizer step, so it is not split out). The dashboard shows a cluster's step
        rate and its share of time in sync."""
        if self._loop_start is None:
            return {}
        loop_s = self._loop_end - self._loop_start[0] if self._loop_end is not None else time.perf_counter() - self._loop_start[0]
        return {"loop_s": loop_s, "loop_steps": self.local_steps_run, **({"sync_s": self._sync_s} if self.config.sync.mode == "hier" else {})}

    @contextlib.contextmanager
    def _count_steps_without_state(self) -> Iterator[None]:
        """Steps the counter moved on by without the user's state arriving (user_state.py):
        since the last state received inside the call (a heal, then the broadcast of another
        cluster's later global model in the same round), else since the call began."""
        before, loads = self.counters.step, self.user.loads
        yield
        since = self.user.loaded_step if self.user.loads != loads else before
        if self.counters.step > since:
            self.steps_without_state += self.counters.step - since

    def _save_due_checkpoint(self) -> None:
        if self._ckpt_due and self.ckpt is not None:
            self._ckpt_due = False
            # The model and optimizer have not moved since the round committed (no step since).
            self.ckpt.save_async(self.counters.step, {**self.strategy.snapshot(), "rng": rng_state()})  # type: ignore[attr-defined]

    def _loop_faults(self, step: int) -> None:
        """faults=[...] actions of the training loop itself (phase LOCAL), and one handed over
        through the inbox (run.fault_inbox): poison the model, then raise, then hang, then exit."""
        self.faults.from_inbox(step)
        for action in ("poison", "raise", "hang", "exit"):
            f = self.faults.take(step, Phase.LOCAL.value, (action,))
            if f is not None:
                if action == "poison":
                    self.pub.event("fault", action="poison", how=f.how, phase=Phase.LOCAL.value, step=step)
                fire(f, f"the training loop at step {step}", block=True, model=self.flat.data)

    def _log_progress(self) -> None:
        c, tr = self.counters, self.config.train
        logger.info("%s step %d/%d loss %.4f inner_round %d outer_round %d%s", self.topology.identity, c.step, tr.steps, self._loss,
                    c.inner_round, c.outer_round, " leader" if self.strategy.leader else "")
        links = self.strategy.link_stats()
        self.pub.update(loss=self._loss, loss_step=c.step, link=links, **self.extra_status)
        self.pub.event("loss", step=c.step, loss=self._loss)
        work = self.strategy.work_counters()
        self.tb.add(c.step, train__loss=self._loss, sync__inner_round=c.inner_round, sync__outer_round=c.outer_round,
                    work__steps_discarded=work.get("steps_discarded"),
                    **{f"link__{lv}_bytes": st["sent_bytes_total"] for lv, st in links.items()})

    # -- the end -----------------------------------------------------------------
    def finish(self) -> None:
        """After the last step: the final reconciliation (hier: a final round skipped for an
        outage reconciles the cluster, at most ``sync.final_wait_s``). Idempotent."""
        if not self._finished:
            self._finished = True
            self._loop_end = time.perf_counter()
            self.user.take()  # the loop is over: its state is complete
            self._save_due_checkpoint()
            with self._count_steps_without_state():
                self.strategy.finish()
            if self._loop_start is not None:
                t, s = self._loop_start
                self._loop_s, self._loop_steps = time.perf_counter() - t, max(1, self.counters.step - s)

    def result(self) -> Dict[str, Any]:
        """This replica group's result record (what ``publish_result`` writes)."""
        c, flat = self.counters, self.flat
        return {
            "cluster": self.topology.cluster, "replica": self.topology.replica, "group_rank": self.topology.rank,
            "mode": self.config.sync.mode, "steps": c.step, "inner_rounds": c.inner_round, "outer_rounds": c.outer_round,
            "leader": self.strategy.leader, "checksum": checksum(flat.data), "finite": bool(torch.isfinite(flat.data).all()),
            "model_params": flat.numel, "model_bytes": flat.nbytes, "link": self.strategy.link_stats(),
            "work": self.strategy.work_counters(), "param_dtype": str(flat.data.dtype), "train_loss": self._loss,
            "user_state": {"names": sorted(self.user.objects), "loads": self.user.loads, "steps_without_state": self.steps_without_state},
            "local_step_s": trimmed_mean(self.local_step_times), "local_steps_timed": len(self.local_step_times),
            "step_s": getattr(self, "_loop_s", 0.0) / getattr(self, "_loop_steps", 1),  # mean over the loop, syncs included
            "device": str(self.topology.device), **memory_stats(self.topology.device), "wall_s": time.time() - self._t0, **self._pace(),
        }

    def publish_result(self, **extra: Any) -> Dict[str, Any]:
        """Publishes the result record (with ``extra`` fields) where the demo's summary, the
        chaos report and the dashboard read it; waits for pending checkpoint writes. Once."""
        self.finish()
        if self._published is not None:
            return self._published
        result = {**self.result(), **extra}
        self._published = result
        self.flat.check_in_place()
        if self.ckpt is not None:
            self.ckpt.wait()
            result["checkpoint_errors"] = self.ckpt.errors
        self.pub.result(result)
        self.pub.update(state="finished", loss=self._loss, link=self.strategy.link_stats(),
                        **({"eval_loss": extra["eval_loss"], "eval_step": self.counters.step} if "eval_loss" in extra else {}))
        self.tracker.enter(Phase.STOPPED, None, reason="finished")
        logger.info("%s finished: checksum %s", self.topology.identity, result["checksum"])
        return result

    def close(self) -> None:
        """Removes the step hooks and stops the heartbeats (idempotent)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.strategy.close()

    def __exit__(self, kind: Any, error: Optional[BaseException], tb: Any) -> None:
        """Success: finish, publish the result, stop the heartbeats. An exception ends the
        process through the runtime (heartbeats stop first; never returns): a job that
        finished meanwhile exits 0, anything else with its exit code (1 by default)."""
        if error is None:
            self.publish_result()
            self.close()
            return
        rt = self.topology.runtime
        if isinstance(error, JobFinished):
            logger.warning("%s: %s; exiting", self.topology.identity, error)
            rt.exit(EXIT_OK, str(error))
        code = error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else getattr(error, "exit_code", EXIT_ERROR)
        rt.exit(code, f"{error.__class__.__name__}: {error}", error=error)

    # -- construction ------------------------------------------------------------
    def _flat_params(self, model: torch.nn.Module) -> Any:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        from hier_localsgd.errors import fail

        sharded = isinstance(model, FSDPModule) or any(isinstance(p, DTensor) for p in model.parameters())
        shards = self.config.group.rank_shards(self.topology.group.size)  # the sync syncs each rank's own shard
        if sharded and not shards:
            fail("group.sharding", f"{self.config.group.sharding!r} — the model's parameters are FSDP2 shards (DTensor): "
                 "set group.sharding=fsdp so each rank syncs its own shard (with several ranks per group)")
        if sharded:  # FSDP2 inside the group: each rank syncs its shard
            from hier_localsgd.core.tensors.fsdp import ShardedParams

            return ShardedParams(model)
        if shards and self.config.group.parallel != "tp":
            fail("group.sharding", "fsdp — but the model's parameters are not FSDP2 shards: apply fully_shard over "
                 "topology.group.pg before building HierarchicalDiLoCo, or set group.sharding=ddp")
        # ddp: gradients as one flat buffer, which it all-reduces across replica groups.
        return FlatParams(model, flat_grads=self.config.sync.mode == "ddp")

    def _publisher(self) -> ReplicaPublisher:
        """The replica's status file and event log; closed with the process's exit reason."""
        cfg, ident, grp = self.config, self.topology.identity, self.topology.group
        lighthouses = {"global": cfg.lighthouse.global_addr}
        if cfg.sync.mode == "hier":
            lighthouses["cluster"] = cfg.lighthouse.cluster_addrs[ident.cluster]
        pub = ReplicaPublisher(
            cfg.run.dir, ident.cluster, ident.replica,
            {"cluster": ident.cluster, "replica": ident.replica, "mode": cfg.sync.mode, "steps_total": cfg.train.steps,
             "lighthouses": lighthouses, "group_rank": grp.rank,
             "topology": {"clusters": cfg.topology.clusters, "replicas_per_cluster": cfg.topology.replicas_per_cluster, "ranks_per_replica": grp.size}},
            rank=grp.rank,
        )

        def closing(code: int, reason: str) -> None:
            if code == EXIT_WATCHDOG:  # a hang: hier-localsgd chaos counts these
                pub.event("watchdog", reason=reason, pid=os.getpid())
            pub.close("done" if code == 0 else f"failed ({reason})")

        self.topology.runtime.on_exit(closing)
        return pub

    def _open_checkpoints(self) -> Optional[Checkpointer]:
        """The durable checkpoints (checkpoint.*); :meth:`_resume` loads the newest usable one."""
        cfg, ident, grp = self.config, self.topology.identity, self.topology.group
        ck = cfg.checkpoint
        if not (ck.every or ck.resume):
            return None
        ckpt = Checkpointer(ck.dir or os.path.join(cfg.run.dir, "checkpoints"), ident.cluster, ident.replica, ck.keep, self.pub.event,
                            rank=grp.rank, layout={"ranks_per_replica": grp.size, "device": self.topology.device.type})
        self.topology.runtime.on_exit(lambda code, reason: ckpt.wait(timeout_s=60.0))
        return ckpt

    def _resume(self) -> None:
        """checkpoint.resume: the sync (and the user's state) from the newest usable checkpoint."""
        ident = self.topology.identity
        if self.ckpt is None or not self.config.checkpoint.resume:
            return
        payload = self.ckpt.load_latest()
        if payload is not None:
            self.strategy.restore(payload["state"])  # type: ignore[attr-defined]  # hier only (config.py)
            set_rng_state(payload["state"]["rng"])
            self._last_ckpt_round = self.counters.outer_round
            logger.info("%s resumed at step %d (outer round %d)", ident, self.counters.step, self.counters.outer_round)
        else:
            logger.warning("%s: checkpoint.resume=true but no usable checkpoint under %s; starting fresh", ident, self.ckpt.dir)
