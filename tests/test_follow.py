"""storage.archive.follow: a directory read while another thread writes it, against a real writer on a real disk."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from storage.pipeline import put as pipeline
from storage.archive.filetree import FileTreeSink
from storage.archive.follow import FollowedDirSource
from storage.pipeline.put import PipelineError
from storage.repo.store import SnapshotStore


class SlowWriter:
    """Writes pages-1.img in small steps (closing it before the end), then pages-2.img and a small file."""

    def __init__(self, d: Path, fail: bool = False) -> None:
        self.d, self.fail = d, fail
        rng = np.random.default_rng(7)
        self.data = {"pages-1.img": rng.bytes(6 << 20) + bytes(4 << 20),
                     "pages-2.img": rng.bytes(3 << 20), "core-1.img": b"core" * 100}
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.closed_at: dict[str, float] = {}

    def run(self) -> None:
        try:
            for name in ("pages-1.img", "pages-2.img"):
                with open(self.d / name, "wb") as f:
                    blob = self.data[name]
                    for off in range(0, len(blob), 256 << 10):
                        f.write(blob[off:off + (256 << 10)])
                        f.flush()
                        time.sleep(0.004)
                        if self.fail and off > (2 << 20):
                            raise RuntimeError("the writer broke")
                    # stamped just before the close: a reader woken by the close may finish before
                    # this thread runs again (a loaded machine), and must find the stamp there
                    self.closed_at[name] = time.monotonic()
                time.sleep(0.2)
            (self.d / "core-1.img").write_bytes(self.data["core-1.img"])
        except BaseException as e:  # noqa: BLE001
            self.error = e
        finally:
            self.done.set()


def _follow(d: Path, w: SlowWriter) -> FollowedDirSource:
    return FollowedDirSource(str(d), follow=lambda n: n.startswith("pages-"), writer_done=w.done,
                             writer_failed=lambda: w.error)


def test_ingest_while_written_is_byte_exact(tmp_path: Path) -> None:
    d = tmp_path / "images"
    d.mkdir()
    w = SlowWriter(d)
    st = SnapshotStore(str(tmp_path / "store"))
    with _follow(d, w) as src:
        th = threading.Thread(target=w.run)
        th.start()
        with st.writer("f") as wr:
            pipeline.put(wr, src, chunker="pages", chunk_size=1 << 20)
            wr.commit()
        th.join()
        assert src.followed == ["pages-1.img", "pages-2.img"]  # both read while being written
    pipeline.get(st, st.load("f"), FileTreeSink(str(tmp_path / "out")))
    for name, blob in w.data.items():
        assert (tmp_path / "out" / "images" / name).read_bytes() == blob, name


def test_followed_file_finishes_when_closed_not_when_writer_ends(tmp_path: Path) -> None:
    """pages-1.img is complete at its close (inotify), long before the writer is done."""
    d = tmp_path / "images"
    d.mkdir()
    w = SlowWriter(d)
    with _follow(d, w) as src:
        th = threading.Thread(target=w.run)
        th.start()
        specs = src.streams()
        next(specs)  # the directory
        spec = next(specs)
        assert spec.name == "images/pages-1.img" and spec.size is None
        with src.open(spec) as r:
            buf = bytearray(32 << 20)
            n = r.readinto(memoryview(buf))
            finished = time.monotonic()
        assert bytes(buf[:n]) == w.data["pages-1.img"]
        assert not w.done.is_set() and finished - w.closed_at["pages-1.img"] < 0.15
        th.join()


def test_a_failing_writer_stops_the_ingest(tmp_path: Path) -> None:
    d = tmp_path / "images"
    d.mkdir()
    w = SlowWriter(d, fail=True)
    st = SnapshotStore(str(tmp_path / "store"))
    with _follow(d, w) as src:
        th = threading.Thread(target=w.run)
        th.start()
        with pytest.raises(PipelineError, match="writer .* failed .*the writer broke"):
            with st.writer("f") as wr:
                pipeline.put(wr, src, chunker="pages", chunk_size=1 << 20)
                wr.commit()
        th.join()
    assert st.names() == [] and os.listdir(st.tmp_dir) == []


def test_a_finished_file_with_much_left_is_read_by_several_readers(tmp_path: Path, monkeypatch) -> None:
    """The writer is already done with pages-1.img when the ingest reaches it: the reader hands the
    unread part over (handoff) and the pipeline cuts it in segments; the stream is still byte-exact."""
    monkeypatch.setattr(pipeline, "SEGMENT", 2 << 20)
    d = tmp_path / "images"
    d.mkdir()
    rng = np.random.default_rng(3)
    blob = rng.bytes(9 << 20) + bytes(5 << 20) + rng.bytes(7 << 20)
    done = threading.Event()
    handoffs: list[tuple[int, int]] = []
    real_open = FollowedDirSource.open

    def spy_open(self, spec):  # records the handoff each followed reader reports
        cm = real_open(self, spec)

        class Wrap:
            def __enter__(s):
                s.r = cm.__enter__()
                return s.r

            def __exit__(s, *e):
                handoff = getattr(s.r, "handoff", None)
                if handoff:
                    handoffs.append(handoff)
                return cm.__exit__(*e)
        return Wrap()
    monkeypatch.setattr(FollowedDirSource, "open", spy_open)
    st = SnapshotStore(str(tmp_path / "store"))
    with FollowedDirSource(str(d), follow=lambda n: n.startswith("pages-"), writer_done=done,
                           writer_failed=lambda: None, handoff_min=4 << 20) as src:
        (d / "pages-1.img").write_bytes(blob)   # written and closed before the ingest starts
        (d / "core-1.img").write_bytes(b"core")

        def finish() -> None:
            time.sleep(0.3)
            done.set()
        threading.Thread(target=finish).start()
        with st.writer("h") as w:
            pipeline.put(w, src, chunker="pages", chunk_size=1 << 20, workers=8, readers=3)
            w.commit()
    assert handoffs == [(0, len(blob))]
    pipeline.get(st, st.load("h"), FileTreeSink(str(tmp_path / "out")))
    assert (tmp_path / "out" / "images" / "pages-1.img").read_bytes() == blob
    assert (tmp_path / "out" / "images" / "core-1.img").read_bytes() == b"core"
