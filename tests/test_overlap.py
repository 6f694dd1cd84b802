"""Overlapped outer sync (overlap.py): the outer round runs behind the cluster's training
and its result is merged with the progress made meanwhile. Real lighthouses, Managers and
Gloo groups; replica groups as threads so every local update is exact (harness.py)."""

from typing import Dict, List, Tuple

import pytest
import torch

from harness import ThreadedHier, local_steps
from hier_localsgd.core.runtime.faults import Fault
from hier_localsgd.core.runtime.invariants import CollectiveGate, InvariantViolation
from hier_localsgd.sync.overlap import is_apply_round, merge_keep_local

C, R, H_IN, H_OUT, D = 2, 2, 1, 2, 1


def update(c: int, r: int, k: int) -> torch.Tensor:
    sign = 1.0 if r == 0 else -0.5
    return torch.tensor([0.1 * (c + 1), sign * 0.2, 0.05 * (k + 1) * (r + 1)])


def nesterov(p, buf, g, lr=0.7, mu=0.9):
    buf = mu * buf + g
    return p - lr * (g + mu * buf), buf


def reference(steps: int, final_step: int, keep_delta: bool = True, eager: bool = False):
    """Two-level DiLoCo with the outer round launched at steps 2, 4, ... and applied D inner
    rounds later as θ_g + (θ_now − θ_snapshot); the round at ``final_step`` blocks (one
    still in flight then is folded into it). ``eager``: at the launch each cluster steps
    from θ_g with its own pseudo-gradient and the global momentum (θ_e), and the apply
    round merges against θ_e; the final round contributes the model without that step."""
    z = torch.zeros(3, dtype=torch.float64)
    theta_g, gbuf = z.clone(), z.clone()
    theta_c, cbuf, snap = [z.clone() for _ in range(C)], [z.clone() for _ in range(C)], [z.clone() for _ in range(C)]
    stand_in = [z.clone() for _ in range(C)]  # θ_s − θ_e while one is pending
    pending = None
    traj: List[List[torch.Tensor]] = []
    for k in range(steps):
        step = k + 1
        for c in range(C):
            avg = -sum(update(c, r, k).double() for r in range(R)) / R
            theta_c[c], cbuf[c] = nesterov(theta_c[c], cbuf[c], avg)
        final = step == final_step
        if not final and is_apply_round(step, H_IN, H_OUT, D) and pending is not None:
            theta_g, gbuf = pending
            theta_c = [theta_g + (theta_c[c] + stand_in[c] - snap[c]) if keep_delta else theta_g.clone() for c in range(C)]
            stand_in = [z.clone() for _ in range(C)]
            pending = None
        if final:  # blocking: adopted at once
            d = sum(theta_g - (theta_c[c] + stand_in[c]) for c in range(C)) / C
            theta_g, gbuf = nesterov(theta_g, gbuf, d)
            theta_c = [theta_g.clone() for _ in range(C)]
            pending = None
        elif step % (H_IN * H_OUT) == 0:
            d = sum(theta_g - theta_c[c] for c in range(C)) / C
            snap = [t.clone() for t in theta_c]
            pending = nesterov(theta_g, gbuf, d)
            if eager:
                for c in range(C):
                    theta_e, _ = nesterov(theta_g, gbuf, theta_g - snap[c])
                    stand_in[c], theta_c[c] = snap[c] - theta_e, theta_e
        traj.append([t.clone() for t in theta_c])
    return traj, theta_g


def run(steps: int, final_step: int, faults=(), eager: bool = False, keep_local: bool = False) -> Tuple[Dict, Dict]:
    seen: Dict[Tuple[int, int], List[torch.Tensor]] = {}
    reps = {}
    h = ThreadedHier(C, R, H_IN, H_OUT, outer_delay=D, outer_eager=eager, final_step=final_step, faults=list(faults),
                     keep_local=keep_local)
    try:
        def body(rep):
            reps[rep.key] = rep
            seen[rep.key] = []
            local_steps(rep, update, steps, record=lambda r: seen[r.key].append(r.flat.data.clone()))

        h.run(body)
    finally:
        h.close()
    return seen, reps


