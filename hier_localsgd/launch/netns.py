"""Real networks on one machine: each cluster in its own Linux network namespace.

:class:`ClusterNetwork` builds, on this machine only::

    <p>-hub   namespace with a bridge <p>br (address 198.18.0.1/24): the global lighthouse
      |-- veth <p>h0 (hub side, on the bridge) == <p>c0 (in <p>-c0, 198.18.0.2/24)
      |-- veth <p>h1                            == <p>c1 (in <p>-c1, 198.18.0.3/24)
      ...
    <p>-c<i>  namespace of cluster i: its lighthouse and its replica-group processes

With a tunnel secret (``security.wan=tunnel``, launch/tunnel.py) each namespace also
gets a WireGuard interface ``<p>wh``/``<p>w<i>`` with an overlay address in 198.19.0.0/24 (hub .1,
cluster i .(i + 2)); the job's services bind those (:meth:`ClusterNetwork.service_address`),
the hosts file maps every namespace's name to it, and the WAN side (the bridge, each
cluster's veth) carries WireGuard's UDP only.

``<p>`` is a prefix unique to the creating process (``hln<pid><letter>``), so
concurrent jobs never share a name. Every address is in 198.18.0.0/15 (RFC 2544,
reserved for benchmarking) and exists only inside these namespaces: the veth pairs
are created directly in their namespaces, nothing is added to the root namespace
(no interface, no address, no route), and the namespaces have no default route, so
no packet can leave the machine.

A cluster's processes share its namespace, so they reach each other (and their own
address) whatever happens to its uplink; they reach the hub (the global lighthouse)
and the other clusters only through the bridge. :meth:`ClusterNetwork.partition`
sets the hub side of the cluster's veth down: the cluster side loses its carrier
(it stays administratively up, so its address, its local routes and all traffic
inside the namespace keep working, tested), the bridge drops every frame to and
from it, and established TCP connections across the cut stall silently (no reset),
as they would behind a real failed link. :meth:`ClusterNetwork.heal` sets it up again.

Processes are started inside a namespace with :meth:`ClusterNetwork.wrap`, which
prefixes a command with ``ip netns exec <ns> unshare --uts`` and a small ``sh``
stage that gives the process a hostname of its own (the namespace's name) and a
hosts file mapping every namespace's name to its address, then ``exec``\\ s the
command (the pid stays the command's: signals and process groups work as without
the wrapper). That matters because torchft advertises ``socket.gethostname()``
(its checkpoint server's address, and Gloo's default device is the hostname's
address): with the machine's hostname, a process in one namespace would hand its
peers an address that resolves, in their namespaces, to themselves. The hosts file
lives in a private temporary directory and is bind-mounted over ``/etc/hosts`` in
the process's own mount namespace (``ip netns exec`` makes one); ``/etc`` is
never written.

The launcher stays in the root namespace. To probe a lighthouse inside a namespace
it runs the probe there: :meth:`ClusterNetwork.run_in` calls a function on a fresh
thread that first joins the namespace with ``setns(2)`` (a thread's network
namespace is its own; the rest of the process is unaffected, and sockets keep the
namespace they were made in). This keeps the root namespace untouched (a root-side
veth onto the bridge would need an address and a route in the root namespace, and
would see the network from a vantage point that no real launcher has); it also
reads interface counters (:meth:`ClusterNetwork.counters`: ``/proc/thread-self/net/dev``
from inside).

Shaping (issue #14): :meth:`ClusterNetwork.shape` puts a ``tbf`` qdisc on both
ends of a cluster's uplink: the cluster side's egress shapes what the cluster
sends, the hub side's egress what it receives; both directions, same rate.

Failure semantics and cleanup guarantees:

* Construction either completes or removes what it made and raises
  :class:`NetnsError` with the failing command and its stderr.
* :meth:`ClusterNetwork.close` (also on ``__exit__``, at interpreter exit for every
  network still open, and idempotent) never raises: it SIGKILLs, by pid, any process
  still inside the network's namespaces (only processes started through this
  network can be there; a namespace with a process in it outlives ``ip netns del``),
  deletes the namespaces (which destroys their veths and the bridge), and removes
  the temporary directory. Failures are logged.
* A run killed outright (SIGKILL) leaves its namespaces behind; :func:`cleanup_stale`,
  called by every new network, removes the namespaces, temporary directories and any
  interface whose name carries a prefix of a process that no longer exists.
* Every external command has a timeout (:data:`COMMAND_TIMEOUT`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, Union

from hier_localsgd.core.security.secret import TUNNEL_MTU

logger = logging.getLogger(__name__)

T = TypeVar("T")
Where = Union[int, str]  # a cluster index, or "hub"

COMMAND_TIMEOUT = timedelta(seconds=20)
SUBNET = "198.18.0.0/24"  # inside 198.18.0.0/15 (RFC 2544)
HUB_ADDR = "198.18.0.1"
OVERLAY = "198.19.0"  # security.wan=tunnel: the WireGuard overlay's /24 (also RFC 2544)
MAX_CLUSTERS = 250  # cluster i is 198.18.0.(i + 2)
PREFIX_RE = re.compile(r"^hln(\d+)([a-z])$")  # default prefixes: hln<pid><letter>
_NAME_RE = re.compile(r"^hln(\d+)[a-z]")  # anything named by such a prefix
IFNAMSIZ = 15
# shape()'s default bucket (tbf_burst_bytes): sent at line rate after an idle spell, ahead of the
# shaped rate. At least one offload packet: a bucket smaller than the veth's 64 KiB GSO packets
# makes tbf split each into MTU frames in software (with 32 KiB, 2 clusters measured 1.54x the
# ring bound at 1 Gbit/s and 1.23x at 20 Mbit/s; 96 KiB: 1.09x and 1.14x). And at least one
# timer tick of the rate (tc-tbf(8): burst >= rate / HZ, HZ = 250 on these kernels), or tbf
# cannot reach a high rate.
TBF_MIN_BURST_BYTES = 96 * 1024
TBF_BURST_TICK = timedelta(milliseconds=4)
CLONE_NEWNET = 0x40000000

_lock = threading.Lock()
_counter = 0
_open: "weakref.WeakSet[ClusterNetwork]" = weakref.WeakSet()


def tbf_burst_bytes(rate_bits_per_s: float) -> int:
    """The bucket :meth:`ClusterNetwork.shape` gives a ``tbf`` at this rate (see TBF_MIN_BURST_BYTES)."""
    return max(TBF_MIN_BURST_BYTES, int(rate_bits_per_s / 8 * TBF_BURST_TICK.total_seconds()))


def tbf_transfer_s(nbytes: float, rate_bits_per_s: float, burst_bytes: Optional[int] = None) -> float:
    """The least time a ``tbf`` at ``rate_bits_per_s`` takes to pass ``nbytes`` of payload that
    start after an idle spell: the bucket's bytes go at once, the rest at the rate (headers not
    counted: the payload's bound). ``burst_bytes`` defaults to :func:`tbf_burst_bytes`."""
    burst = tbf_burst_bytes(rate_bits_per_s) if burst_bytes is None else burst_bytes
    return max(0.0, nbytes - burst) / (rate_bits_per_s / 8)


