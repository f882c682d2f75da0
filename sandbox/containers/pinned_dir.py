"""A directory held open by fd for root-owned configuration edits: nothing is followed through a symlink.

Guarantees: the directory itself and every file in it are opened with O_NOFOLLOW (a symlink is
refused, never followed); every write is a new file in the same directory renamed over the old name
(readers see the old bytes or the new ones, never a mix), with the old file's mode and owner kept;
the directory is refused if group- or world-writable (someone else could swap what root runs or reads).
"""
from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from typing import Iterator

from storage.api import GpusnapError


class PinnedDirError(GpusnapError):
    """A directory or file that cannot be used safely (a symlink, writable by others, unreadable)."""


def _why(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "is a symbolic link; refusing to follow it"
    return (e.strerror or str(e)).lower()


class PinnedDir:
    """An open directory (use `pinned(path)`); names are plain file names inside it."""

    def __init__(self, path: str, fd: int, created: bool) -> None:
        self.path, self.fd, self.created = path, fd, created

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def read(self, name: str) -> bytes | None:
        """NAME's bytes, None if it does not exist; PinnedDirError if it is a symlink or not a file."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.fd)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise PinnedDirError(f"{os.path.join(self.path, name)}: {_why(e)}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise PinnedDirError(f"{os.path.join(self.path, name)}: not a regular file")
            chunks: list[bytes] = []
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    return b"".join(chunks)
                chunks.append(b)
        finally:
            os.close(fd)

    def write(self, name: str, data: bytes, mode: int = 0o644) -> None:
        """Replace NAME with DATA atomically (keeping an existing file's mode and owner; else MODE)."""
        old = self.lstat(name)
        if old is not None and not stat.S_ISREG(old.st_mode):
            raise PinnedDirError(f"{os.path.join(self.path, name)}: not a regular file; refusing to replace it")
        tmp = f".{name}.gpusnap-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self.fd)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if old is not None:
                    os.fchown(fd, old.st_uid, old.st_gid)
                os.fchmod(fd, stat.S_IMODE(old.st_mode) if old is not None else mode)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise
        os.fsync(self.fd)

    def readlink(self, name: str) -> str | None:
        try:
            return os.readlink(name, dir_fd=self.fd)
        except (FileNotFoundError, OSError):
            return None

    def symlink(self, name: str, target: str) -> None:
        """NAME -> TARGET, atomically; an existing NAME is replaced only if it is a symlink."""
        old = self.lstat(name)
        if old is not None and not stat.S_ISLNK(old.st_mode):
            raise PinnedDirError(f"{os.path.join(self.path, name)} exists and is not a link; refusing to replace it")
        tmp = f".{name}.gpusnap-{os.getpid()}"
        os.symlink(target, tmp, dir_fd=self.fd)
        os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def unlink(self, name: str) -> bool:
        try:
            os.unlink(name, dir_fd=self.fd)
            return True
        except FileNotFoundError:
            return False

    def is_empty(self) -> bool:
        return not os.listdir(self.fd)


def _open_dir(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


@contextmanager
def pinned(path: str, create: bool = False) -> Iterator[PinnedDir]:
    """PATH held open for the block (created 0755 if CREATE and missing; `.created` says so)."""
    path = os.path.abspath(path)
    created = False
    try:
        fd = _open_dir(path)
    except FileNotFoundError:
        if not create:
            raise PinnedDirError(f"{path}: no such directory") from None
        try:
            os.makedirs(path, 0o755)
        except OSError as e:
            raise PinnedDirError(f"cannot create {path}: {_why(e)}") from None
        created = True
        fd = _open_dir(path)
    except OSError as e:
        raise PinnedDirError(f"{path}: {_why(e)}") from None
    try:
        st = os.fstat(fd)
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise PinnedDirError(f"{path} is writable by group or others; refusing to put files root runs or "
                                 f"reads there (chmod go-w {path})")
        yield PinnedDir(path, fd, created)
    finally:
        os.close(fd)


def remove_if_empty(path: str) -> bool:
    """Remove directory PATH if it is empty (True), leave it otherwise (False)."""
    try:
        os.rmdir(path)
        return True
    except OSError:
        return False