def assert_as_computed(seen: Dict, expected: List[List[torch.Tensor]], theta_g: torch.Tensor) -> None:
    """Every member's model after every step is its cluster's in ``expected``; the last is θ_g."""
    for key, traj in seen.items():
        for k, got in enumerate(traj):
            torch.testing.assert_close(got.double(), expected[k][key[0]], rtol=0, atol=1e-5, msg=f"{key} after step {k + 1}")
        torch.testing.assert_close(traj[-1].double(), theta_g, rtol=0, atol=1e-5)


def test_the_merge_keeps_the_local_delta():
    g, s, now = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.5]), torch.tensor([0.75, 0.25])
    torch.testing.assert_close(merge_keep_local(g, s, now), torch.tensor([1.25, 1.75]))


def test_overlapped_outer_rounds_merge_as_hand_computed_and_the_last_one_blocks():
    steps = 6  # launches at 2 and 4 (applied at 3 and 5); the round at 6 is the run's last: blocking
    expected, theta_g = reference(steps, final_step=steps)
    seen, reps = run(steps, final_step=steps)
    assert_as_computed(seen, expected, theta_g)
    for rep in reps.values():
        assert not rep.kinds("rollback"), rep.kinds("rollback")
        assert rep.sync.counters.outer_round == 3
        launches = rep.kinds("outer_launch")
        assert [e["step"] for e in launches] == ([2, 4] if rep.sync.leader else []), launches
    # The test tells merges apart: adopting the global model without the local delta
    # (work since the snapshot dropped) gives another model after step 3.
    dropped, _ = reference(steps, final_step=steps, keep_delta=False)
    assert not torch.allclose(dropped[2][0], expected[2][0], atol=1e-3)


@pytest.mark.parametrize("final_step", [6, 5], ids=["final-on-schedule", "final-with-a-stand-in-pending"])
def test_eager_updates_step_at_the_launch_and_correct_at_the_apply_round_as_hand_computed(final_step):
    """Eager updates (overlap.py): at steps 2 and 4 every member steps with its cluster's
    own pseudo-gradient; at steps 3 and 5 the global step replaces it. With the run ending
    at step 5 the stand-in of step 4 is still pending at the final (blocking) round, which
    must contribute the model without it. Every member's model after every step is
    compared with the hand computation (reference), which tells eager from non-eager."""
    steps = final_step
    expected, theta_g = reference(steps, final_step=final_step, eager=True)
    seen, reps = run(steps, final_step=final_step, eager=True)
    assert_as_computed(seen, expected, theta_g)
    for rep in reps.values():
        assert not rep.kinds("rollback"), rep.kinds("rollback")
        assert [e["step"] for e in rep.kinds("eager_step")] == [2, 4], rep.kinds("eager_step")
        assert not bool(rep.sync.st.stand_in.any())  # nothing pending once the run ended
    plain, _ = reference(steps, final_step=final_step)
    # Eager moved the model at the launches (steps 2 and 4). After an apply round the two
    # agree here: these updates do not depend on the model they start from, so the local
    # progress is the same and the correction removes exactly the stand-in.
    for k in (1, 3):
        assert not torch.allclose(plain[k][0], expected[k][0], atol=1e-3)
    torch.testing.assert_close(plain[2][0], expected[2][0], rtol=0, atol=1e-9)


def test_eager_updates_with_a_failed_outer_round_take_the_stand_in_out():
    """Cluster 0's background outer round launched at step 2 fails (as below): at step 3 its
    members take their stand-in out, so from then on cluster 0's model is exactly what it
    is without eager updates; the job ends consistent."""
    fault = [Fault(cluster=0, replica=0, step=2, action="fail", phase="OUTER_REDUCE")]
    seen, reps = run(6, final_step=6, faults=fault, eager=True)
    plain, _ = run(6, final_step=6, faults=fault)
    for key in [(0, 0), (0, 1)]:
        assert not torch.allclose(seen[key][1], plain[key][1], atol=1e-3)  # stepped eagerly at step 2
        torch.testing.assert_close(seen[key][2], plain[key][2], rtol=0, atol=1e-5)  # taken out at step 3
    for rep in reps.values():
        assert not rep.kinds("rollback", level="inner"), rep.kinds("rollback", level="inner")
    finals = [traj[-1] for traj in seen.values()]
    for f in finals[1:]:
        torch.testing.assert_close(f, finals[0], rtol=0, atol=0)


