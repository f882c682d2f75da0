"""The `file:///PATH` backend: a remote in a directory (an NFS export, a shared volume, a PVC) that
other hosts may write too, and so as untrusted as an object store.

- The URL is made canonical at `remote add` (os.path.realpath); afterwards the root is walked from `/`
  one component at a time with O_NOFOLLOW, and every object below it through directory fds with
  O_NOFOLLOW: a link planted anywhere in the share (or in place of the root) is never followed.
- An object is written to `ROOT/tmp/` (O_EXCL, 0600), fsynced, renamed into place and its directory
  fsynced: it appears whole or not at all, as on S3; a killed put leaves only a file in tmp/, which
  `remote gc` removes once it is older than the lock stale time.
- An object is read only if it is a regular file: checked with lstat before it is opened (a FIFO or a
  device is never opened), opened with O_NONBLOCK and checked again on the fd; its size is checked
  against the caller's limit before a byte is read, and reads stop at the limit.
- Listings walk at most two directory levels below the prefix, list regular files only, and stop past
  the key bound; modification times are the file system's (the NFS server's) clock, which `now`
  reads from a file it creates, so lock ages never mix clocks.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
from contextlib import contextmanager
from typing import Iterator

from storage.remote.backend import (LIST_MAX_KEYS, BackendDamage, BackendError, BackendSpec, BackendStats, StreamedGets,
                                    BackendUnavailable, Deadline, ObjectInfo, Page, Sink, _env_float)

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_PIECE = 1 << 20
PAGE = 1000
TMP = "tmp"
_TRANSIENT = {errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.EINTR, errno.ENOLCK, errno.EBUSY}


def check_url(url: str) -> str:
    """'file:///ABS/PATH' in canonical form: absolute, no empty, '.' or '..' component."""
    if not isinstance(url, str) or not url.startswith("file://"):
        raise BackendError(f"{url!r} is not file:///PATH")
    path = url[len("file://"):]
    if not path.startswith("/") or "\0" in path:
        raise BackendError(f"{url!r} is not file:///PATH with an absolute PATH")
    parts = path.strip("/").split("/")
    if not path.strip("/") or any(p in ("", ".", "..") for p in parts):
        raise BackendError(f"{url!r}: the path is / or has an empty, '.' or '..' component")
    return "file:///" + "/".join(parts)


def canonical_url(url: str) -> str:
    """URL with its path resolved (links followed once, by the operator who runs `remote add`)."""
    return check_url("file://" + os.path.realpath(check_url(url)[len("file://"):]))


def open_file(spec: BackendSpec, deadline: Deadline) -> "FileBackend":
    return FileBackend(spec, deadline)


def _kind(mode: int) -> str:
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a directory" if stat.S_ISDIR(mode) else
            "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


class FileBackend(StreamedGets):
    """The Backend protocol over a directory tree."""

    def __init__(self, spec: BackendSpec, deadline: Deadline) -> None:
        self.who = f"remote {spec.name!r}"
        self.url = check_url(spec.url)
        self.root = self.url[len("file://"):]
        self.deadline = deadline
        self.stats = BackendStats()
        self._root_fd: int | None = None
        self._lock = threading.Lock()
        self._listings: dict[str, list[ObjectInfo]] = {}

    # ---- walking ----
    @contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            what = f"{self.who}: {doing} in {self.root} failed: {e.strerror or e}"
            if e.errno in _TRANSIENT:
                raise BackendUnavailable(what) from None
            if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO):
                raise BackendDamage(f"{self.who}: {doing}: something other than a file or directory is in the "
                                    f"way in {self.root} ({e.strerror}); a link is never followed") from None
            raise BackendError(what) from None

    def _open_root(self, create: bool) -> int:
        with self._lock:
            if self._root_fd is not None:
                return self._root_fd
            fd = os.open("/", _DIR)
            for part in self.root.strip("/").split("/"):
                fd = self._step(fd, part, create)  # closes the fd it is given, also when it raises
            self._root_fd = fd
            return fd

    def _step(self, fd: int, part: str, create: bool) -> int:
        """Directory PART of FD (made 0700 where missing and CREATE); FD is closed."""
        try:
            try:
                return os.open(part, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                return os.open(part, _DIR, dir_fd=fd)
        finally:
            os.close(fd)

    def _parent(self, key: str, create: bool = False) -> tuple[int, str]:
        """(an fd of KEY's directory, KEY's last component); FileNotFoundError where a directory on
        the way is missing (and not CREATE). The caller closes the fd."""
        parts = key.split("/")
        if any(p in ("", ".", "..") or p.startswith(".") or "\0" in p for p in parts):
            raise BackendError(f"{self.who}: {key!r} is not a key of a remote")
        fd = os.dup(self._open_root(create))
        for part in parts[:-1]:
            fd = self._step(fd, part, create)
        return fd, parts[-1]

    def _dl(self, deadline: Deadline | None, doing: str) -> Deadline:
        dl = deadline or self.deadline
        dl.check(doing, self.who)
        return dl

    def _open_object(self, key: str) -> int | None:
        """KEY opened for reading, checked to be a regular file before and after the open; None where
        it (or a directory on its way) is not there."""
        try:
            d, name = self._parent(key)
        except FileNotFoundError:
            return None
        try:
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if not stat.S_ISREG(st.st_mode):
                raise BackendDamage(f"{self.who}: {key} is {_kind(st.st_mode)}, not an object; not opened")
            try:
                fd = os.open(name, _READ, dir_fd=d)
            except FileNotFoundError:
                return None
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise BackendDamage(f"{self.who}: {key} is {_kind(st.st_mode)}, not an object; not read")
            return fd
        finally:
            os.close(d)

    # ---- the protocol ----
    def ensure(self, deadline: Deadline | None = None) -> None:
        self._dl(deadline, "creating the remote's directory")
        with self.errors("creating the remote's directory"):
            self._open_root(create=True)

    def put(self, key: str, data: bytes | bytearray | memoryview, deadline: Deadline | None = None) -> None:
        dl = self._dl(deadline, f"writing {key}")
        view = memoryview(data).cast("B")
        with self.errors(f"writing {key}"):
            d, name = self._parent(key, create=True)
            try:
                t, _ = self._parent(f"{TMP}/x", create=True)
                try:
                    tmp = f"{secrets.token_hex(16)}.tmp"
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=t)
                    try:
                        done = 0
                        while done < len(view):
                            dl.check(f"writing {key}", self.who)
                            done += os.write(fd, view[done:done + _PIECE])
                        os.fsync(fd)
                    except BaseException:
                        os.close(fd)
                        os.unlink(tmp, dir_fd=t)
                        raise
                    os.close(fd)
                    try:
                        os.rename(tmp, name, src_dir_fd=t, dst_dir_fd=d)
                    except BaseException:
                        os.unlink(tmp, dir_fd=t)
                        raise
                    os.fsync(d)
                finally:
                    os.close(t)
            finally:
                os.close(d)
        self.stats.count(sent=len(view))

    def get_stream(self, key: str, limit: int, sink: Sink, deadline: Deadline | None = None) -> bool:
        dl = self._dl(deadline, f"reading {key}")
        with self.errors(f"reading {key}"):
            fd = self._open_object(key)
            if fd is None:
                return False
            try:
                size = os.fstat(fd).st_size
                if size > limit:
                    raise BackendDamage(f"{self.who}: {key} claims {size} bytes, more than it can hold ({limit}); "
                                        "not read")
                got = 0
                while True:
                    dl.check(f"reading {key}", self.who)
                    piece = os.read(fd, min(_PIECE, limit - got + 1))
                    if not piece:
                        break
                    got += len(piece)
                    if got > limit:
                        raise BackendDamage(f"{self.who}: {key} goes on past {limit} bytes, more than it can hold; "
                                            "not read")
                    sink(piece)
            finally:
                os.close(fd)
        self.stats.count(received=got)
        return True

    def get_range_into(self, key: str, offset: int, length: int, buf: memoryview,
                       deadline: Deadline | None = None) -> int | None:
        assert 0 < length <= len(buf)
        dl = self._dl(deadline, f"reading {key}")
        with self.errors(f"reading {key}"):
            fd = self._open_object(key)
            if fd is None:
                return None
            try:
                size = os.fstat(fd).st_size
                if size < offset + length:
                    raise BackendDamage(f"{self.who}: {key} is {size} bytes, shorter than its index says "
                                        f"(bytes {offset}-{offset + length - 1} asked)")
                got = 0
                while got < length:
                    dl.check(f"reading {key}", self.who)
                    n = os.preadv(fd, [buf[got:min(length, got + _PIECE)]], offset + got)
                    if n <= 0:
                        raise BackendDamage(f"{self.who}: {key} answered {got} of the {length} bytes asked at "
                                            f"{offset} (shorter than its index says)")
                    got += n
            finally:
                os.close(fd)
        self.stats.count(received=length)
        return length

    def stat(self, key: str, deadline: Deadline | None = None) -> ObjectInfo | None:
        self._dl(deadline, f"checking {key}")
        with self.errors(f"checking {key}"):
            try:
                d, name = self._parent(key)
            except FileNotFoundError:
                return None
            try:
                st = os.stat(name, dir_fd=d, follow_symlinks=False)
            except FileNotFoundError:
                return None
            finally:
                os.close(d)
        self.stats.count()
        if not stat.S_ISREG(st.st_mode):
            raise BackendDamage(f"{self.who}: {key} is {_kind(st.st_mode)}, not an object")
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list_page(self, prefix: str, token: str | None, deadline: Deadline | None = None) -> Page:
        """The regular files whose key starts with PREFIX, sorted, served from one walk made on the
        first page (held until the last page, at most the key bound)."""
        dl = self._dl(deadline, f"listing {prefix}")
        if token is None:
            items = self._walk(prefix, dl)
            token = secrets.token_hex(8) + ":0"
            with self._lock:
                self._listings[token.split(":")[0]] = items
        lid, _, pos_s = token.partition(":")
        with self._lock:
            items = self._listings.get(lid, [])
            pos = int(pos_s) if pos_s.isdigit() else 0
            page = items[pos:pos + PAGE]
            done = pos + PAGE >= len(items)
            if done:
                self._listings.pop(lid, None)
        self.stats.count()
        return Page(page, None if done else f"{lid}:{pos + PAGE}")

    def _walk(self, prefix: str, dl: Deadline) -> list[ObjectInfo]:
        most = int(_env_float("GPUSNAP_REMOTE_LIST_MAX_KEYS", LIST_MAX_KEYS))
        base = prefix.rpartition("/")[0]
        out: list[ObjectInfo] = []

        def walk(fd: int, rel: str, depth: int) -> None:
            with os.scandir(fd) as it:
                for e in it:
                    dl.check(f"listing {prefix}", self.who)
                    if e.name.startswith("."):
                        continue
                    key = f"{rel}/{e.name}" if rel else e.name
                    if not (key.startswith(prefix) or (prefix.startswith(key + "/"))):
                        continue
                    st = e.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode) and depth < 2:
                        try:
                            sub = os.open(e.name, _DIR, dir_fd=fd)
                        except OSError:
                            continue  # swapped for a link or gone since: not listed
                        try:
                            walk(sub, key, depth + 1)
                        finally:
                            os.close(sub)
                    elif stat.S_ISREG(st.st_mode) and key.startswith(prefix):
                        out.append(ObjectInfo(key, st.st_size, st.st_mtime))
                        if len(out) > most:
                            raise BackendDamage(f"{self.who}: the listing of {prefix} goes on past {most} keys, more "
                                                "than a remote may hold; stopped (GPUSNAP_REMOTE_LIST_MAX_KEYS raises "
                                                "the bound)")

        with self.errors(f"listing {prefix}"):
            try:
                d, _ = self._parent(f"{base}/x" if base else "x")
            except FileNotFoundError:
                return []
            try:
                walk(d, base, 0)
            finally:
                os.close(d)
        out.sort(key=lambda o: o.key)
        return out

    def delete(self, key: str, deadline: Deadline | None = None) -> None:
        self._dl(deadline, f"deleting {key}")
        with self.errors(f"deleting {key}"):
            try:
                d, name = self._parent(key)
            except FileNotFoundError:
                return
            try:
                os.unlink(name, dir_fd=d)
                os.fsync(d)
            except FileNotFoundError:
                pass
            finally:
                os.close(d)
        self.stats.count()

    def now(self, deadline: Deadline | None = None) -> float:
        """The file system's clock: the modification time of a file made for the purpose."""
        self._dl(deadline, "reading the file system's clock")
        with self.errors("reading the file system's clock"):
            t, _ = self._parent(f"{TMP}/x", create=True)
            name = f"{secrets.token_hex(16)}.clock"
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=t)
                try:
                    return os.fstat(fd).st_mtime
                finally:
                    os.close(fd)
                    os.unlink(name, dir_fd=t)
            finally:
                os.close(t)

    def close(self) -> None:
        with self._lock:
            if self._root_fd is not None:
                os.close(self._root_fd)
                self._root_fd = None
