"""A chaos run's stall watch: no replica group's step advanced for longer than a dead peer's
detection plus the longest phase timeout, while one of them was training."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from hier_localsgd.core.runtime.phases import Phase
from hier_localsgd.experiments.chaos_evidence import name
from hier_localsgd.launch.local import Key, LocalJob

if TYPE_CHECKING:
    from hier_localsgd.config import Config


def stall_limit_s(cfg: Config) -> float:
    """Heartbeat timeout + the longest phase timeout: the longest no replica group may go
    without a step when nothing hangs (a dead peer is noticed, then one phase runs out)."""
    t = cfg.timeouts_obj()
    phases = (Phase.INNER_QUORUM, Phase.INNER_REDUCE, Phase.INNER_COMMIT, Phase.OUTER_QUORUM, Phase.OUTER_REDUCE, Phase.OUTER_COMMIT, Phase.BROADCAST)
    return cfg.lighthouse.heartbeat_timeout_ms / 1000.0 + max(t.phase(p).total_seconds() for p in phases)


class StallWatch:
    """Records a stall when no replica group's step advanced for longer than ``limit_s``
    while one of them was training (state ``running``, alive, short of its steps)."""

    def __init__(self, job: LocalJob, limit_s: float, steps_total: int, t0: Optional[float] = None) -> None:
        self.job, self.limit_s, self.steps_total = job, limit_s, steps_total
        self.t0 = time.time() if t0 is None else t0
        self.last_progress = self.t0
        self.best: Dict[Tuple[Key, Any], int] = {}
        self.stalls: List[Dict[str, Any]] = []
        self._open: Optional[Dict[str, Any]] = None

    def __call__(self) -> None:
        now = time.time()
        progressed = training = False
        steps = {}
        for key, proc in self.job.replicas.items():
            st = self.job.status(key) or {}
            step = st.get("step")
            if not isinstance(step, int):
                continue
            steps[name(key)] = step
            inc = (key, st.get("pid"))
            if inc in self.best and step > self.best[inc]:
                progressed = True  # a new incarnation's first status is no progress
            self.best[inc] = max(step, self.best.get(inc, step))
            if proc.popen.poll() is None and st.get("state") == "running" and step < self.steps_total:
                training = True
        if progressed or not training:
            if self._open is not None:
                self._open["duration_s"] = now - self.t0 - self._open["since"]
                self._open = None
            self.last_progress = now
        elif self._open is None and now - self.last_progress > self.limit_s:
            self._open = {"t": now - self.t0, "since": self.last_progress - self.t0, "limit_s": self.limit_s, "steps": steps, "duration_s": None}
            self.stalls.append(self._open)

    def finish(self) -> None:
        if self._open is not None:
            self._open["duration_s"] = time.time() - self.t0 - self._open["since"]
            self._open = None
