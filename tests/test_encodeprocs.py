"""The put's per-chunk work in encoder processes (storage/pipeline/encodeprocs.py): the same snapshot, byte
for byte and chunk for chunk, as the threads make; a dead or lying encoder fails the put with one
clear error and commits nothing; the processes end with the put."""
from __future__ import annotations

import os
import signal
from pathlib import Path
import time

import numpy as np
import pytest

from storage.pipeline import encodeprocs

from storage.pipeline import put as pipeline
from storage.codecs.registry import DELTA
from storage.fs.directio import Arena
from storage.pipeline.encodeprocs import EncodeProcs, EncodeProcsError
from storage.archive.filetree import FileTreeSink, FileTreeSource
from storage.repo.store import SnapshotStore

PAGE = 4096


def _weights_image(path, mib: int = 48) -> bytes:
    """bf16 weights (few zeros), a zero run, random bytes and a repeated run: every codec and the
    dedup path get chunks."""
    rng = np.random.default_rng(21)
    w = (rng.normal(0, 0.02, (mib - 16) << 19).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    rnd = rng.bytes(4 << 20)
    data = w[: 16 << 20] + bytes(8 << 20) + rnd + w[16 << 20:] + w[: 4 << 20]
    path.write_bytes(data)
    return data


def _put(store: SnapshotStore, src: str, name: str, procs: int, workers: int = 4,
         parent: str | None = None) -> pipeline.Result:
    with store.writer(name) as w:
        res = pipeline.put(w, FileTreeSource([src]), chunker="pages", procs=procs, workers=workers,
                           parent=store.load(parent) if parent else None)
        w.commit()
    return res


def _ready(enc: encodeprocs.Encoder) -> encodeprocs.Encoder:
    """ENC once it has said it is ready."""
    deadline = time.monotonic() + 30
    while not enc.is_ready():
        assert time.monotonic() < deadline, "the encoder process did not start"
        time.sleep(0.02)
    return enc


def _wait_for_encoders(encs: EncodeProcs, n: int) -> None:
    assert len(encs._all) == n
    for e in encs._all:
        _ready(e)


def test_encoder_processes_make_the_same_snapshot_as_the_threads(tmp_path, monkeypatch) -> None:
    img = tmp_path / "images"
    img.mkdir()
    data = _weights_image(img / "pages-1.img")
    # every chunk through a process: the put's threads wait for one instead of doing the work
    monkeypatch.setattr(encodeprocs.EncodeProcs, "borrowed", _blocking_borrow)
    a, b = SnapshotStore(str(tmp_path / "a")), SnapshotStore(str(tmp_path / "b"))
    ra = _put(a, str(img), "s", procs=0)
    rb = _put(b, str(img), "s", procs=3)
    sa = next(s for s in a.load("s").streams if s.name == "images/pages-1.img")
    sb = next(s for s in b.load("s").streams if s.name == "images/pages-1.img")
    assert [(c.id, c.raw_len, c.codec, c.stored_len) for c in sa.chunks] == \
        [(c.id, c.raw_len, c.codec, c.stored_len) for c in sb.chunks]
    assert sa.attrs["pagekeys"] == sb.attrs["pagekeys"]
    assert {c.codec for c in sb.chunks} >= {"shuffle2-zstd", "raw"}, "the image exercises the codecs"
    assert any(c.is_zero for c in sb.chunks)
    assert ra.stored_bytes == rb.stored_bytes
    table = rb.stages.table()
    assert table["compress"]["bytes"] > 0 and table["checksum"]["bytes"] > 0
    # stored checksums computed by the processes are what verify recomputes
    assert b.verify(["s"]).ok
    pipeline.get(b, b.load("s"), FileTreeSink(str(tmp_path / "out")))
    assert (tmp_path / "out" / "images" / "pages-1.img").read_bytes() == data
    # a second put of the same bytes through the processes dedups every chunk
    rc = _put(b, str(img), "t", procs=2)
    assert rc.stored_bytes == 0


def test_a_put_with_a_parent_has_its_per_chunk_work_done_by_the_processes(tmp_path, monkeypatch) -> None:
    """A second dump (a parent, 5% of the pages changed): the zero test, raw id and page keys of
    every chunk in an encoder process, the changed chunks' deltas in the thread: the same snapshot,
    chunk for chunk, as the thread alone makes (one worker each: the order of the deltas is then fixed)."""
    img = tmp_path / "images"
    img.mkdir()
    data = bytearray(_weights_image(img / "pages-1.img"))
    rng = np.random.default_rng(5)
    pages = rng.choice(len(data) // PAGE, size=len(data) // PAGE // 20, replace=False)
    for pg in pages:  # 5% of the pages: a few bytes each, as a serving process's writes
        data[pg * PAGE + 64: pg * PAGE + 96] = rng.bytes(32)
    calls = {"prepare": 0}
    real_prepare = encodeprocs.Encoder.prepare

    def counted(self, view, keyed):
        calls["prepare"] += 1
        return real_prepare(self, view, keyed)

    monkeypatch.setattr(encodeprocs.Encoder, "prepare", counted)
    monkeypatch.setattr(encodeprocs.EncodeProcs, "borrowed", _blocking_borrow)
    stores = {}
    for procs in (0, 1):
        st = stores[procs] = SnapshotStore(str(tmp_path / f"s{procs}"))
        _put(st, str(img), "first", procs=0, workers=1)
        (tmp_path / f"changed{procs}").mkdir()
        changed = tmp_path / f"changed{procs}" / "images"
        changed.mkdir()
        (changed / "pages-1.img").write_bytes(bytes(data))
        before = calls["prepare"]
        res = _put(st, str(changed), "second", procs=procs, workers=1, parent="first")
        assert (calls["prepare"] > before) == (procs > 0), "the processes did the chunks' work, only where asked"
        assert res.stored_bytes < len(pages) * PAGE, "stored as deltas: less than the changed pages"
    sa, sb = (next(s for s in stores[p].load("second").streams if s.name == "images/pages-1.img") for p in (0, 1))
    assert [(c.id, c.raw_len, c.codec, c.stored_len) for c in sa.chunks] == \
        [(c.id, c.raw_len, c.codec, c.stored_len) for c in sb.chunks]
    assert sa.attrs["pagekeys"] == sb.attrs["pagekeys"]
    assert any(c.codec == DELTA for c in sb.chunks)
    # more workers and processes: the order differs, the bytes do not
    st = stores[1]
    _put(st, str(tmp_path / "changed1" / "images"), "third", procs=3, workers=3, parent="first")
    assert st.verify(["second", "third"]).ok
    for name in ("second", "third"):
        pipeline.get(st, st.load(name), FileTreeSink(str(tmp_path / f"out-{name}")))
        assert (tmp_path / f"out-{name}" / "images" / "pages-1.img").read_bytes() == bytes(data)


_real_borrowed = encodeprocs.EncodeProcs.borrowed


def _blocking_borrow(self):
    """borrowed, waiting for a started process instead of letting the thread do the work."""
    import contextlib

    @contextlib.contextmanager
    def cm():
        enc = _ready(self._free.get(timeout=30))
        try:
            yield enc
        finally:
            if not enc.broken:
                self._free.put(enc)
    return cm()


def test_a_killed_encoder_fails_the_put_and_commits_nothing(tmp_path, monkeypatch) -> None:
    img = tmp_path / "images"
    img.mkdir()
    _weights_image(img / "pages-1.img", mib=64)
    monkeypatch.setattr(encodeprocs.EncodeProcs, "borrowed", _blocking_borrow)
    real_encode = encodeprocs.Encoder.encode
    killed: list[int] = []

    def encode(self, data, frame):
        if not killed:
            killed.append(self.proc.pid)
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        return real_encode(self, data, frame)
    monkeypatch.setattr(encodeprocs.Encoder, "encode", encode)
    st = SnapshotStore(str(tmp_path / "store"))
    with pytest.raises(EncodeProcsError, match=r"encoder process \d+ exited"):
        _put(st, str(img), "s", procs=2)
    assert st.names() == []


def test_a_lying_answer_is_refused(tmp_path) -> None:
    """An answer whose payload would lie outside the frame, or whose codec is not a plain one, is an
    error, not a write."""
    with Arena(8 << 20) as arena, EncodeProcs(1, arena) as encs:
        _wait_for_encoders(encs, 1)
        enc = encs._free.get(timeout=10)
        data, frame = arena.carve(1 << 20), arena.carve(2 << 20)
        data[:] = np.random.default_rng(3).bytes(1 << 20)
        got = enc.encode(data, frame)
        assert got.codec == "raw" and got.length == len(data)  # random bytes do not pay
        bad = encodeprocs.ENC.pack(b"zstd", 10 << 20, b"\0" * 32, 0.0, 0.0)
        enc._ask = lambda *a: bad  # type: ignore[method-assign]
        with pytest.raises(EncodeProcsError, match="encoding 'zstd' of"):
            enc.encode(data, frame)
        enc._ask = lambda *a: encodeprocs.ENC.pack(b"delta", 100, b"\0" * 32, 0.0, 0.0)  # type: ignore[method-assign]
        with pytest.raises(EncodeProcsError, match="encoding 'delta'"):
            enc.encode(data, frame)
        outside = memoryview(bytearray(4096))
        del enc._ask
        with pytest.raises(EncodeProcsError, match="outside the shared arena"):
            enc.prepare(outside, False)


def test_encoder_processes_end_with_the_put_and_take_no_working_directory(tmp_path, monkeypatch) -> None:
    """The processes run gpusnap's own modules: a numpy.py in the caller's working directory is not
    imported; closing the pool ends every process."""
    (tmp_path / "numpy.py").write_text("raise SystemExit('the working directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    with Arena(4 << 20) as arena:
        encs = EncodeProcs(2, arena)
        _wait_for_encoders(encs, 2)
        e = encs._free.get(timeout=10)
        v = arena.carve(PAGE * 4)
        p = e.prepare(v, True)
        assert p.zero and p.cid is None
        v[5] = 1
        p = e.prepare(v, True)
        assert not p.zero and p.cid is not None and len(p.cid) == 64
        encs._free.put(e)
        pids = [x.proc.pid for x in encs._all]
        encs.close()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


def test_default_count(monkeypatch) -> None:
    monkeypatch.setenv("GPUSNAP_ENCODE_PROCS", "0")
    assert encodeprocs.encode_procs() == 0
    monkeypatch.setenv("GPUSNAP_ENCODE_PROCS", "5")
    assert encodeprocs.encode_procs() == 5
    monkeypatch.delenv("GPUSNAP_ENCODE_PROCS")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert encodeprocs.encode_procs() == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert encodeprocs.encode_procs() == 12


def test_a_borrow_before_the_process_is_ready_gives_none_instead_of_waiting(tmp_path) -> None:
    with Arena(4 << 20) as arena, EncodeProcs(1, arena) as encs:
        with encs.borrowed() as e:
            assert e is None, "not ready yet (its imports take longer than this): the thread does the work"
        _wait_for_encoders(encs, 1)
        with encs.borrowed() as e:
            assert e is not None
            v = arena.carve(PAGE)
            v[0] = 7
            assert e.prepare(v, False).cid is not None


def test_an_encoder_runs_as_nobody_and_still_dies_with_its_parent(tmp_path) -> None:
    """Started by root, an encoder drops to nobody once it is ready (it needs only its descriptors
    and the arena), and the change of uid does not lose its parent-death signal."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with Arena(4 << 20) as arena, EncodeProcs(1, arena) as encs:
        _wait_for_encoders(encs, 1)
        e = encs._all[0]
        status = open(f"/proc/{e.proc.pid}/status").read()
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
        assert uids == [str(encodeprocs.NOBODY)] * 4, status
        v = arena.carve(PAGE * 8)
        v[:] = np.random.default_rng(1).bytes(PAGE * 8)
        f = arena.carve(PAGE * 10)
        got = e.encode(v, f)
        assert got.codec == "raw" and len(got.checksum) == 32


def test_a_stopped_encoder_fails_the_put_after_the_answer_timeout(tmp_path, monkeypatch) -> None:
    """An encoder that stops answering (SIGSTOP here) fails the put within GPUSNAP_ENCODE_TIMEOUT, with
    the process killed, instead of hanging it."""
    img = tmp_path / "images"
    img.mkdir()
    _weights_image(img / "pages-1.img", mib=64)
    monkeypatch.setenv("GPUSNAP_ENCODE_TIMEOUT", "2")
    monkeypatch.setattr(encodeprocs.EncodeProcs, "borrowed", _blocking_borrow)
    real_prepare = encodeprocs.Encoder.prepare
    stopped: list[int] = []

    def prepare(self, data, keys):
        if not stopped:
            stopped.append(self.proc.pid)
            os.kill(self.proc.pid, signal.SIGSTOP)
        return real_prepare(self, data, keys)
    monkeypatch.setattr(encodeprocs.Encoder, "prepare", prepare)
    st = SnapshotStore(str(tmp_path / "store"))
    t0 = time.monotonic()
    with pytest.raises(EncodeProcsError, match="did not answer within 2 s"):
        _put(st, str(img), "s", procs=2)
    assert time.monotonic() - t0 < 30
    assert st.names() == []
    with pytest.raises(ProcessLookupError):
        os.kill(stopped[0], 0)


def test_bad_settings_are_refused(monkeypatch) -> None:
    for name, bad in (("GPUSNAP_ENCODE_PROCS", "many"), ("GPUSNAP_ENCODE_PROCS", "-1"), ("GPUSNAP_ENCODE_PROCS", "10000"),
                      ("GPUSNAP_ENCODE_TIMEOUT", "0")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(EncodeProcsError, match=name):
            encodeprocs.encode_procs() if name.endswith("PROCS") else encodeprocs.answer_timeout()
        monkeypatch.delenv(name)


def test_a_stopped_encoder_dies_with_the_put_process(tmp_path) -> None:
    """The parent-death signal (set again after the change to nobody) kills an encoder that could not
    see the end of its pipe: one stopped when its parent is killed -9."""
    import subprocess
    import sys
    code = ("import sys, time; sys.path.insert(0, sys.argv[1])\n"
            "from storage.fs.directio import Arena\nfrom storage.pipeline.encodeprocs import EncodeProcs\n"
            "a = Arena(4 << 20); e = EncodeProcs(1, a)\n"
            "while not e._all[0].is_ready(): time.sleep(0.02)\n"
            "print(e._all[0].proc.pid, flush=True); time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code, str(Path(__file__).resolve().parents[1])],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        os.kill(pid, signal.SIGSTOP)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            try:
                if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.05)
        gone = not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
        assert gone, "a stopped encoder outlived its parent"
    finally:
        parent.kill()
