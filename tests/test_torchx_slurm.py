"""Launch beyond hand launch: the TorchX component and the Slurm sbatch example.

The component's roles are checked as data, through TorchX's own component loader
(``torchx run --dryrun``), and by a real ``torchx run -s local_cwd`` job. The sbatch
script runs under stand-in ``scontrol``/``srun`` commands that record what Slurm
would start and run each replica task's command with its ``SLURM_PROCID``.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hier_localsgd.launch.torchx_component import hier, job_roles

ROOT = Path(__file__).resolve().parent.parent
COMPONENT = ROOT / "hier_localsgd" / "launch" / "torchx_component.py"
SBATCH = ROOT / "launch" / "slurm" / "hier_localsgd.sbatch"


def test_job_roles_one_torchrun_per_replica_group_and_a_lighthouse_role():
    roles = job_roles(2, 2, ranks=2, overrides=["model=tiny", "train.steps=20"])
    assert [r.name for r in roles] == ["lighthouses", "c0r0", "c0r1", "c1r0", "c1r1"]
    lh = roles[0]
    assert lh.args[:5] == ["-m", "hier_localsgd", "lighthouse", "lighthouse.serve=all", "lighthouse.until_done=true"]
    for role in roles[1:]:
        c, r = int(role.name[1]), int(role.name[3])
        a = role.args
        assert a[:2] == ["-m", "torch.distributed.run"] and "--nproc-per-node=2" in a and "--max-restarts=10" in a
        assert "--local-ranks-filter=0" in a  # console shows group rank 0
        train = a[a.index("hier_localsgd") - 1:]
        assert train[:3] == ["-m", "hier_localsgd", "train"]
        assert f"run.cluster={c}" in train and f"run.replica={r}" in train
        assert "topology.ranks_per_replica=2" in train and "model=tiny" in train
        assert "lighthouse.cluster_addrs=[http://localhost:29511,http://localhost:29512]" in train


def test_job_roles_external_lighthouses_and_one_rank():
    roles = job_roles(1, 3, overrides=[], global_addr="http://coord:29510", cluster_addrs=["http://a:29511"], serve_lighthouses=False)
    assert [r.name for r in roles] == ["c0r0", "c0r1", "c0r2"]
    assert "--nproc-per-node=1" in roles[0].args and "--local-ranks-filter=0" not in roles[0].args
    assert "lighthouse.global_addr='http://coord:29510'" in roles[0].args


@pytest.mark.parametrize("kwargs, field", [
    (dict(clusters=0, replicas=1), "clusters"),
    (dict(clusters=1, replicas=1, ranks=0), "ranks"),
    (dict(clusters=2, replicas=1, cluster_addrs=["http://a:1"]), "cluster_addrs"),
    (dict(clusters=1, replicas=1, overrides=["topology.clusters=3"]), "overrides"),
    (dict(clusters=1, replicas=1, max_restarts=-1), "max_restarts"),
])
def test_job_roles_rejects_bad_arguments_naming_them(kwargs, field):
    with pytest.raises(ValueError) as e:
        job_roles(**kwargs)
    assert str(e.value).startswith(f"{field}:")


def test_hier_builds_a_torchx_appdef():
    import torchx.specs as specs

    app = hier("model=tiny", clusters=1, replicas=2, ranks=1, cpu=3, memMB=2048)
    assert isinstance(app, specs.AppDef)
    assert [r.name for r in app.roles] == ["lighthouses", "c0r0", "c0r1"]
    assert app.roles[1].resource.cpu == 3 and app.roles[1].resource.memMB == 2048
    assert app.roles[1].entrypoint == sys.executable and "model=tiny" in app.roles[1].args


def torchx_cli() -> str:
    exe = shutil.which("torchx") or str(Path(sys.executable).parent / "torchx")
    assert Path(exe).exists(), "torchx CLI missing: pip install -e '.[dev]' installs it"
    return exe


def test_torchx_loads_the_component_file():
    p = subprocess.run(
        [torchx_cli(), "run", "-s", "local_cwd", "--dryrun", f"{COMPONENT}:hier", "--clusters", "1", "--replicas", "2", "--", "model=tiny"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "'c0r1'" in out and "run.replica=1" in out and "lighthouse.until_done=true" in out


@pytest.mark.slow
def test_torchx_local_job_trains_to_the_end(tmp_path):
    """A real TorchX job: lighthouses + 2 replica groups; the app ends when training does."""
    run_dir = tmp_path / "run"
    ports = [str(p) for p in _free_ports(2)]
    p = subprocess.run(
        [torchx_cli(), "run", "-s", "local_cwd", "-cfg", f"log_dir={tmp_path / 'torchx'}", f"{COMPONENT}:hier",
         "--clusters", "1", "--replicas", "2", "--max_restarts", "1",
         "--global_addr", f"http://127.0.0.1:{ports[0]}", "--cluster_addrs", f"http://127.0.0.1:{ports[1]}",
         "--", "model=tiny", "train.steps=40", "sync.inner.every=5", "sync.outer.every=2", "sync.min_clusters=1", f"run.dir={run_dir}", "train.eval_every=0"],
        capture_output=True, text=True, timeout=420, cwd=ROOT, env=dict(os.environ, RUST_LOG="warn"),
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    results = [json.loads((run_dir / "replicas" / f"c0r{r}" / "result.json").read_text()) for r in range(2)]
    assert [res["steps"] for res in results] == [40, 40]
    assert results[0]["checksum"] == results[1]["checksum"]  # both ended on the cluster's committed model
    assert "every replica group served here finished" in p.stdout + p.stderr


def _free_ports(n: int):
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


FAKE_SRUN = r'''#!/usr/bin/env python3
"""Stand-in srun: records the step; runs a replica step's command once per task."""
import json, os, subprocess, sys
args, opts = sys.argv[1:], []
while args and args[0].startswith("-"):
    opt = args.pop(0)
    opts.append(opt if "=" in opt or opt == "--overlap" else f"{opt}={args.pop(0)}")
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"srun": opts, "cmd": args}) + "\n")
ntasks = int(dict(o.split("=", 1) for o in opts if "=" in o).get("--ntasks", "1"))
if args[0] == "bash":
    for i in range(ntasks):
        subprocess.run(args, env=dict(os.environ, SLURM_PROCID=str(i)), check=True)
