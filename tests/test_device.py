"""Devices (#15): train.device, per-level backends, host state, bf16 autocast, checkpoint layout.

Every device-agnostic path runs here on the CPU; the paths that need a GPU are in the
``cuda`` tests at the end, skipped with their reason where CUDA is absent
(benchmarks/gpu_check.sh runs them on a GPU machine).
"""

from datetime import timedelta

import pytest
import torch
from torch.distributed import AllreduceOptions, BroadcastOptions, ReduceOp, TCPStore

from harness import logs_tail, run_job
from hier_localsgd.config import ConfigError, load_config
from hier_localsgd.core.runtime.checkpoint import Checkpointer, LayoutMismatch
from hier_localsgd.core.runtime.choices import resolve_backend
from hier_localsgd.core.runtime.device import host_copy, host_state, one_host_backends, resolve_device
from hier_localsgd.core.tensors.level import Level, LevelAlgorithm
from hier_localsgd.core.links.link import LinkProcessGroup
from hier_localsgd.core.links.lossy import LinkEmulation, LinkSpec, LossModel
from hier_localsgd.train.data import DeviceData, MarkovChain, MarkovData
from hier_localsgd.train.model import build_model, lm_loss

NO_CUDA = "needs a CUDA device (torch.cuda.is_available() is False); benchmarks/gpu_check.sh runs it on a GPU machine"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


# -- configuration ------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["train.device=gpu"], "train.device", "expected one of"),
        (["train.device=cpu", "train.backends.inner=nccl"], "train.backends.inner", "needs a CUDA device"),
        (["train.device=cpu", "train.backends.outer=nccl_inproc"], "train.backends.outer", "needs a CUDA device"),
        (["train.backends.group=nccl_inproc"], "train.backends.group", "expected one of"),
        (["train.precision=fp16"], "train.precision", "expected one of"),
        (["train.param_dtype=fp8"], "train.param_dtype", "expected one of"),
    ],
)
def test_bad_device_settings_name_the_field_in_one_line(overrides, field, words):
    with pytest.raises(ConfigError) as e:
        load_config(["model=tiny", *overrides])
    msg = str(e.value)
    assert msg.startswith(field) and words in msg and "\n" not in msg, msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_is_refused_for_training_commands_only():
    with pytest.raises(ConfigError, match=r"^train.device: cuda requested but torch.cuda.is_available\(\) is False"):
        load_config(["model=tiny", "train.device=cuda"], validate_for="demo")
    # `plan` does not train here: naming cuda for another machine is fine
    assert load_config(["model=tiny", "train.device=cuda"], validate_for="plan").train.device == "cuda"
    assert resolve_device("auto") == torch.device("cpu")


def test_backend_defaults_per_level_and_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
    assert [resolve_backend(lv, "auto", cpu) for lv in ("group", "inner", "outer")] == ["gloo", "gloo", "gloo"]
    assert [resolve_backend(lv, "auto", cuda) for lv in ("group", "inner", "outer")] == ["nccl", "nccl", "gloo"]
    assert resolve_backend("outer", "nccl", cuda) == "nccl"
    with pytest.raises(ValueError, match="^train.backends.inner: nccl needs a CUDA device"):
        resolve_backend("inner", "nccl", cpu)


def test_the_local_launcher_keeps_cpu_backends_as_configured():
    auto = {"group": "auto", "inner": "auto", "outer": "auto"}
    assert one_host_backends("cpu", auto, 2) == {}


@cuda_only
def test_the_local_launcher_picks_gloo_for_groups_sharing_a_gpu():
    auto = {"group": "auto", "inner": "auto", "outer": "auto"}
    assert one_host_backends("cuda", auto, 1) == {"inner": "gloo", "outer": "gloo"}
    assert one_host_backends("cuda", {**auto, "inner": "nccl"}, 1) == {"outer": "gloo"}  # explicit choices kept
    assert one_host_backends("cuda", auto, torch.cuda.device_count() + 1)["group"] == "gloo"


