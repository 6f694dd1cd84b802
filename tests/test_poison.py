"""The poison screen (core/tensors/guard.py ``screen``, sync/poison.py; issue #30): a replica group
whose model goes bad never reaches the shared model.

The rule is checked against hand computations; the round's arithmetic with threads over
real lighthouses and Managers; whole jobs as real processes."""

import math
from typing import Dict, List, Tuple

import pytest
import torch

from harness import ThreadedHier, local_steps, logs_tail, run_job
from hier_localsgd.core.tensors.guard import NONFINITE, Fingerprint, accepted_median, plan, screen
from hier_localsgd.core.tensors.level import LevelAlgorithm
from hier_localsgd.sync.common import PoisonLimit
from hier_localsgd.sync.sections import PoisonConfig


def fp(norm: float, weight: float = 1.0, ref: float = 0.0) -> Fingerprint:
    return Fingerprint(hash=1, outer_round=0, inner_round=0, step=10, weight=weight, norm=norm, ref=ref)


# ---------------------------------------------------------------------------- the rule
def test_a_norm_far_above_the_others_median_is_excluded_and_the_rest_kept():
    # norms 1.0, 1.2, 40: for the third, the others' median is 1.1 and 40 > 25 x 1.1 = 27.5;
    # for the first, the others' median is (1.2 + 40) / 2 = 20.6: 1.0 is far below 25 x that.
    why = screen([fp(1.0), fp(1.2), fp(40.0)], ratio=25)
    assert why[:2] == ["", ""] and why[2].startswith("norm 40 > 25 x the other contributors' median 1.1")
    # 27 is under 25 x 1.1 = 27.5: kept
    assert screen([fp(1.0), fp(1.2), fp(27.0)], ratio=25) == ["", "", ""]


def test_two_members_the_outsized_one_is_excluded_the_other_kept():
    assert screen([fp(0.5), fp(1e4)], ratio=25) == ["", "norm 1e+04 > 25 x the other contributors' median 0.5"]


def test_non_finite_is_excluded_whatever_the_ratio_and_members_at_weight_zero_never():
    assert screen([fp(1.0), fp(NONFINITE)], ratio=0) == ["", "non-finite values"]
    assert screen([fp(1.0), fp(float("nan"))], ratio=25)[1] == "non-finite values"
    assert screen([fp(1.0), fp(NONFINITE, weight=0.0)], ratio=25) == ["", ""]  # contributes nothing
    assert screen([fp(1.0), fp(1e9)], ratio=0) == ["", ""]  # no norm check


def test_a_lone_contributor_is_judged_against_the_members_running_references():
    # one contributor, two members' references 2.0 and 4.0 (median 3.0): 80 > 25 x 3 = 75
    why = screen([fp(80.0, ref=2.0), fp(0.0, weight=0.0, ref=4.0)], ratio=25)
    assert why == ["norm 80 > 25 x the level's running reference 3", ""]
    assert screen([fp(70.0, ref=2.0), fp(0.0, weight=0.0, ref=4.0)], ratio=25) == ["", ""]
    assert screen([fp(1e9)], ratio=25) == [""]  # no reference yet: only the non-finite check


def test_the_plan_gives_an_excluded_member_weight_zero_and_the_total_excludes_it():
    p = plan([fp(1.0), fp(1.1), fp(NONFINITE)], ratio=25)
    assert p.weights == [1.0, 1.0, 0.0] and p.total_weight == 2.0 and p.source is None
    assert p.excluded_ranks() == [2]
    assert accepted_median(p.fingerprints, p.weights) == pytest.approx(1.05)


# ---------------------------------------------------------------------------- threads
H_IN, H_OUT, N = 2, 4, 64


