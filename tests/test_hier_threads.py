"""The hierarchical sync's arithmetic and failure handling, over real lighthouses and Managers.

Replica groups run as threads (tests/harness.py) so the test controls every local
update exactly; lighthouses, torchft Managers, stores, checkpoint servers and Gloo
groups are all real.
"""

from datetime import timedelta
from typing import Dict, List, Tuple

import pytest
import torch

from harness import ThreadedHier, await_pending_requests, local_steps
from hier_localsgd.core.runtime.faults import Fault
from hier_localsgd.core.runtime.invariants import InvariantViolation
from hier_localsgd.core.ft.managers import GroupRefused
from hier_localsgd.core.tensors.level import LevelAlgorithm
from hier_localsgd.sync.common import FatalSyncError

C, R, H_IN, H_OUT = 2, 2, 1, 2


def update(c: int, r: int, k: int) -> torch.Tensor:
    """A distinct, hand-checkable local move for every replica and step."""
    sign = 1.0 if r == 0 else -0.5
    return torch.tensor([0.1 * (c + 1), sign * 0.2, 0.05 * (k + 1) * (r + 1)])


def nesterov(p: torch.Tensor, buf: torch.Tensor, g: torch.Tensor, lr: float = 0.7, mu: float = 0.9):
    buf = mu * buf + g
    return p - lr * (g + mu * buf), buf


def reference(steps: int):
    """Hand computation of two-level DiLoCo (float64) for update() above."""
    z = torch.zeros(3, dtype=torch.float64)
    theta_g, gbuf = z.clone(), z.clone()
    theta_c, cbuf = [z.clone() for _ in range(C)], [z.clone() for _ in range(C)]
    expected: Dict[Tuple[int, int], List[torch.Tensor]] = {(c, r): [] for c in range(C) for r in range(R)}
    for k in range(steps):
        for c in range(C):
            # pseudo-gradient of each member: backup - (backup + u) = -u; averaged
            avg = -sum(update(c, r, k).double() for r in range(R)) / R
            theta_c[c], cbuf[c] = nesterov(theta_c[c], cbuf[c], avg)
        if (k + 1) % (H_IN * H_OUT) == 0:
            d = sum(theta_g - theta_c[c] for c in range(C)) / C
            theta_g, gbuf = nesterov(theta_g, gbuf, d)
            theta_c = [theta_g.clone() for _ in range(C)]
        for c in range(C):
            for r in range(R):
                expected[(c, r)].append(theta_c[c].clone())
    return expected, theta_g, gbuf, cbuf


@pytest.mark.parametrize("early_quorum", [False, True])
def test_diloco_at_both_levels_matches_hand_computation_and_keeps_momentum(early_quorum):
    """Also with the early inner quorum (sync/early.py): it changes when the quorum is
    asked for, not what the rounds compute."""
    steps = 4  # two outer rounds: the second depends on both levels' momentum
    expected, theta_g, gbuf, cbuf = reference(steps)
    seen: Dict[Tuple[int, int], List[torch.Tensor]] = {}
    bufs = {}
    early_used: Dict[Tuple[int, int], object] = {}
    h = ThreadedHier(C, R, H_IN, H_OUT, early_quorum=early_quorum)
    try:
        def body(rep):
            seen[rep.key] = []
            local_steps(rep, update, steps, record=lambda r: seen[r.key].append(r.flat.data.clone()))
            bufs[rep.key] = (rep.sync.inner.opt.buf.clone(), rep.sync.outer.opt.buf.clone(), rep.sync.leader)
            early_used[rep.key] = rep.sync.tracker.snapshot().get("early_quorum_s")

        h.run(body)
    finally:
        h.close()
    # The rounds took their quorum from the early request exactly when it was on.
    assert all((v is not None) == early_quorum for v in early_used.values()) and len(early_used) == C * R, early_used
    for key, traj in seen.items():
        for k, (got, want) in enumerate(zip(traj, expected[key])):
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5, msg=f"{key} after step {k + 1}")
    for (c, r), (ibuf, obuf, leader) in bufs.items():
        torch.testing.assert_close(ibuf.double(), cbuf[c], rtol=0, atol=1e-5)
        if leader:  # the outer optimizer's state lives with the leader
            torch.testing.assert_close(obuf.double(), gbuf, rtol=0, atol=1e-5)
    assert sum(leader for _, _, leader in bufs.values()) == C


