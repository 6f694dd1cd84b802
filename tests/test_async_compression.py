"""Compressed pushes of the asynchronous outer level (``sync.outer.compression`` with
``sync.async_outer.enabled``): the codec with its error feedback over many pushes through
the wire format, refused payloads, the server's merge of a compressed push against a hand
computation, and a real 2 x 2 job whose leader restarts and heals the residual."""

from __future__ import annotations

import signal

import pytest
import torch

from hier_localsgd.core.security.wire import decode as wire_decode, encode as wire_encode
from hier_localsgd.core.tensors.compress import Quantized, error_bound, quantized_nbytes
from hier_localsgd.core.tensors.level import LevelAlgorithm
from hier_localsgd.sync.compression import OuterCompression, decode_push, push_bytes
from hier_localsgd.sync.global_server import GlobalModelServer
from hier_localsgd.sync.global_wire import GlobalModelUnavailable, call

N = 1000  # not a multiple of the block: the last block is padded
M = 20_000  # the server's model: large enough that a body's header is small beside it


def _over_the_wire(payload: dict) -> dict:
    b = wire_encode(payload).to_bytes()
    return wire_decode(bytearray(b), len(b))


@pytest.mark.parametrize("fmt", ["int8", "fp8", "topk2"])
def test_pushes_deliver_their_work_less_the_residual_over_many_pushes_and_a_refused_push_keeps_it(fmt):
    """Per merged push ``decoded + ρ' = delta + ρ`` (error feedback); over 60 pushes the
    decoded sum is the delta sum less the last residual; a refused push (every 7th) leaves
    the committed residual as it was; int8's residual never exceeds half a step of its block."""
    comp = OuterCompression(fmt, 64, N, topk=4)
    g = torch.Generator().manual_seed(0)
    sent, got = torch.zeros(N, dtype=torch.float64), torch.zeros(N, dtype=torch.float64)
    for i in range(60):
        delta = torch.randn(N, generator=g) * (0.1 + i % 3)
        before = comp.residual.clone()
        payload = _over_the_wire(comp.encode_push(delta))
        decoded = decode_push(payload, N)
        if i % 7 == 3:
            comp.rollback()
            comp.commit()  # nothing staged any more: the committed residual stays
            assert torch.equal(comp.residual, before)
            continue
        comp.commit()
        torch.testing.assert_close(decoded + comp.residual, delta + before, rtol=0, atol=1e-5)
        if fmt == "int8":
            q = Quantized(codes=payload["codes"], scales=payload["scales"], numel=N, fmt=fmt, block=64)
            assert bool((comp.residual.abs() <= error_bound(delta + before, q)).all())
        sent += delta.double()
        got += decoded.double()
    torch.testing.assert_close(got, sent - comp.residual.double(), rtol=0, atol=1e-4)
    assert float(comp.residual.abs().max()) > 0  # something was left to feed back
    nbytes = sum(t.numel() * t.element_size() for t in payload.values() if isinstance(t, torch.Tensor))
    assert nbytes == push_bytes(N, fmt, 64, 4) < 4 * N / 3


@pytest.mark.parametrize("change, field", [
    (lambda d: "int8", "delta: expected a tensor or a compressed payload"),
    (lambda d: {**d, "fmt": "int4"}, "delta.fmt: 'int4'"),
    (lambda d: {**d, "block": 0}, "delta.block: 0"),
    (lambda d: {**d, "numel": N + 1}, f"delta.numel: {N + 1}, the model has {N}"),
    (lambda d: {**d, "codes": d["codes"][:-1]}, "delta.codes: expected"),
    (lambda d: {**d, "codes": d["codes"].to(torch.int16)}, "delta.codes: expected"),
    (lambda d: {**d, "scales": d["scales"].double()}, "delta.scales: expected"),
    (lambda d: {**d, "scales": d["scales"][:3]}, "delta.scales: expected"),
])
def test_a_malformed_int8_push_is_refused_in_one_line_naming_the_field(change, field):
    good = OuterCompression("int8", 64, N).encode_push(torch.randn(N))
    with pytest.raises(ValueError) as e:
        decode_push(change(good), N)
    assert str(e.value).startswith(field) and "\n" not in str(e.value), str(e.value)


