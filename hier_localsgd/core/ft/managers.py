"""One torchft Manager per level, each with its own store, process group and checkpoint server.

A replica group holds an inner (replica-group) Manager talking to its cluster's
lighthouse and, only while it is its cluster's leader, an outer (cluster)
Manager talking to the global lighthouse.

Store discovery: each Manager gets a TCPStore of its own, hosted by group rank 0 on a
free port. Nothing is shared across replica groups or pre-arranged: torchft's quorum
names one up-to-date member's store as the rendezvous for the level's process group,
so launching needs only the lighthouse addresses. (Two Managers in one process need
separate stores: rank 0 writes unprefixed ``manager_addr``/``replica_id`` keys.) In a
replica group of several ranks, rank 0 publishes its store's address under
``store_key`` in the group's own store (torchrun's), where the other ranks find it.

Failure semantics:

* :func:`~hier_localsgd.core.runtime.addresses.probe_lighthouse` retries a refused connection (a lighthouse that launchers
  like TorchX start alongside the replica groups) and fails, naming the config field
  and address, when the lighthouse does not accept a connection within
  ``timeouts.connect``.
* :meth:`LevelManager.start_quorum` raises :class:`QuorumFailed` when no quorum
  forms in time although the lighthouse answers, and
  :class:`hier_localsgd.core.ft.outage.LighthouseOutage` within one slice (the lighthouse's
  heartbeat timeout) when the lighthouse does not answer. A quorum that forms in the
  few milliseconds between two slices is missed by this replica (torchft's
  lighthouse answers the requests waiting at that instant only); its peers then
  fail that round at their process-group timeout, and the next round re-forms. torchft 0.2.0 keeps a failed quorum future and re-raises it from
  every later ``start_quorum``; we drop it so the next round can try a fresh
  quorum. A heal that fails after the quorum formed does not raise: the Manager is
  left errored and the round's commit vote fails.
* :meth:`LevelManager.shutdown` stops the heartbeat at once (``wait=False``:
  never block behind an in-flight quorum) and aborts the process group.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, Iterator, Optional

import socket
import threading
from contextlib import contextmanager
from urllib.parse import urlsplit

import torchft.manager as _torchft_manager
from torch.distributed import TCPStore
from torchft import Manager
from torchft.coordination import LighthouseClient

from hier_localsgd.core.ft.heals import HealTransport, bind_family
from hier_localsgd.core.security.secret import SECRET_ENV, Key

from hier_localsgd.core.runtime.addresses import probe_lighthouse
from hier_localsgd.core.runtime.invariants import check_group_rank
from hier_localsgd.core.links.link import LinkProcessGroup, bind_gloo
from hier_localsgd.core.ft.outage import LighthouseHealth, LighthouseOutage
from hier_localsgd.core.ft.peers import await_heartbeats
from hier_localsgd.core.ft.presence import PresenceCheck, QuorumAbsent
from hier_localsgd.core.runtime.timeouts import Timeouts, ran_into_deadline

logger = logging.getLogger(__name__)


STORE_TIMEOUT_FLOOR = timedelta(seconds=15)


class QuorumFailed(RuntimeError):
    """No quorum formed. ``timed_out``: the wait ran into its deadline (the clock's verdict)."""

    def __init__(self, msg: str, timed_out: bool = False, dropped: bool = False) -> None:
        super().__init__(msg)
        self.timed_out = timed_out
        self.dropped = dropped  # formed, but a member did not confirm it (presence.py): ask again


class GroupRefused(QuorumFailed):
    """The quorum formed a process group that would break an invariant (I1: two members of
    one cluster in the outer group, which happens for a moment when leadership moves while
    the old and the new leader each see a different inner quorum). The group is refused
    before any collective runs in it, so the invariant holds; the round fails as a failed
    quorum does, and the next inner quorum settles who leads. A violation that persists
    (a misconfiguration) ends the process after ``sync.max_quorum_failures`` rounds."""

    def __init__(self, violation: Exception) -> None:
        super().__init__(f"group refused: {violation}")
        self.violation = violation


class _QuorumTap:
    """torchft's ManagerClient, passing each quorum result to ``sink`` before the Manager
    uses it (the link tags its rendezvous with it: link.LinkProcessGroup.note_quorum)."""

    def __init__(self, client: Any, sink: Callable[[Any], None]) -> None:
        self._client, self._sink = client, sink

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        quorum = self._client._quorum(*args, **kwargs)
        self._sink(quorum)
        return quorum

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@dataclass(frozen=True)
class QuorumView:
    """What a round needs from a formed quorum."""

    rank: int  # this replica's rank among the participants (sorted by replica id)
    size: int  # number of participants
    healed: bool  # whether this replica loaded state from a peer in this quorum


def bound_store(hostname: str, port: int, timeout: timedelta, bind: str = "") -> TCPStore:
    """A c10d store hosted here, listening on ``bind`` (or ``hostname``) at ``port`` (0: any
    free one) and nowhere else. c10d's store listens on every interface unless handed a
    socket: it is handed one (docs/security.md). Clients connect to ``hostname``."""
    fam, addr = bind_family(bind or hostname)
    with socket.socket(fam, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr[0], port, *addr[2:]))
        sock.listen(512)
        store = TCPStore(host_name=hostname, port=sock.getsockname()[1], is_master=True, wait_for_workers=False,
                         timeout=timeout, master_listen_fd=sock.fileno())
        sock.detach()  # the store owns the descriptor now (on failure above, `with` closes it)
    return store