def test_localsgd_both_levels_is_plain_averaging():
    h = ThreadedHier(C, R, H_IN, H_OUT, inner=LevelAlgorithm.build("localsgd"), outer=LevelAlgorithm.build("localsgd"))
    final = {}
    try:
        h.run(lambda rep: (local_steps(rep, update, 2), final.__setitem__(rep.key, rep.flat.data.clone())))
    finally:
        h.close()
    # Two local moves from 0, averaged over the cluster then over the clusters:
    want = sum(update(c, r, k) for c in range(C) for r in range(R) for k in range(2)) / (C * R)
    for key, got in final.items():
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=str(key))


@pytest.mark.parametrize(
    "phase, victim, step",
    [("INNER_REDUCE", (0, 1), 1), ("OUTER_REDUCE", (0, 0), 2), ("BROADCAST", (0, 1), 2)],
)
@pytest.mark.parametrize("early_quorum", [False, True])
def test_injected_failure_rolls_back_to_last_commit_and_next_round_succeeds(phase, victim, step, early_quorum):
    """With the early inner quorum too: the victim's heal is received during the local
    step and applied at the sync point (sync/early.py), with the same outcome."""
    fault = Fault(cluster=victim[0], replica=victim[1], step=step, action="fail", phase=phase)
    h = ThreadedHier(C, R, H_IN, H_OUT, faults=[fault], early_quorum=early_quorum)
    traj: Dict[Tuple[int, int], List[torch.Tensor]] = {}
    backups: Dict[Tuple[int, int], List[torch.Tensor]] = {}
    reps = {}

    def record(rep):
        traj[rep.key].append(rep.flat.data.clone())
        backups[rep.key].append(rep.sync.inner.backup.clone())

    def body(rep):
        reps[rep.key] = rep
        traj[rep.key], backups[rep.key] = [], []
        backups[rep.key].append(rep.sync.inner.backup.clone())  # before the join round
        local_steps(rep, update, 6, record=record)

    try:
        h.run(body)
    finally:
        h.close()

    v = reps[victim]
    level = "outer" if phase == "OUTER_REDUCE" else "inner"
    rollbacks = v.kinds("rollback", level=level)
    assert [e["step"] for e in rollbacks] == [step], [(k, e) for k, e in v.events if k != "phase"]
    if level == "inner":
        # Rolled back: the model equals the commit before the failed round.
        torch.testing.assert_close(traj[victim][step - 1], backups[victim][step - 1])
        # The next round (one step later) heals the victim from its leader and commits.
        assert [e["step"] for e in v.kinds("heal", level="inner") if e["step"] > 0] == [step + H_IN]
        assert any(e["step"] == step + 1 for e in v.kinds("commit", level="inner"))
    else:
        # The leader's outer level kept its last commit; its cluster committed the
        # inner result; the next outer round heals it from the other cluster.
        assert not any(e["step"] == step for e in v.kinds("commit", level="outer"))
        assert [e["step"] for e in v.kinds("heal", level="outer")] == [step + H_IN * H_OUT]
        assert any(e["step"] == step + H_IN * H_OUT for e in v.kinds("commit", level="outer"))
    finals = {k: t[-1] for k, t in traj.items()}
    first = next(iter(finals.values()))
    for key, f in finals.items():
        assert torch.equal(f, first), f"{key} differs after the last outer round"
    for key, rep in reps.items():
        if key != victim:
            assert not rep.kinds("rollback", level="inner"), f"{key} should not have rolled back"


