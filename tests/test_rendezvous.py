"""A replica group spanning two hosts (two network namespaces), launched by torchrun with
the rendezvous backend ``hl-c10d`` (hier_localsgd/launch/rendezvous.py): both agents meet,
their workers share the rank-0 agent's store, and every listening socket in either
namespace binds an address, never every interface; the same group with torch's own
``c10d`` backend listens on every interface (so the check can fail)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import wildcard
from hier_localsgd.launch import netns
from hier_localsgd.launch.rendezvous import BACKEND, spanning_args

REASON = netns.available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"network namespaces unavailable: {REASON}")

PORT = 29431
# Each worker joins the group's store (the rank-0 agent's, through env://), waits for the
# other, says where the store was, and waits for the test to have listed the listeners.
WORKER = """
import os, sys, time, pathlib
from datetime import timedelta
import torch.distributed as dist
out = pathlib.Path(sys.argv[1])
store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=60)))
store.add("arrived", 1)
end = time.time() + 60
while store.add("arrived", 0) < world and time.time() < end:
    time.sleep(0.1)
(out / f"up{rank}").write_text(f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} {store.add('arrived', 0)}")
while not (out / "done").exists() and time.time() < end:
    time.sleep(0.1)
"""


def _listening(net: netns.ClusterNetwork, i: int) -> dict:
    """{local address: 1} of every listening TCP socket in node ``i``'s namespace."""
    out = subprocess.run(["ip", "netns", "exec", net.namespace(i), "ss", "-ltnH"], capture_output=True, text=True, timeout=30).stdout
    return {line.split()[3]: 1 for line in out.splitlines() if line.strip()}


def _group(net: netns.ClusterNetwork, tmp: Path, args_of) -> tuple:
    """Runs the two-node group (``args_of(node)``: its rendezvous arguments); returns the
    listeners of both namespaces while both workers are up, and what the workers wrote."""
    tmp.mkdir()
    (tmp / "worker.py").write_text(WORKER)
    procs = [subprocess.Popen(net.wrap([sys.executable, "-m", "torch.distributed.run", *args_of(k), "--nproc-per-node=1",
                                        "--max-restarts=0", str(tmp / "worker.py"), str(tmp)], k),
                              stdout=open(tmp / f"node{k}.log", "w"), stderr=subprocess.STDOUT) for k in (0, 1)]
    try:
        end = time.time() + 120
        while not all((tmp / f"up{r}").exists() for r in (0, 1)):
            if time.time() > end or any(p.poll() is not None for p in procs):
                logs = "\n".join((tmp / f"node{k}.log").read_text()[-2000:] for k in (0, 1))
                pytest.fail(f"the group never came up:\n{logs}")
            time.sleep(0.2)
        seen = {**_listening(net, 0), **_listening(net, 1)}
        (tmp / "done").write_text("")
        assert all(p.wait(timeout=60) == 0 for p in procs), [p.returncode for p in procs]
        return seen, [(tmp / f"up{r}").read_text() for r in (0, 1)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_group_spanning_two_hosts_meets_with_every_store_bound_to_an_address(tmp_path):
    net = netns.ClusterNetwork(2)
    try:
        host = net.address(0)
        endpoint = f"{host}:{PORT}"
        seen, up = _group(net, tmp_path / "bound", lambda k: spanning_args(2, k, endpoint, "spanning"))
        assert f"{host}:{PORT}" in seen, seen  # the rendezvous's store, on node 0's address
        assert not wildcard(seen), seen
        assert len(seen) >= 2, seen  # and the store the agent shares with its workers
        # Both workers reached the same shared store (node 0's host name), bound to node 0's address.
        master = {u.split()[0] for u in up}
        assert len(master) == 1 and all(u.endswith(" 2") for u in up), up
        name, port = master.pop().rsplit(":", 1)
        assert name == net.hostname(0) and f"{host}:{port}" in seen and port != str(PORT), (name, port, seen)
        # torch's own c10d backend, the same group: its stores listen on every interface.
        plain, _ = _group(net, tmp_path / "plain", lambda k: [
            "--nnodes=2", f"--node-rank={k}", "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{PORT + 1}",
            "--rdzv-id=plain", f"--rdzv-conf=is_host={1 if k == 0 else 0}"])
        assert wildcard(plain), plain
    finally:
        net.close()


def test_hl_c10d_needs_is_host_said_in_one_line():
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from hier_localsgd.launch.rendezvous import create_handler

    params = RendezvousParameters(BACKEND, "127.0.0.1:1", "r", 1, 1)
    with pytest.raises(ValueError, match="is_host=1 on the endpoint's host"):
        create_handler(params)


def test_replica_sh_gets_the_spanning_arguments_one_per_line():
    """launch/replica.sh reads torchrun's arguments for a spanning group from the module."""
    out = subprocess.run([sys.executable, "-m", "hier_localsgd.launch.rendezvous", "--span", "3", "1", "h:29400", "c0r1"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")
    assert out[:-1] == spanning_args(3, 1, "h:29400", "c0r1") and "--rdzv-conf=is_host=0" in out and f"--rdzv-backend={BACKEND}" in out
