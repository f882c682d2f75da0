"""A put's per-chunk CPU work in processes of their own, off the put's GIL.

`put` runs one Python thread per chunk in flight. Each chunk's work (the zero test, the raw id, the
page keys, the codec's probes and planes, the stored checksum) is a dozen-odd calls into numpy,
libzstd and BLAKE3 that give the GIL up and must take it back on return; with 8-16 threads the
returns queue for the GIL, and the ingest stops at ~4-5 busy cores however many the machine has
(BENCHMARKS.md, sections 14, 19 and 26). Here each thread hands that work to an encoder process of
its own: two requests per chunk (prepare, encode) on a pipe, the bytes in a shared memory arena
(directio.Arena: the put's read blocks and encode frames are carved from it), so the thread holds
the GIL only for the store's bookkeeping.

The processes are gpusnap's own (this module in an isolated interpreter, storage/fs/isolated.py:
never the caller's working directory or PYTHON* variables), started for one put and ended with it; each dies
with the put's process (PR_SET_PDEATHSIG) and exits at the end of its request pipe. They see the
arena and two pipes, nothing else of the put. Their answers are checked (lengths, codec names,
payload bounds) before the parent uses them; the parent alone writes the store.

Request (parent -> process), REQ: op (1 prepare, 2 prepare with page keys, 3 encode), the chunk's
offset and length in the arena, the encode frame's offset and length (payload at HEADER_SIZE).
Answer: u8 status (0 ok, 1 error), u32 length, then that many bytes:
  prepare: PREP (zero, key count, raw id digest, seconds of the zero test, hash, keys), then the
           key count's int64 page indices and uint32 keys;
  encode:  ENC (codec name, payload length, stored checksum, seconds of the encoding and checksum);
  error:   the message, UTF-8.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from storage.codecs.registry import host_codecs
from storage.fs import isolated
from storage.format.chunkfile import HEADER_SIZE
from storage.base.settings import setting
from storage.base.errors import GpusnapError

if TYPE_CHECKING:
    import numpy as np

REQ = struct.Struct("<B7xQQQQ")
ANS = struct.Struct("<BI")
PREP = struct.Struct("<?3xI32sddd")
ENC = struct.Struct("<16sQ32sdd")
OP_PREPARE, OP_PREPARE_KEYS, OP_ENCODE = 1, 2, 3
READY = b"R"  # the process's first byte, once its imports are done
ANSWER_MOST = 1 << 20  # a chunk's page keys are a few KiB; anything larger is not an answer of ours
STOP_WAIT_S = 5.0
ANSWER_TIMEOUT_S = 120.0


class EncodeProcsError(GpusnapError):
    """An encoder process failed, exited, or answered something that is not an answer."""


PROCS_MOST = 64


def encode_procs() -> int:
    """Encoder processes for a put of page images: $GPUSNAP_ENCODE_PROCS (0: none, the put's threads
    do the work; at most PROCS_MOST), by default one per core but four (left to CRIU, the readers
    and the store's writes), at most 12, and none on a machine of fewer than 8 cores (there the GIL
    is not what limits a put: its cores are)."""
    n = setting("GPUSNAP_ENCODE_PROCS", None, int, lambda n: 0 <= n <= PROCS_MOST,
                f"a number of processes from 0 to {PROCS_MOST}", EncodeProcsError)
    if n is not None:
        return int(n)
    cores = os.cpu_count() or 1
    return 0 if cores < 8 else max(2, min(12, cores - 4))


def answer_timeout() -> float:
    """Seconds an encoder process may take to answer one request ($GPUSNAP_ENCODE_TIMEOUT, default
    ANSWER_TIMEOUT_S): one chunk's work takes milliseconds, so a process that does not answer in that
    time is stopped or stuck, and the put fails instead of waiting for it forever."""
    return float(setting("GPUSNAP_ENCODE_TIMEOUT", ANSWER_TIMEOUT_S, int, lambda t: 1 <= t <= 86400,
                         "seconds from 1 to 86400", EncodeProcsError))


def check_settings() -> None:
    """EncodeProcsError now for a bad GPUSNAP_ENCODE_PROCS or GPUSNAP_ENCODE_TIMEOUT (a dump reads
    them before CRIU starts, so a typo fails it before the tree is touched)."""
    encode_procs()
    answer_timeout()


@dataclass
class Prepared:
    zero: bool
    cid: str | None
    sample: tuple[np.ndarray, np.ndarray] | None
    zero_s: float
    hash_s: float
    keys_s: float


@dataclass
class Encoded:
    codec: str
    length: int
    checksum: bytes
    encode_s: float
    check_s: float


class Encoder:
    """One encoder process, used by one thread at a time (EncodeProcs.borrowed)."""

    def __init__(self, proc: subprocess.Popen[bytes], req_w: int, ans_r: int, arena: Any,
                 timeout: float = ANSWER_TIMEOUT_S) -> None:
        self.proc, self._w, self._r, self._arena = proc, req_w, ans_r, arena
        self.broken = False
        self.ready = False
        self.timeout = timeout
        self._poll = select.poll()  # not select(): descriptors above 1023 are common in services
        self._poll.register(ans_r, select.POLLIN)

    def is_ready(self) -> bool:
        """Whether the process has said it is ready (READY, once its imports are done); never blocks.
        A process that exited or said anything else is broken: the put fails at its next request."""
        if not self.ready and not self.broken:
            if self._poll.poll(0):
                b = os.read(self._r, 1)
                self.ready = b == READY
                self.broken = not self.ready
                if self.broken:
                    raise self._exited() if not b else EncodeProcsError(
                        f"encoder process {self.proc.pid} did not say it was ready")
        return self.ready

    def _ask(self, op: int, data: memoryview, out: memoryview | None) -> bytes:
        if self.broken:
            raise EncodeProcsError(f"encoder process {self.proc.pid} failed earlier")
        try:
            d_off = self._arena.offset_of(data)
            o_off = self._arena.offset_of(out) if out is not None else 0
        except ValueError as e:
            raise EncodeProcsError(str(e)) from None
        self.broken = True  # until a whole answer is back
        try:
            os.write(self._w, REQ.pack(op, d_off, len(data), o_off, len(out) if out is not None else 0))
            status, n = ANS.unpack(self._read(ANS.size))
            if n > ANSWER_MOST:
                raise EncodeProcsError(f"encoder process {self.proc.pid} answered {n} bytes")
            body = self._read(n)
        except BrokenPipeError:
            raise self._exited() from None
        except OSError as e:
            raise EncodeProcsError(f"encoder process {self.proc.pid}: {e.strerror or e}") from None
        if status != 0:
            raise EncodeProcsError(f"encoder process {self.proc.pid}: "
                                   f"{body.decode('utf-8', 'replace')[:300]}")
        self.broken = False
        return body

    def _read(self, n: int) -> bytes:
        parts, got = [], 0
        deadline = time.monotonic() + self.timeout
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self._poll.poll(int(left * 1000) + 1):
                if time.monotonic() >= deadline:
                    self.proc.kill()
                    raise EncodeProcsError(f"encoder process {self.proc.pid} did not answer within "
                                           f"{self.timeout:g} s (GPUSNAP_ENCODE_TIMEOUT); stopped")
                continue
            b = os.read(self._r, n - got)
            if not b:
                raise self._exited()
            parts.append(b)
            got += len(b)
        return b"".join(parts)

    def _exited(self) -> EncodeProcsError:
        try:
            rc = self.proc.wait(1.0)
        except subprocess.TimeoutExpired:
            rc = None
        return EncodeProcsError(f"encoder process {self.proc.pid} exited"
                                + (f" (status {rc})" if rc is not None else ""))

    def prepare(self, data: memoryview, keys: bool) -> Prepared:
        """DATA's zero test and, when it is not all zeros, its raw id and (KEYS) its sampled page keys."""
        body = self._ask(OP_PREPARE_KEYS if keys else OP_PREPARE, data, None)
        if len(body) < PREP.size:
            raise EncodeProcsError(f"encoder process {self.proc.pid}: short prepare answer")
        zero, nk, digest, zs, hs, ks = PREP.unpack_from(body)
        rest = memoryview(body)[PREP.size:]
        pages = len(data) // 4096
        if nk > pages or len(rest) != nk * 12 or (zero and nk):
            raise EncodeProcsError(f"encoder process {self.proc.pid}: {nk} page keys for {pages} pages")
        sample = None
        if keys and not zero:
            import numpy as np  # noqa: PLC0415 - loaded by a put's page keys by then; nothing else needs it
            at = np.frombuffer(rest[:nk * 8], dtype="<i8").copy()
            kept = np.frombuffer(rest[nk * 8:], dtype="<u4").copy()
            if nk and (int(at.min()) < 0 or int(at.max()) >= pages):
                raise EncodeProcsError(f"encoder process {self.proc.pid}: a page key outside the chunk")
            sample = (at, kept)
        return Prepared(bool(zero), None if zero else digest.hex(), sample, zs, hs, ks)

    def encode(self, data: memoryview, frame: memoryview) -> Encoded:
        """DATA's plain encoding (codecs.HostCodecChooser.encode_into) into FRAME[HEADER_SIZE:] (nothing
        written for "raw": the payload is DATA), with the stored checksum of its GSNPCHK2 header and payload."""
        body = self._ask(OP_ENCODE, data, frame)
        if len(body) != ENC.size:
            raise EncodeProcsError(f"encoder process {self.proc.pid}: encode answer of {len(body)} bytes")
        name, m, checksum, es, cs = ENC.unpack(body)
        codec = name.rstrip(b"\0").decode("ascii", "replace")
        if codec not in host_codecs() or (codec == "raw" and m != len(data)) or \
                (codec != "raw" and not 0 < m <= len(frame) - HEADER_SIZE):
            raise EncodeProcsError(f"encoder process {self.proc.pid}: encoding {codec!r} of {m} bytes "
                                   f"for {len(data)}")
        return Encoded(codec, m, checksum, es, cs)


