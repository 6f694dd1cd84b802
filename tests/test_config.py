"""Bad configuration fails fast, naming the field or address (through the real CLI too)."""

import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from hier_localsgd.config import ConfigError, load_config
from hier_localsgd.core.runtime.addresses import LighthouseUnreachable, probe_lighthouse


@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["sync.inner.algorithm=adam"], "sync.inner.algorithm", "unknown algorithm 'adam'"),
        (["sync.outer.algorithm=foo"], "sync.outer.algorithm", "unknown algorithm 'foo'"),
        (["sync.inner.every=0"], "sync.inner.every", "H must be at least 1"),
        (["sync.outer.every=-3"], "sync.outer.every", "H must be at least 1"),
        (["topology.clusters=0"], "topology.clusters", "empty topology"),
        (["topology.replicas_per_cluster=0"], "topology.replicas_per_cluster", "empty topology"),
        (["sync.mode=ring"], "sync.mode", "unknown mode"),
        (["lighthouse.global_addr=not-an-address"], "lighthouse.global_addr", "http://host:port"),
        (["lighthouse.cluster_addrs=[http://127.0.0.1:1]"], "lighthouse.cluster_addrs", "one lighthouse per cluster"),
        (["sync.mode=flat", "train.steps=100"], "train.steps", "multiple of sync.flat.every=30"),
        (["train.steps=abc"], "train.steps", "could not be converted"),
        (["data.branching=999"], "data.branching", "must be in"),
        (["run.replica=5"], "run.replica", "must be in"),
        (["faults=[{cluster:0,replica:0,step:1,action:explode}]"], "faults[0].action", "expected one of"),
        (["timeouts.inner_quorum=0"], "timeouts.inner_quorum", "positive"),
        # stale updates (docs/architecture.md): both hierarchy levels, never the flat baseline
        (["sync.inner.max_staleness=-1"], "sync.inner.max_staleness", "at least 0"),
        (["sync.flat.max_staleness=2"], "sync.flat.max_staleness", "only the hierarchy's levels"),
        # streaming fragments and the early inner quorum (#13 §2, §4)
        (["sync.outer.fragments=0"], "sync.outer.fragments", "at least 1"),
        (["sync.outer.fragments=2"], "sync.outer.fragments", "sync.outer.every=3 must be a multiple of it"),
        (["sync.outer.every=6", "sync.outer.fragments=6"], "sync.outer.fragments", "6 > 3 units"),
        (["sync.outer.every=4", "sync.outer.fragments=2", "sync.outer.delay=2", "train.steps=400"], "sync.outer.delay",
         "sync.outer.every/sync.outer.fragments=2"),
        (["sync.mode=flat", "sync.outer.every=4", "sync.outer.fragments=2"], "sync.outer.fragments", "needs sync.mode=hier"),
        (["sync.inner.fragments=2"], "sync.inner.fragments", "only the outer level"),
        (["sync.flat.every=30", "sync.flat.fragments=3", "sync.flat.algorithm=localsgd"], "sync.flat.fragments", "DiLoCo only"),
        (["sync.mode=hier", "sync.flat.every=30", "sync.flat.fragments=3"], "sync.flat.fragments", "needs sync.mode=flat"),
        (["sync.mode=flat", "model=tiny", "sync.flat.every=40", "sync.flat.fragments=4", "train.steps=400"], "sync.flat.fragments", "4 > 3 units"),
        (["sync.outer.early_quorum=true"], "sync.outer.early_quorum", "only the inner level"),
        # eager updates (#29 §2): an overlapped outer level only
        (["sync.outer.eager=true"], "sync.outer.eager", "sync.outer.delay > 0"),
        (["sync.inner.eager=true"], "sync.inner.eager", "sync.outer.delay > 0"),
        (["sync.inner.auto=true"], "sync.inner.auto", "only the outer level"),
        (["sync.mode=flat", "sync.outer.auto=true"], "sync.outer.auto", "needs sync.mode=hier"),
        (["topology.clusters=1", "sync.min_clusters=1", "sync.outer.auto=true"], "sync.outer.auto", "topology.clusters >= 2"),
        # what a failed inner round keeps
        (["sync.failed_round=forget"], "sync.failed_round", "unknown policy 'forget'"),
        (["sync.mode=flat", "sync.failed_round=keep_local"], "sync.failed_round", "needs sync.mode=hier"),
        (["topology.ranks_per_replica=2", "sync.failed_round=keep_local"], "sync.failed_round", "topology.ranks_per_replica=1"),
        # heterogeneous clusters: one speed each, in (0, 1]
        (["topology.cluster_speed=[1.0]"], "topology.cluster_speed", "one speed per cluster (topology.clusters=2)"),
        (["topology.cluster_speed=[1.0,0]"], "topology.cluster_speed", "cluster 1's 0.0 must be a number in (0, 1]"),
        (["topology.cluster_speed=[1.5,1.0]"], "topology.cluster_speed", "cluster 0's 1.5 must be a number in (0, 1]"),
        (["topology.cluster_speed=[1.0,fast]"], "topology.cluster_speed[1]", "'fast' of type 'str' could not be converted to Float"),
        (["topology.cluster_speed=[1.0,nan]"], "topology.cluster_speed", "cluster 1's nan must be"),
    ],
)
def test_bad_values_name_the_field(overrides, field, words):
    with pytest.raises(ConfigError) as e:
        load_config(["model=tiny", *overrides])
    msg = str(e.value)
    assert msg.startswith(field), msg
    assert words in msg, msg


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match="nosuchkey"):
        load_config(["nosuchkey=1"])


