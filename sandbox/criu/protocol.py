"""CRIU's image-streamer wire protocol (`criu --stream`), as gpusnap serves it.

CRIU 4.x can hand every image to an *image streamer* instead of writing files: it connects to the
unix socket `streamer-capture.sock` (dump) or `streamer-serve.sock` (restore) in the images
directory and, per image, sends a request (a little-endian uint32 length, then a protobuf
`{1: filename}`); on restore the streamer answers `{1: exists}`; then CRIU passes one end of a pipe
(SCM_RIGHTS, with one byte of data) and writes or reads that image through it. The dump side's
source is sandbox.criu.capture, the restore side's sandbox.criu.serve.

Guarantees kept here: filenames from the socket are checked (one plain name, no path, not one of
the sockets), a request is bounded (4 KiB), and a pipe end of the expected direction is the only
descriptor taken (anything else passed is closed and refused).
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import socket
import stat
import struct
from typing import Any, Callable

from sandbox.criu import split
from storage.api import GpusnapError
from storage.api import setting

CAPTURE_SOCKET = "streamer-capture.sock"
SERVE_SOCKET = "streamer-serve.sock"
_LEN = struct.Struct("<I")
_MAX_REQUEST = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_F_SETPIPE_SZ = 1031
PIPE_SIZE = 1 << 20        # the unprivileged maximum by default; fewer syscalls per GB
BIG_PIPE = 16 << 20        # root may go past it: fewer wake-ups between CRIU and the pipeline
_ACCEPT_POLL_S = 0.1
DUMP_PIPE = BIG_PIPE       # page images on dump; see dump_pipe_size
DUMP_PIPE_MOST = 1 << 30


class StreamerError(GpusnapError):
    """The image streamer could not serve CRIU (socket, protocol or pipe failure)."""


def dump_pipe_size() -> int:
    """$GPUSNAP_DUMP_PIPE: the bytes each page image's pipe from CRIU is grown to on dump (PIPE_SIZE to
    DUMP_PIPE_MOST; default DUMP_PIPE, 16 MiB).

    CRIU moves a process's pages in rounds: its parasite maps up to 8 pipes of ~3.2 MiB each
    (PIPE_MAX_SIZE in its page-pipe.h) with the target's pages, then CRIU splices them into the image's
    pipe, then the next round. While the image's pipe is full CRIU waits, and while the parasite
    maps the next round the pipe drains. A pipe that holds a whole round lets CRIU go on to the next
    one while gpusnap copies the last, instead of waiting for half of it to be copied first: at
    38 GB CRIU's page dump was the dump's serial stage (1.6-2.6 GB/s, the pipeline waiting on it).
    On the 2-core dev VM, where the pipeline rather than CRIU bounds the dump, 64 MiB asked under a
    64 MiB limit made no difference (4.01 against 3.99 s for 4 GB, six paired dumps); whether it
    does where CRIU bounds the dump is measured by scripts/device/probe_pipes.py."""
    n: int = setting("GPUSNAP_DUMP_PIPE", DUMP_PIPE, int, lambda n: PIPE_SIZE <= n <= DUMP_PIPE_MOST,
                     f"a number of bytes from {PIPE_SIZE} to {DUMP_PIPE_MOST}", StreamerError)
    return n


CRIU_PAGE_PIPE = 8 * 4096 * 4096 // 40  # CRIU's PIPE_MAX_SIZE (page-pipe.h), in bytes: ~3.2 MiB per page pipe


def cap_sys_resource() -> bool:
    """Whether this process holds CAP_SYS_RESOURCE (which lifts fs.pipe-max-size for its pipes)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 24 & 1)
    except (OSError, ValueError):
        pass
    return False


def pipe_limits() -> dict[str, Any]:
    """How large this process may grow a pipe: fs.pipe-max-size, whether CAP_SYS_RESOURCE lifts it, and
    what that leaves for a dump's pipe (asked: dump_pipe_size(), or the setting's error; allowed: where
    recv_pipe's halving stops) and for CRIU's own page pipes (a CRIU run by this user under the same limit)."""
    try:
        max_size: int | None = int(open("/proc/sys/fs/pipe-max-size").read())
    except (OSError, ValueError):
        max_size = None
    cap = cap_sys_resource()
    try:
        asked: int | str = dump_pipe_size()
    except StreamerError as e:
        asked = str(e)
    limit = None if cap else max_size
    allowed = asked if isinstance(asked, int) else None
    while allowed is not None and limit is not None and allowed > limit and allowed > PIPE_SIZE:
        allowed //= 2
    return {"pipe_max_size": max_size, "cap_sys_resource": cap, "dump_pipe": asked, "dump_pipe_allowed": allowed,
            "criu_page_pipe": CRIU_PAGE_PIPE if limit is None else min(CRIU_PAGE_PIPE, limit)}


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    """N bytes, or None if the peer closed before the first one."""
    buf = bytearray()
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            if not buf:
                return None
            raise StreamerError("CRIU closed the streamer socket in the middle of a request")
        buf += got
    return bytes(buf)


