"""Process-level plumbing: the process's lifecycle and exit path (runtime), its logs and
status files, phases, timeouts and invariants, planned faults, lighthouse addresses and
store connects, devices and backends, durable checkpoints.

The lowest core layer: imports nothing of hier_localsgd.core outside this subpackage.
"""
