"""What a CRIU dump or restore reports (CriuReport), and the one error its flows raise (CriuSnapshotError)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from storage.api import GpusnapError


class CriuSnapshotError(GpusnapError):
    """A CRIU dump/restore through the store that cannot go ahead or could not be rolled back."""


@dataclass
class CriuReport:
    name: str
    pids: list[int]
    cuda_pids: list[int]
    seconds: dict[str, float] = field(default_factory=dict)
    raw_bytes: int = 0
    new_bytes: int = 0
    dedup_bytes: int = 0
    restored_pid: int | None = None
    stages: dict[str, Any] = field(default_factory=dict)
    images_path: str = "staging"  # how CRIU's images moved: "stream" or "staging" (sandbox.criu.images)
    parent: str | None = None     # a dump's parent snapshot (its changed chunks are deltas against it)
    pipe_reads: str | None = None  # a streamed dump's: how CRIU's pipes were read (storage.fs.fdread.describe)
    pack_writes: str | None = None  # a dump's: "direct", "buffered" or "none" (SnapshotWriter.pack_writes)
    staged_restore: str | None = None  # a dump's: why its restore stages the images (sandbox.criu.images.late_reads)

    def as_dict(self) -> dict[str, Any]:
        """A dump's report (bytes of images, written, deduplicated) or a restore's (the restored pid):
        each carries only its own fields."""
        d = {"name": self.name, "pids": self.pids, "cuda_pids": self.cuda_pids, "stages": self.stages,
             "seconds": {k: round(v, 3) for k, v in self.seconds.items()}, "images_path": self.images_path}
        if self.restored_pid is not None:
            return {**d, "restored_pid": self.restored_pid}
        return {**d, "raw_bytes": self.raw_bytes, "new_bytes": self.new_bytes, "dedup_bytes": self.dedup_bytes,
                "parent": self.parent, **({"pipe_reads": self.pipe_reads} if self.pipe_reads else {}),
                **({"pack_writes": self.pack_writes} if self.pack_writes else {}),
                **({"staged_restore": self.staged_restore} if self.staged_restore else {})}
