"""hier_localsgd: fault-tolerant hierarchical LocalSGD/DiLoCo training on torchft.

Start with docs/architecture.md; the training loop is hier_localsgd/train/trainer.py and
one sync round reads top to bottom in hier_localsgd/sync/hier.py.
"""

__version__ = "0.1.0"
