"""The WAN under attack (security.wan=tunnel; launch/tunnel.py, launch/netns.py).

Real processes in network namespaces, a real WireGuard mesh (wireguard-go), tcpdump on
the WAN bridge, and an attacker: a namespace of its own on the WAN bridge, holding no
secret, with a route to the overlay through the hub. The job trains a program whose
outer payload is known to the byte (known_bytes_program.py), so the capture can be
searched for it: found in plain TCP (security.wan=off), so the search can fail; absent
inside the tunnel.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import pytest

from harness import FAST_JOB, logs_tail, read_events, summarize
from hier_localsgd.config import load_config
from hier_localsgd.core.runtime.status import replica_dir
from hier_localsgd.launch.local import LocalJob
from hier_localsgd.launch.netns import available
from hier_localsgd.launch.tunnel import WG_PORT, dropped, missing_tools, table

sys.path.insert(0, str(Path(__file__).parent))
from known_bytes_program import HOLD_ENV, STEP_ENV, pattern  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(available() is not None, reason=f"network namespaces: {available()}"),
    pytest.mark.skipif(shutil.which("tcpdump") is None or missing_tools() is not None,
                       reason=f"tcpdump, wireguard-go, wg and nft are installed by .ci/run: {missing_tools()}"),
]

PROGRAM = str(Path(__file__).parent / "known_bytes_program.py")
KNOWN = ["run.netns=true", f"run.program={PROGRAM}", "sync.inner.algorithm=localsgd", "sync.outer.algorithm=localsgd",
         "train.steps=30", "sync.inner.every=5", "sync.outer.every=2"]
ATTACKER = "198.18.0.250"


def windows(steps: List[int], width: int = 32) -> List[bytes]:
    """32-byte windows (8 float32s) of the known pseudo-gradients, every 16 bytes."""
    out = []
    for k in steps:
        p = pattern(k)
        out += [p[i:i + width] for i in range(0, len(p) - width + 1, 16)]
    return out


def frames(pcap: Path):
    """The Ethernet frames of a pcap file (tcpdump -w on an Ethernet interface)."""
    data = pcap.read_bytes()
    pos = 24  # the file header
    while pos + 16 <= len(data):
        incl = struct.unpack("<I", data[pos + 8:pos + 12])[0]
        yield data[pos + 16:pos + 16 + incl]
        pos += 16 + incl


def tcp_payloads(pcap: Path) -> bytes:
    """The IPv4 payload bytes (past the IP header) of every packet of a pcap, joined."""
    return b"".join(f[14 + (f[14] & 0x0F) * 4:] for f in frames(pcap) if len(f) > 34 and f[12:14] == b"\x08\x00")


def udp_packets(pcap: Path, port: int) -> List[tuple]:
    """(dst ip, payload) of every UDP packet to ``port`` in a pcap."""
    out = []
    for f in frames(pcap):
        if len(f) > 42 and f[12:14] == b"\x08\x00" and f[23] == 17:
            udp = f[14 + (f[14] & 0x0F) * 4:]
            if struct.unpack(">H", udp[2:4])[0] == port:
                out.append((".".join(str(b) for b in f[30:34]), udp[8:]))
    return out


class Capture:
    """tcpdump on cluster 0's port of the WAN bridge (in the hub's namespace: frames the
    bridge forwards between ports never cross the bridge device itself), to a pcap file."""

    def __init__(self, job: LocalJob, path: Path) -> None:
        net = job.netns
        self.path = path
        self.proc = subprocess.Popen(["ip", "netns", "exec", net.namespace("hub"), "tcpdump", "-i", net.hub_iface(0), "-w", str(path),
                                      "-U", "--immediate-mode", "-B", "65536", "-s", "0", "-n"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not (path.exists() and path.stat().st_size >= 24):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.proc.stderr.read()
            time.sleep(0.05)

    def stop(self) -> None:
        # A packet still in the kernel's capture ring when tcpdump ends is lost (without
        # --immediate-mode, up to a ring block's timeout of them): let the last ones in.
        time.sleep(1.0)
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self.report = self.proc.stderr.read().decode(errors="replace").strip()


def run_captured(tmp: Path, overrides: List[str], during: Optional[Callable[[LocalJob], None]] = None, timeout_s: float = 240):
    """A whole job with the WAN bridge captured from before its lighthouses start."""
    overrides = [*FAST_JOB, *overrides, f"run.dir={tmp / 'run'}"]
    cfg = load_config(overrides, validate_for="demo")
    t0 = time.time()
    job = LocalJob(cfg, overrides)
    with job:
        cap = Capture(job, tmp / "wan.pcap")
        try:
            job.start_lighthouses()
            job.start_all()
            tick = (lambda: during(job)) if during is not None else None
            codes = job.wait(timeout_s, tick=tick, tick_every_s=0.5)
        finally:
            cap.stop()
        drops = job.netns.firewall_drops()
    print("tcpdump:", cap.report)
    summary = summarize(cfg, job, time.time() - t0)
    events = {k: read_events(replica_dir(tmp / "run", *k) / "events.jsonl") for k in job.keys()}
    return job, codes, summary, events, drops


def test_without_the_tunnel_the_wan_carries_the_outer_payload_in_plain_text(tmp_path):
    """The control for the test below: the same job over plain TCP puts the known
    pseudo-gradient's bytes on the wire, where the search finds them."""
    job, codes, summary, _, _ = run_captured(tmp_path, [*KNOWN, "topology.replicas_per_cluster=1", "security.wan=off"])
    assert all(c == 0 for c in codes.values()), codes
    assert summary["outer_rounds_committed"] >= 1
    wire = tcp_payloads(tmp_path / "wan.pcap")
    hits = [w for w in windows([10, 20, 5]) if w in wire]
    assert hits, f"no window of the known payload in {len(wire)} captured bytes"