def _varint(data: bytes, i: int) -> tuple[int, int]:
    r = split.read_varint(data, i, max_shift=35)
    if r is None:
        raise StreamerError("malformed request from CRIU (bad varint)")
    return r


def parse_request(msg: bytes) -> str:
    """The filename of an img_streamer_request_entry ({1: string}); other fields are skipped."""
    i, name = 0, None
    while i < len(msg):
        key, i = _varint(msg, i)
        field, wire = key >> 3, key & 7
        if wire == 2:
            ln, i = _varint(msg, i)
            if i + ln > len(msg):
                raise StreamerError("malformed request from CRIU (truncated field)")
            if field == 1:
                name = msg[i:i + ln].decode("utf-8", "replace")
            i += ln
        elif wire == 0:
            _, i = _varint(msg, i)
        else:
            raise StreamerError(f"malformed request from CRIU (wire type {wire})")
    if name is None or not _NAME.fullmatch(name) or name in (CAPTURE_SOCKET, SERVE_SOCKET):
        raise StreamerError(f"CRIU asked for an image with an unacceptable name: {name!r}")
    return name


def encode_request(name: str) -> bytes:
    """The request CRIU sends (for tests that play CRIU's side)."""
    raw = name.encode()
    body = b"\x0a" + _encode_varint(len(raw)) + raw
    return _LEN.pack(len(body)) + body


def _encode_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def read_request(conn: socket.socket) -> str | None:
    """The image name of CRIU's next request; None once CRIU closed the socket between requests."""
    head = _recv_exact(conn, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > _MAX_REQUEST:
        raise StreamerError(f"request from CRIU too long ({n} bytes)")
    body = _recv_exact(conn, n) if n else b""
    if body is None:
        raise StreamerError("CRIU closed the streamer socket in the middle of a request")
    return parse_request(body)


def send_reply(conn: socket.socket, exists: bool) -> None:
    """The restore side's answer: whether the image CRIU asked for exists."""
    body = b"\x08" + (b"\x01" if exists else b"\x00")
    conn.sendall(_LEN.pack(len(body)) + body)


def recv_pipe(conn: socket.socket, writable: bool, size: int = BIG_PIPE) -> int:
    """The pipe end CRIU passes for one image, grown to SIZE bytes where the kernel allows (else to the
    largest of SIZE/2, SIZE/4, ... down to PIPE_SIZE that it allows); anything else is refused."""
    _msg, fds, _flags, _addr = socket.recv_fds(conn, 1, 4)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise StreamerError(f"CRIU passed {len(fds)} descriptors for one image (expected one pipe)")
    fd = fds[0]
    st = os.fstat(fd)
    mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    if not stat.S_ISFIFO(st.st_mode) or mode != (os.O_WRONLY if writable else os.O_RDONLY):
        os.close(fd)
        raise StreamerError("CRIU passed something other than the expected pipe end")
    while size >= PIPE_SIZE:
        try:
            fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
            break
        except OSError:
            # EPERM: over pipe-max-size without CAP_SYS_RESOURCE; ENOMEM: the kernel found no contiguous
            # room for the ring's slots (40 bytes per 4 KiB page: 640 KiB for 64 MiB). A smaller pipe still works.
            size //= 2
    return fd


class Listener:
    """The socket CRIU connects to, in DIRECTORY; accept() gives up when STOP says so."""

    def __init__(self, directory: str, name: str) -> None:
        self.path = os.path.join(directory, name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(self.path)
            os.chmod(self.path, 0o600)
            self.sock.listen(1)
        except OSError as e:
            self.sock.close()
            raise StreamerError(f"cannot listen on {self.path}: {e.strerror}") from None
        self.sock.settimeout(_ACCEPT_POLL_S)

    def accept(self, stop: Callable[[], bool]) -> socket.socket | None:
        while not stop():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            return conn
        return None

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def write_all(fd: int, data: bytes | memoryview) -> None:
    """All of DATA into FD (a pipe to CRIU); a short write is EPIPE."""
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        if n <= 0:
            raise OSError(errno.EPIPE, "short write")
        view = view[n:]
