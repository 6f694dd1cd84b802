"""A replica group written directly against torchft 0.2.0, with no hier_localsgd runtime.

Used by test_seed004.py to reproduce seed 004's bug: the training loop dies while another
non-daemon thread is still blocked, so the interpreter never exits, the Manager keeps
heartbeating, and its peer cannot form a quorum (the lighthouse needs more than half of the
heartbeating replicas to join).

    python seed004_raw_replica.py LIGHTHOUSE REPLICA_ID ROUNDS crash|survive QUORUM_TIMEOUT_S BARRIER_DIR

Both replicas wait (through files in BARRIER_DIR) until both Managers are up, so their
first rounds are joint.
"""

import os
import sys
import threading
import time
from datetime import timedelta

import torch
from torch.distributed import TCPStore
from torchft import Manager
from torchft.process_group import ProcessGroupGloo

lighthouse, replica_id, rounds, mode, qt = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
barrier = sys.argv[6]
store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
state = {"w": torch.zeros(4)}
mgr = Manager(
    pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
    load_state_dict=lambda sd: state.update(sd),
    state_dict=lambda: dict(state),
    min_replica_size=1,
    use_async_quorum=False,
    timeout=timedelta(seconds=10),
    quorum_timeout=timedelta(seconds=qt),
    rank=0,
    world_size=1,
    store_addr="127.0.0.1",
    store_port=store.port,
    lighthouse_addr=lighthouse,
    replica_id=replica_id,
    hostname="127.0.0.1",
)
open(os.path.join(barrier, replica_id), "w").close()
deadline = time.time() + 60
while len(os.listdir(barrier)) < 2 and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.5)  # a couple of heartbeats so the lighthouse counts both
for i in range(rounds):
    mgr.start_quorum()
    mgr.allreduce(torch.ones(4)).wait()
    print(f"round {i} committed={mgr.should_commit()} participants={mgr.num_participants()}", flush=True)

if mode == "crash":
    threading.Thread(target=time.sleep, args=(3600,), name="blocked-worker").start()
    print("CRASHING", flush=True)
    raise RuntimeError("training loop crashed")

time.sleep(1.0)  # let the peer crash first
t0 = time.time()
try:
    mgr.start_quorum(timeout=timedelta(seconds=qt))
    print(f"QUORUM_OK {time.time() - t0:.1f}", flush=True)
except Exception as e:
    print(f"QUORUM_FAILED {time.time() - t0:.1f} {e}", flush=True)
mgr.shutdown(wait=False)
os._exit(0)