def run_or_undo(cmds: List[List[str]], undo: Callable[[], None]) -> None:
    """Runs the commands that build a namespace setup; on any failure, ``undo`` first."""
    try:
        for c in cmds:
            subprocess.run(c, check=True, capture_output=True, timeout=20)
    except BaseException:
        undo()
        raise


class Attacker:
    """A namespace on the WAN bridge (``ATTACKER``), with a route to each site's overlay
    address through that site's WAN address, and no secret. Removed by :meth:`close`."""

    def __init__(self, job: LocalJob) -> None:
        net = job.netns
        self.net, self.ns = net, f"{net.prefix}-atk"
        inside, outside = f"{net.prefix}ai", f"{net.prefix}ao"
        cmds = [["ip", "netns", "add", self.ns],
                ["ip", "-n", self.ns, "link", "set", "lo", "up"],
                ["ip", "link", "add", inside, "netns", self.ns, "type", "veth", "peer", "name", outside, "netns", net.namespace("hub")],
                ["ip", "-n", net.namespace("hub"), "link", "set", outside, "master", net.bridge],
                ["ip", "-n", net.namespace("hub"), "link", "set", outside, "up"],
                ["ip", "-n", self.ns, "addr", "add", f"{ATTACKER}/24", "dev", inside],
                ["ip", "-n", self.ns, "link", "set", inside, "up"],
                # a route to each site's overlay address through that site's WAN address
                *[["ip", "-n", self.ns, "route", "add", f"{net.service_address(w)}/32", "via", net.address(w)] for w in ["hub", *range(net.clusters)]]]
        run_or_undo(cmds, self.close)
        self.results: Dict[str, str] = {}

    def python(self, name: str, code: str, timeout: float = 60) -> str:
        """Runs an attack (Python source) in the attacker's namespace; records what it printed."""
        r = subprocess.run(["ip", "netns", "exec", self.ns, sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
        self.results[name] = (r.stdout + r.stderr).strip().splitlines()[-1] if (r.stdout + r.stderr).strip() else f"exit {r.returncode}"
        return self.results[name]

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=20)


JOIN = """
from datetime import timedelta
from torchft.coordination import LighthouseClient
try:
    c = LighthouseClient({addr!r}, connect_timeout=timedelta(seconds=3))
    c.quorum(replica_id="attacker:0", timeout=timedelta(seconds=3), address="http://{atk}:9/", store_address="{atk}:9", step=10**6, world_size=1, shrink_only=False)
    print("JOINED")
except Exception as e:
    print("FAILED", type(e).__name__, str(e).splitlines()[0][:100])
"""
HTTP = """
import urllib.request
try:
    r = urllib.request.urlopen(urllib.request.Request({url!r}, method={method!r}, data=b"" if {method!r} == "POST" else None), timeout=3)
    print("ANSWERED", r.status, r.read(64))
except Exception as e:
    print("FAILED", type(e).__name__, str(e)[:100])
"""
REPLAY = """
import json, socket, sys
pkts = json.load(open({path!r}))
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for dst, hexdata in pkts:
    s.sendto(bytes.fromhex(hexdata), (dst, {port}))
print("SENT", len(pkts))
"""


def attack(job: LocalJob, atk: "Attacker", pcap: Path, tmp: Path, state: Dict[str, object]) -> None:
    """Every attempt, from the attacker's namespace, eight at a time (on a thread while the
    job trains)."""
    from concurrent.futures import ThreadPoolExecutor

    net = job.netns
    hub, c0 = net.service_address("hub"), net.service_address(0)
    g_port = int(job.global_addr.rsplit(":", 1)[1])
    c_port = int(job.cluster_addrs[0].rsplit(":", 1)[1])
    tries = [(name, JOIN.format(addr=addr, atk=ATTACKER)) for name, addr in [
        ("join global (overlay)", f"http://{hub}:{g_port}"), ("join global (WAN address)", f"http://{net.address('hub')}:{g_port}"),
        ("join cluster 0 (overlay)", f"http://{c0}:{c_port}"), ("join cluster 0 (WAN address)", f"http://{net.address(0)}:{c_port}")]]
    tries.append(("kill through the cluster lighthouse", HTTP.format(url=f"http://{c0}:{c_port}/replica/c0r1:0/kill", method="POST")))
    ports = subprocess.run(["ip", "netns", "exec", net.namespace(0), "ss", "-ltnH"], capture_output=True, text=True).stdout
    listening = sorted({int(line.split()[3].rsplit(":", 1)[1]) for line in ports.splitlines() if line.strip()})
    state["ports"] = listening
    for port in listening:  # stores, ManagerServers, heal servers (GET /heal/<step>), the lighthouse
        for host in (c0, net.address(0)):
            tries.append((f"fetch {host}:{port}", HTTP.format(url=f"http://{host}:{port}/heal/10", method="GET")))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda t: atk.python(*t), tries))
    pkts = udp_packets(pcap, WG_PORT)  # what the WAN carried so far (tcpdump -U writes each packet)
    state["replayed"] = min(3000, len(pkts))
    path = tmp / "replay.json"
    path.write_text(json.dumps([[d, p.hex()] for d, p in pkts[:3000]]))
    atk.python("replay captured WireGuard packets", REPLAY.format(path=str(path), port=WG_PORT))
    state["step_after"] = (job.status((0, 0)) or {}).get("step", 0)


