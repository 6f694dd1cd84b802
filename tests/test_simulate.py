"""The deployment simulator (hier_localsgd/tools/simulate/engine.py): the no-failure identity, hand-worked
single failures, conservation of time, reproducibility, and the validation figures."""

import functools
import json
import time
from dataclasses import asdict

import pytest

from hier_localsgd.config import Config, ConfigError, load_config
from hier_localsgd.tools.plan import network as plan_network
from hier_localsgd.tools.plan.planner import sync_bytes
from hier_localsgd.tools.simulate import engine, params, report
from hier_localsgd.tools.simulate.config import FailureConfig

DEBUG_PARAMS = 6_163_712
# issue #6's networks: LAN 10 Gbit/s 0.1 ms, WAN 1 Gbit/s 20 ms (links.inner, links.outer)
ISSUE6 = ["links.inner.bandwidth_gbps=10", "links.inner.latency_ms=0.1", "links.outer.bandwidth_gbps=1", "links.outer.latency_ms=20"]


def small(mode: str = "hier", *overrides: str, **sim) -> Config:
    """2 clusters x 2 replica groups, debugmodel-sized sync, 0.34 s steps, issue #6 networks;
    ``sim``: fields of ``simulate.*``."""
    cfg = load_config([
        *ISSUE6, f"sync.mode={mode}", "sync.inner.every=10", "sync.outer.every=3", "sync.flat.every=30", "sync.min_clusters=1",
        f"simulate.params={DEBUG_PARAMS}", "plan.hardware.step_time_s=0.34", "plan.train.sync_dtype=float32",
        "simulate.failures.model=none", "simulate.duration_s=120", "simulate.sensitivity=[]", *overrides,
    ], validate_for="simulate")
    for k, v in sim.items():
        setattr(cfg.simulate, k, v)
    return cfg


def free_network(**failures) -> Config:
    """Syncs that cost nothing (so every figure is a whole number of seconds), 1 s steps. The
    asynchronous level's server closes each batch at once (``grace_s`` 0: a version per push,
    as the hand computations below count); the grace window's own tests set it."""
    fast = ["links.inner.bandwidth_gbps=1e12", "links.inner.latency_ms=0", "links.outer.bandwidth_gbps=1e12", "links.outer.latency_ms=0",
            "sync.async_outer.grace_s=0"]
    return small("hier", *fast, "simulate.params=1000", "plan.hardware.step_time_s=1.0", duration_s=60.0,
                 failures=FailureConfig(model="none", restart_s=6.0, heal_s=0.0, outer_heal_s=0.0, **failures))


def one_run(cfg: Config, seed: int = 0) -> engine.RunResult:
    return engine.simulate_once(params.resolve(cfg), seed)


def loaded(overrides, **sim) -> Config:
    cfg = load_config(overrides, validate_for="simulate")
    for k, v in sim.items():
        setattr(cfg.simulate, k, v)
    return cfg


# ----------------------------------------------------------------------------- the lighthouse rule
def test_lighthouse_rule_by_hand():
    inf = float("inf")
    f = engine.lighthouse_forms_at
    assert f(3.0, 0.0, 1, [inf], 30.0, fast=True) == 3.0  # every previous member joined
    # 1 joined, 1 dead member counted until t=10: 1 <= 2//2 until it expires
    assert f(0.0, 0.0, 1, [10.0], 30.0, fast=False) == 10.0
    # 3 joined, 1 live straggler: a majority, so the join timeout (30 s after the first) decides
    assert f(0.0, 0.0, 3, [inf], 30.0, fast=False) == 30.0
    # 1 joined, 1 live straggler: never a majority without it
    assert f(0.0, 0.0, 1, [inf], 30.0, fast=False) == inf
    # 2 joined, a dead one until 50 and a live one: no majority until 50 (2 > 3//2), past the timeout
    assert f(0.0, 0.0, 2, [50.0, inf], 30.0, fast=False) == 50.0
    assert f(0.0, 0.0, 0, [], 30.0, fast=True) == inf  # nobody joined


# ----------------------------------------------------------------------------- no failures
@pytest.mark.parametrize("mode", ["hier", "flat", "ddp"])
def test_no_failures_goodput_is_one_minus_sync_overhead(mode):
    cfg = small(mode)
    r = one_run(cfg)
    # the planner's formulas, independently: ring bound per level on the demo networks
    lan, wan = cfg.link_spec("inner"), cfg.link_spec("outer")
    st = plan_network.sync_times(sync_bytes(cfg, DEBUG_PARAMS), 2, 2, lan, wan, 0.0)
    per_step = plan_network.sync_per_step(st, mode, 10, 3, 30)
    expected = 1.0 - plan_network.comm_fraction(0.34, per_step)
    assert r.goodput == pytest.approx(expected, rel=1e-12)
    assert r.goodput == pytest.approx({"hier": 0.9698736, "flat": 0.9608267, "ddp": 0.4498198}[mode], abs=1e-6)
    # by hand, per 0.34 s step: hier 19.92 ms / 10 + (237.24 + 19.82) ms / 30 = 10.561 ms;
    # flat 415.86 ms / 30 = 13.862 ms; ddp 415.86 ms (0.34 / 0.75586 = 0.44982)
    assert r.lost == {} and r.failures == [] and r.efficiency == 1.0
    assert r.balance_error < 1e-12


def test_no_failures_at_scale_is_fast_and_exact():
    cfg = loaded([*report.LARGE_DEPLOYMENT, "simulate.params=8030261248", "plan.hardware.step_time_s=1.2",
                  "simulate.failures.model=none", "simulate.sensitivity=[]"])
    t0 = time.time()
    r = one_run(cfg)  # 64 x 16 for 24 simulated hours
    elapsed = time.time() - t0
    assert r.goodput == pytest.approx(r.expected_no_failure_goodput, rel=1e-12)
    assert r.outer_rounds > 30 and elapsed < 60


