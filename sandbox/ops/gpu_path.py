"""How GPU memory leaves a process (GpuPath): the one name for it that journal records, snapshot metadata
and sandbox.gpu.state (which chooses it) share; defined on this floor so that the records need not
import the GPU mechanics."""
from __future__ import annotations

import enum


class GpuPath(enum.Enum):
    """How GPU memory leaves the process: the driver's host copy, or custom storage (streamed by us)."""

    HOST_STAGED = "host-staged"
    CUSTOM_STORAGE = "custom-storage"