# -- placement on a host with several GPUs (the count faked where it is read) -------------
def test_each_group_on_a_host_gets_gpus_of_its_own_or_a_one_line_refusal():
    from hier_localsgd.core.runtime.device import group_gpus

    assert [group_gpus(slot, 2, 8) for slot in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match=r"^train.gpu_slot: 2 — group slot 2 of 2 rank\(s\) needs GPUs 4..5, this host has 4"):
        group_gpus(2, 2, 4)
    assert [group_gpus(slot, 1, 2, share=True) for slot in range(4)] == [[0], [1], [0], [1]]


@pytest.fixture
def fake_gpus(monkeypatch):
    """This CPU machine pretends to have ``n`` GPUs at the one place the count is read."""
    import hier_localsgd.core.runtime.device as device

    def fake(n: int) -> None:
        monkeypatch.setattr(device, "cuda_available", lambda: n > 0)
        monkeypatch.setattr(device, "gpu_count", lambda: n)

    return fake


def test_the_local_launcher_places_every_group_on_its_own_gpu(tmp_path, fake_gpus):
    from hier_localsgd.launch.local import LocalJob

    fake_gpus(8)
    over = ["model=tiny", "train.device=cuda", "topology.ranks_per_replica=2", f"run.dir={tmp_path}"]
    job = LocalJob(load_config(over, validate_for="plan"), over, free_ports=True)
    assert [job._gpu_slot(c, r) for c in (0, 1) for r in (0, 1)] == [[f"train.gpu_slot={i}"] for i in range(4)]
    # every process its own GPU: nothing forced; each process resolves auto itself (NCCL
    # inner, Gloo outer: resolve_backend)
    assert job._backend_overrides() == []


def test_the_local_launcher_refuses_a_host_with_too_few_gpus_unless_asked_to_share(tmp_path, fake_gpus):
    from hier_localsgd.errors import ConfigError
    from hier_localsgd.launch.local import LocalJob

    fake_gpus(2)
    over = ["model=tiny", "train.device=cuda", f"run.dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"^train.share_gpus: false — this host has 2 GPU\(s\) and the job's 4 processes"):
        LocalJob(load_config(over, validate_for="plan"), over, free_ports=True)
    shared = [*over, "train.share_gpus=true"]
    job = LocalJob(load_config(shared, validate_for="plan"), shared, free_ports=True)
    assert job._backend_overrides() == ["train.backends.inner=gloo", "train.backends.outer=gloo"]
    # one slot for every group would put them all on the same GPUs
    fake_gpus(8)
    slotted = [*over, "train.gpu_slot=1"]
    with pytest.raises(ConfigError, match=r"^train.gpu_slot: 1 — a local job places each of its groups itself"):
        LocalJob(load_config(slotted, validate_for="plan"), slotted, free_ports=True)


def test_a_process_with_a_slot_takes_its_groups_gpu(fake_gpus):
    import hier_localsgd.core.runtime.device as device

    fake_gpus(4)
    assert device.group_gpus(1, 2, device.gpu_count()) == [2, 3]
    with pytest.raises(ValueError, match="^train.gpu_slot: 2"):
        device.resolve_device("cuda", 0, slot=2, ranks=2)


# -- host state ---------------------------------------------------------------------------
def test_level_state_is_a_host_copy_and_pinning_is_a_no_op_without_cuda():
    live = torch.arange(6, dtype=torch.float32)
    lvl = Level("inner", LevelAlgorithm.build("diloco"), live)
    assert lvl.backup.device.type == "cpu" and lvl.opt.buf is not None and lvl.opt.buf.device.type == "cpu"
    assert lvl.backup.data_ptr() != live.data_ptr() and torch.equal(lvl.backup, live)
    if not torch.cuda.is_available():  # on CPU "pinned" is a no-op: a plain CPU tensor
        assert not lvl.backup.is_pinned() and not host_copy(live, pin=True).is_pinned()
    g = lvl.pseudo_grad(live - 1)
    assert g.device == live.device and torch.equal(g, torch.ones(6))
    staged = lvl.stage(g)
    assert staged.backup.device.type == "cpu"


def test_host_state_is_a_deep_host_copy_of_an_optimizer_state():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.ones(4)
    opt.step()
    snap = host_state(opt.state_dict())
    before = snap["state"][0]["exp_avg"].clone()
    p.grad = torch.full((4,), 3.0)
    opt.step()  # moves the live state, not the snapshot
    assert torch.equal(snap["state"][0]["exp_avg"], before)
    assert snap["param_groups"][0]["lr"] == 0.1
    opt.load_state_dict(snap)  # a rollback restores it
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], before)


