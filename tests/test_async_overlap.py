"""Overlapped pushes of the asynchronous outer level (``sync.async_outer.enabled`` with
``sync.outer.delay=1``, sync/async_outer.py): the push runs behind training and its answer
is merged at the cluster's next round; the tokens of the steps since the push stay counted."""

from __future__ import annotations

import pytest

from hier_localsgd.config import ConfigError, load_config


def test_an_overlapped_push_sets_its_tokens_aside_and_they_count_again_if_it_is_not_applied():
    """AsyncOuter's bookkeeping, by hand: the launch sets aside what the push carried; a
    merged answer keeps the tokens of the steps since the push (the next push carries
    them) and takes the schedule from the push's step; an apply round without an answer
    counts the set-aside tokens again; the state heals with the launch."""
    from datetime import timedelta
    from types import SimpleNamespace

    from hier_localsgd.sync.async_outer import AsyncOuter, AsyncOuterSettings
    tracker = SimpleNamespace(set_extra=lambda **kw: None)
    st = SimpleNamespace(counters=SimpleNamespace(step=0), settings=SimpleNamespace(h_inner=10, h_outer=3), tracker=tracker)
    a = AsyncOuter(st, AsyncOuterSettings(url="http://127.0.0.1:1", key=None, grace=timedelta(seconds=1), match_pace=True), None)
    for step in (10, 20, 30):  # three rounds of 2 groups x 10 steps
        a.note_work(2.0, step)
        a.round_ended(True, step)
    assert a.tokens == 60.0 and not a.is_apply_round(30)
    a.launch(30)  # the push at step 30 carried the 60 group-steps
    assert (a.tokens, a.sent, a.launched) == (0.0, 60.0, 30) and a.is_apply_round(40) and not a.is_apply_round(30)
    healed = AsyncOuter(st, AsyncOuterSettings(url="http://127.0.0.1:1", key=None, grace=timedelta(seconds=1)), None)
    healed.load_state_dict(a.state_dict())
    assert (healed.sent, healed.launched) == (60.0, 30)

    # The apply round at 40: the answer merged; its push_in counts from the push (30 + 17 = 47),
    # but no round is shorter than half of H_inner (12: 30 + 12 = 42 < 40 + 5).
    other = AsyncOuter(st, AsyncOuterSettings(url="http://127.0.0.1:1", key=None, grace=timedelta(seconds=1)), None)
    other.load_state_dict(a.state_dict())
    other.adopted(step=40, push_in=17, merge=True)
    assert (other.period, other.due) == (17, 47)
    a.note_work(2.0, 40)
    a.adopted(step=40, push_in=12, merge=True)
    a.round_ended(True, 40)
    assert (a.tokens, a.sent, a.launched) == (20.0, 0.0, -1)  # the 20 group-steps since the push stay for the next one
    assert (a.period, a.due) == (12, 45)

    # The same apply round without an answer (dropped, or the server did not answer): counted again.
    healed.note_work(2.0, 40)
    healed.round_ended(True, 40)
    assert (healed.tokens, healed.sent, healed.launched) == (60.0 + 20.0, 0.0, -1)

    # A blocking adoption (the last push) clears everything.
    a.launch(50)
    a.adopted(step=55, push_in=0)
    assert (a.tokens, a.sent, a.launched) == (0.0, 0.0, -1)


