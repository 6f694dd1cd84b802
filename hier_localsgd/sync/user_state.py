"""The user's own state that heals and checkpoints with the model.

A training loop has state of its own that must move with the model when a replica group
heals from a peer or resumes from a durable checkpoint: an LR scheduler's position, a data
loader's position, an RNG, anything with ``state_dict()``/``load_state_dict()``. It is
registered once, by name (``HierarchicalDiLoCo(..., state={"scheduler": sched})``), and
every strategy puts :meth:`UserState.served` in what a donor serves and loads what it
receives with :meth:`UserState.load`.

When the state is taken: at loop boundaries, on the training thread — before each step's
forward pass (``HierarchicalDiLoCo.steps()``/``before_forward``), so it is the state after
the steps completed so far and consistent with itself (a schedule stepped after
``optimizer.step()`` and a data position advanced before it agree). A round runs inside the
next ``optimizer.step()``, so a heal serves the donor's state as of one step before the
sync point, and the healed group resumes one step behind in it (one scheduler step, one
batch re-read); with ``sync.mode=ddp`` the quorum comes after the take, and a heal is exact.
A durable checkpoint is written at the next loop boundary after its round, with a fresh
take: exact. Keep registered state small (positions, counters, schedules, RNG state): it is
copied before every step. A donor never reads the user's objects from another thread.

What does not carry it: a cluster that adopts a later global model from another cluster
(its leader healed at the outer level, or the broadcast of an outer round it was behind
in) takes that cluster's step but keeps its own user state, so its schedule and data
position fall behind by the steps it skipped. :class:`~hier_localsgd.HierarchicalDiLoCo`
counts them (``user_state.steps_without_state`` in its result).

A rollback leaves the user state as it is: the step counter keeps advancing through a
failed round (invariant I5), and so do the scheduler and data position.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Protocol

from hier_localsgd.core.security.wire import WireError, encode


class Stateful(Protocol):
    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state_dict: Dict[str, Any]) -> Any: ...


PARAM_GROUPS = "__param_groups__"  # the inner optimizer's live hyperparameters, served with the state


def hyperparameters(optimizer: Any) -> List[Dict[str, Any]]:
    """An optimizer's per-group hyperparameters (lr, betas, ...: what a scheduler moves)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def set_hyperparameters(optimizer: Any, groups: List[Dict[str, Any]]) -> None:
    for g, hp in zip(optimizer.param_groups, groups):
        g.update(copy.deepcopy(hp))


class UserState:
    """Named objects with ``state_dict``/``load_state_dict``, and the inner optimizer's live
    hyperparameters: ``optimizer.load_state_dict`` (a rollback, a heal) restores the
    hyperparameters of the commit it came from, which a scheduler that computes the next lr
    from the current one (StepLR, ExponentialLR, ...) would then carry forward. A rollback
    re-applies the live ones (committed.py); a heal applies the donor's, taken with its
    state.

    Raises:
        TypeError: (at construction) naming an object that lacks either method, or a
            value in a state that heals cannot carry (core/security/wire.py).
    """

    def __init__(self, objects: Optional[Mapping[str, Stateful]] = None, optimizer: Optional[Any] = None) -> None:
        self.objects: Dict[str, Stateful] = dict(objects or {})
        self.optimizer = optimizer
        for name, obj in self.objects.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"state[{name!r}]: {type(obj).__name__} has no state_dict()/load_state_dict(); "
                                "register objects that have both (wrap a plain value in a small class)")
        self._taken: Dict[str, Any] = {}
        self.loads = 0  # states received (heals, a checkpoint)
        self.loaded_step = 0  # the training position of the last state received
        self.take()
        # Heals carry state in a format that runs no code (core/security/wire.py): a value
        # it cannot carry fails here, naming it, not at the first heal.
        try:
            encode(self._taken)
        except WireError as e:
            raise TypeError(f"state{e} (docs/security.md: heals carry no pickles)") from None

    def take(self) -> None:
        """Copies every object's state now (training thread): what a donor serves next."""
        taken = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.objects.items()}
        if self.optimizer is not None:
            taken[PARAM_GROUPS] = copy.deepcopy(hyperparameters(self.optimizer))
        self._taken = taken

    def served(self) -> Dict[str, Any]:
        """The last state taken (safe from any thread: a dict that is replaced, never mutated)."""
        return self._taken

    def load(self, received: Optional[Dict[str, Any]], source: str, step: int) -> None:
        """Loads what a donor or checkpoint (``source``, for the error) holds, taken with the
        model of training position ``step`` (``loaded_step``: the steps the counter moves on
        by after it, without another load, are steps without state).

        Raises:
            ValueError: naming the registered object the donor did not send (the two
                processes registered different state: a program mismatch).
        """
        self.loads += 1
        self.loaded_step = step
        received = received or {}
        missing = sorted(set(self.objects) - set(received))
        if missing:
            raise ValueError(f"{source} holds no user state {missing} (it registered {sorted(k for k in received if k != PARAM_GROUPS)}): "
                             "every replica group must register the same state")
        for name, obj in self.objects.items():
            obj.load_state_dict(copy.deepcopy(received[name]))
        if self.optimizer is not None and PARAM_GROUPS in received:
            set_hyperparameters(self.optimizer, received[PARAM_GROUPS])  # after the optimizer's own load
        self._taken = copy.deepcopy(received)