class EncodeProcs:
    """COUNT encoder processes sharing ARENA (directio.Arena) with this one; threads borrow one each.

    Started from the thread that runs the put (a process's PR_SET_PDEATHSIG fires when the thread
    that started it ends, and this one outlives the put), which waits only for the exec: each
    process says it is ready once its imports are done, and until then `borrowed` gives None (the
    thread does the chunk's work itself), so a small put never waits for start-up. A process that
    cannot be started leaves its share of the work to the threads."""

    def __init__(self, count: int, arena: Any, level: int = 1, compress: bool = True) -> None:
        self.arena = arena
        self._free: queue.SimpleQueue[Encoder] = queue.SimpleQueue()
        self._all: list[Encoder] = []
        self._level, self._compress = level, compress
        self._timeout = answer_timeout()
        try:
            for _ in range(count):
                try:
                    enc = self._start_one()
                except OSError:
                    break
                self._all.append(enc)
                self._free.put(enc)
        except BaseException:  # an interrupt while starting them: none is left behind
            self.close()
            raise

    def _start_one(self) -> Encoder:
        req_r, req_w = os.pipe2(os.O_CLOEXEC)
        ans_r, ans_w = os.pipe2(os.O_CLOEXEC)
        try:
            args = isolated.python_argv("storage.pipeline.encodeprocs", str(self.arena.fd), str(self.arena.size), str(req_r),
                                        str(ans_w), str(self._level), "1" if self._compress else "0", str(os.getpid()))
            # a session of its own: a ^C at the terminal is the put's to handle (it then ends them)
            proc = subprocess.Popen(args, pass_fds=(self.arena.fd, req_r, ans_w), cwd="/",
                                    stdin=subprocess.DEVNULL, close_fds=True, start_new_session=True)
        except BaseException:
            for fd in (req_r, req_w, ans_r, ans_w):
                os.close(fd)
            raise
        os.close(req_r)
        os.close(ans_w)
        return Encoder(proc, req_w, ans_r, self.arena, self._timeout)

    @contextmanager
    def borrowed(self) -> Iterator[Encoder | None]:
        """An idle encoder process for this thread, or None when none is (not ready yet, or all busy)."""
        try:
            enc: Encoder | None = self._free.get_nowait()
        except queue.Empty:
            enc = None
        if enc is not None and not enc.is_ready():
            self._free.put(enc)
            enc = None
        try:
            yield enc
        finally:
            if enc is not None and not enc.broken:
                self._free.put(enc)

    def kill(self) -> None:
        """Stop every process at once (a put that failed or was interrupted, before its threads are
        joined: a thread waiting on an answer then gets the end of the pipe); nothing is borrowed again."""
        for e in self._all:
            e.broken = True
            try:
                e.proc.kill()
            except OSError:
                pass

    @contextmanager
    def killed_on_error(self) -> Iterator[None]:
        """kill() when the block fails (put: inside its worker pool, so the kill comes before the join)."""
        try:
            yield
        except BaseException:
            self.kill()
            raise

    def close(self) -> None:
        """End every process: the end of its request pipe, then SIGKILL after STOP_WAIT_S (the put's
        threads are joined by then)."""
        encs = list(self._all)
        for e in encs:
            e.broken = True
        for e in encs:
            try:
                os.close(e._w)
            except OSError:
                pass
        deadline = time.monotonic() + STOP_WAIT_S
        for e in encs:
            try:
                e.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                e.proc.kill()
                e.proc.wait()
            try:
                os.close(e._r)
            except OSError:
                pass

    def __enter__(self) -> "EncodeProcs":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the encoder process ----------------------------------------------------------------------

