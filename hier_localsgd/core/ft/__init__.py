"""The torchft-facing pieces: one Manager per level (managers), quorum presence, stopped
peers, lighthouse outages, and each level's collectives under its phase deadline (comm).

The top core layer: may import core.runtime, core.tensors and core.links.
"""
