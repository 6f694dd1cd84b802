"""The links of a level: LinkProcessGroup (byte accounting, staging to the backend's
device, injected failures, point-to-point exchanges), the works its collectives return, and
the link emulation (loss models, LinkSpec and the links section, lossy algorithms).

May import core.runtime (and core.tensors); never core.ft.
"""