def _group_rank0_store(
    level: str, hostname: str, group_rank: int, group_store: Optional[Any], store_key: str, connect_timeout: timedelta,
    bind: str = "",
) -> tuple[Optional[TCPStore], str, int]:
    """The Manager's own store: group rank 0 hosts it (and publishes its address under
    ``store_key`` in the group's store); other ranks wait for that address. Peers find it
    through the quorum. Returns (the store if hosted here, host, port).

    Its timeout has a floor: on the development VM about one c10d store connection in 25
    stalls 5 s before c10d's own retry succeeds, so a shorter timeout turns that stall into
    a failure (docs/runbook.md)."""
    store_timeout = max(connect_timeout, STORE_TIMEOUT_FLOOR)
    if group_rank == 0:
        store = bound_store(hostname, 0, store_timeout, bind)
        if group_store is not None:
            group_store.set(store_key, f"{hostname}:{store.port}")
        return store, hostname, store.port
    if group_store is None:
        raise ValueError(f"{level} manager of group rank {group_rank} needs the group's store to find rank 0's")
    group_store.wait([store_key], store_timeout)
    host, _, port = group_store.get(store_key).decode().rpartition(":")
    return None, host, int(port)


_said_unauthenticated = False


def _say_unauthenticated(lighthouse_addr: str) -> None:
    """Once per process: heals without a job secret are not authenticated. A warning when
    the lighthouse is off this host (a deployment across hosts), else an info line."""
    global _said_unauthenticated
    if _said_unauthenticated:
        return
    _said_unauthenticated = True
    local = (urlsplit(lighthouse_addr).hostname or "") in ("127.0.0.1", "localhost", "::1")
    logger.log(logging.INFO if local else logging.WARNING,
               "no job secret (security.secret_file or %s): heals are not authenticated (docs/security.md)", SECRET_ENV)


_BIND_LOCK = threading.Lock()


@contextmanager
def _manager_server_binds(hostname: str) -> Iterator[None]:
    """torchft's Manager starts its ManagerServer on ``[::]`` (every interface), with no
    argument to change it: while one Manager is built, its ManagerServer binds
    ``hostname``'s address instead (same port). One Manager at a time (a lock)."""
    fam, addr = bind_family(hostname)
    host = f"[{addr[0]}]" if fam == socket.AF_INET6 else addr[0]
    original = _torchft_manager.ManagerServer

    def bound(**kwargs: Any) -> Any:
        kwargs["bind"] = f"{host}:{str(kwargs['bind']).rsplit(':', 1)[1]}"
        return original(**kwargs)

    with _BIND_LOCK:
        _torchft_manager.ManagerServer = bound
        try:
            yield
        finally:
            _torchft_manager.ManagerServer = original


