"""Archive test support: a one-file snapshot committed straight through the writer with a chosen creation
time (the writer's `created` test hook), so retention rules are tested without waiting; shared by the
archive and switch tests."""
from __future__ import annotations

from pathlib import Path

from storage.repo.store import SnapshotStore


def committed_snapshot(store: Path, name: str, created: str, data: bytes = b"x", kind: str = "files",
          tags: tuple[str, ...] = ()) -> None:
    """A one-file snapshot committed with a chosen creation time."""
    from storage.pipeline import put as pipeline
    from storage.archive.filetree import FileTreeSource
    src = store.parent / f"src-{name}"
    src.mkdir()
    (src / "f").write_bytes(data)
    from sandbox.ops.snapshot_meta import FilesMeta, GpuMeta
    meta = (GpuMeta(root_pid=1, pids=(1,)) if kind == "gpu" else FilesMeta((str(src),))).to_json()
    st = SnapshotStore(str(store))
    with st.writer(name, meta=meta, tags=tags, created=created) as w:
        pipeline.put(w, FileTreeSource([str(src)]))
        w.commit()
