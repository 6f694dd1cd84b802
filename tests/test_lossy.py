"""Lossy and slow links: statistics, determinism, fill modes, divergence, timing, training."""

import math
import threading
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
from torch.distributed import ReduceOp, TCPStore
from torch.distributed.distributed_c10d import AllreduceOptions, BroadcastOptions

from harness import ThreadedHier, local_steps, logs_tail, run_job
from hier_localsgd.core.links.stats import CONTROL, PAYLOAD
from hier_localsgd.core.links.link import LinkProcessGroup
from hier_localsgd.core.links.lossy import LinkEmulation, LinkSpec, LossModel, LossStream, parse_netem


# ---------------------------------------------------------------- loss models


def sample_in_chunks(model: LossModel, total: int, seed: int = 1) -> LossStream:
    st = LossStream(model, (seed, 2, 0, 0))
    rng = np.random.default_rng(seed)
    done = 0
    while done < total:
        n = int(rng.integers(1, 5000))  # calls of random sizes: the chain must carry over
        st.sample(n)
        done += n
    return st


def observed_burst(st: LossStream) -> float:
    hist = dict(st.bursts)
    if st.open_burst:
        hist[st.open_burst] = hist.get(st.open_burst, 0) + 1
    return sum(k * v for k, v in hist.items()) / sum(hist.values())


def test_bernoulli_loss_rate_and_burst_length_match_the_formulas():
    m = LossModel("bernoulli", p=0.05)
    st = sample_in_chunks(m, 400_000)
    rate = st.lost / st.sent
    sigma = math.sqrt(m.p * (1 - m.p) / st.sent)
    assert abs(rate - m.loss_rate()) < 5 * sigma, (rate, m.loss_rate())
    assert m.mean_burst() == pytest.approx(1 / (1 - 0.05))
    assert observed_burst(st) == pytest.approx(m.mean_burst(), rel=0.02)


@pytest.mark.parametrize("p, r, k, h", [(0.01, 0.3, 1.0, 0.0), (0.02, 0.25, 0.995, 0.4), (0.05, 0.5, 0.98, 0.1)])
def test_gilbert_elliott_loss_rate_and_burst_length_match_the_formulas(p, r, k, h):
    m = LossModel("gilbert_elliott", p=p, r=r, k=k, h=h)
    pi_b = p / (p + r)
    assert m.loss_rate() == pytest.approx((1 - k) * (1 - pi_b) + (1 - h) * pi_b)
    if k == 1 and h == 0:
        assert m.mean_burst() == pytest.approx(1 / r)
    st = sample_in_chunks(m, 2_000_000)
    # Correlated losses: use a loose bound (bursts of ~1/r packets, ~2e6/(1/loss) of them).
    assert st.lost / st.sent == pytest.approx(m.loss_rate(), rel=0.06)
    assert observed_burst(st) == pytest.approx(m.mean_burst(), rel=0.06)


def test_the_chain_advances_per_packet_not_per_call():
    """Bursts longer than a call must be stitched across calls (mean burst 1/r = 20)."""
    m = LossModel("gilbert_elliott", p=0.01, r=0.05)
    st = LossStream(m, (3, 2, 0, 0))
    for _ in range(100_000):
        st.sample(3)  # calls far shorter than a burst
    assert observed_burst(st) == pytest.approx(20.0, rel=0.1)


def test_netem_parameterisation():
    m = parse_netem("loss gemodel 1% 30% 100% 0%", "links.outer")
    assert (m.kind, m.p, m.r, m.h, m.k) == ("gilbert_elliott", 0.01, 0.30, 0.0, 1.0)
    assert parse_netem("loss 5%", "links.outer") == LossModel("bernoulli", p=0.05)
    with pytest.raises(ValueError, match="links.outer.netem"):
        parse_netem("loss sometimes", "links.outer")


def test_deterministic_by_seed_and_never_reseeded_per_call():
    m = LossModel("bernoulli", p=0.3)
    a, b, c = LossStream(m, (7, 2, 1, 0)), LossStream(m, (7, 2, 1, 0)), LossStream(m, (8, 2, 1, 0))
    calls_a = [a.sample(200) for _ in range(5)]
    assert all(np.array_equal(x, b.sample(200)) for x in calls_a)  # same seed, same fates
    assert not np.array_equal(calls_a[0], c.sample(200))  # other seed
    assert not all(np.array_equal(calls_a[0], x) for x in calls_a[1:])  # calls differ
    e = LinkEmulation(LinkSpec(model=m, seed=7), "outer")
    assert e.stream(0) is not e.stream(1) and e.stream(0) is not e.stream(0, 1)  # per rank streams