def cluster_lighthouse_out_at(rep, step: int) -> None:
    """The group's cluster lighthouse does not answer at ``step`` (not in join rounds): its
    quorum call raises LighthouseOutage there, as outage.py's would."""
    from hier_localsgd.core.ft.outage import LighthouseOutage

    orig = rep.sync.inner_quorum.for_rank

    def quorum(join):
        if not join and rep.sync.counters.step == step:
            raise LighthouseOutage(f"test: cluster lighthouse out at step {step}")
        return orig(join)

    rep.sync.inner_quorum.for_rank = quorum


def run_steps(h: ThreadedHier, steps: int):
    """Runs every replica group for ``steps`` local steps of update(); closes ``h``.
    Returns the replicas and their final models, by key."""
    reps, finals = {}, {}

    def body(rep):
        reps[rep.key] = rep
        local_steps(rep, update, steps)
        finals[rep.key] = rep.flat.data.clone()

    try:
        h.run(body)
    finally:
        h.close()
    return reps, finals


@pytest.mark.parametrize("keep_local", [False, True])
def test_a_round_that_fails_for_a_whole_cluster_rolls_back_or_keeps_the_local_steps(keep_local):
    """Both members of cluster 0 fail their inner all-reduce at step 1 (an inner-only
    round), so nothing of cluster 0 commits there. sync.failed_round=rollback restores the
    step-0 commit: step 1's local moves are gone. keep_local keeps them: the step-2 round's
    pseudo-gradient carries both steps, as one round of two steps would. The final (outer,
    step 2) model matches the hand computation of each policy, and the two differ."""
    faults = [Fault(cluster=0, replica=r, step=1, action="fail", phase="INNER_REDUCE") for r in range(R)]
    reps, final = run_steps(ThreadedHier(C, R, H_IN, H_OUT, faults=faults, keep_local=keep_local), 2)
    z = torch.zeros(3, dtype=torch.float64)
    u = lambda c, r, k: update(c, r, k).double()  # noqa: E731
    theta_c = {}
    # cluster 0: one inner round at step 2, over one step (rollback) or both (keep_local)
    kept = range(2) if keep_local else range(1, 2)
    theta_c[0], _ = nesterov(z, z, -sum(u(0, r, k) for r in range(R) for k in kept) / R)
    # cluster 1: inner rounds at steps 1 and 2, as in reference()
    t1, b1 = nesterov(z, z, -sum(u(1, r, 0) for r in range(R)) / R)
    theta_c[1], _ = nesterov(t1, b1, -sum(u(1, r, 1) for r in range(R)) / R)
    theta_g, _ = nesterov(z, z, sum(z - theta_c[c] for c in range(C)) / C)
    for key, got in final.items():
        torch.testing.assert_close(got.double(), theta_g, rtol=0, atol=1e-5, msg=str(key))
    for r in range(R):
        rep = reps[(0, r)]
        assert [e["step"] for e in rep.kinds("keep_local" if keep_local else "rollback", level="inner")] == [1]
        assert not rep.kinds("rollback" if keep_local else "keep_local")
        assert rep.sync.work["steps_discarded"] == (0 if keep_local else 1)
    assert not any(rep.kinds("rollback") or rep.kinds("keep_local") for key, rep in reps.items() if key[0] == 1)


