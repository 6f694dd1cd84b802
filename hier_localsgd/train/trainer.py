"""The training loop of one replica-group process — read this first.

It composes the pieces the config names: data shard, model, inner optimizer and a
sync strategy (``hier``: :class:`hier_localsgd.sync.hier.HierarchicalSync`; ``flat``
and ``ddp``: :mod:`hier_localsgd.sync.baselines`). The strategy owns the counters, so
a replica group that heals from a peer resumes at the peer's step (and its data
position, since batches are addressed by step).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

import torch

from hier_localsgd.core.checkpoint import Checkpointer, rng_state, set_rng_state
from hier_localsgd.core.device import DTYPES, memory_stats, resolve_backend, resolve_device
from hier_localsgd.train.data import ByteTextData, DeviceData, MarkovChain, MarkovData
from hier_localsgd.core.faults import FaultPlan, fire
from hier_localsgd.core.flat import FlatParams, checksum
from hier_localsgd.core.fragments import flat_ranges, split_fragments
from hier_localsgd.core.level import LevelAlgorithm
from hier_localsgd.train.model import build_model, evaluate, lm_loss
from hier_localsgd.core.phases import Phase, PhaseTracker
from hier_localsgd.core.runtime import EXIT_WATCHDOG, LOG_TAG, Runtime
from hier_localsgd.core.status import ReplicaPublisher, inbox_path, job_finished, read_json, replica_dir
from hier_localsgd.schema import fail
from hier_localsgd.sync.common import SyncStrategy
from hier_localsgd.sync.hier import HierarchicalSync, HierSettings, Identity, JobFinished

if TYPE_CHECKING:
    from hier_localsgd.config import Config

logger = logging.getLogger(__name__)


class Scalars:
    """TensorBoard scalars of one replica group (``<run.dir>/tensorboard/c<C>r<R>``), or nothing."""

    def __init__(self, cfg: Config, identity: Identity) -> None:
        self.w = None
        if cfg.run.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.w = SummaryWriter(os.path.join(cfg.run.dir, "tensorboard", f"c{identity.cluster}r{identity.replica}"), flush_secs=10)

    def add(self, step: int, **values: Optional[float]) -> None:
        if self.w is not None:
            for tag, v in values.items():
                if v is not None:
                    self.w.add_scalar(tag.replace("__", "/"), v, step)

    def close(self) -> None:
        if self.w is not None:
            self.w.close()


def build_data(cfg: Config, rank: int = 0, device: Optional[torch.device] = None):  # type: ignore[no-untyped-def]
    """The rank's data shard; with ``device``, feeding tensors on that device."""
    d, tr = cfg.data, cfg.train
    if d.kind == "markov":
        chain = MarkovChain(d.states, d.branching, d.seed, d.concentration)
        src = MarkovData(chain, d.seed, cfg.shard(rank), tr.batch_size, tr.seq_len, tr.eval_batches, d.stream)
    else:
        src = ByteTextData(d.path, d.kind, d.text_column, d.seed, cfg.shard(rank), cfg.num_shards, tr.batch_size, tr.seq_len, tr.eval_batches, d.eval_fraction)
    return src if device is None else DeviceData(src, device)


def process_device(cfg: Config) -> torch.device:
    """``train.device`` for this process: rank k of a replica group (torchrun's LOCAL_RANK)
    takes GPU k (mod the GPUs visible); the CUDA device becomes the current one."""
    device = resolve_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


@dataclass
class GroupContext:
    """This process's place in its replica group (several ranks: launched by torchrun)."""

    rank: int = 0
    size: int = 1
    pg: Optional[Any] = None  # the group's own process group: gradients every step, never FT traffic
    store: Optional[Any] = None  # torchrun's store: where rank 0 publishes its Managers' stores


def group_context(cfg: Config, t: Any, device: torch.device = torch.device("cpu")) -> GroupContext:
    """The replica group's own process group (``train.backends.group`` on ``device``)."""
    g = cfg.topology.ranks_per_replica
    if g == 1:
        return GroupContext()
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != g:
        raise ValueError(
            f"topology.ranks_per_replica={g} but this process was launched with WORLD_SIZE={world or 'unset'}: "
            f"launch the replica group with torchrun --nproc-per-node {g} (launch/replica.sh --ranks {g})"
        )
    # torchrun's shared store outlives a restart of the group's workers, and the default
    # process group's keys are not per attempt: a restarted rank would read the previous
    # attempt's (dead) peers' addresses. Every attempt gets a key space of its own.
    store, rank, _ = next(dist.rendezvous("env://", timeout=max(t.inner_reduce, t.local_step)))
    store = dist.PrefixStore(f"hier/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    backend = resolve_backend("group", cfg.train.backends.group, device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=g, timeout=max(t.inner_reduce, t.local_step),
                            **({"device_id": device} if backend == "nccl" else {}))
    return GroupContext(rank=rank, size=g, pg=dist.group.WORLD, store=store)


