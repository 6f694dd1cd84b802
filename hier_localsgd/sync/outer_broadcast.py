"""BROADCAST: a cluster's leader hands an outer result to its cluster (called by
:class:`~hier_localsgd.sync.outer_round.OuterLevel` for the round in hier.py).

The leader (inner rank 0) sends a header (status and counters), then the model, then what
every member must hold with it: the compressed level's residual and the eager updates'
momentum. Every member issues the same collectives in the same order (a lost header still
joins the model broadcast), so the leader never waits for a peer that bailed out; any
failure makes the result ABORT, and the round's commit vote fails.
"""

from __future__ import annotations

from typing import Optional

import torch

from hier_localsgd.core.links.stats import CONTROL, PAYLOAD
from hier_localsgd.core.tensors.level import Level
from hier_localsgd.sync.common import OuterResult, Status
from hier_localsgd.sync.compression import OuterCompression
from hier_localsgd.sync.state import SyncState


def broadcast(st: SyncState, result: Optional[OuterResult], prior: torch.Tensor) -> OuterResult:
    """BROADCAST: the leader (inner rank 0) sends status + model to its cluster.

    Both broadcasts run on every member unless the header *says* ABORT: a
    receiver that lost the header still joins the model broadcast (its result
    is discarded), so the leader never waits for a peer that bailed out.
    """
    header = OuterResult.empty_header()
    if st.leader:
        assert result is not None
        header[:] = result.header()
    header_ok = st.inner_comm.broadcast(header, 0, CONTROL)
    if st.leader:
        assert result is not None
        status: Optional[Status] = result.status
    else:
        status = Status(int(header[0])) if header_ok else None  # None: unknown
    if status == Status.ABORT:
        st.inner_mgr.report_error(RuntimeError("the leader aborted this round"))
        return OuterResult(Status.ABORT, None, st.counters.outer_round, st.counters.step)
    # A receiver starts from its own cluster model: what a lossy link's stale fill keeps.
    params = result.params if st.leader and result is not None else prior.clone()
    assert params is not None
    params_ok = st.inner_comm.broadcast(params, 0, PAYLOAD)
    residual = _residual(st)  # issued whenever the model broadcast is
    momentum, momentum_ok = _momentum(st, st.outer)
    if not (header_ok and params_ok and momentum_ok) or status is None or (st.comp is not None and residual is None):
        return OuterResult(Status.ABORT, None, st.counters.outer_round, st.counters.step)
    crc = result.checksum if st.leader and result is not None else None  # not in the header: the leader's own
    return OuterResult.from_header(header, params, residual=residual, momentum=momentum, checksum=crc)

def broadcast_global(st: SyncState, result: Optional[OuterResult], prior: torch.Tensor,
                     stage_comp: Optional[OuterCompression], stage_outer: Optional[Level]) -> OuterResult:
    """BROADCAST at an apply round: a header, then the global model only if the
    header says the outer round committed (every member reads the header first). The
    residual and momentum sent are the overlapped stage's (``stage_comp``,
    ``stage_outer``): what the apply round commits."""
    c = st.counters
    header = OuterResult.empty_header()
    if st.leader:
        assert result is not None
        header[:] = result.header()
    header_ok = st.inner_comm.broadcast(header, 0, CONTROL)
    if not header_ok:  # the group is broken: the commit vote fails
        return OuterResult(Status.ABORT, None, c.outer_round, c.step)
    status = Status(int(header[0]))
    if status != Status.OUTER_COMMITTED:
        return OuterResult(status, None, c.outer_round, c.step)
    params = result.params if st.leader and result is not None else prior.clone()
    assert params is not None
    params_ok = st.inner_comm.broadcast(params, 0, PAYLOAD)
    residual = _residual(st, stage_comp)  # issued even if the model's failed (matched collectives)
    momentum, momentum_ok = _momentum(st, stage_outer)
    if not (params_ok and momentum_ok) or (st.comp is not None and residual is None):
        return OuterResult(Status.ABORT, None, c.outer_round, c.step)
    crc = result.checksum if st.leader and result is not None else None  # not in the header: the leader's own
    return OuterResult.from_header(header, params, merge=True, residual=residual, momentum=momentum, checksum=crc)

def _residual(st: SyncState, stage: Optional[OuterCompression] = None) -> Optional[torch.Tensor]:
    """Compressed outer reduce: the leader sends the cluster's committed residual
    (``stage``'s at an overlapped apply round) after the model, as reliable control
    traffic, so every member holds it (compression.py). Returns what this member
    received (the leader: its own), or None if there is none or the broadcast failed."""
    if st.comp is None:
        return None
    if st.leader:
        buf = (stage or st.comp).residual.clone()
    else:
        buf = torch.empty_like(st.comp.residual)
    return buf if st.inner_comm.broadcast(buf, 0, CONTROL) else None

def _momentum(st: SyncState, source: Optional[Level]) -> tuple[Optional[torch.Tensor], bool]:
    """Eager updates: the leader sends ``source``'s committed outer momentum after the
    model (every member computes its stand-in with it, overlap.py). Returns (what this
    member received, whether the broadcast succeeded); (None, True) when there is none."""
    if st.stand_in is None or st.outer.momentum is None:
        return None, True
    if st.leader:
        mom = (source.momentum if source is not None and source.momentum is not None else st.outer.momentum)
        buf = mom.clone()
    else:
        buf = torch.empty_like(st.outer.momentum)
    ok = st.inner_comm.broadcast(buf, 0, CONTROL)
    return (buf if ok else None), ok