def test_every_value_can_be_overridden():
    cfg = load_config(["model=tiny", "topology.clusters=3", "lighthouse.cluster_addrs=[http://h:1,http://h:2,http://h:3]", "sync.inner.every=7", "train.steps=63", "timeouts.broadcast=5",
                       "run.hostname=10.0.0.5"])  # lighthouses on other hosts: this process's own address (config._check_hostname)
    assert (cfg.topology.clusters, cfg.sync.inner.every, cfg.train.steps) == (3, 7, 63)
    assert cfg.timeouts_obj().broadcast == timedelta(seconds=5)
    assert cfg.timeouts_obj().broadcast_wait == timedelta(seconds=cfg.timeouts.outer_quorum + cfg.timeouts.outer_reduce + cfg.timeouts.outer_commit + 5)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_lighthouse_fails_within_the_timeout_naming_field_and_address():
    addr = f"http://127.0.0.1:{_closed_port()}"
    t0 = time.time()
    with pytest.raises(LighthouseUnreachable) as e:
        probe_lighthouse("lighthouse.cluster_addrs[1]", addr, timedelta(seconds=2))
    assert 1.5 < time.time() - t0 < 3.5  # retried a refused connection until timeouts.connect
    assert "lighthouse.cluster_addrs[1]" in str(e.value) and addr in str(e.value)


def test_probe_waits_for_a_lighthouse_that_starts_late():
    port = _closed_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    timer = threading.Timer(1.0, lambda: (listener.bind(("127.0.0.1", port)), listener.listen()))
    timer.start()
    try:
        t0 = time.time()
        probe_lighthouse("lighthouse.global_addr", f"http://127.0.0.1:{port}", timedelta(seconds=10))
        assert 0.9 < time.time() - t0 < 5
    finally:
        timer.join()
        listener.close()


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hier_localsgd", *args], capture_output=True, text=True, timeout=timeout)


def test_a_bench_arm_the_workload_cannot_run_fails_before_anything_starts(tmp_path):
    """bench.mode=quick has H_outer = 2: two fragments leave no inner round to overlap."""
    p = run_cli("bench", "bench.mode=quick", "bench.arms=[hier,hier_overlap_int8_frag2]", f"run.dir={tmp_path}")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "bench.arms: 'hier_overlap_int8_frag2' cannot run" in lines[0] and "sync.outer.delay" in lines[0], lines[0]
    assert not (tmp_path / "bench" / "runs").exists()  # no arm started


def test_cli_config_error_exits_2_with_the_field():
    p = run_cli("train", "model=tiny", "sync.inner.algorithm=adam")
    assert p.returncode == 2
    assert "sync.inner.algorithm: unknown algorithm 'adam'" in p.stderr


def test_cli_train_with_unreachable_lighthouse_exits_nonzero_naming_address(tmp_path):
    g, c0, c1 = (f"http://127.0.0.1:{_closed_port()}" for _ in range(3))
    t0 = time.time()
    p = run_cli(
        "train", "model=tiny", f"run.dir={tmp_path}", f"lighthouse.global_addr={g}",
        f"lighthouse.cluster_addrs=[{c0},{c1}]", "run.cluster=1", "timeouts.connect=2",
    )
    assert p.returncode == 1, p.stderr[-2000:]
    assert f"lighthouse.cluster_addrs[1]={c1}: lighthouse unreachable" in p.stderr
    assert time.time() - t0 < 60