def test_an_attacker_on_the_wan_without_the_secret_gets_nothing_and_the_job_ends_consistent(tmp_path, caplog, monkeypatch):
    """While a 2 x 2 job trains inside the tunnel, an attacker on the WAN bridge tries to
    join the global and a cluster quorum, to kill a replica group through a lighthouse,
    to reach every listening port of a cluster (stores, ManagerServers, heal servers: the
    heal server of a donor, and the quorum a crafted heal would have to be served through)
    — at the overlay addresses through a route of its own and at the WAN addresses — and
    replays the WireGuard packets captured so far. Every attempt fails; the job ends
    consistent with no restart; each site's firewall counted the attempts and the launcher
    logs one line per site; the capture holds WireGuard's UDP and not one window of the
    known payload."""
    import threading

    state: Dict[str, object] = {}
    holder: Dict[str, object] = {}
    monkeypatch.setenv(STEP_ENV, "0.05")
    monkeypatch.setenv(HOLD_ENV, f"100:{tmp_path / 'attack.done'}")  # the groups wait after step 100 until the attack is over

    def during(job: LocalJob) -> None:
        if "thread" in holder or (job.status((0, 0)) or {}).get("step", 0) < 6:
            return  # attack once, when the job trains

        def attack_then_release() -> None:
            try:
                attack(job, atk, tmp_path / "wan.pcap", tmp_path, state)
            finally:
                (tmp_path / "attack.done").touch()

        holder["attacker"] = atk = Attacker(job)
        holder["thread"] = th = threading.Thread(target=attack_then_release, daemon=True)
        th.start()

    try:
        with caplog.at_level("WARNING", logger="hier_localsgd.launch.netns"):
            job, codes, summary, events, drops = run_captured(tmp_path, [*KNOWN, "train.steps=400", "timeouts.local_step=300", "security.wan=tunnel"], during=during)
    finally:
        if "thread" in holder:
            holder["thread"].join(120)
        if "attacker" in holder:
            holder["attacker"].close()
    results = holder["attacker"].results if "attacker" in holder else {}
    print("attempts:", json.dumps(results, indent=1), "\nfirewall drops:", drops)
    assert "thread" in holder, "the attack ran"
    assert all(c == 0 for c in codes.values()), (codes, logs_tail(job))
    assert summary["consistent"], summary
    assert not [h for h in job.history if h.get("event") == "restart"], job.history
    assert 0 < state["step_after"] <= 101, "the job was still training when the last attempt ended (held after step 100)"
    attempts = {k: v for k, v in results.items() if not k.startswith("replay")}
    assert len(state["ports"]) >= 4 and len(attempts) == 5 + 2 * len(state["ports"]), (results, state)
    assert all(v.startswith("FAILED") for v in attempts.values()), results
    assert results["replay captured WireGuard packets"] == f"SENT {state['replayed']}" and state["replayed"] > 10, results
    assert drops[job.netns.namespace("hub")] > 0 and drops[job.netns.namespace(0)] > 0, drops
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == sum(1 for n in drops.values() if n), lines
    assert len(udp_packets(tmp_path / "wan.pcap", WG_PORT)) > 50
    wire = tcp_payloads(tmp_path / "wan.pcap")
    assert not [w for w in windows([10, 20, 5]) if w in wire]