def test_a_malformed_topk2_push_is_refused_in_one_line():
    """Every malformed field is a ValueError (the server answers 400), never an indexing
    error inside the decoder."""
    good = OuterCompression("topk2", 64, N, topk=4).encode_push(torch.randn(N))
    far = good["payload"].clone()
    far[0] = 64  # the first kept position, one past its chunk of 64
    for bad, field in (({**good, "topk": 65}, "delta.topk: 65"), ({**good, "payload": good["payload"][:-1]}, "delta.payload: expected"),
                       ({**good, "block": 512}, "delta.block: 512"), ({**good, "payload": far}, "delta.payload: a position outside"),
                       ({**good, "numel": torch.tensor([N, N])}, "delta.numel: tensor")):
        with pytest.raises(ValueError) as e:
            decode_push(bad, N)
        assert str(e.value).startswith(field) and "\n" not in str(e.value), str(e.value)


def test_the_server_merges_a_compressed_push_as_its_decoded_delta_and_refuses_a_bad_one():
    """One cluster (C = 1), full tokens: the new model is ``θ − lr·(g + μ·g)`` (Nesterov,
    first step) with ``g`` the decoded delta, by hand; a push for another model size is
    answered 400 and merges nothing."""
    alg = LevelAlgorithm.build("diloco", lr=0.7, momentum=0.9, nesterov=True)
    srv = GlobalModelServer("127.0.0.1", 0, algorithm=alg, full_tokens=10, max_staleness=4, clusters=1, grace_s=0.5,
                            min_clusters=1, final_wait_s=30.0, key=b"k" * 32)
    try:
        url = f"http://127.0.0.1:{srv.port}"
        init = torch.linspace(-1, 1, M)
        comp = OuterCompression("int8", 64, M)
        payload = comp.encode_push(torch.linspace(0, 2, M) ** 2)
        ans = call(url, "/push", {"cluster": 0, "base": 0, "tokens": 10.0, "final": False, "delta": payload, "model": init},
                   b"k" * 32, 30.0)
        g = decode_push(payload, M)
        assert (ans["version"], ans["weight"]) == (1, 1.0)
        torch.testing.assert_close(ans["model"], init - 0.7 * (g + 0.9 * g), rtol=0, atol=1e-6)
        # The request's body on the socket: the int8 delta (M bytes and a scale per 64)
        # where an fp32 push sends 4 M, each with the same header.
        sent = {}
        for delta in (comp.encode_push(torch.ones(M)), torch.ones(M)):
            sizes: dict = {}
            call(url, "/push", {"cluster": 0, "base": 1, "tokens": 0.0, "final": False, "delta": delta, "model": None}, b"k" * 32,
                 30.0, sizes)
            sent[type(delta).__name__] = sizes["sent"]
        assert push_bytes(M, "int8", 64) < sent["dict"] < push_bytes(M, "int8", 64) + 1024 < sent["Tensor"] / 3, sent
        bad = OuterCompression("int8", 64, M - 1).encode_push(torch.ones(M - 1))
        with pytest.raises(GlobalModelUnavailable, match="answered 400"):
            call(url, "/push", {"cluster": 0, "base": 1, "tokens": 10.0, "final": False, "delta": bad, "model": None}, b"k" * 32, 30.0)
        assert srv.status()["version"] == 1
    finally:
        srv.shutdown()


def test_a_leaders_push_commits_the_residual_only_when_the_server_merged_it():
    """AsyncOuter.run, a real leader (HierarchicalSync over real lighthouses) against a real
    server: a merged push (after the fresh server asked for the model) commits a new
    residual; a push the server merges nothing of (no group-steps: weight 0) and a push
    the server does not answer (shut down) keep it."""
    from dataclasses import replace
    from datetime import timedelta

    from harness import ThreadedHier, Vec

    from hier_localsgd.core.runtime.faults import FaultPlan
    from hier_localsgd.core.runtime.phases import Phase, PhaseTracker
    from hier_localsgd.core.tensors.flat_params import FlatParams
    from hier_localsgd.sync.async_outer import AsyncOuterSettings
    from hier_localsgd.sync.build import hier_settings
    from hier_localsgd.sync.common import Status
    from hier_localsgd.sync.hier import HierarchicalSync, Identity

    alg = LevelAlgorithm.build("diloco", lr=0.7, momentum=0.9, nesterov=True)
    srv = GlobalModelServer("127.0.0.1", 0, algorithm=alg, full_tokens=10, max_staleness=4, clusters=1, grace_s=0.2,
                            min_clusters=1, final_wait_s=30.0, key=None)
    th = ThreadedHier(1, 1, 5, 2, numel=N, outer_compression="int8")
    sync, up = None, True
    try:
        model = Vec(th.numel)
        flat = FlatParams(model)
        sync = HierarchicalSync(
            replace(hier_settings(th.cfg, Identity(0, 0), flat, model), **th.direct), Identity(0, 0), th.t, flat,
            torch.optim.SGD(model.parameters(), lr=0.1), PhaseTracker(describe="c0r0"), lambda kind, **kw: None,
            FaultPlan([], 0, 0), async_outer=AsyncOuterSettings(f"http://127.0.0.1:{srv.port}", None, timedelta(seconds=1)))
        a, comp = sync.outer_level.asynchronous, sync.st.comp
        assert a is not None and comp is not None and comp.fmt == "int8"
        g = torch.Generator().manual_seed(1)

        def push(tokens: float):
            a.tokens = tokens
            cluster_model = sync.st.outer.backup - torch.randn(N, generator=g)  # a pseudo-gradient of N(0, 1)
            tr = sync.st.tracker
            tr.enter(Phase.LOCAL)  # a round's phases up to its outer round (phases.py)
            tr.enter(Phase.INNER_QUORUM)
            return a.run(cluster_model, contribute=True, inner_ok=True, tr=tr)

        assert torch.count_nonzero(comp.residual) == 0
        r = push(10.0)
        assert r.status == Status.OUTER_COMMITTED and r.cluster_weight > 0
        after_merge = comp.residual.clone()
        assert torch.count_nonzero(after_merge) > N // 2  # int8 leaves an error in almost every element
        r = push(0.0)
        assert r.status == Status.OUTER_COMMITTED and r.cluster_weight == 0.0
        assert torch.equal(comp.residual, after_merge)
        srv.shutdown()
        up = False
        r = push(10.0)
        assert r.status == Status.INNER_ONLY
        assert torch.equal(comp.residual, after_merge)
    finally:
        if sync is not None:
            sync.close()
        th.close()
        if up:
            srv.shutdown()


