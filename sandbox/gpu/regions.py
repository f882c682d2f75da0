"""Where custom-storage GPU memory goes on the host: the GPU engine, into a snapshot or the memory tier.

EngineRegions is the RegionStore (sandbox.gpu.state) of every host-side flow: save() streams one
process's mapped regions through the engine into a writer as streams gpu/PID/INDEX; load() fills the
regions from those streams (of the uncommitted writer, for a rollback, or of a committed snapshot).
With a chunk-reference log (storage.repo.reflog, the operation's journal), save() records each region,
each chunk once stored, the region's end and then the process as complete, in that order, so that
`gpusnap recover` can give a process whose gpusnap died its memory back from the log alone.
EngineSpill parks mapped regions in host memory through the engine's device when streaming fails, so
the process can be given its memory back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from storage.api import Progress
from sandbox.ops import journal
from sandbox.gpu.driver import DeviceRegion

if TYPE_CHECKING:  # storage.format.manifest needs blake3, which the in-sandbox agent (importing this) may lack
    from storage.api import Manifest, Stream


def stream_name(pid: int, index: int) -> str:
    """The stream that holds GPU INDEX of process PID (both integers, formatted here)."""
    return f"gpu/{int(pid)}/{int(index)}"


class EngineRegions:
    """RegionStore through a storage.pipeline.gpu_engine.GpuEngine (the writer and/or the chunk source)."""

    def __init__(self, engine: Any, *, source: Any, name: str, streams: list[Stream], writer: Any = None,
                 progress: Progress | None = None, log: Any = None) -> None:
        self.engine, self.source, self.name, self.streams = engine, source, name, streams
        self.writer, self.progress, self.log = writer, progress, log

    @classmethod
    def into(cls, engine: Any, writer: Any, progress: Progress | None = None, log: Any = None) -> "EngineRegions":
        """Save into WRITER (a SnapshotWriter or memtier PoolWriter); load from what it holds so far.
        LOG: a storage.repo.reflog.RefLogWriter that records what save() stores (None: not recorded)."""
        return cls(engine, source=writer.source, name=writer.name, streams=writer.streams, writer=writer,
                   progress=progress, log=log)

    @classmethod
    def of(cls, engine: Any, source: Any, manifest: Manifest, progress: Progress | None = None) -> "EngineRegions":
        """Load from snapshot MANIFEST in SOURCE (a SnapshotStore or the memory tier)."""
        return cls(engine, source=source, name=manifest.name, streams=manifest.streams, progress=progress)

    def save(self, pid: int, regions: list[DeviceRegion]) -> None:
        from storage.api import Region
        if self.writer is None:
            raise ValueError("EngineRegions.of() only loads")
        targets = [Region(stream_name(pid, r.index), r.dev_ptr, r.size) for r in regions]
        log, cs = self.log, self.engine.chunk_size
        if log is not None:
            for t in targets:
                log.region(t.name, t.size, -(-t.size // cs), cs)
        res = self.engine.checkpoint(self.writer, targets, progress=self.progress,
                                     on_chunk=None if log is None else self._logged)
        if log is not None:
            for t in targets:
                log.end(t.name)
            log.group(str(pid), [t.name for t in targets])  # durable before the driver completes
        self.writer.meta.setdefault("gpu_stages", {})[str(pid)] = res.stages.table()

    def _logged(self, stream: str, index: int, ref: Any) -> None:
        self.log.chunk(stream, index, ref)
        if index == 0:
            self.log.flush()  # a region's first reference is on disk early (one more fsync per region)
            journal.pause("gpu-chunk")  # test hook: a region's first chunk recorded, the rest not yet

    def load(self, pid: int, regions: list[DeviceRegion]) -> None:
        from storage.api import Region
        from storage.api import Manifest
        targets = {stream_name(pid, r.index): Region(stream_name(pid, r.index), r.dev_ptr, r.size) for r in regions}
        self.engine.restore(self.source, Manifest(self.name, [s for s in self.streams if s.name in targets]),
                            targets, progress=self.progress)

    def spill(self) -> "EngineSpill":
        return EngineSpill(self.engine.dev)


class EngineSpill:
    """RegionSpill through a storage.gpu.device.Device: mapped regions parked in host memory and put back
    (the rollback of a custom-storage checkpoint whose streaming failed)."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self.saved: list[Any] = []

    def _copy(self, regions: list[Any], out: bool) -> None:
        stream = self.dev.new_stream()
        try:
            for r, buf in zip(regions, self.saved):
                if out:
                    self.dev.d2h(buf.ptr, r.dev_ptr, r.size, stream)
                else:
                    self.dev.h2d(r.dev_ptr, buf.ptr, min(r.size, buf.size), stream)
            self.dev.sync(stream)
        finally:
            self.dev.destroy_stream(stream)

    def save(self, regions: list[Any]) -> None:
        self.saved = [self.dev.pinned(r.size) for r in regions]
        self._copy(regions, out=True)

    def load(self, regions: list[Any]) -> None:
        try:
            self._copy(regions, out=False)
        finally:
            for b in self.saved:
                b.close()
            self.saved = []
