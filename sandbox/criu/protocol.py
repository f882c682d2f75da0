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
from typing import Callable

from sandbox.criu import split
from storage.errors import GpusnapError

CAPTURE_SOCKET = "streamer-capture.sock"
SERVE_SOCKET = "streamer-serve.sock"
_LEN = struct.Struct("<I")
_MAX_REQUEST = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_F_SETPIPE_SZ = 1031
PIPE_SIZE = 1 << 20        # the unprivileged maximum by default; fewer syscalls per GB
_BIG_PIPE = 16 << 20       # root may go past it: fewer wake-ups between CRIU and the pipeline
_ACCEPT_POLL_S = 0.1


class StreamerError(GpusnapError):
    """The image streamer could not serve CRIU (socket, protocol or pipe failure)."""


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


def recv_pipe(conn: socket.socket, writable: bool) -> int:
    """The pipe end CRIU passes for one image; anything else is refused."""
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
    for size in (_BIG_PIPE, PIPE_SIZE):
        try:
            fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
            break
        except OSError:
            continue  # over pipe-max-size without CAP_SYS_RESOURCE: a smaller pipe still works
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