def test_device_data_feeds_the_sources_batches_on_the_device():
    src = MarkovData(MarkovChain(16, 2, 0), 0, 0, 2, 8, 2)
    d = DeviceData(src, torch.device("cpu"))
    x, y = d.batch(3)
    sx, sy = src.batch(3)
    assert torch.equal(x, sx) and torch.equal(y, sy) and x.device.type == "cpu"
    assert d.vocab_size == src.vocab_size and len(d.eval_batches()) == 2


# -- bf16 autocast -------------------------------------------------------------------------------------
def _train_tiny(precision: str, steps: int = 60):
    src = MarkovData(MarkovChain(32, 2, 7), 7, 0, 16, 16, 2)
    model = build_model("tiny", src.vocab_size, 16, 32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = src.batch(step)
        loss = lm_loss(model, x, y, precision)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return model, opt, losses


def test_bf16_autocast_trains_on_cpu_with_fp32_master_weights():
    model, opt, losses = _train_tiny("bf16")
    assert sum(losses[-10:]) / 10 < 0.8 * sum(losses[:5]) / 5, losses[::10]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"} == {torch.float32}
    # the autocast really ran in bf16: the logits' dtype under it, and a trajectory unlike fp32's
    x, _ = MarkovData(MarkovChain(32, 2, 7), 7, 0, 16, 16, 2).batch(0)
    from hier_localsgd.train.model import precision_context

    with precision_context(x.device, "bf16"):
        assert model(x).dtype == torch.bfloat16
    _, _, fp32 = _train_tiny("fp32")
    assert losses != fp32


@pytest.mark.slow
def test_a_bf16_hier_job_trains_and_ends_consistent(tmp_path):
    run = run_job(tmp_path, ["train.steps=20", "sync.inner.every=5", "sync.outer.every=2", "train.precision=bf16", "train.device=cpu"])
    assert all(c == 0 for c in run.codes.values()), logs_tail(run)
    s = run.summary
    assert s["consistent"] is True
    assert s["final_eval_loss"] < s["eval_loss_start"]
    results = [run.job.result(k) for k in run.job.keys()]
    assert len(results) == 4
    for r in results:
        assert r["precision"] == "bf16" and r["param_dtype"] == "torch.float32" and r["device"] == "cpu"


# -- checkpoints ----------------------------------------------------------------------------------------
def test_a_checkpoint_of_another_rank_layout_is_refused_naming_both(tmp_path):
    events = lambda *a, **k: None  # noqa: E731
    w = Checkpointer(tmp_path, 0, 0, 3, events, layout={"ranks_per_replica": 1, "device": "cuda"})
    w.save_async(10, {"model": torch.ones(3)})
    w.wait()
    # another device type, same layout: loads (tensors are mapped to the CPU)
    same = Checkpointer(tmp_path, 0, 0, 3, events, layout={"ranks_per_replica": 1, "device": "cpu"}).load_latest()
    assert same is not None and same["state"]["model"].device.type == "cpu"
    with pytest.raises(LayoutMismatch, match="ranks_per_replica=1 .* this job has 2"):
        Checkpointer(tmp_path, 0, 0, 3, events, layout={"ranks_per_replica": 2, "device": "cpu"}).load_latest()


# -- lossy masks on the tensor's device ---------------------------------------------------------------------
def _emu(fill: str) -> LinkEmulation:
    return LinkEmulation(LinkSpec(model=LossModel("bernoulli", p=0.3), fill=fill, where="per_receiver", payload_bytes=16, seed=3), "outer")


@pytest.mark.parametrize("fill", ["zero", "stale", "rescale"])
def test_per_receiver_fill_keeps_every_tensor_on_its_device(fill):
    parts = [torch.arange(37, dtype=torch.float32) * (j + 1) for j in range(3)]
    out = torch.empty(37)
    _emu(fill).reduce_per_receiver([p.clone() for p in parts], 1, [0, 1, 2], out)
    assert out.device == parts[0].device
    assert not torch.equal(out, sum(parts))  # 30 % of 10 packets from each of 2 senders: some lost


@pytest.mark.parametrize("where", ["per_sender", "per_receiver"])
@pytest.mark.parametrize("fill", ["zero", "stale", "rescale"])
def test_loss_masks_made_on_the_host_are_applied_on_the_tensors_device(where, fill):
    """The meta device stands in for a GPU here: index_fill_/index_copy_ refuse an index on
    another device exactly as on CUDA (lossy TP and the link's per-receiver path once
    handed host masks to device tensors, issue #32)."""
    emu = LinkEmulation(LinkSpec(model=LossModel("bernoulli", p=0.5), fill=fill, where=where, payload_bytes=16, seed=1), "group")
    t = torch.empty(64, device="meta")
    lost = torch.tensor([True, False] * 8)  # 16 packets of 4 values, on the host
    arrived = (~lost).to(torch.int32) + 1
    emu.zero_packets(t, lost, 4)
    saved = emu.save_rows(t, arrived, 2, 4)
    emu.fill_per_sender(t, arrived, 2, 4, saved)
    assert all(x.device.type == "meta" for x in saved)


def test_tp_shards_keep_the_models_dtype_and_device():
    """Sharding a model already in bf16 (or on a GPU) keeps each shard there: the shards
    were new fp32 CPU layers, and the flat parameter view refused the mix (H200, issue #32)."""
    from hier_localsgd.core.tensors.flat_params import FlatParams
    from hier_localsgd.train.tp import TPGroup, shard_llama3

    for variant in ("megatron", "naive"):
        model = build_model("llama3_debugmodel", 256, 32, 0, 0).to(torch.bfloat16)
        shard_llama3(model, TPGroup(None, 0, 2), variant)
        assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.bfloat16, "cpu")}, variant
        FlatParams(model)