class Hosts:
    """Two namespaces standing for two hosts on a WAN (a veth pair), removed by close()."""

    def __init__(self, tag: str) -> None:
        import os

        self.ns = [f"hlt{os.getpid()}{tag}a", f"hlt{os.getpid()}{tag}b"]
        self.wan = ["198.18.7.1", "198.18.7.2"]
        cmds = [["ip", "netns", "add", self.ns[0]], ["ip", "netns", "add", self.ns[1]],
                ["ip", "link", "add", "eth0", "netns", self.ns[0], "type", "veth", "peer", "name", "eth0", "netns", self.ns[1]]]
        for i in range(2):
            cmds += [["ip", "-n", self.ns[i], "link", "set", "lo", "up"], ["ip", "-n", self.ns[i], "addr", "add", f"{self.wan[i]}/24", "dev", "eth0"],
                     ["ip", "-n", self.ns[i], "link", "set", "eth0", "up"]]
        run_or_undo(cmds, self.close)

    def close(self) -> None:
        for ns in self.ns:
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


TCP_ECHO = """
import socket, sys
s = socket.create_server((sys.argv[1], 7000)); s.settimeout(20)
print("READY", flush=True)
c, _ = s.accept(); c.sendall(c.recv(100))
"""
TCP_TRY = """
import socket, sys
try:
    c = socket.create_connection((sys.argv[1], 7000), timeout=4); c.sendall(b"over the tunnel"); print("ECHO", c.recv(100).decode())
except OSError as e:
    print("FAILED", e)
"""