# ---------------------------------------------------------------- real Gloo, threads


def run_ranks(n, spec, body, level="outer", ids=None):
    """``body(rank, link)`` on n threads sharing a real Gloo group behind LinkProcessGroups."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ids = ids or list(range(n))
    out, errors = {}, []

    def target(rank):
        try:
            link = LinkProcessGroup(level, timedelta(seconds=20), emulation=spec)
            link.configure(f"127.0.0.1:{store.port}/t", f"m{ids[rank]}", rank, n, 1, 0, 1, ids)
            out[rank] = body(rank, link)
        except BaseException as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors, errors
    return out


def allreduce(link, t):
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    with link.kind(PAYLOAD):
        link.allreduce([t], opts).wait()
    return t


N, NUMEL = 3, 12
X = [torch.arange(NUMEL, dtype=torch.float32) * (j + 1) + 100 * j for j in range(N)]


def masks(spec, level="outer"):
    """The fates each stream will produce first, from an identical, independent emulation."""
    e = LinkEmulation(spec, level)
    if spec.where == "per_sender":
        return {j: torch.from_numpy(e.stream(j).sample(NUMEL)) for j in range(N)}
    return {(j, i): torch.from_numpy(e.stream(j, i).sample(NUMEL)) for i in range(N) for j in range(N) if i != j}


@pytest.mark.parametrize("fill", ["zero", "stale", "rescale"])
def test_per_sender_fill_modes_on_hand_checkable_tensors(fill):
    spec = LinkSpec(model=LossModel("bernoulli", p=0.6), fill=fill, payload_bytes=4, seed=11)  # 1 value per packet
    lost = masks(spec)
    keep = {j: (~lost[j]).float() for j in range(N)}
    arrived = sum(keep.values())
    total = sum(X[j] * keep[j] for j in range(N))
    got = run_ranks(N, spec, lambda rank, link: allreduce(link, X[rank].clone()))
    for i in range(N):
        if fill == "zero":
            want = total
        elif fill == "stale":
            want = total + (N - arrived) * X[i]
        else:
            want = torch.where(arrived > 0, total * N / arrived.clamp(min=1), torch.zeros(NUMEL))
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-4, msg=f"rank {i}")
    if fill != "stale":  # every receiver lost the same packets: replicas stay identical
        assert all(torch.equal(got[0], got[i]) for i in range(N))
    assert 0 < int(sum(lost[j].sum() for j in range(N))) < N * NUMEL
    assert bool((arrived == 0).any()) and bool(((arrived > 0) & (arrived < N)).any())  # both cases occur


def test_per_receiver_loss_makes_receivers_disagree():
    spec = LinkSpec(model=LossModel("bernoulli", p=0.4), fill="zero", where="per_receiver", payload_bytes=4, seed=5)
    lost = masks(spec)
    got = run_ranks(N, spec, lambda rank, link: allreduce(link, X[rank].clone()))
    for i in range(N):
        want = X[i] + sum(X[j] * (~lost[(j, i)]).float() for j in range(N) if j != i)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-4)
    assert not torch.equal(got[0], got[1])


@pytest.mark.parametrize("where", ["per_sender", "per_receiver"])
def test_broadcast_loss_keeps_stale_values(where):
    spec = LinkSpec(model=LossModel("bernoulli", p=0.5), fill="stale", where=where, payload_bytes=4, seed=2)
    e = LinkEmulation(spec, "inner")

    def body(rank, link):
        t = X[0].clone() if rank == 0 else torch.full((NUMEL,), -1.0)
        opts = BroadcastOptions()
        opts.rootRank = 0
        with link.kind(PAYLOAD):
            link.broadcast([t], opts).wait()
        return t

    got = run_ranks(N, spec, body, level="inner")
    torch.testing.assert_close(got[0], X[0])
    shared = torch.from_numpy(e.stream(0).sample(NUMEL))  # per sender: one fate for every receiver
    for i in (1, 2):
        lost = shared if where == "per_sender" else torch.from_numpy(e.stream(0, i).sample(NUMEL))
        want = torch.where(lost, torch.full((NUMEL,), -1.0), X[0])
        torch.testing.assert_close(got[i], want)
        assert bool(lost.any()) and not bool(lost.all())


def test_emulated_time_is_the_ring_bound_for_a_known_size():
    spec = LinkSpec(latency_s=0.02, bandwidth_Bps=0.1e9 / 8)  # 20 ms, 0.1 Gbit/s
    nbytes = 1_000_000
    bound = 2 * 1 * 0.02 + 2 * 1 / 2 * nbytes / spec.bandwidth_Bps  # n = 2: 0.04 + 0.08 s

    def body(rank, link):
        t = torch.zeros(nbytes // 4)
        t0 = time.time()
        allreduce(link, t)
        return time.time() - t0, link.stats.as_dict()["loss"]

    got = run_ranks(2, spec, body)
    for elapsed, stats in got.values():
        assert bound <= elapsed < bound + 0.5, (elapsed, bound)
        assert stats["emulated_time_s"] == pytest.approx(bound)


# ---------------------------------------------------------------- in the hierarchy


def test_per_receiver_divergence_is_detected_and_resynced():
    spec = LinkSpec(model=LossModel("bernoulli", p=0.2), fill="zero", where="per_receiver", payload_bytes=4, seed=3)
    h = ThreadedHier(1, 3, 1, 100, numel=32, inner_link=spec)
    reps = {}
    try:
        h.run(lambda rep: (reps.__setitem__(rep.key, rep), local_steps(rep, lambda c, r, k: torch.full((32,), 0.1 * (r + 1)), 4)))
    finally:
        h.close()
    commits = {k: {e["step"]: e["checksum"] for e in rep.kinds("commit", level="inner")} for k, rep in reps.items()}
    diverged_steps = [s for s in range(1, 5) if len({commits[k][s] for k in reps}) > 1]
    assert diverged_steps, "per-receiver loss should make replicas disagree"
    resyncs = [e for rep in reps.values() for e in rep.kinds("resync", level="inner") if e["diverged"]]
    assert resyncs and all(e["step"] - 1 in diverged_steps for e in resyncs)
    # same round history -> the noisy members kept their weight
    assert all(e["total_weight"] == 3.0 for rep in reps.values() for e in rep.kinds("commit", level="inner") if e["step"] > 0)


@pytest.mark.slow
def test_training_with_5_percent_outer_loss_still_converges(tmp_path):
    run = run_job(tmp_path, ["train.steps=60", "sync.inner.every=5", "sync.outer.every=2",
                             "links.outer.loss=bernoulli", "links.outer.p=0.05", "links.outer.fill=rescale"])
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    s = run.summary
    assert s["consistent"] is True  # per-sender loss with rescale keeps replicas identical
    assert s["excess_loss"] < 0.5 * s["excess_loss_start"]
    outer = s["links"]["outer"]
    assert outer["packets_lost"] > 0
    assert outer["observed_loss_rate"] == pytest.approx(0.05, abs=0.03)


def test_payload_spans_line_up_across_members_and_a_late_arrival_is_skew_not_link_time():
    """Each payload collective's [start, end] is kept in call order (stats.LinkStats.spans)
    on a real Gloo group with a 20 ms emulated latency; rank 1 enters the second all-reduce
    at least 0.5 s after rank 0 did (it sleeps 0.6 s after rank 0 is about to enter: the
    0.1 s spare covers rank 0 being slow to take its start time). Rank 0's own clock holds
    that wait, bench.after_last_arrival does not. Control traffic keeps no spans."""
    from hier_localsgd.experiments.bench import after_last_arrival

    spec = LinkSpec(latency_s=0.02)
    entered = threading.Event()

    def body(rank, link):
        for i in range(3):
            if i == 1:
                if rank == 0:
                    entered.set()
                else:
                    assert entered.wait(30)
                    time.sleep(0.6)
            allreduce(link, torch.ones(4))
        with link.kind(CONTROL):
            link.allreduce([torch.ones(1)], AllreduceOptions()).wait()
        return link.stats.as_dict()

    stats = run_ranks(2, spec, body)
    for rank in (0, 1):
        assert set(stats[rank]["spans"]) == {"allreduce/payload"}
        assert len(stats[rank]["spans"]["allreduce/payload"]) == 3
    (s0, e0), (s1, _) = stats[0]["spans"]["allreduce/payload"][1], stats[1]["spans"]["allreduce/payload"][1]
    assert s1 - s0 >= 0.5 and e0 - s0 >= 0.5  # rank 0 waited for rank 1

    def member(rank, calls):
        return {"cluster": rank, "link": {"outer": {"spans": {"allreduce/payload": calls}}}}

    whole = after_last_arrival([member(r, stats[r]["spans"]["allreduce/payload"]) for r in (0, 1)], "outer")
    assert whole["rounds"] == 3 and whole["skew_s"] >= 0.5 / 3 and whole["round_s"] >= 0.02
    second = after_last_arrival([member(r, stats[r]["spans"]["allreduce/payload"][1:2]) for r in (0, 1)], "outer")
    assert 0.02 <= second["round_s"] < 0.5 and second["skew_s"] >= 0.5  # the wait is skew, not the round's time
