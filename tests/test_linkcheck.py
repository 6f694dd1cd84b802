"""The link model against kernel-shaped links between real network namespaces (linkcheck.py).

What can be asserted without timing races: a shaped link cannot carry the payload faster
than its rate (time >= the ring bound less tbf's one bucket: ``bound_s`` on kernel links), and the bytes each uplink
really sent (its interface counter) are the analytic ring count plus headers and
acknowledgements. How close the time comes to the bound is a figure, printed by
``python -m hier_localsgd.experiments.linkcheck --sweep`` and recorded in docs/benchmarks.md.

Skipped (with the reason) where namespaces cannot be made (not root, no iproute2)."""

import pytest

from hier_localsgd.experiments import linkcheck
from hier_localsgd.launch import netns

REASON = netns.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")

NBYTES = 2 * 1024 * 1024
BURST = netns.tbf_burst_bytes(40e6)  # ClusterNetwork.shape's default bucket at 40 Mbit/s: sent at once, ahead of the rate


def test_a_shaped_link_bounds_the_all_reduce_and_both_modes_send_the_ring_count():
    kernel, emulated = linkcheck.measure(clusters=3, rate_mbit=40, nbytes=NBYTES, reps=2)
    print(linkcheck.report([kernel, emulated]))
    # Every rank's uplink must carry 2(n-1)/n of the payload at 40 Mbit/s, all but one bucket at
    # the rate: no repetition can beat it.
    assert kernel.burst_bytes == BURST and kernel.bound_s == pytest.approx((kernel.analytic_bytes - BURST) * 8 / 40e6)
    assert min(kernel.times_s) >= kernel.bound_s, (kernel.times_s, kernel.bound_s)
    # Payload plus Ethernet/IP/TCP headers (66 of every 1514 bytes once tbf segments) and the
    # acknowledgements of what the rank received: a few per cent, never less than the payload.
    # The user-space emulation (unshaped, same rate) shapes time only, never what is sent.
    for m in (kernel, emulated):
        for sent in m.tx_bytes:
            assert m.analytic_bytes <= sent <= 1.12 * m.analytic_bytes, (m.mode, sent, m.analytic_bytes)


def test_the_int8_all_reduce_on_a_shaped_link_sends_its_compressed_count():
    """The outer level's compressed all-reduce (all-to-all of int8 shards, then all-gather)
    on the same kernel-shaped link: its wire bytes are its compressed payload (about a
    quarter of fp32's) plus headers and acknowledgements, and it cannot beat the rate."""
    (kernel,) = linkcheck.measure(clusters=2, rate_mbit=40, nbytes=NBYTES, reps=2, modes=("kernel",), op="int8")
    print(linkcheck.report([kernel]))
    assert kernel.analytic_bytes < 0.27 * NBYTES  # int8 + per-block scales, not fp32's ring count (NBYTES here)
    floor = kernel.bound_s - BURST * 8 / 40e6  # two collectives, each may start with a full bucket
    assert min(kernel.times_s) >= floor, (kernel.times_s, kernel.bound_s)
    for sent in kernel.tx_bytes:
        assert kernel.analytic_bytes <= sent <= 1.12 * kernel.analytic_bytes, (sent, kernel.analytic_bytes)


def test_the_sparse_topk2_reduce_on_a_shaped_link_sends_its_sparse_count():
    """The sparse 2-bit outer reduce (an all-gather of 9 bytes per 256 elements per sender,
    core/tensors/sparse.py) on a kernel-shaped link: the uplink carries that payload plus
    headers and acknowledgements (about 1/114 of an fp32 ring all-reduce of the same
    tensor), and not faster than the rate allows."""
    nbytes = 32 * 1024 * 1024  # a payload of ~295 kB: several tbf buckets
    (kernel,) = linkcheck.measure(clusters=2, rate_mbit=40, nbytes=nbytes, reps=2, modes=("kernel",), op="topk2")
    print(linkcheck.report([kernel]))
    assert kernel.analytic_bytes == 9 * (nbytes // 4) // 256
    assert min(kernel.times_s) >= kernel.bound_s, (kernel.times_s, kernel.bound_s)
    for sent in kernel.tx_bytes:
        assert kernel.analytic_bytes <= sent <= 1.12 * kernel.analytic_bytes, (sent, kernel.analytic_bytes)
