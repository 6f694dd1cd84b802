"""torchrun for a replica group on one host, with no listener on every interface.

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
A group spanning hosts still needs torch's TCP rendezvous (``--rdzv HOST:PORT``), whose
store listens on every interface of that host (docs/security.md).
"""

from __future__ import annotations

import sys
from typing import Dict, List

# The agent hosts no store for its workers (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py).
ENV: Dict[str, str] = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def one_host_args(store_file: str = "") -> List[str]:
    """torchrun's arguments for a group on one host (in place of ``--standalone``): the
    rendezvous in ``store_file``, which must not hold an earlier launch's rendezvous ("": a
    fresh temporary file that torch makes)."""
    return ["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-conf=store_type=file",
            *([f"--rdzv-endpoint={store_file}"] if store_file else [])]


if __name__ == "__main__":  # launch/replica.sh: one argument per line
    print("\n".join(one_host_args(*sys.argv[1:2])))