def job_done_check(cfg: Config, identity: Identity) -> Callable[[], Optional[str]]:
    """Whether the job finished without this replica group (status.job_finished)."""
    t = cfg.topology
    others = [(c, r) for c in range(t.clusters) for r in range(t.replicas_per_cluster) if (c, r) != (identity.cluster, identity.replica)]
    return lambda: job_finished(cfg.run.dir, others, cfg.train.steps)


def trained_before(cfg: Config, identity: Identity, rank: int = 0) -> bool:
    """Whether an earlier process of this replica group trained in this run directory: its
    last status (read before this process overwrites it) shows a step above 0, so it had
    joined a quorum — its lighthouse answered then."""
    prev = read_json(replica_dir(cfg.run.dir, identity.cluster, identity.replica, rank) / "status.json")
    return bool(prev) and int(prev.get("step") or 0) > 0


def wait_for_lighthouse(cfg: Config, identity: Identity, ran_before: bool) -> None:
    """A restarted replica group rides out its lighthouse's outage at start-up.

    A replica group that never trained checks its lighthouse once (a wrong address is one
    clear line at once, and a launcher that restarts it gets the same line each time). One
    whose earlier process trained (``ran_before``, :func:`trained_before`) has seen the
    lighthouse answer, so a lighthouse that does not answer now is down or cut off: the
    process waits for it, up to ``sync.outage_limit_s``, as a running process would
    (outage.py), instead of exiting and being restarted again.
    """
    from hier_localsgd.core.addresses import LighthouseUnreachable, probe_lighthouse

    if not ran_before:
        return
    if cfg.sync.mode == "hier":
        field, addr = f"lighthouse.cluster_addrs[{identity.cluster}]", cfg.lighthouse.cluster_addrs[identity.cluster]
    else:
        field, addr = "lighthouse.global_addr", cfg.lighthouse.global_addr
    connect = cfg.timeouts_obj().connect
    deadline = time.monotonic() + cfg.sync.outage_limit_s
    waited = False
    while True:
        try:
            probe_lighthouse(field, addr, connect)
            if waited:
                logger.warning("%s: %s=%s answers again; starting", identity, field, addr)
            return
        except LighthouseUnreachable:
            if time.monotonic() >= deadline:
                raise
            if not waited:
                logger.warning("%s: restarted while %s=%s does not answer; waiting for it (up to sync.outage_limit_s=%gs)",
                               identity, field, addr, cfg.sync.outage_limit_s)
                waited = True
            time.sleep(1.0)


def outer_fragment_ranges(model: torch.nn.Module, flat: FlatParams, fragments: int) -> tuple:
    """``sync.outer.fragments`` as ranges of the flat vector (core/fragments.py): the model
    split by layer into contiguous fragments of balanced size; () for one fragment."""
    if fragments <= 1:
        return ()
    try:
        frags = split_fragments(model, fragments)
    except ValueError as e:
        fail("sync.outer.fragments", f"{fragments} — {e}")
    return tuple(flat_ranges(model, flat.params, frags))


