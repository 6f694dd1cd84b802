"""Planned faults, for tests and experiments: where and when a replica misbehaves.

A fault names a replica (cluster, replica), the training step at which it fires,
and what happens:

* ``fail`` in a phase (INNER_REDUCE, OUTER_REDUCE or BROADCAST): the phase's next
  payload collective (the model-sized transfer) completes on the wire but its
  result is reported as failed, as a broken link would be
  (:meth:`hier_localsgd.core.links.link.LinkProcessGroup.arm_failure`); with
  ``collective: control``, the phase's next control collective instead (in a REDUCE
  phase, the consistency guard's exchange, guard.py); at the asynchronous outer
  level's push (OUTER_REDUCE, no link) the push is not sent and counts as
  unanswered (sync/async_outer.py);
* ``raise``: the process raises an exception at that step, in the training loop (while
  another non-daemon thread of the process is still blocked: seed 004's failed process
  that kept heartbeating, since a normal interpreter exit would wait for that thread) or
  in the given sync phase;
* ``hang``: the process stops making progress at that step, inside the given
  phase (LOCAL by default), holding its heartbeat (only the watchdog can end it);
* ``exit``: the process exits with code 17 at once, without any cleanup
  (like a crash that leaves the heartbeat threads alive until the OS reaps it);
* ``stop``: the process SIGSTOPs itself at the start of a sync phase (every thread,
  heartbeats included, stops: a wedged host); whoever runs the test sends SIGCONT (or,
  the chaos command, SIGKILL). Handed over through an inbox with a ``pid``, only that
  process takes it: its restart drops it;
* ``poison`` (training loop, phase LOCAL): the replica group's live model goes bad at that
  step, as a diverging optimizer, a bit flip or a bad shard would leave it: ``how: nan``
  (the default) puts a NaN in every 64th value, ``how: huge`` multiplies the model by
  :data:`POISON_SCALE`. It trains on from there; the poison screen (guard.py) keeps it out
  of the shared model.

A fault hits every rank of its replica group, or with ``rank: k`` only group rank k
(a failure one rank of a several-rank group sees and its siblings do not, group_vote.py).

Faults come from the ``faults`` list of the config, and (with ``run.fault_inbox``) from
files the chaos command writes while the process runs (:meth:`FaultPlan.from_inbox`): a
poison in ``inbox.json``, now, at whatever step the process is; a ``stop`` in
``inbox_phase.json`` (:func:`phase_inbox`), at the next start of its sync phase whatever
the step (:data:`ANY_STEP`), so that the chaos command's phase kill hits its phase however
short it is: the process stops itself there, its status showing the phase, and the
command kills it (two files, so that a pending poison and a pending stop never overwrite
each other). Each process builds one
:class:`FaultPlan`; the training loop (phase LOCAL) and the sync strategy (its phases)
take their faults from it, and :func:`fire` carries every action out: one home for what
a fault does.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, List, Mapping, Optional

if TYPE_CHECKING:  # torch is imported where it is used: the configuration imports this module (core/runtime/choices.py)
    import torch

ACTIONS = ("fail", "raise", "hang", "exit", "stop", "poison")
POISONS = ("nan", "huge")  # what ``poison`` does to the model (poison_model)
POISON_SCALE = 1e4
FAIL_PHASES = ("INNER_REDUCE", "OUTER_REDUCE", "BROADCAST")
# The sync phases whose start is a fault point (sync/state.py fault_point, called by the
# hierarchical strategy: sync/hier.py, outer_round.py); the baselines have none.
SYNC_FAULT_PHASES = ("INNER_QUORUM", "INNER_REDUCE", "BROADCAST", "INNER_COMMIT", "OUTER_QUORUM", "OUTER_REDUCE")
COLLECTIVES = ("payload", "control")  # which collective a ``fail`` hits (link.PAYLOAD / link.CONTROL)
# Whom a process kill hits (chaos, and the simulator's failure model): a replica group
# that does not lead its cluster, one that does, or a whole cluster.
ROLES = ("non_leader", "leader", "cluster")
ANY_STEP = -1  # a fault's step: at its phase's next fault point, whatever the step (phase_inbox)


class InjectedFault(RuntimeError):
    """The exception an injected fault raises."""


@dataclass(frozen=True)
class Fault:
    cluster: int
    replica: int
    step: int
    action: str
    phase: str = "LOCAL"
    rank: Optional[int] = None  # group rank it hits; None: every rank of the group
    collective: str = "payload"  # ``fail`` only: which kind of collective (COLLECTIVES)
    how: str = "nan"  # ``poison`` only: what it does to the model (POISONS)

    @classmethod
    def from_mapping(cls, i: int, m: Mapping[str, object]) -> "Fault":
        where = f"faults[{i}]"
        try:
            f = cls(
                cluster=int(m["cluster"]),  # type: ignore[arg-type]
                replica=int(m["replica"]),  # type: ignore[arg-type]
                step=int(m["step"]),  # type: ignore[arg-type]
                action=str(m["action"]),
                phase=str(m.get("phase", "LOCAL")),
                rank=None if m.get("rank") is None else int(m["rank"]),  # type: ignore[arg-type]
                collective=str(m.get("collective", "payload")),
                how=str(m.get("how", "nan")),
            )
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e.args[0]!r}") from e
        if f.action not in ACTIONS:
            raise ValueError(f"{where}.action={f.action!r}: expected one of {ACTIONS}")
        if f.action == "fail" and f.phase not in FAIL_PHASES:
            raise ValueError(f"{where}.phase={f.phase!r}: a 'fail' fault needs one of {FAIL_PHASES}")
        if f.collective not in COLLECTIVES:
            raise ValueError(f"{where}.collective={f.collective!r}: expected one of {COLLECTIVES}")
        if f.how not in POISONS:
            raise ValueError(f"{where}.how={f.how!r}: expected one of {POISONS}")
        if f.action == "poison" and f.phase != "LOCAL":
            raise ValueError(f"{where}.phase={f.phase!r}: a 'poison' fault fires in the training loop (LOCAL)")
        if f.rank is not None and f.rank < 0:
            raise ValueError(f"{where}.rank={f.rank}: a group rank is 0 or more")
        return f


class FaultPlan:
    """The faults of one process (a replica group's group rank ``rank``), looked up by (step, phase)."""

    def __init__(self, faults: Iterable[Fault], cluster: int, replica: int, rank: int = 0, inbox: Optional[Path] = None) -> None:
        self.faults: List[Fault] = [f for f in faults if f.cluster == cluster and f.replica == replica
                                    and (f.rank is None or f.rank == rank)]
        self._fired: set[Fault] = set()
        self.cluster, self.replica = cluster, replica
        self.inbox = inbox

    def from_inbox(self, step: int) -> List[Fault]:
        """Faults handed over through the inbox files (``{"action": "poison", "how": ...,
        "id": ...}``, written whole by :func:`deliver`): the inbox's planned for ``step``,
        :func:`phase_inbox`'s for :data:`ANY_STEP`. Each file is taken (renamed to
        ``<name>.taken``) so it fires once. Empty: no inbox, or nothing in it."""
        if self.inbox is None:
            return []
        return self._take_files(((self.inbox, step), (phase_inbox(self.inbox), ANY_STEP)))

    def from_phase_inbox(self) -> List[Fault]:
        """The phase inbox's fault alone (:meth:`from_inbox`), for a fault point: a process
        held out of its training loop (a lighthouse outage, a long wait) still takes a phase
        stop before its next phase. (The other inbox's fault is planned for the loop's step:
        only the loop takes it.)"""
        if self.inbox is None:
            return []
        return self._take_files(((phase_inbox(self.inbox), ANY_STEP),))

    def _take_files(self, files: Iterable[tuple]) -> List[Fault]:
        got = []
        for path, at in files:
            if not path.exists():
                continue
            taken = path.with_name(path.name + ".taken")
            try:
                os.replace(path, taken)
                m = json.loads(taken.read_text())
            except (OSError, ValueError):
                continue  # gone meanwhile, or not whole: deliver() writes it atomically
            if m.get("pid") is not None and m.pop("pid") != os.getpid():
                continue  # handed to an earlier process of this group: a restart never fires it
            got.append(Fault.from_mapping(0, {**m, "cluster": self.cluster, "replica": self.replica, "step": at}))
        self.faults += got
        return got

    def take(self, step: int, phase: str, actions: Iterable[str]) -> Optional[Fault]:
        """Returns (once) the fault planned for this step (or :data:`ANY_STEP`) and phase, if any."""
        wanted = set(actions)
        for f in self.faults:
            if f.step in (step, ANY_STEP) and f.phase == phase and f.action in wanted and f not in self._fired:
                self._fired.add(f)
                return f
        return None


def phase_inbox(inbox: Path) -> Path:
    """The inbox file of a fault for a sync phase, next to ``inbox`` (module doc)."""
    return inbox.with_name("inbox_phase.json")


def deliver(inbox: Path, fault: Mapping[str, object]) -> None:
    """Writes ``fault`` (its action and options) to a process's inbox, atomically."""
    tmp = inbox.with_name(inbox.name + ".tmp")
    tmp.write_text(json.dumps(dict(fault)))
    os.replace(tmp, inbox)


def poison_model(t: torch.Tensor, how: str) -> None:
    """What a ``poison`` fault does to the model's flat parameter vector ``t`` (in place)."""
    import torch

    with torch.no_grad():
        if how == "nan":
            t[::64] = float("nan")
        elif how == "huge":
            t.mul_(POISON_SCALE)
        else:
            raise ValueError(f"unknown poison {how!r} (expected one of {POISONS})")


def fire(fault: Fault, where: str, arm_failure: Optional[Callable[[Exception, str], None]] = None, block: bool = False,
         model: Optional[torch.Tensor] = None) -> None:
    """Carries out ``fault`` (taken from a :class:`FaultPlan`) at ``where`` (a phase and
    step, for messages). ``fail`` arms ``arm_failure`` with an :class:`InjectedFault` and
    the fault's ``collective`` kind and returns; ``raise`` raises one (with ``block``, first starting a non-daemon thread that
    stays blocked: the training loop's seed-004 case); ``hang`` never returns (only the
    watchdog or a signal ends the process); ``exit`` ends the process with code 17 without
    cleanup; ``stop`` SIGSTOPs the whole process and returns once someone sends SIGCONT;
    ``poison`` spoils ``model`` (the flat parameter vector: :func:`poison_model`)."""
    if fault.action == "fail":
        if arm_failure is None:
            raise ValueError(f"fault {fault}: 'fail' needs a link to arm at {where}")
        arm_failure(InjectedFault(f"injected failure in {where}"), fault.collective)
    elif fault.action == "raise":
        if block:  # as in seed 004: an interpreter exit would wait for this thread, heartbeat and all
            threading.Thread(target=time.sleep, args=(3600,), name="blocked-worker").start()
        raise InjectedFault(f"injected exception in {where}")
    elif fault.action == "hang":
        while True:  # only the watchdog (or a signal) ends this
            time.sleep(1.0)
    elif fault.action == "exit":
        os._exit(17)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.action == "poison":
        if model is None:
            raise ValueError(f"fault {fault}: 'poison' needs the model at {where}")
        poison_model(model, fault.how)