def threaded(poisoned_steps: Dict[int, str], poison: PoisonConfig = PoisonConfig(), steps: int = 8):
    """2 clusters x 2 groups, localsgd inside (the committed model is the mean of the live
    models that count), c0r1's local update at the given steps replaced by poison."""
    job = ThreadedHier(2, 2, H_IN, H_OUT, inner=LevelAlgorithm.build("localsgd"), numel=N, poison=poison)
    seen: Dict[Tuple[int, int], List[torch.Tensor]] = {}
    errors: Dict[Tuple[int, int], BaseException] = {}

    def update(c: int, r: int, k: int) -> torch.Tensor:
        u = torch.full((N,), 0.01 * (k + 1) * (1 if r == 0 else -0.5) + 0.003 * c)
        how = poisoned_steps.get(k) if (c, r) == (0, 1) else None
        if how == "nan":
            u[::7] = float("nan")
        elif how == "huge":
            u = u * 1e6
        return u

    def body(rep):
        try:
            local_steps(rep, update, steps, record=lambda x: seen.setdefault(x.key, []).append(x.flat.data.clone()))
        except PoisonLimit as e:
            errors[rep.key] = e

    try:
        job.run(body)
    finally:
        job.close()
    return job, seen, errors


def test_a_nan_group_is_excluded_at_the_inner_round_and_heals_to_the_shared_model():
    job, seen, errors = threaded({2: "nan"})  # c0r1's third local step (round 2 ends at step 4)
    assert not errors
    for key, models in seen.items():
        for step, m in enumerate(models, start=1):
            if key == (0, 1) and step == 3:
                continue  # the poisoned member between its bad step and its round
            assert torch.isfinite(m).all(), (key, step)
    # Round 2 of cluster 0 committed c0r0's model alone (localsgd: the mean of what counts):
    # its live model after step 3 plus its step-4 update. c0r1 was given that model.
    expected = seen[(0, 0)][2] + torch.full((N,), 0.01 * 4)
    assert torch.equal(seen[(0, 0)][3], expected) and torch.equal(seen[(0, 1)][3], expected)
    ex = job.replicas[(0, 1)].kinds("excluded")
    assert [(e["level"], e["member"], e["step"], e["reason"], e["mine"]) for e in ex] == [("inner", "c0r1", 4, "non-finite values", True)]
    assert [(e["member"], e["mine"]) for e in job.replicas[(0, 0)].kinds("excluded")] == [("c0r1", False)]
    assert not job.replicas[(1, 0)].kinds("excluded")  # the other cluster never saw it: the outer level stayed clean
    assert [e["reason"] for e in job.replicas[(0, 1)].kinds("discard")] == ["excluded"]
    final = {k: m[-1] for k, m in seen.items()}
    assert all(torch.equal(m, final[(0, 0)]) for m in final.values())  # the run ends on one model


def test_an_outsized_group_is_excluded_by_its_norm():
    job, seen, errors = threaded({2: "huge"})
    assert not errors
    ex = job.replicas[(0, 0)].kinds("excluded")
    assert len(ex) == 1 and ex[0]["member"] == "c0r1" and ex[0]["step"] == 4
    assert ex[0]["reason"].startswith("norm ") and "x the other contributors' median" in ex[0]["reason"]
    assert max(float(m.abs().max()) for models in seen.values() for m in models[3:]) < 1.0  # the 1e6 never spread


def test_a_group_excluded_too_often_gives_up_between_rounds():
    # excluded at steps 2 and 6 (rounds 1 and 3): the second offence within the window of 20 ends it
    job, seen, errors = threaded({0: "nan", 4: "nan"}, PoisonConfig(max_offences=2, window=20), steps=12)
    assert list(errors) == [(0, 1)]
    msg = str(errors[(0, 1)])
    assert "c0r1: contribution excluded 2 times within 20 rounds" in msg and "sync.poison.max_offences=2" in msg
    assert len(seen[(0, 1)]) == 5  # its round at step 6 (recorded after it) was its last
    assert len(seen[(0, 0)]) == 12  # the others trained on without it
    assert all(torch.isfinite(seen[k][-1]).all() for k in ((0, 0), (1, 0), (1, 1)))
    assert torch.equal(seen[(1, 0)][-1], seen[(1, 1)][-1])


# ---------------------------------------------------------------------------- processes
PACED = ["sync.inner.every=5", "sync.outer.every=2", "train.eval_every=5"]


