"""The WAN inside WireGuard: an authenticated, encrypted overlay between the sites.

``security.wan=tunnel`` puts every connection that crosses the WAN — the global
lighthouse's RPCs, the outer process groups and their stores, cross-cluster heals —
inside a WireGuard mesh (``wireguard-go``, the user-space implementation, on
``/dev/net/tun``; configured with ``wg`` from wireguard-tools). Why WireGuard and not a
TLS front such as stunnel: the outer process groups open connections on ports chosen at
run time (Gloo's pairs, c10d stores), which a per-port TLS front cannot cover; an
overlay network covers every connection at once, and WireGuard authenticates every
packet (Curve25519 keys, ChaCha20-Poly1305) and drops replays (its counters) by design.

Each site (a node: the hub of the global lighthouse, a cluster) gets an interface with
an overlay address; every service the job runs binds its site's overlay address. Keys
come from the job secret (core/security/secret.py): a site's private key is an HMAC of
the secret and the site's name, so every holder of the secret can compute every peer's
public key, and nobody else can compute any. A firewall (nftables) on the site's WAN
interface accepts only WireGuard's UDP port: a host on the WAN that holds no key reaches
no service of the job, not even through a route of its own to the overlay addresses
(Linux accepts packets for any local address on any interface).

:func:`up` builds one site inside a network namespace (launch/netns.py uses it for
``run.netns`` jobs: ``hier-localsgd demo security.wan=tunnel``). Failure semantics: a
step that fails raises :class:`TunnelError` naming the command and its error;
the namespace's teardown (netns.py ``close``) kills ``wireguard-go`` and removes the
interface and rules with the namespace. Private keys go to ``wg`` through a file of mode
0600 in a private directory, removed at once; they are never on a command line.

The tunnel's MTU (security.tunnel_mtu) must fit the WAN path: wireguard-go with TUN
offloads (upstream 0.0.20231211, Debian 13; ``launch/install_wireguard_go.sh``) hands the
kernel batches of encrypted datagrams with UDP segmentation offload, which never fragments,
so a datagram larger than the WAN interface's MTU is refused (``sendmmsg: message too
long``) and the peer hears nothing. :func:`up` refuses such an MTU before it starts.
"""

from __future__ import annotations

import base64
import hmac
import ipaddress
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from hashlib import sha256
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from hier_localsgd.core.security.secret import SECRET_ENV, TUNNEL_MTU, TUNNEL_MTU_RANGE, derive
from hier_localsgd.errors import fail

logger = logging.getLogger(__name__)

WG_PORT = 51820
OVERLAY_PREFIX = 24
TOOLS = ("wireguard-go", "wg", "nft")
START_TIMEOUT = timedelta(seconds=10)
# wireguard-go's control (UAPI) socket for an interface: one directory that network
# namespaces share, so interface names are unique per host (netns.py tunnel_iface).
UAPI_DIR = Path("/var/run/wireguard")
# What WireGuard adds to a packet: the outer IP header (20 bytes IPv4, 40 IPv6), UDP (8), its
# own header (16) and the authentication tag (16).
WG_OVERHEAD = {4: 60, 6: 80}


class TunnelError(RuntimeError):
    """A step of building the overlay failed; the message names it."""


@dataclass(frozen=True)
class Site:
    """One end of the mesh: ``name`` (keys derive from it), its WAN endpoint and its
    overlay address."""

    name: str
    endpoint: str  # WAN address its WireGuard listens on
    overlay: str  # its address inside the tunnel


def missing_tools() -> Optional[str]:
    """None if this host can build the overlay, else one line saying what is missing."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"no {', '.join(missing)} on PATH (Debian: apt-get install wireguard-tools nftables, and launch/install_wireguard_go.sh)")
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (wireguard-go needs a TUN device)"
    return None


def wireguard_go_version() -> str:
    """The installed wireguard-go's version: Debian's package version where the binary on
    PATH is the installed package's (the binary of 0.0.20231211 calls itself 0.0.20230223),
    else what the binary prints."""
    path = shutil.which("wireguard-go")
    if path is None:
        return "missing"

    def first_line(argv: List[str]) -> str:
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""

    if os.path.realpath(path) == "/usr/bin/wireguard-go":
        pkg = first_line(["dpkg-query", "-W", "-f=${db:Status-Abbrev} ${Version}", "wireguard-go"])
        if pkg.startswith("ii "):
            return pkg.split()[-1]
    return first_line([path, "--version"]) or "unknown"


def private_key(secret: bytes, site: str) -> bytes:
    """The site's Curve25519 private key (clamped), derived from the job secret."""
    k = bytearray(hmac.new(derive(secret, "wireguard").bytes(), site.encode(), sha256).digest())
    k[0] &= 248
    k[31] &= 127
    k[31] |= 64
    return bytes(k)