# ----------------------------------------------------------------------------- single failures, by hand
def test_non_leader_crash_during_local_steps():
    cfg = free_network(kills=["12.5:0:1"])  # c0r1, 2.5 s into its second round
    r = one_run(cfg)
    assert r.end_s == pytest.approx(60.0)  # the outer commit at step 60 ends the 60 s run
    (f,) = r.failures
    assert f["role"] == "non_leader"
    # its 2.5 s of steps are lost; it is down 6 s, then waits 1.5 s for its cluster's quorum at t=20
    assert f["lost_replica_s"] == pytest.approx({"own_work": 2.5, "down": 7.5})
    assert r.down == pytest.approx(6.0) and r.wait == pytest.approx(1.5)
    assert r.committed == pytest.approx(240 - 2.5 - 6.0 - 1.5)  # capacity 4 x 60
    assert r.goodput == pytest.approx(230 / 240)
    assert (r.steps_run, r.steps_discarded) == (180 + 10 + 2 + 40, 2)


def test_non_leader_crash_that_delays_quorum_and_barrier():
    r = one_run(free_network(kills=["17.5:0:1"]))
    # c0's quorum at t=20 waits for the dead member's heartbeat (17.5 + 5): c0r0 stalls 2.5 s;
    # c0 reaches the outer barrier at 32.5 and c1's two groups wait there 2.5 s each
    (f,) = r.failures
    assert f["lost_replica_s"] == pytest.approx({"own_work": 7.5, "stall": 2.5 + 5.0, "down": 32.5 - 17.5})
    assert r.end_s == pytest.approx(62.5)
    assert r.wait == pytest.approx(2.5 + 5.0 + 9.0)  # + c0r1 back at 23.5, joining at 32.5
    assert r.committed == pytest.approx(4 * 62.5 - 16.5 - 6.0 - 7.5)
    assert (r.steps_run, r.steps_discarded) == (47 + 180, 7)


def test_leader_crash_costs_a_wan_heal_not_the_work():
    cfg = free_network(kills=["5.5:0:0"])
    cfg.simulate.failures.restart_s = 1000.0  # it does not come back within the run
    cfg.simulate.failures.outer_heal_s = 4.0
    r = one_run(cfg)
    (f,) = r.failures
    assert f["role"] == "leader"
    # quorum at 10 waits to 10.5 (c0r1); c1 waits 0.5 s at the barrier (x2); c0r1's new cluster
    # Manager heals from cluster 1 for 4 s while all three live groups wait; no work discarded
    assert f["lost_replica_s"] == pytest.approx({"own_work": 5.5, "stall": 0.5 + 1.0 + 12.0, "down": 64.5 - 5.5})
    assert r.end_s == pytest.approx(64.5)
    assert r.committed == pytest.approx(10 + 20 + 30 + 2 * 60)
    assert r.goodput == pytest.approx(180 / 258)
    assert "discarded" not in r.lost


def test_whole_cluster_loss_discards_its_outer_period():
    r = one_run(free_network(kills=["s15:0"]))  # cluster 0 during local step 16, t = 15.5
    (f,) = r.failures
    assert f["role"] == "cluster" and f["t"] == pytest.approx(15.5)
    # lost: 2 x 5.5 s of steps; round 1 (2 x 10 s, inner-committed); the restarted cluster's
    # 30 steps from scratch (2 x 30 s, weight 0 at its first outer round). Cluster 1 waits at
    # the barrier from 30 to 51.5 (torchft's lighthouse wants a majority of the 2 live Managers).
    assert f["lost_replica_s"] == pytest.approx({"own_work": 11.0, "discarded": 20.0 + 60.0, "stall": 2 * 21.5, "down": 12.0})
    assert r.end_s == pytest.approx(81.5)
    assert r.committed == pytest.approx(60 + 120)
    assert r.goodput == pytest.approx(180 / 326)
    # chaos.py counts: the killed incarnation's 5+5 steps since its commit, the fresh one's 30+30
    assert (r.steps_run, r.steps_discarded) == (30 + 60 + 60 + 120, 10 + 60)


def test_an_asynchronous_cluster_restarted_whole_adopts_the_newest_version_at_its_join_round():
    """The asynchronous level, staleness bound 1, 90 s. Both clusters push at 30 s (versions
    1 and 2). Cluster 0 is lost during step 36 (35.5 s: 2 x 5.5 s of own work) and back at
    41.5 s (2 x 6 s down). Its join round is a push of no work: it adopts version 2 and
    resumes at step 30 (its furthest push), so its next push, at step 60 (71.5 s), is one
    version behind (cluster 1's push at 60 s): merged. Kept: cluster 1's 2 x 90 and cluster
    0's 2 x 30 + 2 x 30; its last 18.5 s are in no push at the end (pending). Before, it
    trained from step 0 and the initial model, and that push, 3 versions behind, was
    discarded (2 x 30 replica-seconds)."""
    cfg = free_network(kills=["s35:0"])
    cfg.simulate.duration_s = 90.0
    cfg.sync.async_outer.enabled, cfg.sync.async_outer.max_staleness = True, 1
    sim = engine.Simulation(params.resolve(cfg), 0)
    r = sim.run()
    (f,) = r.failures
    assert f["role"] == "cluster" and f["lost_replica_s"] == pytest.approx({"own_work": 11.0, "down": 12.0})
    assert sim.pushes_at == {0: [30.0, 71.5], 1: [30.0, 60.0, 90.0]}, dict(sim.pushes_at)
    assert [c.step for c in sim.clusters] == [70, 90]  # cluster 0: 30 + 40 steps committed in 48.5 s
    assert (r.committed, r.goodput, r.lost, r.steps_discarded) == (300.0, 300 / 360, {"own_work": 11.0}, 10)
    assert r.balance_error < 1e-12


# ----------------------------------------------------------------------------- invariants
def test_fixed_seed_is_reproducible():
    cfg = small(failures=FailureConfig(model="independent", mtbf_s=120.0, cluster_mtbf_s=400.0, hang_fraction=0.3, restart_s=6.0), duration_s=900.0, step_jitter=0.02)
    a, b = one_run(cfg, seed=3), one_run(cfg, seed=3)
    assert asdict(a) == asdict(b)
    assert len(a.failures) > 10
    c = one_run(cfg, seed=4)
    assert [f["t"] for f in c.failures] != [f["t"] for f in a.failures]


@pytest.mark.parametrize("mode", ["hier", "flat", "ddp"])
@pytest.mark.parametrize("seed", [0, 1])
def test_time_is_conserved_under_every_failure_kind(mode, seed):
    cfg = small(
        mode, "timeouts.local_step=20", "timeouts.watchdog_grace=5",
        failures=FailureConfig(model="independent", mtbf_s=60.0, cluster_mtbf_s=300.0 if mode == "hier" else 0.0, hang_fraction=0.3, restart_s=6.0, reconfigure_s=0.5),
        duration_s=600.0,
        step_jitter=0.05,
    )
    r = one_run(cfg, seed)
    # every replica-group-second is compute (committed, lost or pending), sync, wait or down
    assert r.balance_error < 1e-9
    assert 0.0 < r.goodput < r.expected_no_failure_goodput
    assert len(r.failures) > 20


