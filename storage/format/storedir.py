"""The layout of a store root and its directories, opened without following links: the store owner's real directory, or damage.

Every name under a store root (FORMAT.md, "Directory layout") is one constant here; other modules
build no store path of their own (the exceptions still to move: storage/repo/damage.py's record name,
and the "packs" that storage/repo/readstage.py asks subdir for).

Guarantees kept here: every directory is opened relative to a directory fd already checked, with
O_NOFOLLOW | O_DIRECTORY, and accepted only if fstat says it is a directory owned by the store's
owner; a symlink, a file or a directory of another user where a store directory belongs raises
StoreDamage naming it, and nothing in or under it is read, written or deleted. Trees are removed
with fd-relative calls that never descend through a link, without recursion (storage/fs/treewalk.py).
"""
from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from typing import Iterator

from storage.fs import treewalk
from storage.base.errors import DamageError, GpusnapError

# ---- the layout ------------------------------------------------------------------------------
MARKER = "gpusnap-store.json"   # the store's format and version
LOCK = "lock"                   # flock(2) target: shared by writers and readers, exclusive by gc/repair
SNAPSHOTS = "snapshots"         # committed manifests, NAME.json
PACKS = "packs"                 # pack files (version 3)
INDEX = "index"                 # the index of each pack
CHUNKS = "chunks"               # chunk files of version 1/2 stores, in XY/ subdirectories
NAMES = "names"                 # NAME.lock: one writer per snapshot name
TMP = "tmp"                     # temporary entries, named after their owners
QUARANTINE = "quarantine"       # damaged chunks set aside by verify, and their records
LOGS = "logs"                   # logs of failed CRIU/runsc runs, for the user
JOURNAL = "journal"             # operations in flight
REMOTES = "remotes"             # configured remotes
FILES_CACHE = "files-cache.json"
SUBDIRS = (SNAPSHOTS, CHUNKS, TMP, NAMES, PACKS, INDEX)  # made with every new store
PACK_DIRS = (PACKS, INDEX)                               # made by the upgrade of a version 1/2 store


def chunk_dir_name(cid: str) -> str:
    """The subdirectory of chunks/ that a version 1/2 chunk file of CID lies in (XY)."""
    return cid[:2]


def manifest_entry(name: str) -> str:
    """The entry of snapshots/ holding snapshot NAME's manifest (NAME already validated)."""
    return name + ".json"


def quarantine_record(cid: str) -> str:
    """The entry of quarantine/ recording why chunk CID was set aside."""
    return cid + ".json"


def name_lock_entry(name: str) -> str:
    """The entry of names/ that NAME's one writer holds (NAME already validated)."""
    return name + ".lock"


def path_in(store_path: str, *parts: str) -> str:
    """The path of PARTS under the store root STORE_PATH (for messages and for tools that take a
    path, such as CRIU's log directory; gpusnap itself opens store entries through checked fds)."""
    return os.path.join(store_path, *parts)


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class StoreDamage(DamageError):
    """A store entry that is not what the format says it is (a link, a foreign or misplaced entry)."""


class StoreAccessError(GpusnapError):
    """A store directory this user may not read or write."""


def _describe(dir_fd: int, name: str) -> str:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as e:
        return e.strerror or str(e)
    if stat.S_ISLNK(st.st_mode):
        return f"a symbolic link (to {os.readlink(name, dir_fd=dir_fd)!r})"
    if stat.S_ISDIR(st.st_mode):
        return f"a directory owned by uid {st.st_uid}"
    return "not a directory"


def open_dir(parent_fd: int, name: str, uid: int, where: str) -> int:
    """NAME under PARENT_FD opened as a directory fd; StoreDamage unless a real directory of UID.

    WHERE names it in messages (e.g. "chunks/ab"). FileNotFoundError is raised as is."""
    try:
        fd = os.open(name, _DIR, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise StoreDamage(f"{where} is {_describe(parent_fd, name)}, not a directory of the store; "
                              "left alone") from None
        if e.errno == errno.EACCES:
            raise StoreAccessError(f"{where}: permission denied") from None
        raise
    st = os.fstat(fd)
    if st.st_uid != uid:
        os.close(fd)
        raise StoreDamage(f"{where} is owned by uid {st.st_uid}, not by the store's owner (uid {uid}); "
                          "left alone")
    return fd


@contextmanager
def opened_dir(parent_fd: int, name: str, uid: int, where: str) -> Iterator[int]:
    fd = open_dir(parent_fd, name, uid, where)
    try:
        yield fd
    finally:
        os.close(fd)


@contextmanager
def opened_child(parent_fd: int, name: str, where: str) -> Iterator[int]:
    """NAME under the checked store directory PARENT_FD, held to the same owner as its parent."""
    with opened_dir(parent_fd, name, os.fstat(parent_fd).st_uid, where) as fd:
        yield fd


@contextmanager
def opened_root(path: str) -> Iterator[tuple[int, int]]:
    """The store directory PATH (links in PATH itself are the user's choice) and its owner's uid."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except PermissionError:
        raise StoreAccessError(f"{path}: permission denied") from None
    try:
        yield fd, os.fstat(fd).st_uid
    finally:
        os.close(fd)


def entries(dir_fd: int) -> list[os.DirEntry[str]]:
    """The entries of DIR_FD, sorted by name (DirEntry.stat on them never follows a link when asked not to)."""
    with os.scandir(dir_fd) as it:
        return sorted(it, key=lambda e: e.name)


def lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def remove_tree(dir_fd: int, name: str, uid: int, where: str) -> None:
    """Remove the directory NAME under DIR_FD and everything in it, descending through no link;
    StoreDamage (nothing removed) unless it is a real directory of UID."""
    os.close(open_dir(dir_fd, name, uid, where))
    try:
        treewalk.remove_tree(dir_fd, name, where, uid=uid)
    except treewalk.TreeError as e:
        raise StoreDamage(str(e)) from None