def public_key(private: bytes) -> str:
    """The base64 public key of a private key (``wg pubkey``)."""
    r = subprocess.run(["wg", "pubkey"], input=base64.b64encode(private).decode() + "\n", capture_output=True, text=True, timeout=10)
    if r.returncode != 0:
        raise TunnelError(f"wg pubkey: {r.stderr.strip()}")
    return r.stdout.strip()


def _run(argv: Sequence[str]) -> str:
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TunnelError(f"{' '.join(argv)}: {e}") from e
    if r.returncode != 0:
        raise TunnelError(f"{' '.join(argv)}: exit {r.returncode}: {(r.stderr or r.stdout).strip()}")
    return r.stdout


def _in(ns: Optional[str], argv: Sequence[str]) -> List[str]:
    """``argv`` run inside namespace ``ns`` (None: here)."""
    return (["ip", "netns", "exec", ns] if ns else []) + list(argv)


def up(ns: Optional[str], iface: str, wan_iface: str, me: Site, peers: List[Site], secret: bytes, log: Path,
       strict: bool = True, mtu: int = TUNNEL_MTU) -> subprocess.Popen:
    """Builds site ``me`` in namespace ``ns`` (None: this host's): ``wireguard-go`` on
    ``iface`` (its process, returned; ending it removes the interface), the keys, one peer
    per other site, the overlay address, the interface's ``mtu`` (security.tunnel_mtu),
    and the firewall (:func:`firewall`). Raises
    :class:`TunnelError`; what it built is then removed."""
    why = missing_tools()
    if why is not None:
        raise TunnelError(why)
    limit, where = largest_mtu(ns, wan_iface, peers)
    if mtu > limit:
        raise TunnelError(f"security.tunnel_mtu: {mtu} does not fit the WAN: {where}, so at most {limit} "
                          f"(wireguard-go sends with UDP segmentation offload, which does not fragment)")
    if subprocess.run(_in(ns, ["ip", "link", "show", iface]), capture_output=True, timeout=20).returncode == 0:
        raise TunnelError(f"interface {iface}{f' in {ns}' if ns else ''} exists already (another tunnel, or one left by a crash: "
                          f"ip link del {iface})")
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    env.update(WG_PROCESS_FOREGROUND="1", LOG_LEVEL="error")
    with open(log, "ab") as out:
        # Its own session (a terminal's Ctrl-C reaches the launcher, which takes it down in
        # order), and SIGTERM when the launcher dies (it would outlive a SIGKILLed one).
        proc = subprocess.Popen(_in(ns, ["wireguard-go", iface]), stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_session_and_deathsig)
    try:
        _configure(ns, iface, wan_iface, me, peers, secret, log, proc, strict, mtu)
    except BaseException:
        down(ns, proc, iface)
        raise
    return proc


def largest_mtu(ns: Optional[str], wan_iface: str, peers: List[Site]) -> Tuple[int, str]:
    """The largest tunnel MTU whose encrypted datagrams fit the WAN, and one phrase saying
    why: ``wan_iface``'s MTU (a namespace's WAN veth), else (a real host) the smallest MTU
    of the routes to the peers' endpoints, each less WireGuard's overhead for its address
    family. A namespace's mesh passes its WAN interface; a real host passes none, since its
    WAN interface may differ per peer. Raises :class:`TunnelError` when a peer's endpoint
    does not resolve or has no route."""
    if wan_iface:  # a namespace's mesh: the peers' endpoints are addresses
        wan, family = _link_mtu(ns, wan_iface), max([ipaddress.ip_address(p.endpoint).version for p in peers], default=4)
        return wan - WG_OVERHEAD[family], f"the WAN interface {wan_iface} has MTU {wan} and WireGuard adds {WG_OVERHEAD[family]} bytes"
    best: Optional[Tuple[int, str]] = None
    for p in peers:
        try:
            addr = socket.getaddrinfo(p.endpoint, WG_PORT, proto=socket.IPPROTO_UDP)[0][4][0]
        except OSError as e:
            raise TunnelError(f"peer {p.name}: its WAN address {p.endpoint!r} does not resolve: {e}") from e
        family = ipaddress.ip_address(addr.split("%")[0]).version  # an IPv6 address may carry a scope
        route = _run(_in(ns, ["ip", "route", "get", addr]))
        dev = re.search(r"\bdev (\S+)", route)
        route_mtu = re.search(r"\bmtu (?:lock )?(\d+)", route)  # the route's own, or a learned path MTU
        if route_mtu is None and dev is None:
            raise TunnelError(f"peer {p.name}: ip route get {addr} names no interface: {route.strip()!r}")
        wan = int(route_mtu.group(1)) if route_mtu else _link_mtu(ns, dev.group(1))
        limit = wan - WG_OVERHEAD[family]
        if best is None or limit < best[0]:
            best = (limit, f"the route to peer {p.name} ({addr}{f' via {dev.group(1)}' if dev else ''}) has MTU {wan} "
                           f"and WireGuard adds {WG_OVERHEAD[family]} bytes over IPv{family}")
    if best is None:
        return TUNNEL_MTU_RANGE[1], "there is no peer"
    return best