@pytest.mark.parametrize("case", ["same secret", "another secret", "bypass"])
def test_the_tunnel_command_links_two_hosts_that_hold_the_secret_and_goes_down_on_sigterm(tmp_path, case):
    """launch/tunnel.sh on two hosts (namespaces): with the same job secret a connection to
    the peer's overlay address goes through (WireGuard on the WAN); with another secret it
    does not; nor does one that routes around the tunnel to the overlay address over the
    WAN (the real-host firewall drops it, and counts it); SIGTERM takes the interface and
    the firewall down and exits cleanly."""
    same_secret = case != "another secret"
    import os
    import signal

    from hier_localsgd.core.security.secret import keygen

    secrets_ = [tmp_path / "a.secret", tmp_path / "b.secret"]
    keygen(str(secrets_[0]))
    if same_secret:
        secrets_[1] = secrets_[0]
    else:
        keygen(str(secrets_[1]))
    tag = {"same secret": "s", "another secret": "o", "bypass": "b"}[case]
    hosts = Hosts(tag)
    procs = []
    iface = [f"hlt{os.getpid() % 100000}{tag}{i}" for i in range(2)]
    try:
        script = Path(__file__).parent.parent / "launch" / "tunnel.sh"
        for i, name in enumerate(("a", "b")):
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", hosts.ns[i], "bash", str(script), f"tunnel.site={name}", f"tunnel.sites=[a@{hosts.wan[0]},b@{hosts.wan[1]}]",
                 f"tunnel.iface={iface[i]}", f"security.secret_file={secrets_[i]}", f"run.dir={tmp_path / name}"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, PYTHON=sys.executable)))
        lines = [p.stdout.readline().strip() for p in procs]
        assert lines[0].startswith("tunnel up: site a at 198.19.0.1") and lines[1].startswith("tunnel up: site b at 198.19.0.2"), lines
        echo = subprocess.Popen(["ip", "netns", "exec", hosts.ns[1], sys.executable, "-c", TCP_ECHO, "198.19.0.2"], stdout=subprocess.PIPE, text=True)
        assert echo.stdout.readline().strip() == "READY"
        if case == "bypass":  # host a routes around the tunnel: its packets reach b's overlay address over the WAN
            subprocess.run(["ip", "-n", hosts.ns[0], "route", "add", "198.19.0.2/32", "via", hosts.wan[1], "dev", "eth0"], check=True)
        out = subprocess.run(["ip", "netns", "exec", hosts.ns[0], sys.executable, "-c", TCP_TRY, "198.19.0.2"], capture_output=True, text=True, timeout=60).stdout
        echo.kill()
        if case == "same secret":
            assert out.strip() == "ECHO over the tunnel", out
        else:
            assert out.startswith("FAILED"), out
        drops = dropped(hosts.ns[1], iface[1])
        assert drops > 0 if case == "bypass" else drops == 0, drops
        table_ = ["ip", "netns", "exec", hosts.ns[1], "nft", "list", "table", "inet", table(iface[1])]
        assert subprocess.run(table_, capture_output=True).returncode == 0  # up: its table exists
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for i, p in enumerate(procs):
            rest = p.communicate(timeout=30)[0]
            assert p.returncode == 143 and "tunnel down" in rest, (p.returncode, rest)
            assert subprocess.run(["ip", "-n", hosts.ns[i], "link", "show", iface[i]], capture_output=True).returncode != 0
            assert subprocess.run(["ip", "netns", "exec", hosts.ns[i], "nft", "list", "table", "inet", table(iface[i])], capture_output=True).returncode != 0
    finally:
        for p in procs:
            p.kill()
        hosts.close()


