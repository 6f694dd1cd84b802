import os
import sys
from pathlib import Path

# torchft's Rust logger reads RUST_LOG when it is first imported.
os.environ.setdefault("RUST_LOG", "warn")
sys.path.insert(0, str(Path(__file__).parent))

# The files that take longest, longest first (minutes of worker time in a fresh-clone CI run
# on 2 cores, 2026-12-02: test_tp 13.8, test_chaos 10.7, test_async_outer 10.5, test_multirank
# 10.0, test_faults 8.6, test_outages 8.4, test_examples 7.3, test_auto_watch 5.1; the whole
# suite 123 min). With `--dist loadfile --no-loadscope-reorder` xdist hands files out in
# collection order, so these go first and the short files fill both workers at the end
# (xdist's own order is most tests first, which puts these few-test files late). Measured
# on this machine: 67.6 min ordered, 67.0 min unordered: no gain beyond run-to-run spread.
LONGEST_FIRST = ("test_tp.py", "test_chaos.py", "test_async_outer.py", "test_multirank.py", "test_faults.py",
                 "test_outages.py", "test_examples.py", "test_auto_watch.py", "test_job.py", "test_netns.py",
                 "test_api.py", "test_async_overlap.py", "test_outer_compression.py", "test_bench.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order stays
