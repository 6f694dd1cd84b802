"""Planned faults, for tests and experiments: where and when a replica misbehaves.

A fault names a replica (cluster, replica), the training step at which it fires,
and what happens:

* ``fail`` in a phase (INNER_REDUCE, OUTER_REDUCE or BROADCAST): the phase's next
  payload collective (the model-sized transfer) completes on the wire but its
  result is reported as failed, as a broken link would be
  (:meth:`hier_localsgd.core.link.LinkProcessGroup.arm_failure`);
* ``raise``: the process raises an exception at that step, in the training loop (while
  another non-daemon thread of the process is still blocked: seed 004's failed process
  that kept heartbeating, since a normal interpreter exit would wait for that thread) or
  in the given sync phase;
* ``hang``: the process stops making progress at that step, inside the given
  phase (LOCAL by default), holding its heartbeat (only the watchdog can end it);
* ``exit``: the process exits with code 17 at once, without any cleanup
  (like a crash that leaves the heartbeat threads alive until the OS reaps it);
* ``stop``: the process SIGSTOPs itself at the start of a sync phase (every thread,
  heartbeats included, stops: a wedged host); whoever runs the test sends SIGCONT.

Faults come from the ``faults`` list of the config. Each process builds one
:class:`FaultPlan`; the training loop (phase LOCAL) and the sync strategy (its phases)
take their faults from it, and :func:`fire` carries every action out: one home for what
a fault does.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, List, Mapping, Optional

ACTIONS = ("fail", "raise", "hang", "exit", "stop")
FAIL_PHASES = ("INNER_REDUCE", "OUTER_REDUCE", "BROADCAST")
# Whom a process kill hits (chaos, and the simulator's failure model): a replica group
# that does not lead its cluster, one that does, or a whole cluster.
ROLES = ("non_leader", "leader", "cluster")


class InjectedFault(RuntimeError):
    """The exception an injected fault raises."""


@dataclass(frozen=True)
class Fault:
    cluster: int
    replica: int
    step: int
    action: str
    phase: str = "LOCAL"

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
            )
        except KeyError as e:
            raise ValueError(f"{where}: missing field {e.args[0]!r}") from e
        if f.action not in ACTIONS:
            raise ValueError(f"{where}.action={f.action!r}: expected one of {ACTIONS}")
        if f.action == "fail" and f.phase not in FAIL_PHASES:
            raise ValueError(f"{where}.phase={f.phase!r}: a 'fail' fault needs one of {FAIL_PHASES}")
        return f


class FaultPlan:
    """The faults of one replica, looked up by (step, phase)."""

    def __init__(self, faults: Iterable[Fault], cluster: int, replica: int) -> None:
        self.faults: List[Fault] = [f for f in faults if f.cluster == cluster and f.replica == replica]
        self._fired: set[Fault] = set()

    def take(self, step: int, phase: str, actions: Iterable[str]) -> Optional[Fault]:
        """Returns (once) the fault planned for this step and phase, if any."""
        wanted = set(actions)
        for f in self.faults:
            if f.step == step and f.phase == phase and f.action in wanted and f not in self._fired:
                self._fired.add(f)
                return f
        return None


def fire(fault: Fault, where: str, arm_failure: Optional[Callable[[Exception], None]] = None, block: bool = False) -> None:
    """Carries out ``fault`` (taken from a :class:`FaultPlan`) at ``where`` (a phase and
    step, for messages). ``fail`` arms ``arm_failure`` with an :class:`InjectedFault` and
    returns; ``raise`` raises one (with ``block``, first starting a non-daemon thread that
    stays blocked: the training loop's seed-004 case); ``hang`` never returns (only the
    watchdog or a signal ends the process); ``exit`` ends the process with code 17 without
    cleanup; ``stop`` SIGSTOPs the whole process and returns once someone sends SIGCONT."""
    if fault.action == "fail":
        if arm_failure is None:
            raise ValueError(f"fault {fault}: 'fail' needs a link to arm at {where}")
        arm_failure(InjectedFault(f"injected failure in {where}"))
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
