"""The asynchronous outer level's model on the way down as quantized steps
(``sync.async_outer.compress_down``, sync/global_model.py): the model is the sum of its
decoded steps, within the error feedback of the fp32 sequence; a leader that adds the
steps since its base gets the server's model bit for bit (through the wire and the real
server); a chain longer than the model, another server life or a mismatched base gets the
model whole."""

from __future__ import annotations

import pytest
import torch

from hier_localsgd.core.tensors.compress import dequantize, error_bound
from hier_localsgd.core.tensors.level import LevelAlgorithm
from hier_localsgd.sync.compression import decode_push, down_format, encode_update
from hier_localsgd.sync.global_model import GlobalModel, apply_update, checksum
from hier_localsgd.sync.global_server import GlobalModelServer
from hier_localsgd.sync.global_wire import call

N = 1000  # not a multiple of the block: the last block is padded
M = 20_000  # the server's model: large enough that a body's header is small beside it
ALG = dict(name="diloco", lr=0.7, momentum=0.9, nesterov=True)


def _alg() -> LevelAlgorithm:
    return LevelAlgorithm.build(**ALG)


def test_the_model_is_the_sum_of_its_decoded_steps_and_a_chain_rebuilds_it_bit_for_bit():
    """Two global models fed the same batches, one fp32, one with int8 steps down: at every
    version the fp32 model minus the compressed one is the server's residual (the error
    feedback), which never exceeds half a quantization step of the last update; from every
    kept version, a copy plus the chain (through the wire format) is the server's model bit
    for bit, with its checksum; the chain stays under the model's bytes (older bases get
    None), the current version's chain is empty, and an adoption drops the chain."""
    g = torch.Generator().manual_seed(0)
    init = torch.randn(N, generator=g)
    fp32 = GlobalModel(_alg(), 10, 4, init, 0, clusters=2)
    down = GlobalModel(_alg(), 10, 4, init, 0, clusters=2, down=("int8", 64))
    seen = {0: down.params.clone()}
    for v in range(1, 13):
        delta = torch.randn(N, generator=g) * (0.05 + v % 3)
        for gm in (fp32, down):
            gm.add(v % 2, gm.version, 10.0, delta)
            assert gm.apply()
        assert down.version == v and down.updates[-1][0] == v
        torch.testing.assert_close(fp32.params - down.params, down.residual, rtol=0, atol=1e-5)
        assert bool((down.residual.abs() <= error_bound(down.residual, down.updates[-1][1])).all())
        assert down.checksum == checksum(down.params)
        seen[v] = down.params.clone()
        kept = 0
        for base in range(v + 1):
            chain = down.chain(base)
            if chain is None:
                continue
            kept += 1
            x = seen[base].clone()
            for q in chain:
                b = encode_update(q)
                apply_update(x, decode_push(b, N))
            assert torch.equal(x, down.params) and checksum(x) == down.checksum, (v, base)
        assert kept >= 2 and down.chain(v) == []  # its own base and at least the one before
        assert sum(q.nbytes for _, q in down.updates) < 4 * N
        assert down.chain(0) is None if v > 3 else down.chain(0) is not None  # int8 + scales: 3 steps fit under fp32
    assert float(down.residual.abs().max()) > 0  # something was left to feed back
    assert torch.equal(down.params, seen[12]) and not torch.equal(down.params, fp32.params)
    down.adopt(fp32.params.clone(), 20)
    assert down.chain(12) is None and down.chain(20) == [] and int(torch.count_nonzero(down.residual)) == 0
    assert down.checksum == checksum(fp32.params)


def test_down_format_follows_the_push_codec_and_the_switch():
    assert down_format("none", True, 256) is None
    assert down_format("int8", False, 256) is None
    assert down_format("int8", True, 128) == ("int8", 128)
    assert down_format("fp8", True, 128) == ("fp8", 128)
    assert down_format("topk2", True, 128) == ("int8", 256)  # topk2's block is its chunk


def test_the_server_answers_a_leader_of_its_life_with_the_steps_since_its_base():
    """A real server with int8 steps down: a push from another server life (its epoch) gets
    the model whole; from this life, with ``down``, the steps since its base (a quarter of
    the bytes) whose sum on the leader's copy gives the checksum and the model a request
    without ``down`` gets; a push again from the same base (not merged twice) gets the
    steps since that base too."""
    key = b"k" * 32
    srv = GlobalModelServer("127.0.0.1", 0, algorithm=_alg(), full_tokens=10, max_staleness=4, clusters=1, grace_s=0.2,
                            min_clusters=1, final_wait_s=30.0, key=key, down=("int8", 64))
    try:
        url = f"http://127.0.0.1:{srv.port}"
        g = torch.Generator().manual_seed(2)
        init = torch.randn(M, generator=g)

        def push(base, epoch, down, model=None):
            sizes: dict = {}
            ans = call(url, "/push", {"cluster": 0, "base": base, "epoch": epoch, "tokens": 10.0, "final": False,
                                      "delta": torch.randn(M, generator=g), "model": model, "down": down}, key, 30.0, sizes)
            return ans, sizes["received"]

        a1, whole = push(0, "", True, model=init)  # a fresh server asks for nothing here: the model comes with the push
        assert a1["version"] == 1 and isinstance(a1["model"], torch.Tensor) and "updates" not in a1
        assert whole > 4 * M
        a2, got = push(1, a1["epoch"], True)
        assert a2["version"] == 2 and a2["model"] is None and len(a2["updates"]) == 1 and got < whole / 3
        x = a1["model"].clone()
        apply_update(x, decode_push(a2["updates"][0], M))
        assert checksum(x) == a2["checksum"] and torch.equal(x, srv.model.params)
        a3, _ = push(1, a1["epoch"], True)  # the same base again: not merged twice
        assert a3["weight"] == 0.0 and a3["version"] == 2 and len(a3["updates"]) == 1
        assert torch.equal(dequantize(srv.model.updates[-1][1]), decode_push(a3["updates"][0], M))
        a4, _ = push(2, "another life", True)
        assert isinstance(a4["model"], torch.Tensor) and "updates" not in a4
        a5, _ = push(3, a1["epoch"], False)
        assert isinstance(a5["model"], torch.Tensor) and torch.equal(a5["model"], srv.model.params)
    finally:
        srv.shutdown()