@pytest.mark.slow
def test_int8_pushes_carry_the_compressed_bytes_and_a_restarted_leader_heals_the_residual(tmp_path):
    """2 x 2, asynchronous, int8 pushes. c0r0 (cluster 0's leader) is killed at step 20 and
    restarted; its cluster waits for it (WAIT_FOR_RESTART), it heals from c0r1 with the
    cluster's residual (a heal without it logs "starting from zeros"), leads again and its
    pushes merge; the job ends on one model; the leaders' pushes carried int8 deltas."""
    from harness import WAIT_FOR_RESTART, logs_tail, run_job, when_step

    killer = when_step((0, 0), 20, lambda job: job.kill((0, 0), signal.SIGKILL))
    run = run_job(tmp_path, ["sync.async_outer.enabled=true", "sync.inner.every=5", "sync.outer.every=2", "train.min_step_time_s=0.1",
                             "train.steps=60", "sync.outer.compression=int8", *WAIT_FOR_RESTART,
                             # the server's wait for a silent cluster at the end outlasts any cold restart
                             "sync.final_wait_s=240"],
                  during=killer, restart=True, timeout_s=400)
    assert killer.fired.get("done") and all(code == 0 for code in run.codes.values()), logs_tail(run)
    restarted = max(h["t"] for h in run.job.history if h["event"] == "restart" and h["key"] == (0, 0))
    heal = [e for e in run.kinds((0, 0), "heal", level="inner") if e["t"] > restarted]
    assert heal, logs_tail(run)
    log = (run.job.run_dir / "logs" / "c0r0.log").read_text(errors="replace")
    assert "starting from zeros" not in log, log[-3000:]
    merged = [e for e in run.kinds((0, 0), "commit", level="outer") if "base" in e and e["t"] > heal[0]["t"] and e["weight"] > 0]
    assert merged, "the restarted leader's pushes never merged"
    n = run.summary["model_params"]
    for k in ((0, 0), (1, 0)):  # the leaders' pushes (a registration of the model alone has no delta)
        pushed = run.job.result(k)["link"]["outer"]["tensor_bytes"]["push/payload"]
        assert pushed > 0 and pushed % quantized_nbytes(n, "int8", 256) == 0, (k, pushed, n)
    # The model came down as int8 steps (sync.async_outer.compress_down, on by default) at
    # most pushes: whole only at a leader's first push, after its restart, or behind more
    # versions than the server keeps steps for; and yet the job ended on one model.
    pushes = [e for k in ((0, 0), (1, 0)) for e in run.kinds(k, "commit", level="outer") if "base" in e]
    stepped = [e for e in pushes if e.get("down_steps") is not None]
    assert len(stepped) >= len(pushes) // 2 and any(e["down_steps"] >= 1 for e in stepped), pushes
    done = {k: run.kinds(k, "async_final", state="done") for k in run.job.keys()}
    assert all(len(v) == 1 for v in done.values()) and len({v[0]["outer_round"] for v in done.values()}) == 1, done
    assert run.summary["consistent"] is True