def test_chaos_schedule_picks_roles_like_chaos_py():
    s = report.summarize_runs(report.simulate_many(params.resolve(loaded(report.CHAOS_VALIDATION)), 0, 50))
    roles = s["lost_per_failure_by_role"]
    assert set(roles) == {"non_leader", "leader", "cluster"}
    # a whole-cluster kill costs most (all its groups are down, and the work since its last
    # outer commit goes with it); it no longer trains from scratch after the restart, so
    # what it discards is that work alone
    assert roles["cluster"]["total"] > roles["leader"]["total"] and 0 < roles["cluster"]["discarded"] < roles["cluster"]["total"] / 2


# ----------------------------------------------------------------------------- validation figures
def test_replayed_kills_discard_what_the_model_says_by_hand():
    """The model's accounting of three replayed kills, hand-computed (H_inner 10, H_outer 3):
    cluster 0 during local step 173 (2 steps since the inner commit at 170, each of 2 groups),
    c1r1 during step 235 (4 steps), cluster 0 during step 371 (0 steps). A cluster restarted
    whole takes the global model in its join round (an outer round of weight 0, before its
    first local step), so it discards nothing more: 2·2 + 4 + 0 = 8 steps. (Under the code
    before that join, the same kills measured 128: each cluster restart trained 60 steps from
    step 0 and lost them at its first outer round.)"""
    cfg = loaded(report.CHAOS_VALIDATION, runs=1, failures=FailureConfig(model="none", restart_s=6.0, kills=["s172:0", "s234:1:1", "s370:0"]))
    r = one_run(cfg)
    assert r.steps_discarded == 8
    assert r.final_step == 600 and not r.truncated


def discarded(kill, *extra):
    """Steps the model discards for one replayed kill on chaos validation's topology (H_inner 10)."""
    cfg = loaded([*report.CHAOS_VALIDATION, *extra], runs=1, failures=FailureConfig(model="none", restart_s=6.0, kills=[kill]))
    return one_run(cfg).steps_discarded


def test_a_replayed_kill_in_a_sync_phase_costs_the_round():
    """A kill of c1r1 at a round boundary placed by the phase it hit (what chaos.py counts: a
    dead process's steps since its last inner commit, and rolled-back rounds): in local step
    231 it loses nothing (the round at 230 committed); in INNER_REDUCE of the round ending at
    230 that round fails for c1r0 too (10 + 10 steps); in INNER_COMMIT the round's collectives
    are done, so c1r0 commits and only the victim's 10 uncommitted steps go."""
    assert discarded("s230:1:1") == 0
    assert discarded("s230:1:1@LOCAL") == 0
    assert discarded("s230:1:1@INNER_REDUCE") == 20
    assert discarded("s230:1:1@INNER_COMMIT") == 10
    # INNER_QUORUM: with the early quorum (the default) the victim is already in the round's
    # quorum, so the round fails as in INNER_REDUCE; without it the lighthouse waits for its
    # heartbeat to stop and forms the quorum without it: only the victim's steps go.
    assert discarded("s230:1:1@INNER_QUORUM") == 20
    assert discarded("s230:1:1@INNER_QUORUM", "sync.inner.early_quorum=false") == 10
    # BROADCAST of the outer round at 240: the outer commit holds the cluster's work, but the
    # victim's process had not committed its round and c1r0's round fails with the broadcast.
    assert discarded("s240:1:1@BROADCAST") == 20


def test_a_death_in_the_last_local_step_fails_the_round_with_the_early_quorum():
    """With sync.inner.early_quorum (the default) a round's quorum is asked for during its
    last local step (sync/early.py), so a member that dies in that step is in the quorum its
    peers get and their round fails. (Found by matching the measured chaos runs' rollbacks to
    their kills: every kill in a last local step with a live peer was followed by the peer's
    rollback; the model had them commit.) c1r1 killed during step 240, the last of the round
    ending at 240: its 9 steps since the commit at 230 and c1r0's 10 rolled back; during step
    239, or without the early quorum, only its own steps."""
    assert discarded("s239:1:1") == 9 + 10
    assert discarded("s238:1:1") == 8
    assert discarded("s239:1:1", "sync.inner.early_quorum=false") == 9


def test_torchft_per_step_shape():
    shares = {}
    for every in (60.0, 15.0):
        s = report.summarize_runs(report.simulate_many(params.resolve(loaded(report.torchft_per_step(every))), 0, 5))
        shares[every] = s["goodput"]["mean"] / s["expected_no_failure_goodput"]
    # published: 82.3 % of steps committed at one failure per 60 s, 30.2 % at one per 15 s.
    # The 60 s point calibrates reconfigure_s; at 15 s the simulator is more optimistic
    # (recoveries overlap in it; in the published run each failure cost the same ~10.6 s).
    assert abs(shares[60.0] - 0.823) / 0.823 < 0.05
    assert shares[15.0] == pytest.approx(0.42, abs=0.04)
    assert shares[15.0] < shares[60.0] - 0.3


def test_goodput_falls_with_the_failure_rate():
    p = params.resolve(loaded(report.CHAOS_VALIDATION))
    g = [report.summarize_runs(report.simulate_many(params.scale_failures(p, k), 0, 40))["goodput"]["mean"] for k in (0.0, 0.5, 1.0, 3.0)]
    assert g[0] > g[1] > g[2] > g[3]