def test_guard_resyncs_a_member_whose_state_diverged_with_equal_steps():
    h = ThreadedHier(C, R, H_IN, H_OUT)
    reps = {}
    finals = {}

    def body(rep):
        reps[rep.key] = rep

        def record(r):
            # After the round at step 1 (inner only), silently corrupt c1r1's committed
            # state: steps stay equal, so torchft would not heal it; the guard must.
            if r.key == (1, 1) and r.sync.counters.step == 1:
                r.sync.inner.backup.add_(1.0)
                r.flat.load_(r.sync.inner.backup)

        local_steps(rep, update, 4, record=record)
        finals[rep.key] = rep.flat.data.clone()

    try:
        h.run(body)
    finally:
        h.close()
    # Detected and repaired in the next round, at step 2.
    resyncs = reps[(1, 1)].kinds("resync", level="inner")
    assert [(e["step"], e["diverged"]) for e in resyncs] == [(2, True)]
    assert [(e["step"], e["diverged"]) for e in reps[(1, 0)].kinds("resync", level="inner")] == [(2, False)]
    commits = [e for e in reps[(1, 1)].kinds("commit", level="inner") if e["step"] == 2]
    # Same round history, different values: the member keeps its weight (guard.py).
    assert commits and commits[0]["total_weight"] == 2.0
    assert len({f.numpy().tobytes() for f in finals.values()}) == 1


def test_two_leaders_of_one_cluster_in_the_outer_group_violate_i1():
    """Two processes both claiming cluster 0 would share the inner and the outer group. Each
    such outer group is refused before any collective runs in it (a failed quorum, so a
    momentary split during a leader handover costs one round); one that persists ends the
    process after sync.max_quorum_failures (3) rounds, the violation named as the cause."""
    h = ThreadedHier(2, 1, H_IN, H_OUT)
    errors = {}

    def body(rep):
        try:
            local_steps(rep, update, 4 * H_IN * H_OUT)
        except FatalSyncError as e:
            errors[rep.key] = e

    # Both replica groups say they are cluster 0 (outer replica id cluster0000) but
    # each leads its own cluster lighthouse: the global quorum gets cluster 0 twice.
    orig = h.make

    def make_as_cluster0(c, r):
        rep = orig(c, r)
        rep.sync.id = type(rep.sync.id)(0, c)
        return rep

    h.make = make_as_cluster0  # type: ignore[method-assign]
    try:
        h.run(body)
    finally:
        h.close()
    assert len(errors) == 2, errors
    for e in errors.values():
        assert "quorum failed 3 times in a row" in str(e), e
        refused = e.__cause__
        assert isinstance(refused, GroupRefused), refused
        v = refused.violation
        assert isinstance(v, InvariantViolation) and v.invariant.startswith("I1") and "cluster(s) [0]" in str(v)
    for rep in h.replicas.values():
        assert rep.kinds("commit", level="outer") == []  # no collective ran in a refused group
        refusals = [e for e in rep.kinds("quorum_failed", level="outer") if "group refused" in e["detail"]]
        assert len(refusals) == 3, rep.kinds("quorum_failed")


def test_training_progress_orders_outer_rounds_then_steps_then_committed_rounds():
    """Who heals from whom inside a cluster (sync/common.training_progress)."""
    from hier_localsgd.sync.common import training_progress as p

    # a leader that kept syncing across clusters through its cluster lighthouse's outage is
    # ahead of a member that only took more local steps meanwhile
    assert p(15, 180, 6) > p(3, 185, 6)
    assert p(3, 185, 6) > p(3, 180, 6)  # then training progress
    assert p(3, 180, 7) > p(3, 180, 6)  # then a committed round over a rolled-back one
    assert p(0, 5, 3) < p(0, 10, 0)  # a restart's no-op join rounds are no progress
    # fields saturate instead of spilling into the next: still an int64, still ordered
    assert p(2**40, 2**40, 5) < 2**63 and p(2**40, 0, 0) > p(2**22 - 2, 2**40, 0)


def test_outer_progress_heals_behind_from_ahead_and_a_fresh_leader_from_an_established_one():
    """Who heals from whom at the outer quorum (sync/common.outer_progress): the global
    round first (a new leader whose cluster is ahead never heals from one behind, which
    torchft's own commit count made it do), then, at equal rounds, a fresh leader (its
    outer momentum possibly stale) from an established one."""
    from hier_localsgd.sync.common import outer_progress as p

    assert p(60, 1860, fresh=True) > p(59, 1830, fresh=False)  # ahead, though fresh
    assert p(20, 630, fresh=False) < p(21, 630, fresh=True)  # behind heals from ahead
    assert p(21, 630, fresh=True) < p(21, 630, fresh=False)  # equal rounds: the momentum
    assert p(0, 0, fresh=True) == p(0, 0, fresh=True)  # a fresh job: nobody heals