def _link_mtu(ns: Optional[str], iface: str) -> int:
    out = _run(_in(ns, ["ip", "-o", "link", "show", "dev", iface]))
    m = re.search(r"\bmtu (\d+)", out)
    if m is None:
        raise TunnelError(f"ip link show {iface}{f' in {ns}' if ns else ''}: no MTU in {out.strip()!r}")
    return int(m.group(1))


def _session_and_deathsig() -> None:
    import ctypes
    import signal

    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG


def _configure(ns: Optional[str], iface: str, wan_iface: str, me: Site, peers: List[Site], secret: bytes, log: Path,
               proc: subprocess.Popen, strict: bool, mtu: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT.total_seconds()
    # wireguard-go opens its control socket after the interface: a `wg set` in between finds
    # no socket, falls back to the kernel's WireGuard and fails ("Protocol not supported";
    # seen in CI)
    for ready, what in ((lambda: subprocess.run(_in(ns, ["ip", "link", "show", iface]), capture_output=True, timeout=20).returncode == 0,
                         "create its interface"),
                        (lambda: _uapi_answers(iface), f"open its control socket {uapi_socket(iface)}")):
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise TunnelError(f"wireguard-go {iface}{f' in {ns}' if ns else ''} did not {what} (log: {log})")
            time.sleep(0.05)
    keydir = Path(tempfile.mkdtemp(prefix="hl-wg-"))  # mode 0700
    try:
        keyfile = keydir / "key"
        fd = os.open(keyfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(base64.b64encode(private_key(secret, me.name)).decode() + "\n")
        wg = ["wg", "set", iface, "private-key", str(keyfile), "listen-port", str(WG_PORT)]
        for p in peers:
            host = f"[{p.endpoint}]" if ":" in p.endpoint else p.endpoint  # an IPv6 address
            wg += ["peer", public_key(private_key(secret, p.name)), "endpoint", f"{host}:{WG_PORT}",
                   "allowed-ips", f"{p.overlay}/32", "persistent-keepalive", "5"]
        _run(_in(ns, wg))
    finally:
        shutil.rmtree(keydir, ignore_errors=True)
    _run(_in(ns, ["ip", "addr", "add", f"{me.overlay}/{OVERLAY_PREFIX}", "dev", iface]))
    _run(_in(ns, ["ip", "link", "set", iface, "mtu", str(mtu)]))
    _run(_in(ns, ["ip", "link", "set", iface, "up"]))
    firewall(ns, iface, wan_iface, me.overlay, strict)


def uapi_socket(iface: str) -> Path:
    """wireguard-go's control socket for ``iface``."""
    return UAPI_DIR / f"{iface}.sock"


def _uapi_answers(iface: str) -> bool:
    """Whether ``iface``'s control socket accepts a connection (``wg`` talks to it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(uapi_socket(iface)))
        except OSError:
            return False
    return True


def down(ns: Optional[str], proc: subprocess.Popen, iface: str) -> None:
    """Ends ``wireguard-go`` (its interface goes with it), removes its firewall table and
    its control socket (a killed wireguard-go leaves it behind)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    subprocess.run(_in(ns, ["nft", "delete", "table", "inet", table(iface)]), capture_output=True, timeout=20)
    uapi_socket(iface).unlink(missing_ok=True)


def table(iface: str) -> str:
    """The nftables table of the tunnel on ``iface`` (one per tunnel: two on a host never
    touch each other's rules)."""
    return f"hier_localsgd_{iface}"


def firewall(ns: Optional[str], iface: str, wan_iface: str, overlay: str, strict: bool) -> None:
    """The site's firewall (nftables table ``hier_localsgd_<iface>``, counted drops):

    * always: a packet to an overlay address that did not come through the tunnel (or
      from the host itself) is dropped — Linux accepts packets for any local address on
      any interface, so without this a host on the WAN could route to the overlay;
    * ``strict`` (a namespace that holds only the job): on ``wan_iface`` only WireGuard's
      UDP port is open. Not on a real host, where the WAN interface also carries its own
      services (ssh): there the job's services bind the overlay address only.
    """
    net = ".".join(overlay.split(".")[:3]) + ".0/24"
    rules = [f'ip daddr {net} iifname != {{ "{iface}", "lo" }} counter drop']
    if strict:
        rules += [f'iifname "{wan_iface}" udp dport {WG_PORT} accept', f'iifname "{wan_iface}" counter drop']
    text = (f"table inet {table(iface)} {{\n  chain input {{\n    type filter hook input priority 0; policy accept;\n"
            + "".join(f"    {r}\n" for r in rules) + "  }\n}\n")
    try:
        r = subprocess.run(_in(ns, ["nft", "-f", "-"]), input=text, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise TunnelError(f"nft{f' in {ns}' if ns else ''}: {e}") from e
    if r.returncode != 0:
        raise TunnelError(f"nft{f' in {ns}' if ns else ''}: {r.stderr.strip()}")


def dropped(ns: Optional[str], iface: str) -> int:
    """Packets the firewall of the tunnel on ``iface`` in namespace ``ns`` (None: this host's) dropped."""
    r = subprocess.run(_in(ns, ["nft", "list", "table", "inet", table(iface)]), capture_output=True, text=True, timeout=20)
    return sum(int(line.split("packets")[1].split()[0]) for line in r.stdout.splitlines() if "drop" in line and "packets" in line)


@dataclass
class TunnelConfig:
    """The ``tunnel`` section: one host's end of the WAN mesh across real hosts
    (``hier-localsgd tunnel``, ``launch/tunnel.sh``; docs/security.md). Local jobs
    (``security.wan=tunnel``) build their own between namespaces and ignore it."""

    site: str = ""  # this host's name in ``sites``
    # Every site, the same list on every host: "name@WAN address" (IP or DNS name). Site k
    # (from 0) gets overlay address k + 1 in ``overlay``.
    sites: List[str] = field(default_factory=list)
    overlay: str = "198.19.0.0/24"  # the overlay network (a /24 no host uses otherwise)
    iface: str = "hlwg0"  # the WireGuard interface's name

    def parsed(self) -> List[Site]:
        """The sites, each with its overlay address; ConfigError naming the field otherwise."""
        net = self.overlay.split("/")[0].rsplit(".", 1)[0]
        if not self.overlay.endswith(".0/24") or len(net.split(".")) != 3 or not all(p.isdigit() and int(p) < 256 for p in net.split(".")):
            fail("tunnel.overlay", f"{self.overlay!r} — an IPv4 /24 such as 198.19.0.0/24")
        out: List[Site] = []
        for k, entry in enumerate(self.sites):
            name, sep, endpoint = str(entry).partition("@")
            if not sep or not name or not endpoint or not name.replace("-", "").replace("_", "").isalnum():
                fail(f"tunnel.sites[{k}]", f"{entry!r} — expected name@WAN address (letters, digits, - and _ in the name)")
            if any(s.name == name for s in out):
                fail(f"tunnel.sites[{k}]", f"{name!r} appears twice")
            out.append(Site(name, endpoint, f"{net}.{k + 1}"))
        if len(out) > 253:
            fail("tunnel.sites", f"{len(out)} sites; a /24 overlay holds at most 253")
        return out

    def check(self) -> None:
        """Checks what ``hier-localsgd tunnel`` needs (other commands do not use the section)."""
        sites = self.parsed()
        if len(sites) < 2:
            fail("tunnel.sites", f"{len(sites)} site(s) — a mesh needs at least 2 (name@WAN address each)")
        if self.site not in [s.name for s in sites]:
            fail("tunnel.site", f"{self.site!r} — must be one of tunnel.sites' names {[s.name for s in sites]}")
        if not 1 <= len(self.iface) <= 15:
            fail("tunnel.iface", f"{self.iface!r} — an interface name of 1 to 15 characters")


def serve(cfg: TunnelConfig, secret: Optional[bytes], stop: threading.Event, log: Path, mtu: int = TUNNEL_MTU) -> int:
    """``hier-localsgd tunnel``: builds this host's end of the mesh, prints one line with
    its overlay address, waits for ``stop`` (SIGTERM/SIGINT) or for wireguard-go to end,
    and takes it down. Returns the exit code (0, or 1 when wireguard-go died)."""
    cfg.check()
    if secret is None:
        fail("security.secret_file", "the tunnel's keys derive from the job secret: give security.secret_file or HIER_LOCALSGD_SECRET")
    sites = cfg.parsed()
    me = next(s for s in sites if s.name == cfg.site)
    proc = up(None, cfg.iface, "", me, [s for s in sites if s is not me], secret, log, strict=False, mtu=mtu)
    print(f"tunnel up: site {me.name} at {me.overlay} on {cfg.iface} (MTU {mtu}, wireguard-go {wireguard_go_version()}); peers "
          + ", ".join(f"{s.name} {s.overlay} (WAN {s.endpoint})" for s in sites if s is not me), flush=True)
    try:
        while not stop.wait(0.5):
            if proc.poll() is not None:
                print(f"tunnel: wireguard-go exited with {proc.returncode} (log: {log})", file=sys.stderr, flush=True)
                return 1
    finally:
        down(None, proc, cfg.iface)
    print("tunnel down", flush=True)
    return 0