def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the put's process died before the signal was set
        os._exit(1)


NOBODY = 65534


def _drop_privileges() -> None:
    """An encoder needs nothing but the descriptors and the mapping it holds: as root it becomes
    nobody, with no supplementary groups and no way back (PR_SET_NO_NEW_PRIVS), so that a flaw in a
    codec reached by a tenant's bytes does not run as root. Best effort: where the uid cannot be
    changed (a user namespace without it mapped) it stays as it is."""
    if os.geteuid() != 0:
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    except (OSError, AttributeError):
        pass


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def child_main(argv: list[str]) -> None:
    """The encoder process: answer requests until the end of the request pipe."""
    mfd, size, req_r, ans_w, level, compress, parent = (int(a) for a in argv)
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is the put's to handle; it closes the pipes
    from storage.codecs import pagekeys  # noqa: PLC0415 - after the parent check: nothing heavy for an orphan
    from storage.format.chunkfile import ChunkHeader, raw_chunk_id, stored_digest  # noqa: PLC0415
    from storage.codecs.registry import HostCodecChooser  # noqa: PLC0415
    from storage.fs.directio import is_zero  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    m = mmap.mmap(mfd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(mfd)
    arena = memoryview(m)
    chooser = HostCodecChooser(level=level, compress=bool(compress))
    # every lazy import and per-thread buffer taken now, while the modules are surely readable
    warm = memoryview(bytearray(np.arange(1 << 17, dtype="<u2").tobytes()))
    frame = memoryview(bytearray(HEADER_SIZE + len(warm)))
    is_zero(warm)
    raw_chunk_id(warm)
    pagekeys.sampled(warm)
    codec, n = chooser.encode_into(warm, frame[HEADER_SIZE:])
    stored_digest(ChunkHeader(codec, len(warm), n, True), warm if codec == "raw" else frame[HEADER_SIZE:HEADER_SIZE + n])
    _drop_privileges()
    _die_with_parent(parent)  # again: a change of uid clears the parent-death signal
    os.write(ans_w, READY)

    def answer(status: int, body: bytes) -> None:
        out = memoryview(ANS.pack(status, len(body)) + body)
        while out:
            out = out[os.write(ans_w, out):]

    while True:
        req = _read_exact(req_r, REQ.size)
        if req is None:
            return
        op, d_off, d_len, o_off, o_len = REQ.unpack(req)
        try:
            if d_off + d_len > size or o_off + o_len > size:
                raise ValueError("a request outside the arena")
            data = arena[d_off:d_off + d_len]
            if op in (OP_PREPARE, OP_PREPARE_KEYS):
                t0 = time.perf_counter()
                zero = is_zero(data)
                t1 = time.perf_counter()
                digest, at, kept = b"\0" * 32, np.empty(0, "<i8"), np.empty(0, "<u4")
                t2 = t3 = t1
                if not zero:
                    digest = bytes.fromhex(raw_chunk_id(data))
                    t2 = time.perf_counter()
                    if op == OP_PREPARE_KEYS:
                        a, k = pagekeys.sampled(data)
                        at, kept = a.astype("<i8"), k.astype("<u4")
                    t3 = time.perf_counter()
                body = PREP.pack(zero, len(at), digest, t1 - t0, t2 - t1, t3 - t2) + at.tobytes() + kept.tobytes()
                answer(0, body)
            elif op == OP_ENCODE:
                frame = arena[o_off:o_off + o_len]
                t0 = time.perf_counter()
                codec, n = chooser.encode_into(data, frame[HEADER_SIZE:])
                t1 = time.perf_counter()
                payload = data if codec == "raw" else frame[HEADER_SIZE:HEADER_SIZE + n]
                check = stored_digest(ChunkHeader(codec, d_len, n, True), payload)
                answer(0, ENC.pack(codec.encode("ascii"), n, check, t1 - t0, time.perf_counter() - t1))
            else:
                raise ValueError(f"unknown request {op}")
        except Exception as e:  # noqa: BLE001 - the parent raises it as EncodeProcsError
            answer(1, f"{type(e).__name__}: {e}".encode("utf-8", "replace"))


if __name__ == "__main__":
    child_main(sys.argv[1:])