def test_guard_keeps_the_weight_of_an_outer_member_at_most_max_behind_rounds_behind():
    from hier_localsgd.core.tensors.guard import Fingerprint, plan

    src, one, two = Fingerprint(7, 5, 0, 50, 1.0), Fingerprint(8, 4, 0, 40, 1.0), Fingerprint(9, 3, 0, 30, 1.0)
    assert plan([src, one, two]).weights == [1.0, 0.0, 0.0]  # the default: behind is weight 0
    p = plan([src, one, two], max_behind=1)
    assert p.source == 0 and p.weights == [1.0, 1.0, 0.0]
    assert plan([one, src], max_behind=1).weights == [1.0, 1.0]
    # a member that announced weight 0 keeps weight 0
    assert plan([src, Fingerprint(8, 4, 0, 40, 0.0)], max_behind=1).weights == [1.0, 0.0]


def _cluster_model(c: int, steps: range, start: torch.Tensor) -> torch.Tensor:
    """A cluster's model under inner localsgd (plain averaging) after ``steps`` from ``start``."""
    return start + sum(sum(update(c, r, k) for r in range(R)) / R for k in steps)


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_a_cluster_that_missed_an_outer_round_contributes_a_stale_update(max_staleness):
    """Cluster 0's leader drops out of the outer level at step 2 (its cluster Manager shut
    down, as a leader that died would; min_clusters=1, so cluster 1 commits that round
    alone once the lighthouse has stopped hearing it). At step 4, with a new cluster
    Manager, it heals to the newer global model, one round ahead of its own. With
    sync.outer.max_staleness=1 its cluster's work since step 0 still counts, measured from
    the global model it started from (step 0) and applied to the newest one; with 0 it
    carries weight 0 and its four steps are lost. Plain averaging at both levels, so the
    final model is a hand computation. Events order the two clusters: no timing race."""
    import threading

    from hier_localsgd.core.runtime.phases import Phase

    L = LevelAlgorithm.build("localsgd")
    # One quorum request per phase (no 5 s slices: this test has no outage to detect), so
    # a request seen pending at the lighthouse stays there until its quorum forms.
    h = ThreadedHier(2, R, 1, 2, inner=L, outer=L, min_clusters=1, outer_max_staleness=max_staleness,
                     quorum_slice=timedelta(seconds=60))
    reps, finals = {}, {}
    dropped = threading.Event()  # cluster 0's leader has left the outer level (step 2)
    alone = threading.Event()  # cluster 1 committed step 2's outer round without cluster 0
    asking = threading.Event()  # cluster 0's leader is about to ask for step 4's outer quorum

    def body(rep):
        reps[rep.key] = rep
        if rep.key == (0, 0):
            orig = rep.sync.outer_level.quorum

            def drop_out_at_step_2(tr, cur_round, cur_step):
                if cur_step == 4:
                    asking.set()
                if cur_step != 2:
                    return orig(tr, cur_round, cur_step)
                tr.enter(Phase.OUTER_QUORUM)  # as a failed quorum: an inner-only round
                rep.sync.outer_mgr.shutdown()  # its heartbeat stops; a new Manager joins at step 3
                rep.sync.outer_mgr, rep.sync.outer_comm = None, None
                dropped.set()
                # Its new Manager must not join the round cluster 1 is waiting in (the
                # lighthouse forms it once this one's heartbeats have lapsed).
                assert alone.wait(60)
                rep.sync.events("rollback", level="outer", reason="test: left the outer level", step=cur_step)
                return None

            rep.sync.outer_level.quorum = drop_out_at_step_2
        if rep.key == (1, 0):
            orig1 = rep.sync.outer_level.quorum

            def after_cluster_0_left(tr, cur_round, cur_step):
                # Cluster 1 asks for step 2's quorum only once cluster 0 has left. Else a
                # cluster 0 slow to start (its join round took 10 s under load) finds the
                # global level at step 2 already, joins it at step 0 (outer_join), and waits
                # there for cluster 1, which waits at step 3 for cluster 0's step 4.
                if cur_step == 2:
                    assert dropped.wait(60), "cluster 0 never reached step 2"
                return orig1(tr, cur_round, cur_step)

            rep.sync.outer_level.quorum = after_cluster_0_left

        def record(r):
            if r.key == (1, 0) and r.sync.counters.step == 2:
                assert r.kinds("commit", level="outer", step=2, participants=1)
                alone.set()
            if r.key == (1, 0) and r.sync.counters.step == 3:
                # Cluster 0 asks first: torchft's lighthouse forms a quorum at once when all
                # of the previous quorum's members ask (cluster 1 alone), so if cluster 1
                # asked first it would sync alone again; this way the lighthouse waits for
                # cluster 1, which heartbeats (up to its 20 s join timeout). Its request must
                # be at the lighthouse, not just about to be sent (its new Manager starts
                # first: under CI load cluster 1 once asked before it and synced alone).
                assert asking.wait(60)
                assert await_pending_requests(h.global_lh.address(), 1), "cluster 0's step-4 request never reached the lighthouse"

        local_steps(rep, update, 4, record=record)
        finals[rep.key] = rep.flat.data.clone()

    try:
        h.run(body)
    finally:
        h.close()
    zero = torch.zeros(3)
    global1 = _cluster_model(1, range(2), zero)  # cluster 1 alone at step 2
    mine = _cluster_model(0, range(4), zero)  # cluster 0: four steps from the step-0 model
    theirs = _cluster_model(1, range(2, 4), global1)
    want = global1 + ((mine - zero) + (theirs - global1)) / 2 if max_staleness else theirs
    for key, got in finals.items():
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=str(key))
    leader = reps[(0, 0)]
    assert [e["step"] for e in leader.kinds("heal", level="outer")] == [4]
    assert [e["behind"] for e in leader.kinds("stale_update")] == ([1] if max_staleness else [])
    lost = [e["steps"] for e in leader.kinds("discard") if e["reason"] == "cluster_weight0"]
    assert lost == ([] if max_staleness else [4])