class NetnsError(RuntimeError):
    """A namespace command failed; the message names the command and its error."""


def _cmd(argv: Sequence[str], check: bool = True, timeout: timedelta = COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout.total_seconds())
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{' '.join(argv)}: {e}") from e
    if check and r.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: exit {r.returncode}: {(r.stderr or r.stdout).strip()}")
    return r


def _netns_names() -> List[str]:
    r = _cmd(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


@functools.lru_cache(maxsize=1)
def available() -> Optional[str]:
    """None if cluster networks can be built here, else a one-line reason.

    Builds and removes a throw-away namespace with a veth pair and a bridge, and
    runs a command inside it the way :meth:`ClusterNetwork.wrap` does. Cached.
    """
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        return "not Linux with network namespaces (/proc/self/ns/net missing)"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "unshare", "mount", "sh"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command on PATH (iproute2 / util-linux)"
    ns = f"{_new_prefix()}-probe"
    try:
        _cmd(["ip", "netns", "add", ns])
        _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        _cmd(["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        _cmd(["ip", "-n", ns, "link", "add", "pbr", "type", "bridge"])
        _cmd(["ip", "-n", ns, "link", "set", "pb", "master", "pbr"])
        _cmd(["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", "echo probe > /proc/sys/kernel/hostname"])
        _run_in_ns(ns, lambda: socket.socket().close())
    except (NetnsError, OSError) as e:
        return f"cannot build a network namespace here: {str(e).splitlines()[0]}"
    finally:
        _cmd(["ip", "netns", "del", ns], check=False)
    return None


@functools.lru_cache(maxsize=1)
def shaping_available() -> Optional[str]:
    """None if :meth:`ClusterNetwork.shape` works here (namespaces and the kernel's
    ``tbf`` qdisc), else a one-line reason. Puts a ``tbf`` on the loopback of a
    throw-away namespace and removes the namespace. Cached."""
    why = available()
    if why is not None:
        return why
    if shutil.which("tc") is None:
        return "no `tc` command on PATH (iproute2)"
    ns = f"{_new_prefix()}-tbf"
    try:
        _cmd(["ip", "netns", "add", ns])
        _cmd(["tc", "-n", ns, "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", "1mbit", "burst", "32k", "latency", "50ms"])
    except (NetnsError, OSError) as e:
        return f"the kernel's tbf qdisc is unavailable: {str(e).splitlines()[0]}"
    finally:
        _cmd(["ip", "netns", "del", ns], check=False)
    return None


def _new_prefix() -> str:
    """``hln<pid><letter>``: unique per process, and per network within the process
    (the first letter whose namespaces do not exist, counting on from the last)."""
    global _counter
    pid = os.getpid()
    with _lock:
        existing = _netns_names()
        for _ in range(26):
            p = f"hln{pid}{chr(ord('a') + _counter % 26)}"
            _counter += 1
            if not any(n.startswith(p + "-") for n in existing):
                return p
    raise NetnsError(f"26 cluster networks of process {pid} exist already; close some")


def cleanup_stale() -> List[str]:
    """Removes what networks of dead processes left behind (a run killed with SIGKILL):
    namespaces, temporary directories and root-namespace interfaces named
    ``hln<pid>...`` where ``<pid>`` no longer exists. Never raises; returns what it removed."""
    removed: List[str] = []

    def stale(name: str) -> bool:
        m = _NAME_RE.match(name)
        return bool(m) and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1)))

    try:
        for ns in _netns_names():
            if stale(ns):
                for pid in _cmd(["ip", "netns", "pids", ns], check=False).stdout.split():  # wireguard-go, say
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                if _cmd(["ip", "netns", "del", ns], check=False).returncode == 0:
                    removed.append(f"netns {ns}")
        r = _cmd(["ip", "-o", "link", "show"], check=False)
        for line in r.stdout.splitlines():
            parts = line.split(":", 2)
            if len(parts) > 1:
                name = parts[1].strip().split("@")[0]
                if stale(name) and _cmd(["ip", "link", "del", name], check=False).returncode == 0:
                    removed.append(f"link {name}")
        tmp = Path(tempfile.gettempdir())
        for d in tmp.glob("hln*"):
            if d.is_dir() and stale(d.name):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(f"dir {d}")
    except Exception:  # cleanup of others' leftovers must never fail a run
        logger.exception("cleanup of stale network namespaces failed")
    if removed:
        logger.warning("removed leftovers of dead runs: %s", ", ".join(removed))
    return removed