def test_a_new_local_job_archives_the_previous_runs_outputs_and_keeps_checkpoints(tmp_path):
    from hier_localsgd.launch.local import LocalJob

    (tmp_path / "replicas" / "c0r0").mkdir(parents=True)
    (tmp_path / "replicas" / "c0r0" / "events.jsonl").write_text('{"kind": "old"}\n')
    (tmp_path / "job_events.jsonl").write_text("old\n")
    (tmp_path / "checkpoints").mkdir()
    cfg = load_config(["model=tiny", f"run.dir={tmp_path}"])
    LocalJob(cfg, [], free_ports=True)
    archived = list((tmp_path / "previous").iterdir())
    assert len(archived) == 1
    assert (archived[0] / "replicas" / "c0r0" / "events.jsonl").read_text() == '{"kind": "old"}\n'
    assert (archived[0] / "job_events.jsonl").read_text() == "old\n"
    assert not (tmp_path / "replicas").exists() and (tmp_path / "checkpoints").exists()
    # resuming continues in place: nothing moves
    (tmp_path / "replicas").mkdir()
    LocalJob(load_config(["model=tiny", f"run.dir={tmp_path}", "checkpoint.resume=true"]), [], free_ports=True)
    assert (tmp_path / "replicas").exists() and len(list((tmp_path / "previous").iterdir())) == 1


def test_run_netns_where_namespaces_are_unavailable_fails_in_one_line_naming_the_field(monkeypatch):
    from hier_localsgd.launch import netns
    monkeypatch.setattr(netns, "available", lambda: "network namespaces need root (running as uid 1000)")
    for command in ("demo", "chaos"):
        with pytest.raises(ConfigError) as e:
            load_config(["model=tiny", "run.netns=true"], validate_for=command)
        assert str(e.value) == "run.netns: network namespaces are unavailable here: network namespaces need root (running as uid 1000)"
    # The processes a job starts inside the namespaces do not check (they create nothing).
    assert load_config(["model=tiny", "run.netns=true"], validate_for="train").run.netns is True


def test_configs_yaml_and_the_dataclass_defaults_agree():
    """configs/config.yaml restates defaults for readers; a Config built in Python (tests,
    tools) must be the same one the CLI loads, or the two drift apart unseen."""
    from dataclasses import asdict

    from hier_localsgd.config import Config, load_config

    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out

    loaded, built = flat(asdict(load_config([]))), flat(asdict(Config()))
    assert len(loaded) > 100  # the walk reached the nested sections
    assert {k: (loaded.get(k), built.get(k)) for k in set(loaded) | set(built) if loaded.get(k) != built.get(k)} == {}


def test_a_lighthouse_and_a_configuration_check_import_no_torch(tmp_path):
    """Composing and checking a configuration (every command does, a lighthouse too) and
    serving lighthouses import neither torch nor torchft's Python package: a lighthouse is
    up in a fraction of a second instead of after seconds of imports (core/runtime/choices.py,
    launch/lighthouse.py lighthouse_server_type). A fresh interpreter, since this one has torch."""
    code = f"""
import socket, sys
from hier_localsgd.config import load_config
from hier_localsgd.launch.lighthouse import start
common = ["lighthouse.serve=all", "lighthouse.global_addr=http://127.0.0.1:0",
          "lighthouse.cluster_addrs=[http://127.0.0.1:0,http://127.0.0.1:0]", "train.device=auto", "run.dir={tmp_path}"]
for extra in (["sync.outer.compression=topk2", "group.parallel=dp"],
              ["sync.outer.compression=int8", "sync.outer.every=2", "sync.outer.fragments=2"],
              ["sync.outer.compression=fp8", "train.backends.inner=nccl"]):  # nccl: cuda is for elsewhere
    cfg = load_config([*common, *extra], validate_for="lighthouse")
servers = start(cfg)
for s in servers:  # each accepts connections
    socket.create_connection(("127.0.0.1", int(s.address().rsplit(":", 1)[1])), timeout=5).close()
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.") or m == "torchft")
for s in servers:
    s.shutdown()
print(len(servers), loaded[:3])  # the first few, if any
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "3 []", out.stdout