def test_an_outer_round_whose_payload_went_out_is_never_a_stale_update_too():
    """Cluster 0's leader sends its step-2 pseudo-gradient, and cluster 1 commits with it;
    only the leader's own result is reported failed. Its work is in the global model
    already, so at step 4, one round behind, it carries weight 0 even with
    max_staleness=1 (a stale update would count steps 1-2 twice)."""
    L = LevelAlgorithm.build("localsgd")
    fault = Fault(cluster=0, replica=0, step=2, action="fail", phase="OUTER_REDUCE")
    reps, finals = run_steps(ThreadedHier(2, R, 1, 2, inner=L, outer=L, faults=[fault], outer_max_staleness=1), 4)
    zero = torch.zeros(3)
    global1 = (_cluster_model(0, range(2), zero) + _cluster_model(1, range(2), zero)) / 2
    want = _cluster_model(1, range(2, 4), global1)  # cluster 1's work only at step 4
    for key, got in finals.items():
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=str(key))
    leader = reps[(0, 0)]
    assert [e["step"] for e in leader.kinds("heal", level="outer")] == [4]
    assert leader.kinds("stale_update") == []
    assert [e["steps"] for e in leader.kinds("discard") if e["reason"] == "cluster_weight0"] == [4]


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_a_member_that_healed_after_an_outage_contributes_its_steps_as_a_stale_update(max_staleness):
    """One cluster of two groups, every round an outer round (min_clusters=1, localsgd at both
    levels, so the outer level of one cluster is the identity). At step 1 the cluster
    lighthouse is out for both (their quorum call raises LighthouseOutage, as outage.py's
    would): the leader syncs across clusters alone (``_outer_without_cluster``), so its
    outer round moves ahead; the member just trains on. At step 2 both ask the real
    lighthouse (the previous quorum's two members: it waits for both, no race) and torchft
    heals the member from the leader. With sync.inner.max_staleness=2 its two local steps
    since its last commit (step 0) still count, measured from that commit and averaged
    with the leader's step into the healed model (an inner stale update); with 0 they
    carry weight 0 and are lost, as before. Both end equal to the hand computation."""
    L = LevelAlgorithm.build("localsgd")
    h = ThreadedHier(1, 2, 1, 1, inner=L, outer=L, min_clusters=1, inner_max_staleness=max_staleness)
    reps, finals = {}, {}

    def body(rep):
        reps[rep.key] = rep
        cluster_lighthouse_out_at(rep, 1)
        local_steps(rep, update, 3)
        finals[rep.key] = rep.flat.data.clone()

    try:
        h.run(body)
    finally:
        h.close()
    u = lambda r, k: update(0, r, k)  # noqa: E731
    g1 = u(0, 0)  # the leader alone at step 1 (its global model)
    if max_staleness:
        theta2 = g1 + (u(0, 1) + u(1, 0) + u(1, 1)) / 2  # the member's two steps from 0, stale
    else:
        theta2 = g1 + u(0, 1)  # the member's steps at weight 0
    want = theta2 + (u(0, 2) + u(1, 2)) / 2
    for key, got in finals.items():
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=str(key))
    member, leader = reps[(0, 1)], reps[(0, 0)]
    assert [e["step"] for e in leader.kinds("commit", level="outer") if e["step"] == 1] == [1]  # alone through the outage
    assert [e["step"] for e in member.kinds("heal", level="inner") if e["step"] > 0] == [2]
    stale = [(e["step"], e["steps"], e["behind"]) for e in member.kinds("stale_update", level="inner")]
    assert stale == ([(2, 2, 2)] if max_staleness else [])
    lost = [(e["reason"], e["steps"]) for e in member.kinds("discard")]
    assert lost == ([] if max_staleness else [("heal", 2)])
    assert member.sync.work["steps_discarded"] == (0 if max_staleness else 2)
    assert not leader.kinds("stale_update") and not leader.kinds("discard")