def test_an_overlapped_push_tells_the_server_the_fewest_steps_to_its_next_push_from_its_apply_round():
    """match_pace's floor (the request's ``min_steps``), by hand. H_inner 10, full period 30,
    half a round 5. A blocking push: 5. An overlapped push at step 76 on a schedule of pushes
    every 16 steps from 76: the grid rounds at 80 and 90 fall within 5 steps of a push step
    (left out), so its apply round is the push step 92 and its next push comes at 97 at the
    earliest: 21 steps. On the default schedule (every 30 from 30) a push at 60 is applied at
    the grid round 70: 15. Clamped to the full period (the server's bound)."""
    from datetime import timedelta
    from types import SimpleNamespace

    from hier_localsgd.sync.async_outer import AsyncOuter, AsyncOuterSettings
    st = SimpleNamespace(counters=SimpleNamespace(step=0), settings=SimpleNamespace(h_inner=10, h_outer=3),
                         tracker=SimpleNamespace(set_extra=lambda **kw: None))
    a = AsyncOuter(st, AsyncOuterSettings(url="http://127.0.0.1:1", key=None, grace=timedelta(seconds=1), match_pace=True), None)
    assert (a.floor_for(60, overlap=False), a.floor_for(60, overlap=True), a.apply_in(60)) == (5, 15, 10)
    a.due, a.period = 76, 16
    assert (a.floor_for(76, overlap=False), a.floor_for(76, overlap=True), a.apply_in(76)) == (5, 21, 16)
    st.settings.h_outer = 1  # a full period of 10: a push at 10 applied at 20 could push at 25 at the earliest
    b = AsyncOuter(st, AsyncOuterSettings(url="http://127.0.0.1:1", key=None, grace=timedelta(seconds=1), match_pace=True), None)
    assert b.floor_for(10, overlap=True) == 10


@pytest.mark.parametrize("extra, field", [
    (["sync.outer.delay=2"], "sync.async_outer.enabled: not combined with sync.outer.delay=2"),
    (["sync.outer.delay=1", "sync.outer.eager=true"], "sync.async_outer.enabled: not combined with sync.outer.eager"),
])
def test_overlaps_the_asynchronous_level_does_not_run_are_one_line_naming_the_field(extra, field):
    with pytest.raises(ConfigError) as e:
        load_config(["sync.async_outer.enabled=true", *extra], validate_for="train")
    assert str(e.value).startswith(field), str(e.value)
    load_config(["sync.async_outer.enabled=true", "sync.outer.delay=1"], validate_for="train")  # the one it runs