def evals(run, key) -> List[Tuple[int, float]]:
    return [(e["step"], e["loss"]) for e in run.kinds(key, "eval")]


@pytest.mark.slow
def test_a_poisoned_group_never_reaches_the_other_groups_and_the_run_ends_consistent_and_finite(tmp_path):
    run = run_job(tmp_path, [*PACED, "train.steps=40", "faults=[{cluster:0,replica:1,step:12,action:poison}]"])
    assert all(c == 0 for c in run.codes.values()), logs_tail(run)
    s = run.summary
    assert s["consistent"] is True and s["not_finite"] == []
    assert [(x["level"], x["member"], x["step"], x["reason"]) for x in s["excluded"]] == [("inner", "c0r1", 15, "non-finite values")]
    for key in run.job.keys():
        for step, loss in evals(run, key):
            if key == (0, 1) and 12 < step < 15:
                continue  # the poisoned group's own evaluations before its round
            assert math.isfinite(loss), (key, step, loss)
    assert run.kinds((0, 1), "optimizer_restored", how="last commit")
    assert math.isfinite(s["final_eval_loss"]) and s["final_eval_loss"] < s["eval_loss_start"]


@pytest.mark.slow
def test_a_group_that_keeps_poisoning_exits_with_code_2_and_is_not_restarted(tmp_path):
    faults = ",".join(f"{{cluster:0,replica:1,step:{s},action:poison}}" for s in (7, 12, 17))
    run = run_job(tmp_path, [*PACED, "train.steps=40", "sync.poison.max_offences=2", f"faults=[{faults}]"], restart=True)
    assert run.codes[(0, 1)] == 2, run.codes
    assert all(c == 0 for k, c in run.codes.items() if k != (0, 1)), logs_tail(run)
    assert sum(1 for h in run.job.history if h.get("event") == "restart") == 0
    log = (run.job.run_dir / "logs" / "c0r1.log").read_text()
    assert "exiting with code 2: PoisonLimit: c0r1: contribution excluded 2 times within 20 rounds" in log
    assert "giving up (sync.poison.max_offences=2)" in log


@pytest.mark.slow
def test_flat_baseline_has_no_screen_and_an_all_nan_job_is_never_called_consistent(tmp_path):
    """The summary's consistency never counts one checksum of NaN parameters as success
    (issue #30: a whole job turned NaN reported itself consistent)."""
    run = run_job(tmp_path, ["sync.mode=flat", "sync.flat.every=10", "train.steps=30",
                             "faults=[{cluster:0,replica:1,step:12,action:poison}]"])
    s = run.summary
    assert len(set(s["checksums"].values())) == 1  # one checksum everywhere ...
    assert sorted(s["not_finite"]) == ["c0r0", "c0r1", "c1r0", "c1r1"]  # ... of NaN parameters
    assert s["consistent"] is False


@pytest.mark.slow
def test_a_cluster_whose_only_group_is_excluded_at_the_last_outer_round_still_meets_the_others(tmp_path):
    """2 clusters x 1 group, every inner round an outer round: c1r0 poisoned at step 17 is
    excluded at step 20, the last round. Its cluster has no weight at the inner level but
    still carries its earlier work, so its leader meets the other cluster at the outer
    level (with the committed cluster model) and every group ends on the global model.
    (Skipping the outer round for want of inner weight left cluster 1 on its own model.)"""
    run = run_job(tmp_path, ["topology.replicas_per_cluster=1", "sync.inner.every=5", "sync.outer.every=1",
                             "train.steps=20", "faults=[{cluster:1,replica:0,step:17,action:poison}]"])
    assert all(c == 0 for c in run.codes.values()), logs_tail(run)
    s = run.summary
    assert [(x["level"], x["member"], x["step"]) for x in s["excluded"]] == [("inner", "c1r0", 20)]
    assert s["consistent"] is True and s["not_finite"] == []
    for key in run.job.keys():
        last = [e for e in run.kinds(key, "commit", level="inner") if e["step"] == 20]
        assert last and last[-1]["outer"] is True, (key, last)
