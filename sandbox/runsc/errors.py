"""The runsc flows' one error type (checkpoint, restore, the GPU agent's channel), below every module
that raises it."""
from __future__ import annotations

from storage.api import GpusnapError


class RunscSnapshotError(GpusnapError):
    """A sandbox request that cannot be done as asked."""
