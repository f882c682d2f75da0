"""Trees removed without recursion and without following links.

Guarantees kept here: a tree is removed through directory file descriptors only (openat with
O_NOFOLLOW | O_DIRECTORY, unlinkat, renameat), so a symbolic link in it is removed as a link and
never followed; the walk is an explicit stack, not recursion, so no depth of tree makes it fail with
a RecursionError; it holds at most MAX_OPEN_DIRS directory fds, moving anything deeper up to the
top of the tree being removed (a rename within the tree) and going on from there, so no depth makes
it run out of file descriptors; and it never crosses into another file system (a mount point inside
the tree stops it: TreeError, the mount and what it holds left alone).
"""
from __future__ import annotations

import errno
import os

from storage.base.errors import GpusnapError

MAX_OPEN_DIRS = 64  # directory fds one removal holds at most (below the usual soft limit of 1024)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TreeError(GpusnapError):
    """A tree that cannot be removed as it stands (a mount point in it, not a directory, another owner)."""


def remove_tree(parent_fd: int, name: str, where: str, *, uid: int | None = None) -> None:
    """Remove directory NAME of PARENT_FD and everything in it. With UID: only if it is a real directory
    of that user (else TreeError, nothing removed). WHERE names it in messages."""
    try:
        top = os.open(name, _DIR, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise TreeError(f"{where} is not a directory; left alone") from None
        raise
    try:
        st = os.fstat(top)
        if uid is not None and st.st_uid != uid:
            raise TreeError(f"{where} is owned by uid {st.st_uid}, not uid {uid}; left alone")
        empty_tree(top, where)
    finally:
        os.close(top)
    os.rmdir(name, dir_fd=parent_fd)


def empty_tree(top: int, where: str, uid: int | None = None) -> None:
    """Remove everything in the open directory TOP (kept open, left empty), iteratively. With UID: every
    directory descended into must be that user's (checked on the fd it is emptied through; TreeError
    otherwise), so what is removed is only what UID could have removed itself."""
    dev = os.fstat(top).st_dev
    stack: list[tuple[int, str]] = [(top, "")]   # (fd, its name in the directory below it on the stack)
    moved = 0
    try:
        while stack:
            fd = stack[-1][0]
            child = _first_subdir(fd, dev, where, uid)
            if child is not None:
                cname, cfd = child
                if len(stack) < MAX_OPEN_DIRS:
                    stack.append((cfd, cname))
                    continue
                os.close(cfd)   # too deep to hold: move it up to TOP, where the walk will come back to it
                while True:
                    moved += 1
                    try:
                        os.rename(cname, f".gpusnap-rm.{moved}", src_dir_fd=fd, dst_dir_fd=top)
                        break
                    except OSError as e:
                        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                            raise
                continue
            if fd == top:
                return
            _, name = stack.pop()
            os.close(fd)
            try:
                os.rmdir(name, dir_fd=stack[-1][0])
            except OSError as e:
                if e.errno == errno.ENOTEMPTY:
                    raise TreeError(f"{where}: changed while being removed; run again") from None
                if e.errno != errno.ENOENT:
                    raise
    finally:
        for fd, _ in stack[1:]:
            os.close(fd)


def _first_subdir(fd: int, dev: int, where: str, uid: int | None = None) -> tuple[str, int] | None:
    """Unlink every non-directory in FD; return the first subdirectory found (its name and an fd of it),
    or None when FD holds nothing any more."""
    with os.scandir(fd) as it:
        names = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in names:
        if not is_dir:
            try:
                os.unlink(name, dir_fd=fd)
                continue
            except FileNotFoundError:
                continue
            except IsADirectoryError:
                pass  # swapped for a directory since the scan: descend into it
        try:
            cfd = os.open(name, _DIR, dir_fd=fd)
        except FileNotFoundError:
            continue
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):  # swapped for a link or a file: removed, not followed
                os.unlink(name, dir_fd=fd)
                continue
            raise
        st = os.fstat(cfd)
        if st.st_dev != dev:
            os.close(cfd)
            raise TreeError(f"{where}: another file system is mounted inside it; left alone")
        if uid is not None and st.st_uid != uid:
            os.close(cfd)
            raise TreeError(f"{where}: holds a directory {name!r} of uid {st.st_uid}, not uid {uid}; left alone")
        return name, cfd
    return None


def foreign_entry(top: int, uid: int, where: str, *, dirs_only: bool = False) -> str | None:
    """The first entry under the open directory TOP (no link followed, not past a mount) that is not UID's
    (with DIRS_ONLY: the first such directory), described; None when there is none. Holds at most one
    directory fd besides TOP."""
    dev = os.fstat(top).st_dev
    stack: list[tuple[str, ...]] = [()]
    while stack:
        rel = stack.pop()
        fd = _open_rel(top, rel)
        try:
            with os.scandir(fd) as it:
                ents = list(it)
            for e in ents:
                st = e.stat(follow_symlinks=False)
                path = "/".join((where, *rel, e.name))
                is_dir = e.is_dir(follow_symlinks=False)
                if st.st_uid != uid and (is_dir or not dirs_only):
                    return f"{path} (uid {st.st_uid})"
                if is_dir:
                    if st.st_dev != dev:
                        return f"{path} (another file system)"
                    stack.append((*rel, e.name))
        finally:
            if fd != top:
                os.close(fd)
    return None


def _open_rel(top: int, rel: tuple[str, ...]) -> int:
    fd = top
    for comp in rel:
        nfd = os.open(comp, _DIR, dir_fd=fd)
        if fd != top:
            os.close(fd)
        fd = nfd
    return fd