_libc = None


def _setns(fd: int) -> None:
    import ctypes

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"setns: {os.strerror(e)}")


def _run_in_ns(ns: str, fn: Callable[[], T], timeout: Optional[timedelta] = None) -> T:
    """Calls ``fn`` on a fresh thread inside network namespace ``ns``; returns or raises its result."""
    out: Dict[str, object] = {}

    def target() -> None:
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            out["value"] = fn()
        except BaseException as e:  # handed to the caller
            out["error"] = e

    th = threading.Thread(target=target, name=f"netns-{ns}", daemon=True)
    th.start()
    th.join(None if timeout is None else timeout.total_seconds())
    if th.is_alive():
        raise TimeoutError(f"{ns}: call did not return within {timeout}")
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["value"]  # type: ignore[return-value]


def read_net_dev(text: str) -> Dict[str, Tuple[int, int]]:
    """Parses ``/proc/net/dev``: interface -> (rx_bytes, tx_bytes)."""
    out: Dict[str, Tuple[int, int]] = {}
    for line in text.splitlines()[2:]:
        name, _, rest = line.partition(":")
        f = rest.split()
        if len(f) >= 9:
            out[name.strip()] = (int(f[0]), int(f[8]))
    return out


class ClusterNetwork:
    """A hub namespace with a bridge, and one namespace per cluster on a veth to it.

    Args:
        clusters: how many cluster namespaces (1..:data:`MAX_CLUSTERS`).
        prefix: name prefix of every namespace and interface (default
            ``hln<pid><letter>``); at most ``15 - 1 - len(str(clusters - 1))`` characters
            so interface names fit ``IFNAMSIZ``.
        tunnel_secret: the job secret: build the WireGuard overlay (launch/tunnel.py).
        tunnel_mtu: the overlay interfaces' MTU (security.tunnel_mtu).

    Raises:
        NetnsError: a command failed (what was built is removed first), or the
            arguments do not fit.
        TunnelError: building the overlay failed, or ``tunnel_mtu`` does not fit the
            WAN (launch/tunnel.py); what was built is removed first.
    """

    def __init__(self, clusters: int, prefix: Optional[str] = None, tunnel_secret: Optional[bytes] = None,
                 tunnel_mtu: int = TUNNEL_MTU) -> None:
        if not 1 <= clusters <= MAX_CLUSTERS:
            raise NetnsError(f"clusters={clusters}: must be in [1, {MAX_CLUSTERS}]")
        cleanup_stale()
        self.prefix = prefix or _new_prefix()
        longest = len(f"{self.prefix}h{clusters - 1}")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", self.prefix) or longest > IFNAMSIZ:
            raise NetnsError(f"prefix {self.prefix!r}: letters and digits only, and {self.prefix}h{clusters - 1} must fit {IFNAMSIZ} characters")
        self.clusters = clusters
        self.hub = f"{self.prefix}-hub"
        self.namespaces = [f"{self.prefix}-c{i}" for i in range(clusters)]
        self.bridge = f"{self.prefix}br"
        self._closed = False
        self._partitioned: set = set()
        self._made: List[str] = []  # namespaces created so far (close() removes them)
        self.tunnel = tunnel_secret is not None
        self._wireguard: List[subprocess.Popen] = []  # wireguard-go per namespace (tunnel)
        self.tmpdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        _open.add(self)
        try:
            self._build()
            if tunnel_secret is not None:
                self._build_tunnel(tunnel_secret, tunnel_mtu)
        except BaseException:
            self.close()
            raise

    # -- construction ------------------------------------------------------------
    def _build(self) -> None:
        for ns in [self.hub, *self.namespaces]:
            _cmd(["ip", "netns", "add", ns])
            self._made.append(ns)
            _cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
        hub = ["ip", "-n", self.hub]
        _cmd([*hub, "link", "add", self.bridge, "type", "bridge"])
        _cmd([*hub, "addr", "add", f"{HUB_ADDR}/24", "dev", self.bridge])
        _cmd([*hub, "link", "set", self.bridge, "up"])
        for i, ns in enumerate(self.namespaces):
            inside, outside = self.cluster_iface(i), self.hub_iface(i)
            _cmd(["ip", "link", "add", inside, "netns", ns, "type", "veth", "peer", "name", outside, "netns", self.hub])
            _cmd([*hub, "link", "set", outside, "master", self.bridge])
            _cmd([*hub, "link", "set", outside, "up"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", inside])
            _cmd(["ip", "-n", ns, "link", "set", inside, "up"])
        hosts = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"{self.service_address('hub')}\t{self.hub}"]
        hosts += [f"{self.service_address(i)}\t{ns}" for i, ns in enumerate(self.namespaces)]
        (self.tmpdir / "hosts").write_text("\n".join(hosts) + "\n")
        logger.info("cluster network %s: hub %s, clusters %s", self.prefix, HUB_ADDR, [self.address(i) for i in range(self.clusters)])

    def _build_tunnel(self, secret: bytes, mtu: int) -> None:
        from hier_localsgd.launch.tunnel import Site, up, wireguard_go_version

        where: List[Where] = ["hub", *range(self.clusters)]
        sites = {w: Site(self.namespace(w), self.address(w), self.service_address(w)) for w in where}
        for w in where:
            wan = self.bridge if w == "hub" else self.cluster_iface(int(w))
            self._wireguard.append(up(self.namespace(w), self.tunnel_iface(w), wan, sites[w], [s for v, s in sites.items() if v != w],
                                      secret, self.tmpdir / f"wireguard-{self.namespace(w)}.log", mtu=mtu))
        logger.info("cluster network %s: WireGuard overlay up (%s, MTU %d, wireguard-go %s)", self.prefix,
                    [s.overlay for s in sites.values()], mtu, wireguard_go_version())

    # -- names and addresses -----------------------------------------------------
    def _index(self, where: Where) -> Optional[int]:
        if where == "hub":
            return None
        if isinstance(where, int) and 0 <= where < self.clusters:
            return where
        raise ValueError(f"where={where!r}: expected 'hub' or a cluster in [0, {self.clusters})")

    def namespace(self, where: Where) -> str:
        i = self._index(where)
        return self.hub if i is None else self.namespaces[i]

    def address(self, where: Where) -> str:
        """The IPv4 address of the hub (its bridge) or of cluster ``where``."""
        i = self._index(where)
        return HUB_ADDR if i is None else f"198.18.0.{i + 2}"

    def service_address(self, where: Where) -> str:
        """Where the job's services at ``where`` listen and are reached: the overlay address
        with the tunnel, else :meth:`address`."""
        i = self._index(where)
        if not self.tunnel:
            return self.address(where)
        return f"{OVERLAY}.1" if i is None else f"{OVERLAY}.{i + 2}"

    def hostname(self, where: Where) -> str:
        """The hostname processes started by :meth:`wrap` have there (resolves to :meth:`address`)."""
        return self.namespace(where)

    def tunnel_iface(self, where: Where) -> str:
        """The WireGuard interface at ``where`` (unique across namespaces: wireguard-go's
        control socket is /var/run/wireguard/<name>.sock, which namespaces share)."""
        i = self._index(where)
        return f"{self.prefix}w{'h' if i is None else i}"

    def cluster_iface(self, cluster: int) -> str:
        """The cluster-side end of cluster ``cluster``'s veth (in its namespace)."""
        return f"{self.prefix}c{cluster}"

    def hub_iface(self, cluster: int) -> str:
        """The hub-side end of cluster ``cluster``'s veth (in the hub, on the bridge)."""
        return f"{self.prefix}h{cluster}"

    # -- running things inside ---------------------------------------------------
    def wrap(self, argv: Sequence[str], where: Where) -> List[str]:
        """``argv`` run inside ``where``'s namespace, with the namespace's hostname and
        hosts file; the process keeps the pid of the returned command (all ``exec``)."""
        if self._closed:
            raise NetnsError(f"{self.prefix}: the cluster network is closed")
        script = 'mount --bind "$1" /etc/hosts && echo "$2" > /proc/sys/kernel/hostname && shift 2 && exec "$@"'
        return ["ip", "netns", "exec", self.namespace(where), "unshare", "--uts", "--", "sh", "-c", script, "sh",
                str(self.tmpdir / "hosts"), self.hostname(where), *argv]

    def run_in(self, where: Where, fn: Callable[[], T], timeout: Optional[timedelta] = None) -> T:
        """Calls ``fn`` in this process, on a fresh thread inside ``where``'s namespace
        (sockets it opens belong there). ``fn`` should bound its own waits; ``timeout``
        bounds the wait for it (the thread is abandoned then)."""
        return _run_in_ns(self.namespace(where), fn, timeout)

    # -- faults and shaping ------------------------------------------------------
    def partition(self, cluster: int) -> None:
        """Cuts cluster ``cluster`` off the hub and the other clusters (its hub-side
        veth end goes down). Traffic inside its namespace is unaffected."""
        self._index(cluster)
        _cmd(["ip", "-n", self.hub, "link", "set", self.hub_iface(cluster), "down"])
        self._partitioned.add(cluster)
        logger.warning("cluster network %s: cluster %d partitioned", self.prefix, cluster)

    def heal(self, cluster: int) -> None:
        """Reconnects cluster ``cluster`` (its hub-side veth end goes up again)."""
        self._index(cluster)
        _cmd(["ip", "-n", self.hub, "link", "set", self.hub_iface(cluster), "up"])
        self._partitioned.discard(cluster)
        logger.warning("cluster network %s: cluster %d healed", self.prefix, cluster)

    def partitioned(self) -> List[int]:
        return sorted(self._partitioned)

    def shape(self, cluster: int, rate_bits_per_s: float, burst_bytes: Optional[int] = None, latency: timedelta = timedelta(milliseconds=50)) -> None:
        """Shapes cluster ``cluster``'s uplink with ``tbf`` in both directions: the
        cluster side's egress (what it sends) and the hub side's egress (what it
        receives), each at ``rate_bits_per_s`` with a ``burst_bytes`` bucket (default
        :func:`tbf_burst_bytes`) and at most ``latency`` of queueing (tbf drops beyond it).
        Replaces earlier shaping."""
        self._index(cluster)
        if rate_bits_per_s > 0 and burst_bytes is None:
            burst_bytes = tbf_burst_bytes(rate_bits_per_s)
        if rate_bits_per_s <= 0 or burst_bytes is None or burst_bytes <= 0 or latency <= timedelta(0):
            raise ValueError(f"shape: rate {rate_bits_per_s}, burst {burst_bytes}, latency {latency} must be positive")
        tbf = ["root", "tbf", "rate", f"{int(rate_bits_per_s)}bit", "burst", str(int(burst_bytes)),
               "latency", f"{max(1, round(latency.total_seconds() * 1000))}ms"]
        _cmd(["tc", "-n", self.namespace(cluster), "qdisc", "replace", "dev", self.cluster_iface(cluster), *tbf])
        _cmd(["tc", "-n", self.hub, "qdisc", "replace", "dev", self.hub_iface(cluster), *tbf])

    def unshape(self, cluster: int) -> None:
        """Removes :meth:`shape`'s qdiscs (no error if there were none)."""
        self._index(cluster)
        _cmd(["tc", "-n", self.namespace(cluster), "qdisc", "del", "dev", self.cluster_iface(cluster), "root"], check=False)
        _cmd(["tc", "-n", self.hub, "qdisc", "del", "dev", self.hub_iface(cluster), "root"], check=False)

    def uplink_bytes(self) -> Dict[int, Tuple[int, int]]:
        """Cluster -> (rx_bytes, tx_bytes) of its uplink's cluster-side end: everything the
        cluster received from and sent to the hub and the other clusters (headers included)."""
        return {c: self.counters(c)[self.cluster_iface(c)] for c in range(self.clusters)}

    def qdiscs(self, where: Where) -> str:
        """``tc qdisc show`` inside ``where`` (for checks and reports)."""
        return _cmd(["tc", "-n", self.namespace(where), "qdisc", "show"]).stdout

    def counters(self, where: Where) -> Dict[str, Tuple[int, int]]:
        """Interface -> (rx_bytes, tx_bytes) inside ``where``'s namespace (its ``/proc/net/dev``)."""
        return read_net_dev(self.run_in(where, lambda: Path("/proc/thread-self/net/dev").read_text(), timeout=COMMAND_TIMEOUT))

    def pids(self, where: Where) -> List[int]:
        """Processes inside ``where``'s namespace."""
        return self._ns_pids(self.namespace(where))

    def firewall_drops(self) -> Dict[str, int]:
        """Tunnel: namespace -> packets its WAN firewall dropped (launch/tunnel.py)."""
        from hier_localsgd.launch.tunnel import dropped

        return {self.namespace(w): dropped(self.namespace(w), self.tunnel_iface(w)) for w in ["hub", *range(self.clusters)]} if self.tunnel else {}

    # -- teardown ----------------------------------------------------------------
    def close(self) -> None:
        """Removes everything this network made. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        _open.discard(self)
        try:
            drops = {ns: n for ns, n in self.firewall_drops().items() if n}
            if drops:  # someone outside the mesh sent to a site: one line per site
                for ns, n in drops.items():
                    logger.warning("cluster network %s: the WAN firewall of %s dropped %d packet(s) from outside the WireGuard mesh", self.prefix, ns, n)
        except Exception:
            logger.exception("cluster network %s: reading the firewall counters failed", self.prefix)
        for proc in self._wireguard:  # they would be killed below; stop them first, quietly
            proc.terminate()
        for proc in self._wireguard:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
        try:
            self._kill_leftovers()
        except Exception:
            logger.exception("cluster network %s: killing leftover processes failed", self.prefix)
        for ns in reversed(self._made):
            try:
                r = _cmd(["ip", "netns", "del", ns], check=False)
                if r.returncode != 0 and ns in _netns_names():
                    logger.error("cluster network %s: ip netns del %s: %s", self.prefix, ns, r.stderr.strip())
            except Exception:
                logger.exception("cluster network %s: removing namespace %s failed", self.prefix, ns)
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        logger.info("cluster network %s removed", self.prefix)

    def _kill_leftovers(self) -> None:
        left = {ns: pids for ns in self._made if (pids := [p for p in self._ns_pids(ns) if p != os.getpid()])}
        if not left:
            return
        logger.warning("cluster network %s: killing processes still inside: %s", self.prefix, left)
        for pids in left.values():
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_pid_alive(p) for ps in left.values() for p in ps):
            time.sleep(0.05)

    @staticmethod
    def _ns_pids(ns: str) -> List[int]:
        r = _cmd(["ip", "netns", "pids", ns], check=False)
        return [int(p) for p in r.stdout.split() if p.isdigit()]

    def __enter__(self) -> "ClusterNetwork":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ClusterNetwork({self.prefix!r}, clusters={self.clusters}, partitioned={self.partitioned()}, closed={self._closed})"


@atexit.register
def _close_all() -> None:
    for net in list(_open):
        net.close()