@pytest.mark.parametrize("keep_local", [False, True], ids=["rollback", "keep_local"])
def test_a_stand_in_left_by_a_failed_apply_round_is_taken_out_at_the_next_launch(keep_local):
    """Cluster 0's outer round launched at step 2 fails, and its inner rounds at steps 3
    (the apply round) and 4 (the next launch) fail too: the stand-in of step 2 is still in
    its committed and live models when the launch at step 4 finds its commit failed, and
    must come out of both (with keep_local the live model holds kept local steps). These
    updates do not depend on the model they start from, so from step 4 on every member's
    model is exactly the run's without eager updates (cluster 1, whose rounds succeed,
    holds a stand-in after each launch, at steps 2 and 4, and none after its apply rounds)."""
    faults = [Fault(cluster=0, replica=0, step=2, action="fail", phase="OUTER_REDUCE")]
    faults += [Fault(cluster=0, replica=r, step=s, action="fail", phase="INNER_REDUCE") for r in range(R) for s in (3, 4)]
    seen, reps = run(6, final_step=6, faults=faults, eager=True, keep_local=keep_local)
    plain, _ = run(6, final_step=6, faults=faults, keep_local=keep_local)
    pending = {0: (2, 3), 1: (2, 4)}  # the steps after which each cluster holds a stand-in
    for key in seen:
        for step in range(1, 7):
            got, want = seen[key][step - 1], plain[key][step - 1]
            if step in pending[key[0]]:
                assert not torch.allclose(got, want, atol=1e-3), (key, step)
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=f"{key} after step {step}")
    for key in [(0, 0), (0, 1)]:
        kinds = ("keep_local" if keep_local else "rollback")
        assert [e["step"] for e in reps[key].kinds(kinds, level="inner")] == [3, 4], reps[key].kinds(kinds, level="inner")
    finals = [traj[-1] for traj in seen.values()]
    for f in finals[1:]:
        torch.testing.assert_close(f, finals[0], rtol=0, atol=0)


def test_a_failed_background_outer_round_costs_only_the_outer_stage():
    """Cluster 0's outer all-reduce fails in the round launched at step 2 (cluster 1's
    completes: torchft's commit vote is per replica group, so cluster 1 commits). At step 3
    cluster 0 does not merge and rolls no inner work back; at its next outer round its
    leader finds its outer level behind and heals it from cluster 1, and the job ends
    consistent."""
    steps = 6
    seen, reps = run(steps, final_step=steps, faults=[Fault(cluster=0, replica=0, step=2, action="fail", phase="OUTER_REDUCE")])
    for rep in reps.values():
        assert not rep.kinds("rollback", level="inner"), rep.kinds("rollback", level="inner")
        (at3,) = rep.kinds("commit", level="inner", step=3)
        assert at3["outer"] is (rep.key[0] == 1), at3  # only cluster 1 merged the round launched at 2
        assert rep.sync.counters.outer_round == 3
    leader0 = reps[(0, 0)]
    assert [e["step"] for e in leader0.kinds("rollback", level="outer")] == [2]
    assert [e["step"] for e in leader0.kinds("heal", level="outer")] == [4]
    finals = [traj[-1] for traj in seen.values()]
    for f in finals[1:]:
        torch.testing.assert_close(f, finals[0], rtol=0, atol=0)


def test_the_gate_lets_only_inner_and_outer_overlap():
    gate = CollectiveGate(concurrent=[("inner", "outer")])
    with gate.collective("inner", "allreduce"):
        with gate.collective("outer", "allreduce"):
            pass
        with pytest.raises(InvariantViolation):
            with gate.collective("inner", "broadcast"):
                pass
    strict = CollectiveGate()
    with strict.collective("inner", "allreduce"):
        with pytest.raises(InvariantViolation):
            with strict.collective("outer", "allreduce"):
                pass


# ---------------------------------------------------------------------------
# Real processes (one `hier-localsgd train` per replica group).

from harness import logs_tail, run_job  # noqa: E402

JOB = ["train.min_step_time_s=0.05", "sync.inner.every=5", "sync.outer.every=2", "sync.outer.delay=1", "train.steps=40"]