def test_steps_kept_from_a_round_whose_outer_commit_held_them_are_never_a_stale_update():
    """keep_local + the inner stale update must not count a step twice. One cluster of two
    groups, every round an outer round (localsgd at both levels). At step 1 the member's
    BROADCAST fails: the leader's outer commit (alone, min_clusters=1) is final and holds
    both groups' step-1 work, but the inner commit fails, so the member keeps its step
    (keep_local: its committed state did not move). At step 2 it is behind and heals from
    the leader; its kept step 1 is in the global model already, so it carries weight 0 even
    with sync.inner.max_staleness=2 — a stale update would add step 1 a second time."""
    L = LevelAlgorithm.build("localsgd")
    fault = Fault(cluster=0, replica=1, step=1, action="fail", phase="BROADCAST")
    reps, finals = run_steps(ThreadedHier(1, 2, 1, 1, inner=L, outer=L, min_clusters=1, faults=[fault],
                                          keep_local=True, inner_max_staleness=2), 3)
    u = lambda r, k: update(0, r, k)  # noqa: E731
    theta1 = (u(0, 0) + u(1, 0)) / 2  # the leader's final outer commit at step 1
    want = theta1 + u(0, 1) + (u(0, 2) + u(1, 2)) / 2  # step 2: the leader's step only
    for key, got in finals.items():
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=str(key))
    member = reps[(0, 1)]
    assert [e["step"] for e in member.kinds("keep_local")] == [1]
    assert [e["step"] for e in member.kinds("heal", level="inner") if e["step"] > 0] == [2]
    assert member.kinds("stale_update") == []
    assert [(e["reason"], e["steps"]) for e in member.kinds("discard")] == [("heal", 2)]