# ----------------------------------------------------------------------------- config, errors, command
@pytest.mark.parametrize(
    "mutate, prefix",
    [
        (lambda c: setattr(c.sync, "mode", "ring"), "sync.mode: unknown mode"),
        (lambda c: setattr(c.sync.outer, "every", 0), "sync.outer.every:"),
        (lambda c: setattr(c.sync, "min_clusters", 3), "sync.min_clusters:"),
        (lambda c: setattr(c.topology, "clusters", 0), "topology.clusters:"),
        (lambda c: setattr(c.simulate.failures, "kills", ["soon:0"]), "simulate.failures.kills[0]:"),
        (lambda c: setattr(c.simulate.failures, "kills", ["3:5"]), "simulate.failures.kills[0]:"),
        (lambda c: setattr(c.simulate.failures, "kills", ["s10:0:1@LUNCH"]), "simulate.failures.kills[0]: 's10:0:1@LUNCH' — a phase goes with"),
        (lambda c: setattr(c.simulate.failures, "kills", ["12.5:0@INNER_REDUCE"]), "simulate.failures.kills[0]:"),
        (lambda c: setattr(c.simulate.failures, "roles", ["janitor"]), "simulate.failures.roles[0]: unknown role"),
        (lambda c: setattr(c.simulate.failures, "hang_fraction", 2.0), "simulate.failures.hang_fraction:"),
        (lambda c: setattr(c.lighthouse, "heartbeat_timeout_ms", 0), "lighthouse.heartbeat_timeout_ms:"),
        (lambda c: setattr(c.timeouts, "inner_quorum", 0.0), "timeouts.inner_quorum"),
        (lambda c: setattr(c.plan.hardware, "step_time_s", 0.0), "plan.hardware.step_time_s: must be given"),
        (lambda c: setattr(c.simulate, "runs", 0), "simulate.runs: must be at least 1"),
    ],
)
def test_bad_values_name_the_field(mutate, prefix):
    cfg = small()
    mutate(cfg)
    with pytest.raises(ValueError) as e:
        params.resolve(cfg)
    assert str(e.value).startswith(prefix), str(e.value)


def test_simulate_reads_the_shared_deployment():
    # topology, sync and the lighthouse's timeouts are the shared sections' (issue #12)
    p = params.resolve(small("hier", "topology.clusters=4", "topology.replicas_per_cluster=3", "sync.inner.every=5", "sync.outer.every=4",
                             "lighthouse.join_timeout_ms=120000", "timeouts.outer_quorum=200", "links.outer.latency_ms=50"))
    assert (p.clusters, p.replicas, p.h_inner, p.h_outer, p.join_s, p.outer_quorum_s) == (4, 3, 5, 4, 120.0, 200.0)
    assert p.outer_link.latency_s == 0.05 and p.min_clusters == 1
    flat = params.resolve(small("flat", "sync.flat.every=12"))
    assert (flat.clusters, flat.replicas, flat.h_inner) == (1, 4, 12)
    assert one_run(small("hier", "topology.clusters=3")).capacity == pytest.approx(3 * 2 * one_run(small()).end_s, rel=0.05)
    with pytest.raises(ConfigError, match="^simulate.sync.h_inner: moved to sync.inner.every"):
        load_config(["simulate.sync.h_inner=5"], validate_for="simulate")


def test_the_horizon_is_train_steps_unless_a_duration_is_given_and_must_be_simulable():
    assert params.resolve(small("hier", "train.steps=90", duration_s=0.0)).steps == 90
    assert params.resolve(small()).steps == 0  # duration_s=120
    with pytest.raises(ValueError, match="^simulate.duration_s: about 1.73e"):
        params.resolve(small("hier", "plan.hardware.step_time_s=1e-6", duration_s=86400.0))


def test_config_is_omegaconf_structured():
    from omegaconf import OmegaConf

    from hier_localsgd.tools.simulate.config import SimulateConfig

    merged = OmegaConf.merge(OmegaConf.structured(SimulateConfig), OmegaConf.from_dotlist(["params=8", "failures.kills=[s10:0]", "sensitivity=[1,2]"]))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, SimulateConfig) and cfg.params == 8 and cfg.failures.kills == ["s10:0"]