def test_a_leader_adds_the_steps_to_its_copy_and_asks_whole_after_a_mismatch():
    """AsyncOuter.run, a real leader (HierarchicalSync over real lighthouses) against a real
    server with int8 steps down: each answer after the first carries steps, not the model,
    and the cluster's new model is the server's bit for bit; a copy of the base that is not
    the server's (one element off) fails the checksum: that round is an inner-only round
    (logged), and the next push asks for the model whole and gets the server's."""
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

    srv = GlobalModelServer("127.0.0.1", 0, algorithm=_alg(), full_tokens=10, max_staleness=4, clusters=1, grace_s=0.2,
                            min_clusters=1, final_wait_s=30.0, key=None, down=("int8", 256))
    th = ThreadedHier(1, 1, 5, 2, numel=M, outer_compression="int8")
    sync = None
    events: list = []
    try:
        model = Vec(th.numel)
        flat = FlatParams(model)
        settings = AsyncOuterSettings(f"http://127.0.0.1:{srv.port}", None, timedelta(seconds=1), compress_down=True)
        sync = HierarchicalSync(
            replace(hier_settings(th.cfg, Identity(0, 0), flat, model), **th.direct), Identity(0, 0), th.t, flat,
            torch.optim.SGD(model.parameters(), lr=0.1), PhaseTracker(describe="c0r0"),
            lambda kind, **kw: events.append((kind, kw)), FaultPlan([], 0, 0), async_outer=settings)
        a, st = sync.outer_level.asynchronous, sync.st
        assert a is not None
        g = torch.Generator().manual_seed(3)

        def push():
            a.tokens = 10.0
            cluster_model = st.outer.backup - torch.randn(M, generator=g) * 0.1
            st.tracker.enter(Phase.LOCAL)
            st.tracker.enter(Phase.INNER_QUORUM)
            before = a.stats.sent_bytes["payload"]  # a push's bytes both ways
            r = a.run(cluster_model, contribute=True, inner_ok=True, tr=st.tracker)
            if r.status == Status.OUTER_COMMITTED:  # what BROADCAST does on every member
                st.outer.set_backup(r.params)
                st.counters.outer_round = r.outer_round
            return r, a.stats.sent_bytes["payload"] - before

        wire = []
        for i in range(4):
            r, nbytes = push()
            wire.append(nbytes)
            assert r.status == Status.OUTER_COMMITTED and r.outer_round == i + 1
            assert torch.equal(st.outer.backup, srv.model.params), i
        # The first answer brings the model (a fresh server: the registration's too); then
        # an int8 push up and one int8 step down, where fp32 would be 4 M bytes each way.
        assert wire[0] > 4 * M and all(M < w < 0.6 * 4 * M for w in wire[1:]), wire
        st.outer.backup[7] += 1e-3  # not the server's copy of the base any more
        r, _ = push()
        assert r.status == Status.INNER_ONLY
        assert any(kind == "outer_unavailable" and "checksum" in kw.get("detail", "") for kind, kw in events)
        r, nbytes = push()  # asks whole: the model comes back as the server holds it
        assert r.status == Status.OUTER_COMMITTED and torch.equal(st.outer.backup, srv.model.params)
        assert nbytes > 4 * M + M
    finally:
        if sync is not None:
            sync.close()
        th.close()
        srv.shutdown()


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_model_that_goes_down_compressed_still_converges_where_fp32_does(fmt):
    """A quadratic pulled toward a target by 60 lone pushes (one cluster): with steps down
    in int8 or fp8 the model ends as close to the target as fp32's, within the last
    residual, and never further than a few quantization steps along the way."""
    target = torch.linspace(-3, 3, N)
    init = torch.zeros(N)
    fp32 = GlobalModel(_alg(), 10, 4, init, 0, clusters=1)
    down = GlobalModel(_alg(), 10, 4, init, 0, clusters=1, down=(fmt, 64))
    for _ in range(60):
        for gm in (fp32, down):
            gm.add(0, gm.version, 10.0, 0.2 * (gm.params - target))
            gm.apply()
    e32 = float((fp32.params - target).abs().max())
    edown = float((down.params - target).abs().max())
    assert e32 < 0.05, e32  # the fp32 sequence converges here (so the comparison means something)
    assert edown <= e32 + float(down.residual.abs().max()) + 1e-3, (edown, e32)