def test_staging_buffers_are_dropped_with_an_abandoned_group():
    """A pinned staging buffer is reused round to round, but not past an abandoned
    collective, which may still complete into it (issue #32)."""
    pg = LinkProcessGroup("outer", timedelta(seconds=10), backend="gloo")
    t, cpu = torch.zeros(8), torch.device("cpu")
    first = pg._buffer(0, t, cpu)
    assert pg._buffer(0, t, cpu) is first
    pg.retire()
    assert pg._buffer(0, t, cpu) is not first


# -- GPU only --------------------------------------------------------------------------------------------------------
@cuda_only
def test_level_on_cuda_keeps_its_state_in_pinned_host_memory():
    live = torch.randn(1000, device="cuda")
    lvl = Level("outer", LevelAlgorithm.build("diloco"), live)
    assert lvl.backup.device.type == "cpu" and lvl.backup.is_pinned() and lvl.opt.buf.is_pinned()
    g = lvl.pseudo_grad(live + 1)
    assert g.is_cuda and torch.allclose(g, -torch.ones_like(g))


@cuda_only
@pytest.mark.parametrize("fill", ["zero", "stale", "rescale"])
def test_per_receiver_fill_on_cuda_equals_cpu_bit_for_bit(fill):
    parts = [torch.randn(1000, generator=torch.Generator().manual_seed(j)) for j in range(3)]
    out_cpu, out_gpu = torch.empty(1000), torch.empty(1000, device="cuda")
    _emu(fill).reduce_per_receiver([p.clone() for p in parts], 1, [0, 1, 2], out_cpu)
    _emu(fill).reduce_per_receiver([p.cuda() for p in parts], 1, [0, 1, 2], out_gpu)
    assert torch.equal(out_cpu, out_gpu.cpu())


