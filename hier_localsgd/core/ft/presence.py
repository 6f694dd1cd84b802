"""Quorum presence: every member of a formed quorum confirms it is in it before it is used.

Why: torchft 0.2.0's lighthouse keeps a quorum request after its client gave up on it
(the request timed out at the client; the lighthouse never hears of it) and forms the
next quorum with it as soon as a peer asks. That peer then waits a whole phase for a
member that is not there, in the process group's rendezvous or in a collective, while
the member's next request waits for the peer. With equal phase timeouts the two waits
lock in phase (each side arrives just after the other gave up), round after round;
seen on CI in tests/test_outages.py: three 30 s outer quorums failed in a row and the
leader exited.

How: when a quorum result arrives, each member writes a key naming itself into the
quorum's rendezvous store (the primary member's manager store, where torchft's process
group meets too) and waits at most ``timeout`` (the lighthouse's heartbeat timeout) for
the keys of every member. The verdict is one atomic ``compare_set`` of one verdict key
per quorum: whoever saw every key first sets "go", whoever ran out of time first sets
"abort", and every member acts on the verdict the store holds, so all members use the
quorum or all drop it. A member whose request was a left-over never writes its key, so
the others drop the quorum within ``timeout`` and ask again, this time together with
that member's live request. Whoever drops a quorum reports a commit failure with its
next request (managers.LevelManager._on_quorum), so torchft's lighthouse gives the next
quorum of the same members a new id, and so a new tag: the dropped quorum's "abort" is
never read again.

Replica groups of one rank only. With several ranks, group rank k's Managers form their
own quorums with their own stores (the outer level's rank-0 and rank-1 quorums name
different stores), so each rank could only confirm its own; under load one rank's
quorum was then dropped while another rank's went ahead (a member's rank 0 confirmed
5 s late, seen in tests/test_multirank.py), and the group's ranks disagreed on the
round. A verdict shared by all ranks of all members needs one store every rank reaches,
which torchft's quorum does not name; those groups keep torchft's plain behaviour.

Failure semantics: :func:`confirm_presence` raises :class:`QuorumAbsent` on an "abort"
verdict and :class:`~hier_localsgd.core.runtime.addresses.StoreUnreachable` when the store's
host is gone; the caller fails that quorum (LevelManager turns both into QuorumFailed).
A quorum of one is not checked.

Keys live under ``hier/present/<tag>/`` with ``<tag>`` from
:func:`quorum_tag` (addresses.py; the link's rendezvous prefix carries it too): the same
on every member of one formed quorum. Two formations share
a tag only with the same id, highest step and member ids (uuids included): torchft
changes the id when membership changes or a member reports a failed commit, and the
step on every commit, so a repeat needs a round that ended without a commit vote.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Dict, Sequence

from torch.distributed import TCPStore

from hier_localsgd.core.runtime.addresses import connect_store, quorum_tag

logger = logging.getLogger(__name__)

GO, ABORT = "go", "abort"


class QuorumAbsent(RuntimeError):
    """A member of the formed quorum did not confirm it within the timeout: do not use it."""


class PresenceCheck:
    """Confirms quorums for one Manager (of a replica group of one rank).

    Args:
        timeout: how long a member waits for the others' keys (the lighthouse heartbeat
            timeout: a live member writes its key as soon as its quorum call returns).
    """

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self._stores: Dict[str, TCPStore] = {}  # host:port -> client (one primary at a time, usually)

    def _store(self, hostport: str) -> TCPStore:
        store = self._stores.get(hostport)
        if store is None:
            store = connect_store(hostport, self.timeout)  # a dead host fails now, not after c10d's retries
            self._stores = {hostport: store}  # keep one client: the primary rarely changes
        return store

    def confirm(self, quorum: object, me: str) -> None:
        """Raises :class:`QuorumAbsent` unless every member of ``quorum`` confirms it."""
        members: Sequence[str] = list(getattr(quorum, "replica_ids", None) or [])
        if len(members) <= 1:
            return
        hostport = str(getattr(quorum, "store_address")).split("/", 1)[0]
        prefix = f"hier/present/{quorum_tag(quorum)}/"
        try:
            verdict, missing = self._vote(self._store(hostport), prefix, me, members)
        except Exception:
            self._stores.pop(hostport, None)  # a broken client: connect afresh next time
            raise
        if verdict != GO:
            raise QuorumAbsent(
                f"quorum {getattr(quorum, 'quorum_id', '?')} formed with member(s) {missing or '(another member timed out)'} "
                f"not confirming it within {self.timeout.total_seconds():g}s: a quorum request its replica had "
                "given up (torchft's lighthouse keeps those); asking again"
            )

    def _vote(self, store: TCPStore, prefix: str, me: str, members: Sequence[str]) -> tuple:
        t0 = time.monotonic()
        store.set(prefix + me, "1")
        try:
            store.wait([prefix + m for m in members], self.timeout)
            want, missing = GO, []
        except Exception:  # c10d raises DistStoreError on its timeout
            want = ABORT
            missing = [m for m in members if not store.check([prefix + m])]
        verdict = store.compare_set(prefix + "verdict", "", want).decode()
        if verdict != GO or missing:
            logger.warning("quorum presence %s after %.1fs (missing %s)", verdict, time.monotonic() - t0, missing)
        return verdict, missing