@pytest.mark.slow
@pytest.mark.parametrize("eager", [False, True], ids=["plain", "eager"])
def test_a_leader_dying_with_its_outer_round_in_flight_hands_over_and_the_job_ends_consistent(tmp_path, eager):
    """c0r0 (cluster 0's leader) exits inside the background OUTER_QUORUM of the round
    launched at step 10. c0r1 leads at the apply round (step 15): it has no result, so
    cluster 0 merges nothing there and trains on; the restarted c0r0 heals; the outer
    rounds after it include cluster 0 again; every group that finishes ends on the same
    model. (The restarted c0r0 rejoins, or, on a slow machine, finds the job finished and
    exits 0 without a result: both are correct, so only finished groups are compared.)
    Eager updates: c0r1 took its stand-in step at step 10 and takes it out at step 15 (no
    result); the restarted c0r0 heals with the cluster's stand-in and outer momentum."""
    # At OUTER_QUORUM: the fault fires as the stage thread starts, while the training thread
    # has 5 steps (>= 0.25 s) to go before step 15's round. At OUTER_REDUCE it fired only
    # once cluster 1's leader had joined the outer quorum; with that leader late (a loaded
    # CI machine; in a one-off run, by SIGSTOPping c1r0 for 2.5 s from step 5) c0r0 had joined step 15's
    # inner round first, whose commit vote then failed: c0r1 rolled back at step 15, with
    # no commit there. At OUTER_QUORUM the same stop leaves c0r1's commit at step 15.
    run = run_job(tmp_path, [*JOB, f"sync.outer.eager={eager}", "faults=[{cluster:0,replica:0,step:10,action:exit,phase:OUTER_QUORUM}]"],
                  restart=True)
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    sums = run.summary["checksums"]
    assert {"c0r1", "c1r0", "c1r1"} <= set(sums) and len(set(sums.values())) == 1, sums
    assert [h["code"] for h in run.job.history if h["event"] == "exit" and h["key"] == (0, 0)][0] == 17
    (at15,) = run.kinds((0, 1), "commit", level="inner", step=15)
    assert at15["outer"] is False, at15  # the new leader had no outer result to give
    assert run.kinds((0, 1), "leader", leader=True), "c0r1 must have taken over"
    assert [e for e in run.kinds((0, 1), "commit", level="inner") if e["outer"] and e["step"] > 15], "cluster 0 must merge a later outer round"
    assert not run.kinds((1, 0), "rollback", level="inner") and not run.kinds((1, 1), "rollback", level="inner")
    if eager:
        assert 10 in [e["step"] for e in run.kinds((0, 1), "eager_step")]
    launches = [e["step"] for k in run.job.keys() for e in run.kinds(k, "outer_launch")]
    assert 10 in launches and 30 in launches and 40 not in launches  # the last outer round blocks


@pytest.mark.slow
def test_the_global_model_evaluated_at_the_merges_is_one_model_in_every_group(tmp_path):
    """``train.eval_global`` with overlapped outer rounds: at every merge (steps 15, 25, 35;
    step 5 holds the initial model) each group evaluates the global model it applied, the
    same in all four groups (equal losses bit for bit: one eval set), where their live
    models differ (each cluster's own progress since the launch). (That the live model comes
    back: tests/test_api.py, by hand.)"""
    run = run_job(tmp_path, [*JOB, "train.eval_every=10", "train.eval_offset=5", "train.eval_global=true"])
    assert all(code == 0 for code in run.codes.values()) and run.summary["consistent"], logs_tail(run)
    keys = sorted(run.job.keys())
    assert len(keys) == 4
    glob = {k: {e["step"]: e["loss"] for e in run.kinds(k, "eval_global")} for k in keys}
    live = {k: {e["step"]: e["loss"] for e in run.kinds(k, "eval") if e["step"] in (5, 15, 25, 35)} for k in keys}
    for k in keys:
        assert sorted(glob[k]) == [5, 15, 25, 35] and sorted(live[k]) == [5, 15, 25, 35], (k, glob[k], live[k])
    for step in (5, 15, 25, 35):
        assert len({glob[k][step] for k in keys}) == 1, (step, glob)
    for step in (15, 25, 35):
        assert len({live[k][step] for k in keys}) > 1, (step, live)  # the clusters' live models differ there
        assert glob[keys[0]][step] not in {live[k][step] for k in keys}, (step, glob, live)


def test_eval_global_needs_the_hierarchy():
    from hier_localsgd import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"train\.eval_global: needs sync\.mode=hier \(sync\.mode=flat"):
        load_config(["sync.mode=flat", "train.eval_global=true"], validate_for="demo")