@cuda_only
def test_gloo_link_stages_device_tensors_through_pinned_host_buffers():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = LinkProcessGroup("outer", timedelta(seconds=10), backend="gloo")
    pg.configure(f"127.0.0.1:{store.port}/q1", "r0", 0, 1, quorum_id=1)
    t = torch.arange(5, dtype=torch.float32, device="cuda")
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    pg.allreduce([t], opts).wait()
    b = BroadcastOptions()
    b.rootRank, b.rootTensor = 0, 0
    pg.broadcast([t], b).wait()
    assert t.is_cuda and t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert pg.staged_bytes > 0 and all(buf.is_pinned() for buf in pg._staging.values())


@cuda_only
def test_gloo_link_stages_an_all_to_all_of_device_tensors():
    """alltoall_base (the int8/fp8 outer codec's path) is staged like the other
    collectives: NCCL's send/recv and Gloo take no tensors of the other kind."""
    from torch.distributed.distributed_c10d import AllToAllOptions

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = LinkProcessGroup("outer", timedelta(seconds=10), backend="gloo")
    pg.configure(f"127.0.0.1:{store.port}/q1", "r0", 0, 1, quorum_id=1)
    src, dst = torch.arange(6, dtype=torch.float32, device="cuda"), torch.zeros(6, device="cuda")
    pg.alltoall_base(dst, src, [], [], AllToAllOptions()).wait()
    assert dst.is_cuda and dst.tolist() == src.tolist() and pg.staged_bytes > 0


# -- FSDP2 inside a replica group ------------------------------------------------------------------
G2_SMALL = ["topology.ranks_per_replica=2", "topology.replicas_per_cluster=1", "train.steps=10", "sync.inner.every=5",
            "sync.outer.every=2", "train.device=cpu"]


@pytest.mark.slow
def test_fsdp_in_a_replica_group_on_gloo_matches_the_ddp_run(tmp_path):
    """group.sharding=fsdp (FSDP2 over Gloo on CPU, each rank syncing its own shard across
    groups) trains the same model as ddp (each rank a whole replica, gradients averaged):
    the same averaged gradients, the same elementwise updates, so the loss matches up to
    floating-point reduction order."""
    from hier_localsgd.core.runtime.status import read_json, replica_dir

    ddp = run_job(tmp_path / "ddp", [*G2_SMALL, "group.sharding=ddp"])
    assert all(c == 0 for c in ddp.codes.values()), logs_tail(ddp)
    fsdp = run_job(tmp_path / "fsdp", [*G2_SMALL, "group.sharding=fsdp"])
    assert all(c == 0 for c in fsdp.codes.values()), logs_tail(fsdp)
    # rank k of every group holds the same shard; the two ranks' shards differ
    assert fsdp.summary["consistent"] is True and len(fsdp.summary["checksums"]) == 4
    res = {(c, k): read_json(replica_dir(fsdp.job.run_dir, c, 0, k) / "result.json") for c in (0, 1) for k in (0, 1)}
    assert res[(0, 0)]["checksum"] == res[(1, 0)]["checksum"] != res[(0, 1)]["checksum"] == res[(1, 1)]["checksum"]
    full = read_json(replica_dir(ddp.job.run_dir, 0, 0) / "result.json")["model_params"]
    assert res[(0, 0)]["model_params"] + res[(0, 1)]["model_params"] == full  # two halves of the model
    a, b = ddp.summary["final_eval_loss"], fsdp.summary["final_eval_loss"]
    assert b < fsdp.summary["eval_loss_start"]
    assert abs(a - b) < 1e-4 * a, (a, b)
    assert fsdp.summary["outer_rounds_committed"] == ddp.summary["outer_rounds_committed"] == 1