'''

FAKE_SCRIPT = r'''#!/usr/bin/env bash
python3 -c 'import json, os, sys; open(os.environ["FAKE_LOG"], "a").write(json.dumps({"script": sys.argv[1], "args": sys.argv[2:]}) + "\n")' "$(basename "$0")" "$@"
'''


def run_sbatch(tmp_path: Path, nodes, *overrides: str, **env: str):
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    (work / "launch").mkdir(parents=True)
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\n" + "".join(f"echo {n}\n" for n in nodes))
    (bin_dir / "srun").write_text(FAKE_SRUN)
    for name in ("replica.sh", "lighthouses.sh"):
        (work / "launch" / name).write_text(FAKE_SCRIPT)
    for f in [bin_dir / "scontrol", bin_dir / "srun", work / "launch" / "replica.sh", work / "launch" / "lighthouses.sh"]:
        f.chmod(0o755)
    log = tmp_path / "log.jsonl"
    e = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), SLURM_SUBMIT_DIR=str(work),
             SLURM_JOB_NODELIST="fake[0-9]", SLURM_JOB_ID="77", LIGHTHOUSE_WAIT_S="0", **env)
    p = subprocess.run(["bash", str(SBATCH), *overrides], capture_output=True, text=True, timeout=60, env=e)
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return p, lines


def test_sbatch_places_lighthouses_and_one_replica_group_per_node(tmp_path):
    p, log = run_sbatch(tmp_path, ["n0", "n1", "n2", "n3"], "model=tiny", RANKS="2")
    assert p.returncode == 0, p.stderr
    steps = [x for x in log if "srun" in x]
    lighthouse_steps = sorted((x["srun"][-1], x["cmd"][1:3]) for x in steps if x["cmd"][0] == "launch/lighthouses.sh")
    assert lighthouse_steps == [("-w=n0", ["cluster", "0"]), ("-w=n0", ["global", "topology.clusters=2"]), ("-w=n2", ["cluster", "1"])]
    replica_step = [x for x in steps if x["cmd"][0] == "bash"]
    assert len(replica_step) == 1 and "--ntasks=4" in replica_step[0]["srun"] and "--kill-on-bad-exit=0" in replica_step[0]["srun"]
    launched = [x["args"] for x in log if x.get("script") == "replica.sh"]
    assert [(a[2], a[3]) for a in launched] == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    for a in launched:
        assert a[:2] == ["--ranks", "2"]
        assert a[4] == "http://n0:29510" and a[5] == "http://n0:29511,http://n2:29511"
        assert "topology.replicas_per_cluster=2" in a and "topology.ranks_per_replica=2" in a
        assert "run.dir=runs/slurm-77" in a and a[-1] == "model=tiny"


def test_sbatch_rejects_nodes_that_do_not_split_into_clusters(tmp_path):
    p, log = run_sbatch(tmp_path, ["n0", "n1", "n2"], CLUSTERS="2")
    assert p.returncode == 2
    assert "3 nodes do not split into CLUSTERS=2 clusters" in p.stderr
    assert log == []  # nothing started


def test_sbatch_hands_a_users_program_to_the_replica_groups_only(tmp_path):
    p, log = run_sbatch(tmp_path, ["n0", "n1", "n2", "n3"], "model=tiny", "--", "python", "my_train.py", RANKS="2")
    assert p.returncode == 0, p.stderr
    lighthouse_cmds = [x["cmd"] for x in log if "srun" in x and x["cmd"][0] == "launch/lighthouses.sh"]
    assert lighthouse_cmds and all("--" not in c and "my_train.py" not in c for c in lighthouse_cmds)
    launched = [x["args"] for x in log if x.get("script") == "replica.sh"]
    assert len(launched) == 4
    for a in launched:
        assert a[-4:] == ["model=tiny", "--", "python", "my_train.py"], a


def test_job_roles_run_a_users_program_with_its_overrides_as_arguments():
    roles = job_roles(1, 2, program="my_train.py", overrides=["train.steps=5"])
    trainers = [r for r in roles if r.name != "lighthouses"]
    assert [r.name for r in trainers] == ["c0r0", "c0r1"]
    for k, r in enumerate(trainers):
        i = r.args.index("my_train.py")
        assert "hier_localsgd" not in r.args and "HIER_LOCALSGD_OVERRIDES" not in r.env
        assert "train.steps=5" in r.args[i:] and f"run.replica={k}" in r.args[i:] and "run.cluster=0" in r.args[i:]
