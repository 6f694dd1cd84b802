"""A warm spare: a process with the training stack already imported, waiting to become
a restarted replica group (:class:`hier_localsgd.launch.local.LocalJob` restarts).

Why: most of a restart's start-up is importing torch, torchft and torchtitan (about 6 s
of CPU on the 2-core development VM, far more when the cores are busy training), and the
restarted group can neither join a quorum nor serve as a heal source meanwhile. A spare
pays that before it is needed. Handed a replica group's arguments it runs what
``python -m hier_localsgd`` would, in the same process: its pid becomes the group's pid,
its output goes to the group's log.

Protocol: one JSON line on stdin, ``{"argv": [...], "log": "<path>"}``. End of input
first (its launcher closed the pipe or died): exit 0 without running anything.

Failure semantics: once assigned, the spare *is* the replica process (exit codes, signals
and the runtime's handling as for a cold start; SIGTERM/SIGINT/SIGHUP are blocked before
any thread exists, as ``cli.main`` does for ``train``). Only ``train`` commands of
single-rank groups outside network namespaces are handed to spares (a torchrun group and
a namespace's process are started by their own wrappers).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Optional, Sequence


def warm_up() -> None:
    """Imports what a replica process imports (the expensive part of its start)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torchft  # noqa: F401
    from torchtitan.models.llama3 import Transformer  # noqa: F401

    import hier_localsgd.cli  # noqa: F401
    import hier_localsgd.config  # noqa: F401
    import hier_localsgd.sync.baselines  # noqa: F401
    import hier_localsgd.train.trainer  # noqa: F401


def main(argv: Optional[Sequence[str]] = None) -> int:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
    warm_up()
    print(f"spare: ready (pid {os.getpid()}) at {time.strftime('%H:%M:%S')}", flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0
    order = json.loads(line)
    fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    print(f"spare {os.getpid()}: warm start of {' '.join(order['argv'][:1])} at {time.strftime('%H:%M:%S')}", flush=True)
    from hier_localsgd.cli import main as cli_main

    sys.argv = ["hier_localsgd", *order["argv"]]
    return cli_main(list(order["argv"]))


if __name__ == "__main__":
    sys.exit(main())