class LevelManager:
    """A torchft Manager for one level of one replica group.

    Args:
        level: "inner", "outer" or a baseline's name (logs, errors).
        replica_id: torchft replica id; must end in digits (torchft parses them).
        lighthouse_addr: the level's lighthouse.
        lighthouse_field: the config field that holds ``lighthouse_addr`` (errors).
        pg: the level's process group.
        state_dict / load_state_dict: the committed state a donor serves and a
            healing replica loads (through torchft's HTTP checkpoint transport).
        min_replicas: fewest participants for this Manager to commit.
        timeouts: the process's timeouts; the level's are taken from them (an "outer"
            Manager the outer level's, any other the inner level's): quorum and heal
            within the level's QUORUM timeout, each operation within the longer of its
            REDUCE and COMMIT timeouts, connections within ``connect``.
        hostname: address peers use to reach this process's servers.
        group_rank / group_world_size: this rank inside its replica group.
        max_commit_failures: consecutive failed commits before the Manager raises.
        use_async_quorum: False for hier/flat (sync quorum, heal before the round).
        presence_timeout: every member of a formed quorum must confirm it within this
            (presence.py; the lighthouse heartbeat timeout); None, or a group of several
            ranks: quorums are used as formed.
        heal_key: the job's heal key (core/security/secret.py); None: heals are not
            authenticated (they are still in the no-code format, heals.py).
        bind: the address the listeners bind ("" = ``hostname``'s; ``run.bind``).

    Every listener this Manager opens (its store, torchft's ManagerServer, the heal
    server) binds ``hostname``'s address (or ``bind``), never every interface by default.
    """

    def __init__(
        self,
        level: str,
        replica_id: str,
        lighthouse_addr: str,
        lighthouse_field: str,
        pg: LinkProcessGroup,
        state_dict: Callable[[], Any],
        load_state_dict: Callable[[Any], None],
        min_replicas: int,
        timeouts: Timeouts,
        hostname: str,
        group_rank: int = 0,
        group_world_size: int = 1,
        max_commit_failures: Optional[int] = None,
        use_async_quorum: bool = False,
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        group_store: Optional[Any] = None,
        store_key: str = "",
        presence_timeout: Optional[timedelta] = None,
        heal_key: Optional[Key] = None,
        bind: str = "",
    ) -> None:
        outer = level == "outer"
        quorum_timeout = timeouts.outer_quorum if outer else timeouts.inner_quorum
        op_timeout = max(timeouts.outer_reduce, timeouts.outer_commit) if outer else max(timeouts.inner_reduce, timeouts.inner_commit)
        heal_timeout, connect_timeout = quorum_timeout, timeouts.connect
        if not replica_id[-1:].isdigit():
            raise ValueError(f"replica id {replica_id!r} must end in digits (torchft parses them)")
        check_group_rank(level, group_rank, group_world_size)
        probe_lighthouse(lighthouse_field, lighthouse_addr, connect_timeout)
        if heal_key is None:
            _say_unauthenticated(lighthouse_addr)
        self.level = level
        self.replica_id = replica_id
        self.pg = pg
        self._healed = False
        self.rounds_started = 0  # quorum requests made: a collective's round (comm.py: stale errors)
        self._load = load_state_dict
        bind_gloo(hostname)  # the level's Gloo group listens where peers are told to connect
        self._store, store_host, store_port = _group_rank0_store(level, hostname, group_rank, group_store, store_key, connect_timeout, bind)
        self.heals = HealTransport(hostname, heal_timeout, None if heal_key is None else heal_key.bytes(),
                                   template=lambda: {"user": {level: state_dict()}, "torchft": {}}, level=level, bind=bind)
        try:
            with _manager_server_binds(bind or hostname):
                self.manager = Manager(
                    pg=pg,
                    load_state_dict=None,
                    state_dict=None,
                    min_replica_size=min_replicas,
                    use_async_quorum=use_async_quorum,
                    timeout=max(op_timeout, heal_timeout),
                    quorum_timeout=quorum_timeout,
                    connect_timeout=connect_timeout,
                    rank=group_rank,
                    world_size=group_world_size,
                    store_addr=store_host,
                    store_port=store_port,
                    lighthouse_addr=lighthouse_addr,
                    replica_id=replica_id,
                    hostname=hostname,
                    heartbeat_interval=heartbeat_interval,
                    checkpoint_transport=self.heals,
                    init_sync=False,  # every replica builds identical initial weights from the seed
                    max_retries=max_commit_failures,
                )
        except BaseException:
            self.heals.shutdown(wait=False)
            raise
        # Every quorum result is checked (a reissued id) and reaches the link before
        # torchft configures it (link.note_quorum).
        self._members: Optional[tuple] = None  # the member ids the group was configured for
        # Only for groups of one rank: each group rank confirms its own quorum, and in a
        # 2-rank group under load one rank's quorum was dropped while the other's went ahead
        # (a member's rank 0 confirmed 5 s late): the group's ranks then disagreed on the round.
        self._presence = (PresenceCheck(presence_timeout)
                          if presence_timeout is not None and group_world_size == 1 else None)
        self._dropped = 0  # commit failures reported for dropped quorums (see _on_quorum)
        self.manager._client = _QuorumTap(self.manager._client, self._on_quorum)
        self.manager.register_state_dict_fn(level, self._load_and_mark, state_dict)
        self._closed = False
        self.lighthouse_addr = lighthouse_addr
        # torchft appends a uuid to the replica id; the lighthouse knows members by it
        # (its kill endpoint, its status page). Rank 0 wrote it to the store.
        self.full_replica_id = self.manager._store.get("replica_id").decode()
        logger.info("%s manager %s up (lighthouse %s)", level, replica_id, lighthouse_addr)

    def _on_quorum(self, quorum: Any) -> None:
        """Sees each quorum result before the torchft Manager acts on it (its thread).

        torchft reconfigures the process group only when the quorum id changes, and a
        restarted lighthouse numbers quorums from 1 again: a reissued id with other
        members would run the round's collectives on the group of the old members (seen
        in tests/test_outages.py: after its cluster lighthouse came back, a leader alone
        in a new quorum 1 all-reduced on the old two-member group of quorum 1 and waited
        its whole phase for a peer that was not there). Such a quorum is configured afresh.

        First, every member must confirm the quorum (presence.py): one formed with a
        request its replica had given up raises here, before torchft uses it. A dropped
        quorum counts as a commit failure in the next request (torchft's lighthouse then
        gives the next quorum a new id, presence.py says why), taken back once a quorum holds.
        """
        if self._presence is not None:
            try:
                self._presence.confirm(quorum, self.full_replica_id)
            except Exception:
                self.manager._commit_failures += 1
                self._dropped += 1
                raise
            self.manager._commit_failures = max(0, self.manager._commit_failures - self._dropped)
            self._dropped = 0
        members = tuple(sorted(getattr(quorum, "replica_ids", None) or []))
        reconfigure = quorum.quorum_id != self.manager._quorum_id
        if not reconfigure and members != self._members:
            logger.warning(
                "%s quorum %d reissued with other members (%d, was %d; a restarted lighthouse): reconfiguring",
                self.level, quorum.quorum_id, len(members), len(self._members or ()),
            )
            self.manager._quorum_id = -1
            reconfigure = True
        if reconfigure:
            self._members = members
        self.pg.note_quorum(quorum)

    def _load_and_mark(self, sd: Any) -> None:
        self._healed = True
        self._load(sd)

    def start_quorum(
        self, timeout: timedelta, health: Optional[LighthouseHealth] = None, slice_: Optional[timedelta] = None,
        progress: Optional[int] = None, agree: Optional[Callable[..., Dict[str, bool]]] = None,
    ) -> QuorumView:
        """Forms a quorum (and heals from a peer if behind) within ``timeout``.

        ``progress``: what this replica announces as its step (torchft heals everyone
        below the quorum's highest step from a member at it). By default torchft counts
        commits; the inner level announces its outer round, training step and committed
        rounds (``sync.common.training_progress``), so who heals from whom follows progress
        (and, at equal steps, a member that rolled a round back heals from one that
        committed it): a replica group restarted at step 0 that
        committed a few no-op join rounds alone (its lighthouse had just come back) must
        not look ahead of a peer that trained on through the outage with its rounds
        skipped — with commit counts it did, and the peer healed from it, losing all its
        training (seen in tests/test_outages.py's restart-during-outage test).

        With ``health`` and ``slice_`` (the lighthouse's heartbeat timeout), the request
        is made in slices of at most ``slice_`` and the lighthouse is probed between
        slices (outage.py says why): an answering lighthouse is asked again until
        ``timeout`` is spent; one that does not answer ends the call at once.

        ``agree`` (a replica group of several ranks; sync/group_vote.py ``GroupVote.agree``
        bound to a name): every rank of the group asks torchft's ManagerServer on group
        rank 0, which asks the lighthouse once every rank has asked and hands the quorum to
        the requests waiting at that instant. Slices that each rank times alone end at
        different instants, and a quorum that forms between two of those ends reaches only
        some ranks (seen: rank 0 joined while rank 1, asking again alone, waited out the
        group's vote; the group restarted). So the caller starts the ranks' first slices
        together (a vote of its own), and after every slice the ranks agree with
        ``agree(none_joined=, again=, no_outage=)`` (each true only if true on every rank):
        they ask again together, or all stop. A rank that would have asked again, but whose
        sibling joined or stopped, raises QuorumFailed (LighthouseOutage when a sibling
        found the lighthouse down); the caller's own vote then reconciles the group
        (sync/inner_quorum.py ``InnerQuorum.for_group``). What is left: a quorum that forms within the few
        milliseconds between two ranks' slice ends, which the votes then handle.

        Raises:
            LighthouseOutage: the lighthouse does not answer (before or during the call).
            QuorumFailed: no quorum formed within ``timeout`` although the lighthouse answered.
            GroupRefused: the quorum's group would break I1 (at once, not retried).
        """
        was_down = health is not None and health.down
        if health is not None:
            health.before_quorum()
        deadline = time.monotonic() + timeout.total_seconds()
        if was_down and slice_ is not None:
            self._rejoin(slice_, min(2 * slice_, timeout / 2))
        while True:
            left = timedelta(seconds=max(0.1, deadline - time.monotonic()))
            this = min(left, slice_) if slice_ is not None and health is not None else left
            if progress is not None:
                self.manager._step = progress  # sent with the quorum request (torchft 0.2.0 reads it there)
            q: Optional[QuorumView] = None
            err: Optional[Exception] = None
            again = outage = False
            try:
                q = self._quorum_once(this, heal_budget=timedelta(seconds=max(0.1, deadline - time.monotonic())))
            except GroupRefused as e:
                err = e  # asking again in this round would form the same group
            except QuorumFailed as e:
                err, again, outage = self._after_slice(e, health, this >= left, deadline)
            if agree is None:
                if q is not None:
                    return q
                if again:
                    continue
                assert err is not None
                raise err
            v = agree(none_joined=q is None, again=again, no_outage=not outage)
            if q is not None:
                return q
            if v["none_joined"] and v["again"]:
                continue
            if again:  # this rank would have asked again: a sibling joined, or stopped
                why = f"{self.level} quorum: another rank of this replica group"
                if not v["no_outage"]:
                    raise LighthouseOutage(health.message(f"{why} found the lighthouse not answering") if health else why)
                raise QuorumFailed(f"{why} {'stopped asking' if v['none_joined'] else 'joined a quorum this rank missed'}")
            assert err is not None
            raise err

    @staticmethod
    def _after_slice(e: QuorumFailed, health: Optional[LighthouseHealth], last: bool,
                     deadline: float) -> tuple[Exception, bool, bool]:
        """After a slice that formed no quorum for this rank: (what to raise if it stops,
        whether to ask again, whether the lighthouse was found down)."""
        if e.dropped and time.monotonic() < deadline - 0.05:
            return e, True, False  # the members that are there ask again at once, sliced or not
        if health is not None and not health.probe():
            down = LighthouseOutage(health.message(f"quorum request failed: {e}"))
            down.__cause__ = e
            return down, False, True
        if last or time.monotonic() >= deadline - 0.05:
            # the last slice: a timeout only if the whole budget ran out
            e.timed_out = e.timed_out and time.monotonic() >= deadline - 0.05
            return e, False, False
        if not e.timed_out:
            time.sleep(0.1)  # failed early with the lighthouse answering: don't spin
        return e, True, False

    def _rejoin(self, heartbeat_timeout: timedelta, bound: timedelta) -> None:
        """Before the first quorum request after an outage of this level's lighthouse.

        A restarted lighthouse has no previous quorum and knows only the replicas whose
        heartbeats reached it, and torchft's heartbeat reconnects with a backoff of up to
        10 s. The first member to ask may be the only one it knows, and (min_replicas=1)
        it gets a quorum of one at once. A member that sorts after others of its last
        quorum is then rank 0, its cluster's leader: it runs outer rounds while the real
        leader waits out the join timeout for it (seen: commits resumed 13.3 s and 29.9 s
        after a cluster lighthouse came back, with a 2-5 s heartbeat timeout).

        So a returning member heartbeats at once (a direct heartbeat, repeated while it
        waits: its peers' waits end on it) and waits, at most ``bound``, until the
        lighthouse has heard the members of its last quorum that sort before it (torchft
        ranks a quorum by replica id). Once they are heard the lighthouse waits for their
        requests (the join timeout) instead of forming without them, so rank 0 stays with
        the member that had it. The member that sorts first waits for nobody; a member of
        the last quorum that died meanwhile costs at most ``bound``. Never raises.
        """
        before = [m for m in (self._members or ()) if m < self.full_replica_id]
        try:
            client = LighthouseClient(self.lighthouse_addr, connect_timeout=heartbeat_timeout)
        except Exception as e:  # the next quorum request meets the same problem, and says so
            logger.warning("%s rejoin: cannot reach lighthouse %s: %s", self.level, self.lighthouse_addr, e)
            return

        def beat() -> None:
            try:
                client.heartbeat(self.full_replica_id, timeout=heartbeat_timeout)
            except Exception as e:
                logger.debug("%s rejoin: heartbeat failed: %s", self.level, e)

        t0 = time.monotonic()
        missing = await_heartbeats(self.lighthouse_addr, before, heartbeat_timeout, bound, beat=beat)
        if before:
            logger.info("%s rejoin after the lighthouse's outage: %s after %.1fs", self.level,
                        f"not heard from {missing}, asking anyway" if missing else f"{len(before)} earlier member(s) heard",
                        time.monotonic() - t0)

    def _quorum_once(self, timeout: timedelta, heal_budget: Optional[timedelta] = None) -> QuorumView:
        """One quorum request of at most ``timeout``; a heal it starts (checkpoint metadata
        and transfer from the donor) gets at most ``heal_budget``, the time left in the
        caller's phase."""
        self._healed = False
        # Before torchft clears the error of the last round: from here on, a late failure
        # of a collective issued before belongs to a round that is over (comm.py).
        self.rounds_started += 1
        deadline = time.time() + timeout.total_seconds()
        # torchft bounds a heal by the Manager's one op timeout (the full heal timeout),
        # whatever of the phase is already spent: a heal starting late in the phase could
        # outlast its deadline and the watchdog would end the process. The quorum is
        # synchronous (use_async_quorum=False), so the bound applies to this call only.
        saved = self.manager._timeout
        if heal_budget is not None:
            self.manager._timeout = min(saved, heal_budget)
            # the same for the process group's connect to the quorum's store (link.py)
            self.pg.configure_deadline = time.monotonic() + heal_budget.total_seconds()
        try:
            self.manager.start_quorum(timeout=timeout)
            rank = self.manager.participating_rank()
            size = self.manager.num_participants()
        except Exception as e:
            # torchft 0.2.0 would re-raise this failed future from every later
            # start_quorum; drop it so the next round starts from a fresh quorum.
            self.manager._quorum_future = None
            raise QuorumFailed(f"{self.level} quorum failed: {e}", timed_out=ran_into_deadline(deadline),
                               dropped=isinstance(e, QuorumAbsent)) from e
        finally:
            self.manager._timeout = saved
            self.pg.configure_deadline = None
        if self.pg.violation is not None:
            # Never run a collective in a group that breaks an invariant (I1). torchft set
            # its quorum id before configure() raised: forget it, so the next quorum
            # configures (and checks) the group again even if its id is the same.
            self.manager._quorum_id = -1
            raise GroupRefused(self.pg.violation) from self.pg.violation
        if rank is None:
            raise QuorumFailed(f"{self.level} quorum formed without this replica participating")
        # A heal or process-group reconfiguration that failed after the quorum formed
        # leaves the Manager errored: the caller still runs the round's collectives
        # (its peers expect them) and its commit vote fails.
        return QuorumView(rank=rank, size=size, healed=self._healed)

    def should_commit(self, timeout: timedelta) -> bool:
        return self.manager.should_commit(timeout=timeout)

    def report_error(self, e: Exception) -> None:
        self.manager.report_error(e)

    def errored(self) -> Optional[Exception]:
        return self.manager.errored()

    @property
    def step(self) -> int:
        return self.manager.current_step()

    @property
    def quorum_id(self) -> int:
        return self.manager._quorum_id

    def describe(self, size: int) -> dict:
        """What the status file publishes about this level's membership."""
        return {"replica_id": self.full_replica_id, "lighthouse": self.lighthouse_addr, "quorum_id": self.quorum_id, "quorum_size": size, "manager_step": self.step}

    def shutdown(self) -> None:
        """Stops the heartbeat now and aborts the process group. Idempotent, never blocks long."""
        if self._closed:
            return
        self._closed = True
        try:
            self.manager.shutdown(wait=False)
        except Exception:  # shutting down on a failure path must not raise
            logger.exception("%s manager shutdown failed", self.level)
        try:
            self.pg.abort(errored=False)
        except Exception:
            logger.exception("%s process group abort failed", self.level)
        logger.info("%s manager %s shut down (heartbeat stopped)", self.level, self.replica_id)