def test_a_final_round_skipped_for_an_outage_ends_on_the_leaders_model_after_finish():
    """One cluster of two groups, every round an outer round (localsgd at both levels,
    min_clusters=1). At the last step (3) the cluster lighthouse is out for both: the leader
    syncs across clusters alone, the member keeps its own step, and the loop ends with the
    cluster on two models. finish() (sync/final.py) waits for the lighthouse (here it
    answers at once), runs a join round with both groups in it, and the member takes the
    leader's model; its own last step is lost (weight 0). A group whose final round ran
    returns from finish() at once."""
    L = LevelAlgorithm.build("localsgd")
    h = ThreadedHier(1, 2, 1, 1, inner=L, outer=L, min_clusters=1, final_step=3)
    reps, before, finals = {}, {}, {}

    def body(rep):
        reps[rep.key] = rep
        cluster_lighthouse_out_at(rep, 3)  # the last step
        local_steps(rep, update, 3)
        before[rep.key] = rep.flat.data.clone()
        rep.sync.finish()
        finals[rep.key] = rep.flat.data.clone()

    try:
        h.run(body)
    finally:
        h.close()
    leader, member = reps[(0, 0)], reps[(0, 1)]
    assert not torch.equal(before[(0, 0)], before[(0, 1)])  # the loop ended on two models
    for key, got in finals.items():
        torch.testing.assert_close(got, before[(0, 0)], rtol=0, atol=0, msg=str(key))
    for rep in (leader, member):
        assert [e["state"] for e in rep.kinds("final_wait")] == ["start", "done"]
        assert [e["quorum"] for e in rep.kinds("final_wait") if e["state"] == "done"] == [2]
    assert [e["step"] for e in leader.kinds("commit", level="outer") if e["step"] == 3] == [3]  # alone through the outage

    # Without an outage at the last step finish() has nothing to do.
    reps2, finals2 = run_steps(ThreadedHier(1, 2, 1, 1, inner=L, outer=L, min_clusters=1, final_step=2), 2)
    for rep in reps2.values():
        rep.sync.finish()
        assert rep.kinds("final_wait") == []


def test_finish_gives_up_at_its_bound_when_the_lighthouse_stays_out():
    """The same ending with the lighthouse still out (its probe never answers): each group
    waits sync.final_wait_s (1 s here), records gave_up, ends with its own model and does not
    raise (it trained every step: its result must be written)."""
    import dataclasses
    import time

    L = LevelAlgorithm.build("localsgd")
    h = ThreadedHier(1, 2, 1, 1, inner=L, outer=L, min_clusters=1, final_step=2)
    reps, before, finals, took = {}, {}, {}, {}

    def body(rep):
        reps[rep.key] = rep
        cluster_lighthouse_out_at(rep, 2)  # the last step
        local_steps(rep, update, 2)
        before[rep.key] = rep.flat.data.clone()
        rep.sync.health["inner"].probe = lambda: False
        rep.sync.settings = dataclasses.replace(rep.sync.settings, final_wait=timedelta(seconds=1))
        t0 = time.monotonic()
        rep.sync.finish()
        took[rep.key] = time.monotonic() - t0
        finals[rep.key] = rep.flat.data.clone()

    try:
        h.run(body)
    finally:
        h.close()
    assert not torch.equal(finals[(0, 0)], finals[(0, 1)])
    for key, rep in reps.items():
        assert [e["state"] for e in rep.kinds("final_wait")] == ["start", "gave_up"], key
        torch.testing.assert_close(finals[key], before[key], rtol=0, atol=0)
        assert 1.0 <= took[key] < 10.0, took  # its bound, not a phase timeout