def build_strategy(cfg: Config, identity: Identity, flat: FlatParams, model: torch.nn.Module, opt: torch.optim.Optimizer, tracker: PhaseTracker, pub: ReplicaPublisher, grp: GroupContext = GroupContext(), faults: Optional[FaultPlan] = None) -> SyncStrategy:
    """The sync strategy ``sync.mode`` names, built from the config; ``faults`` is the
    process's one fault plan (its sync-phase faults fire inside hier's phases)."""
    s, t = cfg.sync, cfg.timeouts_obj()
    hostname = cfg.run.hostname or socket.gethostname()
    if s.mode == "hier":
        settings = HierSettings(
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
            hostname=hostname,
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
            final_step=cfg.train.steps,
            outer_compression=s.outer.compression,
            outer_compression_block=s.outer.compression_block,
            outer_fragments=outer_fragment_ranges(model, flat, s.outer.fragments),
            early_quorum=s.inner.early_quorum,
            outer_max_staleness=s.outer.max_staleness,
            inner_max_staleness=s.inner.max_staleness,
            keep_local=s.failed_round == "keep_local",
            poison=s.poison,
            inner_backend=resolve_backend("inner", cfg.train.backends.inner, flat.data.device),
            outer_backend=resolve_backend("outer", cfg.train.backends.outer, flat.data.device),
        )
        return HierarchicalSync(settings, identity, t, flat, opt, tracker, pub.event, faults, group=grp.pg, group_store=grp.store,
                                job_done=job_done_check(cfg, identity))

    from hier_localsgd.sync.baselines import DDPSync, FlatSync

    common = dict(
        identity=identity,
        replicas_per_cluster=cfg.topology.replicas_per_cluster,
        timeouts=t,
        flat=flat,
        optimizer=opt,
        tracker=tracker,
        events=pub.event,
        global_lighthouse=cfg.lighthouse.global_addr,
        hostname=hostname,
        max_quorum_failures=s.max_quorum_failures,
        max_commit_failures=s.max_commit_failures,
        link_spec=cfg.link_spec("outer"),
        backend=resolve_backend("outer", cfg.train.backends.outer, flat.data.device),
    )
    if s.mode == "ddp":
        return DDPSync(**common)
    f = s.flat
    return FlatSync(**common, model=model, algorithm=f.algorithm, every=f.every, lr=f.lr, momentum=f.momentum, nesterov=f.nesterov, delay=f.delay,
                    fragments=f.fragments)


def wait_for_gate(path: str, timeout_s: float) -> None:
    """Local jobs start every replica group together: the launcher creates ``path``
    once all are ready (Managers heartbeating). Bounded by ``timeouts.startup``."""
    if not path:
        return
    deadline = time.time() + timeout_s
    while not os.path.exists(path):
        if time.time() > deadline:
            logger.warning("start gate %s not opened after %.0fs; starting anyway", path, timeout_s)
            return
        time.sleep(0.1)


def _bytes_by_level(stats: Dict[str, Any]) -> Dict[str, float]:
    return {level: st["sent_bytes_total"] for level, st in stats.items()}


def trimmed_mean(xs: list, warmup: int = 3) -> float | None:
    """Mean step time, skipping the first steps (allocator and cache warm-up)."""
    xs = xs[warmup:]
    return sum(xs) / len(xs) if xs else None


def train(cfg: Config, rt: Runtime) -> Dict[str, Any]:
    """Trains one replica group to ``train.steps`` and returns its result record.

    A group that finds the job already finished without it (at start-up, or when its
    quorums keep failing: :class:`JobFinished`) says so in one line and returns without
    a result, so the process exits 0 and no launcher restarts it."""
    done = job_done_check(cfg, Identity(cfg.run.cluster, cfg.run.replica))()
    if done:
        logger.warning("c%dr%d: %s; exiting", cfg.run.cluster, cfg.run.replica, done)
        return {"job_finished": done}
    try:
        return _train(cfg, rt)
    except JobFinished as e:
        logger.warning("c%dr%d: %s; exiting", cfg.run.cluster, cfg.run.replica, e)
        return {"job_finished": str(e)}


@dataclass
class Built:
    """What the loop trains: the model (``fwd`` wraps it for the forward pass: DDP inside a
    multi-rank group, torch.compile), its parameters as the sync sees them, the inner
    optimizer, and this rank's TP group (group.parallel=tp)."""

    model: torch.nn.Module
    fwd: torch.nn.Module
    flat: Any  # FlatParams, or train/fsdp.ShardedParams
    opt: torch.optim.Optimizer
    tp: Any = None