def test_run_simulate_prints_and_writes_json_and_plot(tmp_path, capsys):
    cfg = small(failures=FailureConfig(model="chaos", kill_every_s=30.0, restart_s=6.0), duration_s=300.0, runs=3, sensitivity=[0.0, 1.0, 3.0])
    assert report.run_simulate(cfg, str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "goodput" in out and "Time lost per failure" in out and "Sensitivity" in out
    data = json.loads((tmp_path / "simulate.json").read_text())
    assert data["summary"]["runs"] == 3 and len(data["sensitivity"]) == 3
    assert data["sensitivity"][0]["goodput"] == pytest.approx(data["summary"]["expected_no_failure_goodput"])
    assert (tmp_path / "simulate.png").stat().st_size > 10_000



def _out_of_sample():
    """benchmarks/measured/simulate_validation.json (benchmarks/validate_simulate.py): four
    chaos runs with kills of every role, replayed in the simulator at the kills' steps with
    today's code; restart_s fitted on the 2 x 2 run (a calibration, not a validation), the
    3 x 2 run, the run with twice the kill rate and the 2 x 3 run predicted with it. The
    2 x 3 run was measured after the last change to the model (the early-quorum rule, found
    on the other three): the one prediction no model change has seen."""
    from pathlib import Path

    from hier_localsgd.experiments.simulate_validation import validate

    saved = Path(__file__).resolve().parents[1] / "benchmarks" / "measured" / "simulate_validation.json"
    records = json.loads(saved.read_text())["records"]
    predicted = ("3x2", "2x2_fast_kills", "2x3")
    assert {r["label"] for r in records} == {"2x2", *predicted}
    v = validate(records, "2x2")
    rows = {r["label"]: r for r in v["rows"]}
    assert rows["2x2"]["calibration"] and not any(rows[k]["calibration"] for k in predicted)
    # every predicted run had several kills that discarded work, or the checks would be vacuous
    assert all(rows[k]["kills"] >= 5 and rows[k]["steps_discarded"]["measured"] >= 40 for k in predicted)
    return v


def test_simulator_predicts_steps_run_out_of_sample_within_15_percent():
    """Steps run (every local step any process took), out of sample: +5.7 %, +1.9 % and
    +8.2 %. For scale, the failure-free count C·R·steps is off by +14 %, +28 % and +25 %
    on these runs (the time processes were down); the steps discarded are the harder
    figure (next test)."""
    from hier_localsgd.experiments.simulate_validation import worst_out_of_sample

    worst = worst_out_of_sample(_out_of_sample())
    assert worst["steps_run"] is not None and worst["steps_run"] <= 0.15


@pytest.mark.xfail(strict=True, reason="known gap, measured (2026-11-26): with the early-quorum rule the three runs "
                   "it was found on are predicted within 15 % (-9.6 % calibration, -2.5 %, -14.9 %), but the 2 x 3 run "
                   "measured after it is under-predicted by 26.2 % (docs/planner.md, 'Validation out of sample'); "
                   "strict: passing means the docs must change")
def test_simulator_predicts_steps_discarded_out_of_sample_within_15_percent():
    from hier_localsgd.experiments.simulate_validation import worst_out_of_sample

    worst = worst_out_of_sample(_out_of_sample())
    assert worst["steps_discarded"] is not None and worst["steps_discarded"] <= 0.15


def test_simulator_predicts_the_asynchronous_levels_steps_run_under_kills_within_15_percent():
    """benchmarks/measured/simulate_validation_async.json (``validate_simulate.py --set
    async``, issue #33 §4): chaos runs with kills under the asynchronous outer level (equal
    speeds; cluster 1 at half speed) and the synchronous level at half speed, replayed with
    the restart time fitted on the synchronous 2 x 2 run: none of them was seen by the fit.
    Measured 2026-12-01: steps run +1.6 %, -0.8 %, +9.8 %; steps discarded -31.2 %, +34.5 %,
    +11.6 % (docs/planner.md: not asserted, the asynchronous runs miss 15 %)."""
    from pathlib import Path

    from hier_localsgd.experiments.simulate_validation import validate, worst_out_of_sample

    root = Path(__file__).resolve().parents[1] / "benchmarks" / "measured"
    cal = [r for r in json.loads((root / "simulate_validation.json").read_text())["records"] if r["label"] == "2x2"]
    records = json.loads((root / "simulate_validation_async.json").read_text())["records"]
    assert {r["label"] for r in records} == {"2x2_async", "2x2_async_half", "2x2_half"}
    v = validate([*cal, *records], "2x2")
    rows = {r["label"]: r for r in v["rows"]}
    assert v["restart_s"] == 4.0 and not any(rows[k]["calibration"] for k in ("2x2_async", "2x2_async_half", "2x2_half"))
    assert all(rows[k]["kills"] >= 5 for k in rows)  # kills of every role, or the check would be vacuous
    assert worst_out_of_sample(v)["steps_run"] <= 0.15


def test_time_to_the_target_counts_each_steps_share_of_a_round_by_hand():
    """target.py on free syncs, 1 s steps, H 10/3 (an outer round every 30 s), 120 s,
    ``target_rounds`` 2.5: the synchronous level's rounds (30, 60, 90, 120 s) are worth 1
    each, so the target falls at the third, 90 s. Asynchronous, with the grace window
    (default) both clusters' fresh pushes meet in one batch: a_i = 1 each, w = min(1, 2/2) = 1,
    the same. With grace 0 every push is its own version: at 30 s cluster 0's is fresh
    (a = 1, w = 1/2) and cluster 1's one version stale (λ(1) = 1/2, w = 1/4); from then on
    each adopted the other's version before it, so every push is one version stale (w = 1/4):
    2.25 rounds in all, the target not reached. With max_staleness 0 the stale pushes are
    refused and add nothing: 0.5 a period, 2.0. Overlapped pushes (``sync.outer.delay=1``)
    merge the same, but a cluster holds a version from its apply round on, the next inner
    round (10 steps later): the target at 100 s."""
    fast = ["links.inner.bandwidth_gbps=1e12", "links.inner.latency_ms=0", "links.outer.bandwidth_gbps=1e12", "links.outer.latency_ms=0"]
    cases = [
        ([], [1.0] * 4, 90.0),
        (["sync.async_outer.enabled=true"], [1.0] * 4, 90.0),
        # overlapped: the third version is out at step 90 but held from its apply round, step 100
        (["sync.async_outer.enabled=true", "sync.outer.delay=1"], [1.0] * 4, 100.0),
        (["sync.async_outer.enabled=true", "sync.async_outer.grace_s=0"], [0.5, 0.25] + [0.25] * 6, None),
        (["sync.async_outer.enabled=true", "sync.async_outer.grace_s=0", "sync.async_outer.max_staleness=0"], [0.5] * 4, None),
    ]
    for extra, shares, reached in cases:
        cfg = small("hier", *fast, "simulate.params=1000", "plan.hardware.step_time_s=1.0", *extra, duration_s=120.0, target_rounds=2.5,
                    failures=FailureConfig(model="none", heal_s=0.0, outer_heal_s=0.0))
        sim = engine.Simulation(params.resolve(cfg), 0)
        seen = []
        step = sim.progress.step
        sim.progress.step = lambda version, share: (seen.append(share), step(version, share))  # type: ignore[method-assign]
        r = sim.run()
        assert seen == shares, (extra, seen)
        assert r.progress_rounds == pytest.approx(sum(shares)) and r.target_s == reached, (extra, r.target_s)
    with pytest.raises(ValueError, match="simulate.target_rounds"):
        params.resolve(small("hier", target_rounds=-1.0))


@functools.lru_cache(maxsize=None)  # the two tests below share one replay
def _target_errors() -> dict:
    """The saved target validation replayed: (predicted - measured) / measured per record."""
    from pathlib import Path

    from hier_localsgd.experiments import target_validation as tv

    saved = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "measured" / "simulate_validation_target.json").read_text())
    assert saved["records"] == tv.RECORDED and len(saved["result"]) == len(tv.RECORDED)
    errors = {}
    for rec, row in zip(tv.RECORDED, saved["result"]):
        assert row["label"] == rec["label"] and row["target_rounds"] == tv.sync_rounds(rec)
        sync = tv.simulated_target_s(rec, row["target_rounds"], row["round_overhead_s"], False)
        assert sync == pytest.approx(rec["sync_s"], rel=0.01), rec["label"]
        pred = tv.simulated_target_s(rec, row["target_rounds"], row["round_overhead_s"], True)
        errors[rec["label"]] = (pred - rec["async_s"]) / rec["async_s"]
    return errors