ALL = [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.slow
def test_overlapped_pushes_merge_at_the_next_round_count_every_step_once_and_end_on_one_model(tmp_path):
    """2 x 2, asynchronous, sync.outer.delay=1, pushes every 10 steps, 55 steps: each push
    (launched behind training, an ``outer_launch`` event) is merged into both members of
    its cluster at the next round (5 steps later), the last push (step 55) first takes the
    answer still in flight from step 50 (its apply round is the last round), every group
    ends on the job's final version, and the tokens a cluster's pushes carried add up to
    the group-steps its inner rounds committed (nothing lost or counted twice by the overlap)."""
    from harness import logs_tail, run_job

    run = run_job(tmp_path, ["sync.async_outer.enabled=true", "sync.outer.delay=1", "train.steps=55", "sync.inner.every=5",
                             "sync.outer.every=2", "train.min_step_time_s=0.05"], timeout_s=300)
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    done = {k: run.kinds(k, "async_final", state="done") for k in ALL}
    assert all(len(v) == 1 for v in done.values()) and len({v[0]["outer_round"] for v in done.values()}) == 1, done
    assert run.summary["consistent"] is True
    crcs: dict = {}
    for c in (0, 1):
        members = [(c, 0), (c, 1)]
        launches = sorted(e["step"] for k in members for e in run.kinds(k, "outer_launch", asynchronous=True))
        assert launches == [10, 20, 30, 40, 50], launches  # the leader's; none at the last step (blocking)
        pushes = [e for k in members for e in run.kinds(k, "commit", level="outer") if "base" in e]
        assert sorted(e["step"] for e in pushes) == [10, 20, 30, 40, 50, 55], pushes
        for k in members:  # merged at the next round: inner commits that carried the outer level
            merged = sorted({e["step"] for e in run.kinds(k, "commit", level="inner") if e["outer"]})
            assert [15, 25, 35, 45] == [s for s in merged if s < 55], (k, merged)
        steps = {k: [0] + [e["step"] for e in run.kinds(k, "commit", level="inner") if not e.get("join")] for k in members}
        work = sum(e["total_weight"] * (e["step"] - prev) for e, prev in
                   zip(run.kinds((c, 0), "commit", level="inner"), steps[(c, 0)]))
        assert sum(e["tokens"] for e in pushes) == pytest.approx(work), (pushes, work)
        # Heal evidence (chaos_evidence.py): an overlapped push's answer is pending when it
        # comes, and its checksum is written when the apply round adopts it.
        assert all(e.get("pending") and "checksum" not in e for e in pushes if e["step"] < 55), pushes
        assert all(e.get("checksum") for e in pushes if e["step"] == 55), pushes  # blocking: adopted at once
        adopts = [e for k in members for e in run.kinds(k, "adopt", level="outer")]
        assert sorted(e["step"] for e in adopts) == [15, 25, 35, 45], adopts
        for e in adopts:
            crcs.setdefault(e["outer_round"], set()).add(e["checksum"])
    assert all(len(v) == 1 for v in crcs.values()), crcs  # one model per version, whichever cluster adopted it


def test_an_overlapped_push_waits_for_the_other_cluster_up_to_grace_not_a_share_of_its_period():
    """The server's window: a blocking push waits at most a tenth of its cluster's period
    (it holds its cluster), an overlapped one up to ``grace_s`` (its cluster trains on),
    but not past its apply round (``free_s``: its cluster's training until then).
    Cluster 1 has never pushed, so it may come and the batch waits for it to the window's end:
    with a 1 s period, 0.1 s blocking, 4 s overlapped, 1.5 s overlapped with 1.5 s free
    (wide margins on every side)."""
    from hier_localsgd.core.tensors.level import LevelAlgorithm
    from hier_localsgd.sync.global_server import GlobalModelServer
    from hier_localsgd.sync.global_wire import call
    import time
    import torch

    alg = LevelAlgorithm.build("diloco", lr=0.7, momentum=0.9, nesterov=True)
    waited = {}
    for overlap, free in ((False, None), (True, None), (True, 1.5)):
        srv = GlobalModelServer("127.0.0.1", 0, algorithm=alg, full_tokens=10, max_staleness=4, clusters=2, grace_s=4.0,
                                min_clusters=1, final_wait_s=30.0, key=b"k" * 32)
        try:
            t0 = time.time()
            ans = call(f"http://127.0.0.1:{srv.port}", "/push", {
                "cluster": 0, "base": 0, "tokens": 10.0, "final": False, "period_s": 1.0, "period_steps": 10, "overlap": overlap,
                "free_s": free, "delta": torch.ones(2), "model": torch.zeros(2)}, b"k" * 32, 30.0)
            waited[overlap, free] = time.time() - t0
            assert ans["version"] == 1 and ans["weight"] == 1.0, ans
        finally:
            srv.shutdown()
    assert waited[False, None] < 3.0 and waited[True, None] >= 3.9 and 1.4 <= waited[True, 1.5] < 3.0, waited


@pytest.mark.slow
def test_a_leader_dying_with_its_overlapped_push_in_flight_hands_its_merged_work_to_the_cluster_and_the_job_ends_on_one_model(tmp_path):
    """c0r0 exits in BROADCAST at step 25, the apply round of its push from step 20 (merged
    by the server, never applied by its cluster): the round rolls back, the push stays in
    flight, and c0r1, now the leader, has no answer of its own at the next round (step 30). It asks the server, which
    merged a push of cluster 0 from the cluster's base: c0r1 merges the newest version as
    that push's answer (a ``recovered`` event), so neither the push's work nor the steps
    since it are lost (before, the round dropped the push and the next one, from the same
    version, was refused as a repeat with the steps since the first); the job ends on one
    model."""
    from harness import logs_tail, run_job

    run = run_job(tmp_path, ["sync.async_outer.enabled=true", "sync.outer.delay=1", "train.steps=60", "sync.inner.every=5",
                             "sync.outer.every=2", "train.min_step_time_s=0.05",
                             "faults=[{cluster:0,replica:0,step:25,action:exit,phase:BROADCAST}]"], restart=True, timeout_s=300)
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    assert [h["code"] for h in run.job.history if h["event"] == "exit" and h["key"] == (0, 0)][0] == 17
    # The push from step 20: its base is the version c0r0 launched it from. Its answer (a
    # ``commit`` event on c0r0's stage) may come after the exit at step 25 when cluster 1's
    # push is late to the batch; where it came first, it says the server merged it.
    (launch,) = [e for e in run.kinds((0, 0), "outer_launch") if e["step"] == 20]
    first = {"base": launch["outer_round"], "outer_round": launch["outer_round"] + 1}
    for e in run.kinds((0, 0), "commit", level="outer"):
        if "base" in e and e["step"] == 20:
            assert e["base"] == first["base"] and e["weight"] > 0, e  # merged by the server before the leader died
            first = e
    (rec,) = run.kinds((0, 1), "recovered")  # the server says it merged a push of cluster 0 from that base
    assert (rec["step"], rec["base"]) == (20, first["base"]) and rec["outer_round"] >= first["outer_round"], (first, rec)
    merged = [e["step"] for e in run.kinds((0, 1), "commit", level="inner") if e["outer"] and e["t"] > rec["t"]]
    assert merged and merged[0] == 30, merged  # the next round (a rolled-back one is not rerun) merged the global model
    pushes = [e for e in run.kinds((0, 1), "commit", level="outer") if "base" in e]
    assert pushes and all(e["base"] != first["base"] for e in pushes), (first, pushes)  # no repeat from that version
    log = (run.job.run_dir / "logs" / "lighthouse_global.log").read_text()
    assert "not merged twice" not in log, log[-3000:]
    assert not [e for e in run.kinds((0, 1), "discard") if e["level"] == "outer"], run.kinds((0, 1), "discard")
    survivors = [(0, 1), (1, 0), (1, 1)]
    done = {k: run.kinds(k, "async_final", state="done") for k in survivors}
    assert all(len(v) == 1 for v in done.values()) and len({v[0]["outer_round"] for v in done.values()}) == 1, done
    sums = run.summary["checksums"]
    assert len({sums[f"c{c}r{r}"] for c, r in survivors}) == 1, sums


@pytest.mark.slow
def test_with_matched_paces_an_overlapped_cluster_pushes_when_its_merged_answer_says(tmp_path):
    """2 x 2, cluster 1 at half speed, match_pace, overlapped pushes: after each push whose
    answer merged at the next round, the cluster's next push comes ``push_in`` steps after
    that push, or half an inner round after the merge if that is later (the server times an
    overlapped cluster from its push, async_outer.py ``adopted``), never at a step the
    previous schedule had put earlier; every member follows one schedule; one model at the end."""
    from harness import logs_tail, run_job

    run = run_job(tmp_path, ["sync.async_outer.enabled=true", "sync.async_outer.match_pace=true", "sync.outer.delay=1",
                             "train.steps=120", "sync.inner.every=6", "sync.outer.every=4", "train.min_step_time_s=0.1",
                             "topology.cluster_speed=[1.0,0.5]"], timeout_s=400)
    assert all(code == 0 for code in run.codes.values()), logs_tail(run)
    done = {k: run.kinds(k, "async_final", state="done") for k in ALL}
    assert all(len(v) == 1 for v in done.values()) and len({v[0]["outer_round"] for v in done.values()}) == 1, done
    checked = 0
    for c in (0, 1):
        pushes = sorted((e["step"], e["push_in"]) for k in ((c, 0), (c, 1)) for e in run.kinds(k, "commit", level="outer")
                        if "base" in e and e["weight"] > 0)
        merges = {k: sorted({e["step"] for e in run.kinds(k, "commit", level="inner") if e["outer"]}) for k in ((c, 0), (c, 1))}
        assert merges[(c, 0)] == merges[(c, 1)], merges  # one schedule per cluster
        for (p, n), (p2, _) in zip(pushes, pushes[1:]):
            applied = [m for m in merges[(c, 0)] if p < m <= p2]
            if applied and p2 < 120:
                assert p2 == max(p + n, applied[0] + 3), (c, p, n, applied[0], p2, pushes)
                checked += 1
    assert checked >= 4, checked