def build_trainee(cfg: Config, grp: GroupContext, device: torch.device, vocab_size: int) -> Built:
    """Model, parameters and inner optimizer, built on the CPU from the seed (identical
    everywhere), then moved to train.device in train.param_dtype (fp32 master weights)."""
    tr = cfg.train
    tp = None
    model = build_model(cfg.model.name, vocab_size, tr.seq_len, cfg.model.dim, tr.seed).to(device=device, dtype=DTYPES[tr.param_dtype])
    if cfg.group.parallel == "tp":
        from hier_localsgd.train.tp import group_tp, shard_llama3

        tp = group_tp(cfg, grp.pg, grp.rank, grp.size)
        shard_llama3(model, tp, cfg.group.tp_variant)
    fsdp = grp.pg is not None and tp is None and cfg.group.sharding == "fsdp"
    if fsdp:  # FSDP2 inside the group; each rank syncs its own shard (train/fsdp.py)
        from hier_localsgd.train.fsdp import ShardedParams, shard_model

        shard_model(model, grp.pg, device)
        flat: Any = ShardedParams(model)
    else:
        # Gradients as one flat buffer for the ddp baseline, which all-reduces it across replica groups.
        flat = FlatParams(model, flat_grads=cfg.sync.mode == "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=tr.lr, betas=(tr.beta1, tr.beta2), weight_decay=tr.weight_decay)
    # Data parallel inside a multi-rank replica group: torch DDP over the group's own process
    # group (bucketed gradient averaging overlapped with backward), never across the
    # fault-tolerant dimension.
    fwd: torch.nn.Module = model
    if grp.pg is not None and tp is None and not fsdp:
        from torch.nn.parallel import DistributedDataParallel

        fwd = DistributedDataParallel(model, process_group=grp.pg, forward_sync_buffers=False,
                                      device_ids=[device.index] if device.type == "cuda" else None)
    if tr.compile:
        fwd = torch.compile(fwd)  # type: ignore[assignment]
    return Built(model, fwd, flat, opt, tp)


def publisher(cfg: Config, rt: Runtime, identity: Identity, grp: GroupContext) -> ReplicaPublisher:
    """The replica's status file and event log; closed with the process's exit reason."""
    lighthouses = {"global": cfg.lighthouse.global_addr}
    if cfg.sync.mode == "hier":
        lighthouses["cluster"] = cfg.lighthouse.cluster_addrs[identity.cluster]
    pub = ReplicaPublisher(
        cfg.run.dir,
        identity.cluster,
        identity.replica,
        {"cluster": identity.cluster, "replica": identity.replica, "mode": cfg.sync.mode, "steps_total": cfg.train.steps,
         "lighthouses": lighthouses, "group_rank": grp.rank,
         "topology": {"clusters": cfg.topology.clusters, "replicas_per_cluster": cfg.topology.replicas_per_cluster, "ranks_per_replica": grp.size}},
        rank=grp.rank,
    )

    def closing(code: int, reason: str) -> None:
        if code == EXIT_WATCHDOG:  # a hang: hier-localsgd chaos counts these
            pub.event("watchdog", reason=reason, pid=os.getpid())
        pub.close("done" if code == 0 else f"failed ({reason})")

    rt.on_exit(closing)
    return pub


def open_checkpoints(cfg: Config, rt: Runtime, identity: Identity, grp: GroupContext, device: torch.device,
                     pub: ReplicaPublisher, sync: SyncStrategy) -> Optional[Checkpointer]:
    """The durable checkpoints (checkpoint.*), resuming ``sync`` from the newest usable one."""
    ck = cfg.checkpoint
    if not (ck.every or ck.resume):
        return None
    ckpt = Checkpointer(ck.dir or os.path.join(cfg.run.dir, "checkpoints"), identity.cluster, identity.replica, ck.keep, pub.event, rank=grp.rank,
                        layout={"ranks_per_replica": grp.size, "device": device.type})
    rt.on_exit(lambda code, reason: ckpt.wait(timeout_s=60.0))
    if ck.resume:
        payload = ckpt.load_latest()
        if payload is not None:
            sync.restore(payload["state"])  # type: ignore[attr-defined]  # hier only (config.py)
            set_rng_state(payload["state"]["rng"])
            logger.info("%s resumed at step %d (outer round %d)", identity, sync.counters.step, sync.counters.outer_round)
        else:
            logger.warning("%s: checkpoint.resume=true but no usable checkpoint under %s; starting fresh", identity, ckpt.dir)
    return ckpt


def injected_loop_fault(plan: FaultPlan, step: int, model: torch.Tensor, pub: ReplicaPublisher) -> None:
    """faults=[...] actions of the training loop itself (phase LOCAL), and one handed over
    through the inbox (run.fault_inbox): poison the model, then raise, then hang, then exit."""
    plan.from_inbox(step)
    for action in ("poison", "raise", "hang", "exit"):
        f = plan.take(step, Phase.LOCAL.value, (action,))
        if f is not None:
            if action == "poison":
                pub.event("fault", action="poison", how=f.how, phase=Phase.LOCAL.value, step=step)
            fire(f, f"the training loop at step {step}", block=True, model=model)


def _train(cfg: Config, rt: Runtime) -> Dict[str, Any]:
    """Set-up, the loop, the result: one function on purpose (a newcomer reads the whole
    training of a replica group here in one sitting, as in nanoGPT); the parts that are not
    the loop itself live in the functions above and below."""
    t0 = time.time()
    identity = Identity(cfg.run.cluster, cfg.run.replica)
    tr = cfg.train
    device = process_device(cfg)
    grp = group_context(cfg, cfg.timeouts_obj(), device)
    ran_before = trained_before(cfg, identity, grp.rank)  # before the publisher overwrites the status
    pub = publisher(cfg, rt, identity, grp)
    LOG_TAG.set_role("member")
    tracker = PhaseTracker(
        describe=str(identity) + (f"g{grp.rank}" if grp.size > 1 else ""),
        listeners=[pub.on_transition, lambda tr, snap: LOG_TAG.set_role("leader" if snap.get("leader") else "member")],
    )
    rt.watch(tracker)
    torch.set_num_threads(tr.threads)
    tb = Scalars(cfg, identity)
    rt.on_exit(lambda code, reason: tb.close())

    # -- data, model, inner optimizer -------------------------------------------
    data = build_data(cfg, 0 if cfg.group.parallel == "tp" else grp.rank, device)  # TP ranks share their group's batches
    b = build_trainee(cfg, grp, device, data.vocab_size)
    model, fwd, flat, opt, tp = b.model, b.fwd, b.flat, b.opt, b.tp
    eval_set = data.eval_batches()
    floor = data.entropy_floor
    eval_start = evaluate(model, eval_set, tr.precision)
    pub.update(model_params=flat.numel, model_bytes=flat.nbytes, entropy_floor=floor, eval_loss_start=eval_start)
    pub.event("eval", step=0, loss=eval_start, floor=floor)
    tb.add(0, eval__loss=eval_start, eval__excess=None if floor is None else eval_start - floor)

    # -- sync strategy (hier / flat / ddp) --------------------------------------------
    wait_for_lighthouse(cfg, identity, ran_before)
    plan = FaultPlan(cfg.fault_list(), identity.cluster, identity.replica, grp.rank,  # the loop's and the sync phases' faults (this rank's)
                     inbox=inbox_path(cfg.run.dir, identity.cluster, identity.replica) if cfg.run.fault_inbox and grp.rank == 0 else None)
    sync = build_strategy(cfg, identity, flat, model, opt, tracker, pub, grp, plan)
    rt.add_closer(sync.close)
    c = sync.counters
    ck = cfg.checkpoint
    ckpt = open_checkpoints(cfg, rt, identity, grp, device, pub, sync)
    last_ckpt_round = c.outer_round
    pub.update(state="ready")
    wait_for_gate(cfg.run.start_gate, cfg.timeouts_obj().startup.total_seconds())
    pub.update(state="running")
    sync.start()  # join round: a restarted group heals here, before any local step
    loss_val = float("nan")
    local_step_times: list = []  # durations of steps without a sync (overhead measurements)
    t_loop, step_loop = time.perf_counter(), c.step

    while c.step < tr.steps:
        sync.before_forward()  # ddp: quorum (and heal) for this step
        injected_loop_fault(plan, c.step, flat.data, pub)
        t_step = time.time()
        t_perf = time.perf_counter()
        x, y = data.batch(c.step)
        loss = lm_loss(fwd, x, y, tr.precision)
        loss.backward()  # with G > 1 ranks, DDP has averaged the gradients across the group on return
        if sync.before_optimizer_step():  # ddp: gradient all-reduce + commit vote
            opt.step()
        if flat.grad is not None:
            flat.zero_grad()
        else:
            opt.zero_grad()
        if tr.min_step_time_s > 0:  # emulated compute: pad the step
            time.sleep(max(0.0, tr.min_step_time_s - (time.time() - t_step)))
        c.step += 1  # every replica advances its own step counter (I5)
        synced = sync.after_optimizer_step()  # hier/flat: a sync round at round boundaries
        if not synced:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the step's kernels, not just their launch
            local_step_times.append(time.perf_counter() - t_perf)
        if ckpt is not None and ck.every and c.outer_round > last_ckpt_round and c.outer_round % ck.every == 0:
            last_ckpt_round = c.outer_round  # right after the outer round committed
            ckpt.save_async(c.step, {**sync.snapshot(), "rng": rng_state()})  # type: ignore[attr-defined]
        loss_val = float(loss.detach())
        # Every step: a killed process's last status says how much work it had done.
        pub.update(step=c.step, loss=loss_val, loss_step=c.step, **sync.work_counters())
        if c.step % tr.log_every == 0 or c.step == tr.steps:
            log_progress(identity, tr, c, loss_val, sync, pub, tb, tp)
        if tr.eval_every and c.step % tr.eval_every == tr.eval_offset and c.step < tr.steps:
            t_eval = time.perf_counter()
            ev = evaluate(model, eval_set, tr.precision)  # eval_s: the bench takes evaluation time out of its time axis
            pub.event("eval", step=c.step, loss=ev, floor=floor, bytes=_bytes_by_level(sync.link_stats()), eval_s=time.perf_counter() - t_eval)
            pub.update(eval_loss=ev, eval_step=c.step)
            tb.add(c.step, eval__loss=ev, eval__excess=None if floor is None else ev - floor)

    sync.finish()  # hier: a final round skipped for an outage reconciles the cluster first
    loop_s = time.perf_counter() - t_loop  # every step, syncs included
    # -- final evaluation and result ---------------------------------------------
    final = evaluate(model, eval_set, tr.precision)
    pub.event("eval", step=c.step, loss=final, floor=floor, bytes=_bytes_by_level(sync.link_stats()))
    tb.add(c.step, eval__loss=final, eval__excess=None if floor is None else final - floor)
    result = {
        **result_of(cfg, identity, grp.rank, c, sync, flat, tp),
        "eval_loss_start": eval_start, "eval_loss": final, "entropy_floor": floor, "train_loss": loss_val,
        "local_step_s": trimmed_mean(local_step_times), "local_steps_timed": len(local_step_times),
        "step_s": loop_s / max(1, c.step - step_loop),  # mean over the loop, syncs included
        "device": str(device), **memory_stats(device),
        "wall_s": time.time() - t0,
    }
    flat.check_in_place()
    if ckpt is not None:
        ckpt.wait()
        result["checkpoint_errors"] = ckpt.errors
    pub.result(result)
    pub.update(state="finished", eval_loss=final, eval_step=c.step, loss=loss_val, link=sync.link_stats())
    tracker.enter(Phase.STOPPED, None, reason="finished")
    logger.info("%s finished: eval loss %.4f (floor %s) checksum %s", identity, final, floor, result["checksum"])
    return result


def log_progress(identity: Identity, tr: Any, c: Any, loss_val: float, sync: SyncStrategy, pub: ReplicaPublisher, tb: "Scalars", tp: Any) -> None:
    """Every train.log_every steps: the log line, status, a loss event and TensorBoard scalars."""
    logger.info("%s step %d/%d loss %.4f inner_round %d outer_round %d%s", identity, c.step, tr.steps, loss_val, c.inner_round, c.outer_round, " leader" if sync.leader else "")
    links = sync.link_stats()
    pub.update(loss=loss_val, loss_step=c.step, link=links, **({"tp": tp.stats()} if tp is not None else {}))
    pub.event("loss", step=c.step, loss=loss_val)
    work = sync.work_counters()
    tb.add(c.step, train__loss=loss_val, sync__inner_round=c.inner_round, sync__outer_round=c.outer_round,
           work__steps_discarded=work.get("steps_discarded"),
           **{f"link__{lv}_bytes": st["sent_bytes_total"] for lv, st in links.items()})


def result_of(cfg: Config, identity: Identity, rank: int, c: Any, sync: SyncStrategy, flat: Any, tp: Any) -> Dict[str, Any]:
    """The result's fields that describe the replica group and its final model."""
    tr = cfg.train
    return {
        "cluster": identity.cluster, "replica": identity.replica, "group_rank": rank, "mode": cfg.sync.mode,
        "steps": c.step, "inner_rounds": c.inner_round, "outer_rounds": c.outer_round, "leader": sync.leader,
        "checksum": checksum(flat.data), "finite": bool(torch.isfinite(flat.data).all()),
        "model_params": flat.numel, "model_bytes": flat.nbytes,
        "link": sync.link_stats(),
        **({"tp": tp.stats(), "tp_variant": cfg.group.tp_variant} if tp is not None else {}),
        "work": sync.work_counters(),
        "tokens_per_step": tr.batch_size * tr.seq_len,  # per rank
        "precision": tr.precision, "param_dtype": str(flat.data.dtype),
    }