def test_the_modelled_time_to_the_target_predicts_recorded_asynchronous_runs():
    """benchmarks/measured/simulate_validation_target.json (``validate_simulate.py --set
    target``): per recorded bench run, the rounds to the target and the per-collective
    overhead fitted on its synchronous arm (a calibration), and the asynchronous arm
    predicted (experiments/target_validation.py). Replayed here with the saved calibration
    (the fit's bisection takes a minute): the synchronous arm must still land on its
    measured time, and the predictions where they were on 2026-12-01: equal speeds -0.7,
    +1.1, -1.1 %; cluster 1 at half speed -16.3, -7.0, +5.0 % (the measured half-speed runs
    spread 147-164 s around the seeds' batches meeting or not, docs/planner.md)."""
    errors = _target_errors()
    equal = [e for k, e in errors.items() if k.startswith("equal")]
    half = [e for k, e in errors.items() if k.startswith("half")]
    assert len(equal) == 3 and len(half) == 3
    assert max(abs(e) for e in equal) <= 0.03, errors
    assert max(abs(e) for e in half) <= 0.20 and abs(sum(half) / 3) <= 0.10, errors


@pytest.mark.xfail(strict=True, reason="measured 2026-12-01: three clusters at 1.0/0.7/0.4 predicted +49.7, +21.8, +81.6 % "
                   "(docs/planner.md: their global models reached the target at 3.0-6.3 rounds' worth of merged work where the "
                   "synchronous arms needed 6-10); strict: passing means the docs must change")
def test_the_modelled_time_to_the_target_predicts_three_clusters_of_different_speeds_within_20_percent():
    errors = _target_errors()
    three = [e for k, e in errors.items() if k.startswith("three")]
    assert len(three) == 3 and max(abs(e) for e in three) <= 0.20, errors


def test_a_failure_free_runs_step_is_its_groups_commits_over_steps_and_the_slowest_clusters_at_speed_1(tmp_path):
    """simulate_validation.baseline_step_s: seconds per step from each group's first to last
    commit, averaged; with topology.cluster_speed only the slowest cluster's groups, scaled
    to a speed-1 step (a faster cluster may wait for it, under the synchronous level)."""
    from hier_localsgd.experiments.simulate_validation import baseline_step_s

    def events(name, t_per_step):
        d = tmp_path / "replicas" / name
        d.mkdir(parents=True)
        lines = [{"kind": "commit", "t": 100.0 + t_per_step * st, "step": st} for st in (0, 10, 20)]
        (d / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))

    events("c0r0", 0.1)
    events("c0r1", 0.3)  # waits for cluster 1 (a synchronous level)
    events("c1r0", 0.2)
    assert baseline_step_s(tmp_path) == pytest.approx(0.2)  # the mean of the three
    assert baseline_step_s(tmp_path, [1.0, 0.5]) == pytest.approx(0.1)  # cluster 1's 0.2 s at half speed
    with pytest.raises(ValueError, match="no replica group with two commits"):
        baseline_step_s(tmp_path / "nothing")


def test_kills_of_a_chaos_report_name_the_sync_phase_they_hit():
    from hier_localsgd.experiments.simulate_validation import kills_of

    report = {"kills": [
        {"targets": ["c0r0", "c0r1"], "phase": {"c0r0": "LOCAL", "c0r1": "INNER_REDUCE"}, "step": {"c0r0": 109, "c0r1": 110}},
        {"targets": ["c1r1"], "phase": {"c1r1": "BROADCAST"}, "step": {"c1r1": 240}},
        {"targets": ["c1r0", "c0r1"], "phase": {"c1r0": "INNER_COMMIT", "c0r1": "START"}, "step": {"c1r0": 330, "c0r1": 0}},
        {"targets": ["c0r0"], "step": {"c0r0": 57}},  # an older report: no phases
    ]}
    assert kills_of(report, replicas=2) == ["s109:0", "s240:1:1@BROADCAST", "s0:0:1", "s330:1:0@INNER_COMMIT", "s57:0:0"]


def test_a_half_speed_cluster_holds_the_fast_one_at_the_outer_barrier_as_computed_by_hand():
    """Free syncs, 1 s steps, H 10 x 3 (an outer round every 30 steps), 120 s. Cluster 1 at
    half speed ends an outer period every 60 s; cluster 0 every 30 s, then waits 30 s at the
    global lighthouse (a single joiner of two live leaders is no majority: it waits). So 60
    steps in 2 outer rounds instead of 120 in 4; cluster 0's 2 groups compute 60 s and wait
    60 s each: wait 120 replica-seconds, goodput (2 x 60 + 2 x 120) / 480 = 0.75."""
    cfg = free_network()
    cfg.simulate.duration_s = 120.0
    even = one_run(cfg)
    assert (even.final_step, even.outer_rounds, even.wait, even.goodput) == (120, 4, 0.0, 1.0)
    cfg.topology.cluster_speed = [1.0, 0.5]
    r = one_run(cfg)
    assert (r.end_s, r.final_step, r.outer_rounds, r.inner_rounds) == (120.0, 60, 2, 12)
    assert (r.compute, r.wait, r.goodput, r.expected_no_failure_goodput) == (360.0, 120.0, 0.75, 0.75)
    assert r.balance_error < 1e-12
    # The asynchronous outer level (sync.async_outer): nobody waits. Cluster 0 pushes at 30,
    # 60, 90 and 120 s, cluster 1 at 60 and 120 s (2 versions behind: merged, within the
    # bound of 4); 6 pushes, 120 steps for cluster 0, no wait, every second of compute kept.
    cfg.sync.async_outer.enabled = True
    a = one_run(cfg)
    assert (a.end_s, a.final_step, a.outer_rounds, a.wait, a.goodput, a.expected_no_failure_goodput) == (120.0, 120, 6, 0.0, 1.0, 1.0)
    assert a.lost == {} and a.balance_error < 1e-12
    # Matched paces (sync.async_outer.match_pace), over 180 s: the server learns the paces
    # from the pushes (1 and 2 s per step; no transit on a free network). Cluster 0, the
    # fastest, pushes every 30 steps (30, 60, ..., 180 s). Cluster 1's first push (60 s,
    # handled before cluster 0's push at the same second): cluster 0, answered at 30 s,
    # is due at 30 + 30 steps x 1 s = 60 s, now: under the 5-step floor, so it aims at the
    # one after, 30 s = 15 of its steps (step 45, 90 s), then 15 again: from 90 s on both
    # push together. (With the fastest's time between arrivals, unknown until its second
    # push, cluster 1's first answer was the full 30 steps and they met from 120 s.)
    cfg.sync.async_outer.match_pace, cfg.simulate.duration_s = True, 180.0
    sim = engine.Simulation(params.resolve(cfg), 0)
    m = sim.run()
    assert sim.pushes_at == {0: [30.0, 60.0, 90.0, 120.0, 150.0, 180.0], 1: [60.0, 90.0, 120.0, 150.0, 180.0]}, dict(sim.pushes_at)
    assert (m.final_step, m.wait, m.goodput, m.lost) == (180, 0.0, 1.0, {})
    # Without it, cluster 1 pushes every 30 of its steps: every 60 s.
    cfg.sync.async_outer.match_pace = False
    plain = engine.Simulation(params.resolve(cfg), 0)
    plain.run()
    assert plain.pushes_at[1] == [60.0, 120.0, 180.0], dict(plain.pushes_at)
    # Beyond the staleness bound: cluster 1 at a fifth of the speed pushes once, at 150 s,
    # from version 0 when the model is at version 4 or 5 (bound 2): not merged, its 300
    # replica-seconds are discarded; cluster 0's 300 are kept.
    cfg.topology.cluster_speed, cfg.simulate.duration_s, cfg.sync.async_outer.max_staleness = [1.0, 0.2], 150.0, 2
    b = one_run(cfg)
    assert (b.end_s, b.goodput, b.lost, b.wait) == (150.0, 0.5, {"discarded": 300.0}, 0.0)
    cfg.sync.async_outer.enabled = False
    with pytest.raises(ConfigError, match=r"^topology\.cluster_speed: \[1\.0, 0\.5\] — clusters of different speeds need sync\.mode=hier"):
        small("flat", "topology.cluster_speed=[1.0,0.5]")


