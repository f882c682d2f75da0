"""The page cache in tests: how much of a directory's files is resident, and a store made cold."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np


def resident_bytes(directory: Path) -> int:
    """Bytes of the files in DIRECTORY that are in the page cache now (mincore over a read-only map)."""
    return sum(resident_in(p, 0, size) for p in directory.iterdir() if (size := p.stat().st_size))


def resident_in(path: Path, offset: int, length: int) -> int:
    """Bytes of the pages of PATH's range [OFFSET, OFFSET + LENGTH) that are in the page cache now."""
    import ctypes
    import mmap
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    first, end = offset // 4096 * 4096, offset + length
    with open(path, "rb") as f, mmap.mmap(f.fileno(), end - first, prot=mmap.PROT_READ, offset=first) as m:
        vec = ctypes.create_string_buffer((end - first + 4095) // 4096)
        view = memoryview(m)
        try:
            if libc.mincore(np.frombuffer(view, np.uint8).ctypes.data, end - first, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            view.release()
    return sum(1 for b in vec.raw if b & 1) * 4096


def cold_store(tmp_path: Path, nbytes: int) -> tuple[Any, list[Any]]:
    """A store of one snapshot `a` of NBYTES random bytes (in packs), its non-zero chunk refs, and the
    page cache dropped: the packs are on disk only."""
    from storage.pipeline import put as pipeline
    from storage.archive.filetree import FileTreeSource
    from storage.repo.store import SnapshotStore
    src = tmp_path / "src"
    src.mkdir()
    (src / "blob").write_bytes(os.urandom(nbytes))
    st = SnapshotStore(str(tmp_path / "store"))
    with st.writer("a") as w:
        pipeline.put(w, FileTreeSource([str(src)]), workers=2)
        w.commit()
    refs = [c for s in st.load("a").streams for c in s.chunks if not c.is_zero]
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")
    return st, refs
