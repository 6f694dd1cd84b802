"""torchrun for a replica group, with no listener on every interface.

``torchrun --standalone`` hosts two c10d TCPStores in its agent, the rendezvous's and one
it shares with its workers, and a c10d store listens on every interface unless handed a
socket (``ss -ltn`` shows both on ``*``). A replica group on one host needs neither:

* the rendezvous keeps its state in a file (torch's c10d rendezvous backend with
  ``store_type=file``): no socket at all;
* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the agent hosts no store for its workers; the
  group's rank 0 hosts it, bound to ``run.bind`` or ``run.hostname`` (job.py
  ``group_place``, core/ft/managers.py ``bound_store``), at the ``MASTER_PORT`` the agent
  picked.

Every launcher of a one-host group takes its arguments from here (launch/local.py, the
TorchX component, launch/replica.sh through ``python -m hier_localsgd.launch.rendezvous``).

A group spanning hosts needs a rendezvous over TCP (``--rdzv HOST:PORT``). torch's ``c10d``
backend hosts it in a store listening on every interface of HOST, and the agent of the
rendezvous's rank 0 hosts a second one, shared with its workers, on every interface of its
host. :data:`BACKEND` (``hl-c10d``, registered with torchrun through the ``torchrun.handlers``
entry point, pyproject.toml) is that backend with both stores bound: the rendezvous's to
HOST's address, the shared one to the agent's own address (``--local-addr``, else its
host name), each handed a socket bound there (core/ft/managers.py ``bound_store``). Which
agent hosts the rendezvous is said, not guessed: ``--rdzv-conf is_host=1`` on HOST's node,
``0`` elsewhere (:func:`spanning_args`). It relies on one private hook of torch's pinned
handler (``DynamicRendezvousHandler._create_tcp_store_server``); tests/test_rendezvous.py
lists the listeners of a group spanning two network namespaces, and shows the plain ``c10d``
backend listening on every interface there.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import Any, Callable, Dict, List

BACKEND = "hl-c10d"
DEFAULT_PORT = 29400  # torch's default for an endpoint without a port

# The agent hosts no store for its workers (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py).
ENV: Dict[str, str] = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def one_host_args(store_file: str = "") -> List[str]:
    """torchrun's arguments for a group on one host (in place of ``--standalone``): the
    rendezvous in ``store_file``, which must not hold an earlier launch's rendezvous ("": a
    fresh temporary file that torch makes)."""
    return ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-conf=store_type=file",
            *([f"--rdzv-endpoint={store_file}"] if store_file else [])]


def spanning_args(nnodes: int, node_rank: int, endpoint: str, run_id: str) -> List[str]:
    """torchrun's arguments for node ``node_rank`` of a group spanning ``nnodes`` hosts whose
    rendezvous is at ``endpoint`` (HOST:PORT, on node 0's host): :data:`BACKEND`."""
    return [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={1 if node_rank == 0 else 0}"]


def create_handler(params: Any) -> Any:
    """torchrun's rendezvous handler for :data:`BACKEND` (module doc): torch's dynamic
    rendezvous over a c10d store, both stores bound.

    Raises:
        ValueError: ``is_host`` not given, or a ``read_timeout`` under 1 s (one line each)."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as dynamic_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    from hier_localsgd.core.ft.managers import bound_store

    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    is_host = params.get_as_bool("is_host")
    if is_host is None:
        raise ValueError(f"rendezvous {BACKEND}: --rdzv-conf is_host=1 on the endpoint's host ({host}), is_host=0 on the others")
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout < 1:
        raise ValueError(f"rendezvous {BACKEND}: read_timeout={read_timeout} — must be at least 1 (seconds)")
    timeout = timedelta(seconds=read_timeout)
    store = bound_store(host, port, timeout) if is_host else TCPStore(host, port, is_master=False, timeout=timeout)
    class Backend(C10dRendezvousBackend):  # torch's, under this backend's name (torchrun checks it)
        @property
        def name(self) -> str:
            return BACKEND

    handler = dynamic_handler(store, Backend(store, params.run_id), params)
    bind: Callable[[str, int], Any] = lambda addr, p: bound_store(addr, p, timeout)  # noqa: E731
    handler._create_tcp_store_server = bind  # the store shared with the workers (module doc)
    return handler


def handler() -> Callable[[Any], Any]:
    """The ``torchrun.handlers`` entry point (pyproject.toml): torchrun registers what this
    returns under :data:`BACKEND` (torch/distributed/elastic/rendezvous/registry.py)."""
    return create_handler


if __name__ == "__main__":  # launch/replica.sh: one argument per line
    if sys.argv[1:2] == ["--span"]:  # --span NNODES NODE_RANK HOST:PORT RUN_ID
        n, k, endpoint, run_id = sys.argv[2:6]
        print("\n".join(spanning_args(int(n), int(k), endpoint, run_id)))
    else:
        print("\n".join(one_host_args(*sys.argv[1:2])))