def overlapped(kills=(), delay: int = 1) -> Config:
    """Free syncs but a WAN of 7.5 s latency (a push: two transfers, 15 s), 1 s steps, H 10 x 3,
    120 s, the asynchronous level with overlapped pushes (``delay``) and staleness bound 4."""
    cfg = free_network(kills=list(kills))
    cfg.links.outer.latency_ms = 7500.0
    cfg.simulate.duration_s = 120.0
    cfg.sync.async_outer.enabled, cfg.sync.async_outer.max_staleness = True, 4
    cfg.sync.outer.delay = delay
    return cfg


def test_an_overlapped_push_hides_behind_the_next_round_as_computed_by_hand():
    """Both clusters push at step 30 (30 s) and train on; the pushes reach the server at
    37.5 s (versions 1 and 2) and the answers are back at 45 s. The apply round (step 40, at
    40 s) waits 5 s for its answer, so each period of 30 steps costs 35 s: pushes at 30, 65,
    100 s, and at 135 s, past the 120 s horizon, the run's last push, blocking (15 s): the end
    at 150 s. Every group computes 120 s and waits 3 x 5 + 15 = 30 s: goodput 480/600 = 0.8.
    Blocking pushes cost the whole 15 s each: pushes at 30, 75, 120 s, end 135 s, goodput
    360/540. Without failures and in steady state 5 of every 35 s are exposed: 30/35."""
    sim = engine.Simulation(params.resolve(overlapped()), 0)
    r = sim.run()
    assert sim.pushes_at == {0: [30.0, 65.0, 100.0, 135.0], 1: [30.0, 65.0, 100.0, 135.0]}, dict(sim.pushes_at)
    assert (r.end_s, r.committed, r.sync, r.wait, r.goodput, r.lost, sim.round_no) == (150.0, 480.0, 120.0, 0.0, 0.8, {}, 8)
    assert r.expected_no_failure_goodput == pytest.approx(30 / 35, rel=1e-12) and r.balance_error < 1e-12
    blocking = engine.Simulation(params.resolve(overlapped(delay=0)), 0)
    b = blocking.run()
    assert blocking.pushes_at == {0: [30.0, 75.0, 120.0], 1: [30.0, 75.0, 120.0]}, dict(blocking.pushes_at)
    assert (b.end_s, b.committed, b.goodput) == (135.0, 360.0, 360 / 540)


@pytest.mark.parametrize("kill, lost, pushes0", [
    # Cluster 0's leader dies at 33 s, before its push reached the server (37.5 s): the
    # upload is lost. Its apply round (step 40) has nothing to wait for; the push's work
    # (2 x 30 s) rides on the next push, at 60 s. Lost: the leader's 3 s of step 31..33.
    ("33:0:0", {"own_work": 3.0}, [30.0, 60.0, 95.0, 130.0]),
    # At 38 s, after the push arrived: merged; the new leader recovers it at the apply round.
    ("38:0:0", {"own_work": 8.0}, [30.0, 65.0, 100.0, 135.0]),
    # The whole cluster at 33 s: the upload and its 2 x 30 s of work go with it.
    ("33:0", {"own_work": 6.0, "discarded": 60.0}, [30.0, 84.0, 119.0]),
    # At 38 s: the push had arrived; its work stays merged.
    ("38:0", {"own_work": 16.0}, [30.0, 89.0, 124.0]),
])
def test_a_leader_or_cluster_lost_with_its_push_in_flight_costs_what_the_model_says(kill, lost, pushes0):
    sim = engine.Simulation(params.resolve(overlapped(kills=[kill])), 0)
    r = sim.run()
    assert r.lost == lost and sim.pushes_at[0] == pushes0, (r.lost, dict(sim.pushes_at))
    assert sim.pushes_at[1] == [30.0, 65.0, 100.0, 135.0] and r.balance_error < 1e-12


