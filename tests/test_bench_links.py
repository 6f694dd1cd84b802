"""`hier-localsgd bench` on real links (bench.links=kernel): clusters in network namespaces,
the WAN shaped by the kernel's tbf, the user-space bandwidth padding off.

What is asserted cannot race: the bytes each cluster uplink really sent (its interface
counter) against the bytes the process groups accounted, within a bound derived below, and
the runs end consistent at their last step. How fast the arms are is a figure
(docs/benchmarks.md), not asserted.

Skipped, with the reason, where namespaces or tbf are unavailable (not root, no iproute2,
no sch_tbf)."""

import pytest

from hier_localsgd.config import load_config
from hier_localsgd.experiments.bench import plan_arms, run_arm
from hier_localsgd.launch import netns

REASON = netns.shaping_available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"real links unavailable: {REASON}")]

MTU_PAYLOAD, HEADERS = 1448, 66  # TCP payload and Ethernet/IP/TCP(+timestamps) header of a 1514-byte frame
# What crosses an uplink beyond the accounted collectives: torchft heartbeats to the lighthouse
# beyond it (every 100 ms, under 200 bytes each plus headers, the reply and the acknowledgements:
# < 400 bytes per 100 ms), quorum RPCs and the process group's store traffic (a few per round).
CONTROL_BPS_PER_PROCESS = 4_000.0


def test_kernel_links_put_the_accounted_bytes_on_the_wire(tmp_path):
    cfg = load_config(["bench.mode=quick", "bench.links=kernel", "bench.wan_gbps=0.1"], validate_for="demo")
    common, arms, steps = plan_arms(cfg)
    assert "run.netns=true" in common and "links.outer.bandwidth_gbps=0" in common  # padding off: the kernel shapes
    C, R = cfg.topology.clusters, cfg.topology.replicas_per_cluster
    for name, crossing in (("hier", C), ("flat_count", C * R)):  # processes whose control plane crosses the WAN
        row = run_arm(name, [*common, *arms[name]], tmp_path, timeout_s=300, wan_bps=0.1e9)
        assert not row.get("failed"), row
        assert row["consistent"] is True and row["curve"][-1]["step"] == steps, row["curve"][-1]
        w = row["wire"]
        assert "tbf" in w["qdisc"] and "rate 100Mbit" in w["qdisc"], w["qdisc"]
        acc = row["slow_link_bytes"]
        assert acc > 0
        # Lower: the ring's bytes must cross (for flat, this checks that Gloo's ring crosses the
        # WAN on C of its n hops, as bench.py's split assumes; crossing on every hop would double it).
        # Upper: + a header per MTU of payload, + at most one acknowledgement per segment received
        # (each cluster receives what it sends), + the control plane for the job's lifetime.
        upper = acc * (1 + 2 * HEADERS / MTU_PAYLOAD) + CONTROL_BPS_PER_PROCESS * crossing * row["job_wall_s"]
        assert acc <= w["tx_bytes"] <= upper, (name, w["tx_bytes"], acc, upper)
        assert w["rx_bytes"] >= acc  # what the clusters sent, the others received
        sync = row["sync"]["outer" if name == "hier" else "flat"]
        assert sync is not None and sync["bound_s"] > 0