def test_a_tunnel_command_with_a_bad_site_list_is_one_line_naming_the_field(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hier_localsgd", "tunnel", "tunnel.site=a", "tunnel.sites=[a@1.2.3.4,b]", f"run.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "tunnel.sites[1]: 'b' — expected name@WAN address" in out.stderr, out.stderr


def _link_mtu(ns: str, iface: str) -> int:
    out = subprocess.run(["ip", "-n", ns, "-j", "link", "show", iface], capture_output=True, text=True, check=True, timeout=20).stdout
    return json.loads(out)[0]["mtu"]


def _tx_bytes(ns: str, iface: str) -> int:
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", iface], capture_output=True, text=True, check=True, timeout=20).stdout
    return json.loads(out)[0]["stats64"]["tx"]["bytes"]


SLOW_WIREGUARD_GO = """#!/usr/bin/env bash
# wireguard-go's order, slowed: the interface at once, the control socket a second later
set -e
ip tuntap add dev "$1" mode tun
sleep 1
exec "$PYTHON" -c '
import os, socket, sys
path = "/var/run/wireguard/%s.sock" % sys.argv[1]
os.makedirs(os.path.dirname(path), exist_ok=True)
srv = socket.socket(socket.AF_UNIX); srv.bind(path); srv.listen()
while True:
    c, _ = srv.accept(); got = b""
    while not got.endswith(b"\\n\\n"):
        chunk = c.recv(4096)
        if not chunk:
            break
        got += chunk
    if got:  # wg set: answer as wireguard-go does
        c.sendall(b"errno=0\\n\\n")
    c.close()
' "$1"
"""


def test_the_tunnel_waits_for_wireguard_gos_control_socket_before_configuring_it(tmp_path, monkeypatch):
    """wireguard-go creates its interface, then opens its control socket; a `wg set` in
    between finds no socket, falls back to the kernel's WireGuard and fails ("Unable to
    modify interface: Protocol not supported", a CI run). A stand-in wireguard-go that waits
    a second between the two (and answers `wg set` as wireguard-go does): the tunnel comes up
    all the same, and going down leaves no socket behind."""
    import secrets

    from hier_localsgd.launch.tunnel import Site, down, up, uapi_socket

    fake = tmp_path / "bin" / "wireguard-go"
    fake.parent.mkdir()
    fake.write_text(SLOW_WIREGUARD_GO)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("PYTHON", sys.executable)
    hosts = Hosts("u")
    iface = f"hlt{os.getpid() % 100000}u"
    proc = None
    try:
        me, peer = Site("a", hosts.wan[0], "198.19.0.1"), Site("b", hosts.wan[1], "198.19.0.2")
        proc = up(hosts.ns[0], iface, "eth0", me, [peer], secrets.token_bytes(32), tmp_path / "wg.log")
        assert proc.poll() is None and uapi_socket(iface).exists()
        assert "198.19.0.1/24" in subprocess.run(["ip", "-n", hosts.ns[0], "addr", "show", iface], capture_output=True, text=True,
                                                   check=True, timeout=20).stdout
        down(hosts.ns[0], proc, iface)
        assert proc.poll() is not None and not uapi_socket(iface).exists()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        uapi_socket(iface).unlink(missing_ok=True)
        subprocess.run(["ip", "-n", hosts.ns[0], "link", "del", iface], capture_output=True, timeout=20)
        hosts.close()


@pytest.mark.parametrize("mtu", [1280, 1440])
def test_the_tunnel_runs_at_the_configured_mtu_up_to_the_largest_the_wan_carries(mtu):
    """security.tunnel_mtu: every site's WireGuard interface has it, the WAN veths keep
    1500, and an all-reduce through the overlay arrives intact, its bytes on the WAN veths.
    1440 is the largest that fits a 1500-byte IPv4 WAN (60 bytes of WireGuard): were the
    overhead larger, wireguard-go would drop its datagrams and the all-reduce would fail."""
    import secrets

    import torch

    from hier_localsgd.experiments.linkcheck import run_workers
    from hier_localsgd.launch.netns import ClusterNetwork

    nbytes = 1 << 22
    with ClusterNetwork(2, tunnel_secret=secrets.token_bytes(32), tunnel_mtu=mtu) as net:
        assert [_link_mtu(net.namespace(w), net.tunnel_iface(w)) for w in ("hub", 0, 1)] == [mtu] * 3
        assert [_link_mtu(net.namespace(c), net.cluster_iface(c)) for c in (0, 1)] == [1500, 1500]
        before = [_tx_bytes(net.namespace(c), net.cluster_iface(c)) for c in (0, 1)]
        results = run_workers(net, 2, nbytes, reps=1, emulate_Bps=0.0)
        after = [_tx_bytes(net.namespace(c), net.cluster_iface(c)) for c in (0, 1)]
    expected = float(sum(torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(r)).double().sum() for r in (0, 1)))
    assert all(abs(r["result_sum"] - expected) < 1e-2 for r in results), ([r["result_sum"] for r in results], expected)
    sent = [a - b for a, b in zip(after, before)]  # each rank sends the other half the tensor, encrypted
    assert all(n >= nbytes // 2 for n in sent), sent


def test_a_tunnel_mtu_larger_than_the_wan_allows_is_refused_in_one_line_naming_the_field():
    """1441 on a 1500-byte IPv4 WAN: its encrypted datagrams (+60 bytes) would not fit, and
    wireguard-go's UDP segmentation offload would drop them instead of fragmenting, so the
    network is refused before wireguard-go starts, and nothing is left behind (1440 carries
    traffic: the test above)."""
    import secrets

    from hier_localsgd.launch.netns import ClusterNetwork
    from hier_localsgd.launch.tunnel import TunnelError

    prefix = f"hln{os.getpid()}z"  # this process's: no other test's cleanup removes it
    with pytest.raises(TunnelError) as err:
        ClusterNetwork(2, prefix=prefix, tunnel_secret=secrets.token_bytes(32), tunnel_mtu=1441)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("security.tunnel_mtu: 1441 does not fit the WAN: the WAN interface "), msg
    assert "has MTU 1500 and WireGuard adds 60 bytes, so at most 1440" in msg, msg
    left = [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True, timeout=20).stdout.split()
            if n.startswith(prefix)]
    assert left == [], left