def test_a_blocking_push_merged_before_its_leader_died_is_merged_once():
    """overlapped(delay=0): blocking pushes of 15 s (7.5 s each way), grace 0. Both clusters
    push at 30 s; the pushes reach the server at 37.5 s (versions 1 and 2). Cluster 0's
    leader dies at 38 s, mid-push: the round fails, and the global model holds the 2 x 20 s
    of the rounds before it (committed); the round's own 2 x 10 s are lost (the leader's at
    its death, the survivor's rolled back), as chaos.py counts them. The survivor trains the
    round again (38-48 s) and pushes from version 0 again: the server merged a push of
    cluster 0's from version 0 already, so it refuses this one (answered at once, back at
    63 s) and the cluster adopts version 2; the model holds the steps that round trained
    again (the real cluster's step count went back to 20), so they count as committed, and
    no step is discarded there (the processes' ``held_to``). Its next push, at 83 s, is
    version 4 (cluster 1's at 75 s: 3); cluster 1's at 120 s is version 5 and its answer at
    135 s ends the run. Committed: cluster 1's 2 x 90, cluster 0's 40 + 10 + 2 x 20. Before,
    the repeat was merged as a version of its own (6 versions). A whole cluster lost at
    38 s: the server holds its 40 too (before: counted as discarded with the cluster)."""
    sim = engine.Simulation(params.resolve(overlapped(delay=0, kills=["38:0:0"])), 0)
    r = sim.run()
    assert sim.pushes_at == {0: [30.0, 48.0, 83.0, 128.0], 1: [30.0, 75.0, 120.0]}, dict(sim.pushes_at)
    assert (sim.round_no, r.end_s, r.committed, r.steps_run, r.steps_discarded) == (5, 135.0, 270.0, 350, 20)
    assert r.lost == {"own_work": 10.0, "rollback": 10.0} and r.balance_error < 1e-12
    whole = engine.Simulation(params.resolve(overlapped(delay=0, kills=["38:0"])), 0)
    w = whole.run()
    assert (whole.round_no, w.committed, w.lost) == (5, 280.0, {"own_work": 10.0, "rollback": 10.0})
    assert whole.pushes_at[0] == [30.0, 89.0, 134.0] and w.balance_error < 1e-12


def test_the_servers_grace_window_merges_pushes_into_versions_as_computed_by_hand():
    """The server's grace window (sync/global_server.py; batches.py), 1 s steps, H 10 x 3, 120 s,
    free syncs. Equal speeds: both clusters push at 30, 60, 90 and 120 s; each pair closes as
    one batch, so 4 versions where grace 0 makes 8, at the same times. Cluster 1 at half
    speed, grace 4 s: cluster 0's push at 30 s waits for cluster 1, not heard yet, until a
    tenth of its own 30 s period (33 s; version 1). Cluster 1's push at 60 s waits for
    cluster 0, expected at its last push plus its period (60 s), up to min(4, 6) s: cluster
    0 comes at 63 s and both close as version 2 (cluster 1 waited 3 s). At 93 s cluster 1
    is expected at 60 + 60 = 120 s, after the window: version 3 at once. At 123 s both push
    together: version 4. Sync: 2 groups x (3 + 3) s = 12. With min_clusters 2 a lone push
    waits out its window (93 -> 96 s), and so does cluster 1's at 123 s (until 126 s, when
    cluster 0 comes): 24."""
    cfg = free_network()
    cfg.simulate.duration_s = 120.0
    cfg.sync.async_outer.enabled, cfg.sync.async_outer.max_staleness = True, 4
    versions = {}
    for grace in (0.0, 2.0):
        cfg.sync.async_outer.grace_s = grace
        sim = engine.Simulation(params.resolve(cfg), 0)
        r = sim.run()
        assert sim.pushes_at == {0: [30.0, 60.0, 90.0, 120.0], 1: [30.0, 60.0, 90.0, 120.0]}, dict(sim.pushes_at)
        assert (r.sync, r.goodput) == (0.0, 1.0)
        versions[grace] = sim.round_no
    assert versions == {0.0: 8, 2.0: 4}
    cfg.topology.cluster_speed, cfg.sync.async_outer.grace_s = [1.0, 0.5], 4.0
    for min_clusters, pushes0, pushes1, sync, end in ((1, [30.0, 63.0, 93.0, 123.0], [60.0, 123.0], 12.0, 123.0),
                                                      (2, [30.0, 63.0, 93.0, 126.0], [60.0, 123.0], 24.0, 126.0)):
        cfg.sync.async_outer.min_clusters = min_clusters
        sim = engine.Simulation(params.resolve(cfg), 0)
        r = sim.run()
        assert sim.pushes_at == {0: pushes0, 1: pushes1}, (min_clusters, dict(sim.pushes_at))
        assert (sim.round_no, r.sync, r.end_s, r.committed, r.lost) == (4, sync, end, 480.0, {}), min_clusters
        assert r.balance_error < 1e-12


def test_an_overlapped_push_waits_in_its_batch_no_longer_than_its_clusters_training():
    """overlapped(): pushes of 15 s (7.5 s each way), the apply round 10 steps (10 s) after a
    push. Equal speeds, grace 2 s: both pushes reach the server together and close as one
    version, at the times of test_an_overlapped_push_hides_behind_the_next_round_as_computed_by_hand
    (4 versions, not 8). Cluster 1 at half speed: cluster 0's first push (out at 30 s, at the
    server at 37.5 s) waits for cluster 1, not heard yet: with grace 2 s until 39.5 s, back
    at 47 s, so its apply round (40 s) waits 7 s and its next push is at step 60, 67 s; with
    grace 20 s only until 47.5 s, when its answer must leave for its apply round (37.5 + 10 s
    of training): back at 55 s, next push at 75 s."""
    cfg = overlapped()
    cfg.sync.async_outer.grace_s = 2.0
    sim = engine.Simulation(params.resolve(cfg), 0)
    r = sim.run()
    assert sim.pushes_at == {0: [30.0, 65.0, 100.0, 135.0], 1: [30.0, 65.0, 100.0, 135.0]}, dict(sim.pushes_at)
    assert (r.end_s, r.committed, r.goodput, sim.round_no) == (150.0, 480.0, 0.8, 4)
    cfg.topology.cluster_speed = [1.0, 0.5]
    for grace, second in ((2.0, 67.0), (20.0, 75.0)):
        cfg.sync.async_outer.grace_s = grace
        sim = engine.Simulation(params.resolve(cfg), 0)
        r = sim.run()
        assert sim.pushes_at[0][:2] == [30.0, second], (grace, dict(sim.pushes_at))
        assert r.balance_error < 1e-12


def test_overlapped_pushes_conserve_time_under_every_failure_kind():
    for extra in ([], ["sync.async_outer.match_pace=true", "topology.cluster_speed=[1.0,0.5]"]):
        cfg = small("hier", "timeouts.local_step=20", "timeouts.watchdog_grace=5", "sync.async_outer.enabled=true", "sync.outer.delay=1", *extra,
                    failures=FailureConfig(model="independent", mtbf_s=60.0, cluster_mtbf_s=300.0, hang_fraction=0.3, restart_s=6.0, reconfigure_s=0.5),
                    duration_s=600.0, step_jitter=0.05)
        r = one_run(cfg, 1)
        assert r.balance_error < 1e-9 and 0.0 < r.goodput < r.expected_no_failure_goodput and len(r.failures) > 20
