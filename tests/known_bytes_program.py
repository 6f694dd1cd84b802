"""A training program whose outer-level payload is known to the byte (tests/test_security.py).

One parameter of 256 float32s, starting at zero, with a constant gradient ``c`` (c_j =
(j + 1)·2^-12) and plain SGD at lr 2^-4, averaged (``localsgd``) at both levels: every
value is a small integer times a power of two, so every step is exact and each cluster's
outer pseudo-gradient after k local steps is exactly k·lr·c. A capture of the WAN finds
these bytes in plain TCP, and must not find them inside the tunnel.
"""

import os
import time

import torch
from torch import nn

import hier_localsgd
from hier_localsgd import HierarchicalDiLoCo, Topology

N, LR = 256, 2.0**-4
STEP_ENV = "KNOWN_BYTES_STEP_S"  # seconds each step takes at least (a job that outlasts a test's actions)
# "STEP:PATH": after step STEP, wait (up to 100 s) until PATH exists — a test's actions then
# happen while the job is alive, whatever the machine's speed.
HOLD_ENV = "KNOWN_BYTES_HOLD"
C = torch.arange(1, N + 1, dtype=torch.float32) * 2.0**-12


def pattern(steps: int) -> bytes:
    """The float32 bytes of the pseudo-gradient after ``steps`` local steps."""
    return (C * (LR * steps)).numpy().tobytes()


def main(topology: Topology) -> None:
    model = nn.Linear(1, 1, bias=False)
    model.weight = nn.Parameter(torch.zeros(N))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with HierarchicalDiLoCo(model, opt, topology) as sync:
        hold = os.environ.get(HOLD_ENV, "")
        hold_step, _, hold_path = hold.partition(":")
        for step in sync.steps():
            if hold and step == int(hold_step) + 1:
                deadline = time.monotonic() + 100
                while not os.path.exists(hold_path) and time.monotonic() < deadline:
                    time.sleep(0.1)
            loss = (model.weight * C).sum()
            loss.backward()
            sync.record_loss(loss)
            opt.step()
            opt.zero_grad()
            time.sleep(float(os.environ.get(STEP_ENV, "0")))
        sync.finish()
        sync.publish_result()


if __name__ == "__main__":
    hier_localsgd.run(main)
