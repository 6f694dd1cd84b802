"""A TorchX component for hierarchical jobs, for users who outgrow hand launch.

    pip install 'hier_localsgd[torchx]'
    torchx run -s local_cwd hier_localsgd/launch/torchx_component.py:hier \\
        --clusters 2 --replicas 2 --ranks 1 -- model=tiny train.steps=60

One TorchX role per replica group (``c<C>r<R>``), each a torchrun of ``ranks``
processes (``--nproc-per-node``), and, unless ``serve_lighthouses`` is false, one
role serving the global and every cluster lighthouse, which exits once every
replica group has written its result (``lighthouse.until_done``), so the app ends
when training does. torchrun restarts a replica
group as a whole when any rank dies (``max_restarts`` times); the restarted group
rejoins its cluster and heals from a live peer, as with ``launch/replica.sh``.
Nothing else is shared between roles: every replica group creates its own stores
and finds its peers through the lighthouses' quorums, so the roles may start in
any order (a group that starts before its lighthouse retries until
``timeouts.startup``).

On a remote scheduler (Slurm, Kubernetes) run the lighthouses yourself
(``launch/lighthouses.sh``) on hosts every role can reach, pass their addresses
and ``--serve_lighthouses false``, as torchft's own ``torchft.torchx.hsdp``
expects an external lighthouse.

The job is described by :func:`job_roles` in plain data (tested without TorchX:
TorchX 0.7 pins ``urllib3<1.27``, so it is an optional extra); :func:`hier`
turns that into a ``torchx.specs.AppDef``.
"""

import sys
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

from hier_localsgd.launch.rendezvous import ENV as RENDEZVOUS_ENV, one_host_args

DEFAULT_GLOBAL = "http://localhost:29510"
DEFAULT_CLUSTER_PORT = 29511


@dataclass(frozen=True)
class RoleSpec:
    """One TorchX role: ``entrypoint args...`` on one host, with ``env``."""

    name: str
    entrypoint: str
    args: List[str]
    env: Dict[str, str] = field(default_factory=dict)


def default_cluster_addrs(clusters: int, host: str = "localhost", port: int = DEFAULT_CLUSTER_PORT) -> List[str]:
    return [f"http://{host}:{port + c}" for c in range(clusters)]


def job_roles(
    clusters: int,
    replicas: int,
    ranks: int = 1,
    overrides: Sequence[str] = (),
    global_addr: str = DEFAULT_GLOBAL,
    cluster_addrs: Sequence[str] = (),
    serve_lighthouses: bool = True,
    max_restarts: int = 10,
    python: str = "python",
    program: str = "",
) -> List[RoleSpec]:
    """The roles of a ``clusters`` × ``replicas`` × ``ranks`` job.

    ``overrides`` are hydra overrides shared by every role (model, sync, steps...);
    the topology and lighthouse addresses are set here and must not be among them.
    ``program``: a user's script on the public API (docs/api.md) that each replica group
    runs instead of the built-in trainer, with the overrides as its arguments.
    Raises ``ValueError`` naming the bad argument.
    """
    for name, value in (("clusters", clusters), ("replicas", replicas), ("ranks", ranks)):
        if value < 1:
            raise ValueError(f"{name}: {value} — need at least 1")
    if max_restarts < 0:
        raise ValueError(f"max_restarts: {max_restarts} — need 0 or more")
    addrs = list(cluster_addrs) or default_cluster_addrs(clusters)
    if len(addrs) != clusters:
        raise ValueError(f"cluster_addrs: {len(addrs)} addresses for {clusters} clusters — give one per cluster, in cluster order")
    owned = ("topology.", "lighthouse.global_addr", "lighthouse.cluster_addrs", "run.cluster", "run.replica")
    for o in overrides:
        if o.lstrip("+~").startswith(owned):
            raise ValueError(f"overrides: {o!r} — set by the component; use its clusters/replicas/ranks/global_addr/cluster_addrs arguments")
    common = [
        f"topology.clusters={clusters}",
        f"topology.replicas_per_cluster={replicas}",
        f"topology.ranks_per_replica={ranks}",
        f"lighthouse.global_addr='{global_addr}'",
        f"lighthouse.cluster_addrs=[{','.join(addrs)}]",
        *overrides,
    ]
    roles: List[RoleSpec] = []
    if serve_lighthouses:
        roles.append(RoleSpec("lighthouses", python, ["-m", "hier_localsgd", "lighthouse", "lighthouse.serve=all", "lighthouse.until_done=true", *common]))
    for c in range(clusters):
        for r in range(replicas):
            # torchrun even for one rank: it is what restarts the group on every scheduler.
            # one_host_args: no listener on every interface (launch/rendezvous.py)
            torchrun = ["-m", "torch.distributed.run", *one_host_args(), f"--nproc-per-node={ranks}", f"--max-restarts={max_restarts}"]
            if ranks > 1:
                torchrun += ["--tee=3", "--local-ranks-filter=0"]
            mine = [*common, f"run.cluster={c}", f"run.replica={r}"]
            # A user's program takes the overrides as its arguments (job.config_from_env reads
            # them there too): a scheduler may pass the environment comma-separated (Slurm's
            # srun --export), and a JSON list has commas.
            train = [program, *mine] if program else ["-m", "hier_localsgd", "train", *mine]
            roles.append(RoleSpec(f"c{c}r{r}", python, [*torchrun, *train], {"PYTHONUNBUFFERED": "1", **RENDEZVOUS_ENV}))
    return roles


def hier(
    *overrides: str,
    clusters: int = 2,
    replicas: int = 2,
    ranks: int = 1,
    global_addr: str = DEFAULT_GLOBAL,
    cluster_addrs: str = "",
    serve_lighthouses: bool = True,
    max_restarts: int = 10,
    image: str = "",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    h: str = "",
    program: str = "",
) -> "AppDef":  # noqa: F821  (torchx reads annotations as written; no __future__ import here)
    """Hierarchical LocalSGD/DiLoCo job: lighthouses plus one torchrun per replica group.

    Args:
        overrides: hydra overrides for every role, e.g. ``model=tiny train.steps=60``
        clusters: number of clusters C
        replicas: replica groups per cluster R
        ranks: ranks per replica group G (torchrun --nproc-per-node)
        global_addr: the global lighthouse's address
        cluster_addrs: comma-separated cluster lighthouse addresses (default localhost:29511+c)
        serve_lighthouses: also run the lighthouses as a role (false when they run elsewhere)
        max_restarts: torchrun restarts per replica group
        image: scheduler image (local_cwd: the working directory)
        cpu: CPUs per replica-group role
        gpu: GPUs per replica-group role
        memMB: memory per replica-group role in MB
        h: named resource (overrides cpu/gpu/memMB)
        program: a script on hier_localsgd's API to run instead of the built-in trainer
    """
    import torchx.specs as specs

    roles = job_roles(
        clusters, replicas, ranks, overrides, global_addr,
        [a for a in cluster_addrs.split(",") if a], serve_lighthouses, max_restarts,
        python=sys.executable if not image else "python", program=program,
    )
    out = []
    for role in roles:
        small = role.name == "lighthouses"
        out.append(specs.Role(
            name=role.name, image=image, entrypoint=role.entrypoint, args=role.args, env=role.env,
            num_replicas=1, max_retries=0,
            resource=specs.resource(cpu=1, gpu=0, memMB=1024) if small else specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h or None),
        ))
    return specs.AppDef(name="hier-localsgd", roles=out)
