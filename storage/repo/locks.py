"""Who holds the store's locks (`store lock status`, `store break-lock`), read from /proc/locks.

The store's locks are flock(2) locks on files (FORMAT.md, "Concurrency"): the kernel drops them when
their holder exits, so a lock whose holder is gone is only a file that nobody holds. break-lock
removes such files (for names with no snapshot) and refuses while a live process holds one.
"""
from __future__ import annotations

import os
from typing import Callable
from dataclasses import dataclass

from storage.base.errors import GpusnapError
from storage.format.storedir import LOCK, NAMES, path_in


class LockError(GpusnapError):
    """A lock that cannot be broken (its holder is alive)."""


@dataclass(frozen=True)
class LockInfo:
    path: str
    kind: str              # "store" or "name"
    name: str | None       # the snapshot name of a name lock
    holders: tuple[tuple[int, str], ...]   # (pid, "READ"|"WRITE") of live flock holders

    @property
    def held(self) -> bool:
        return bool(self.holders)


def _flock_holders() -> dict[tuple[int, int], list[tuple[int, str]]]:
    """(device, inode) -> [(pid, mode)] for every FLOCK lock in /proc/locks."""
    out: dict[tuple[int, int], list[tuple[int, str]]] = {}
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, not a holder
            continue
        if len(parts) < 6 or parts[1] != "FLOCK":
            continue
        try:
            pid = int(parts[4])
            major, minor, ino = parts[5].split(":")
            dev = os.makedev(int(major, 16), int(minor, 16))
            out.setdefault((dev, int(ino)), []).append((pid, parts[3]))
        except ValueError:
            continue
    return out


def lock_status(store_path: str) -> list[LockInfo]:
    """Every lock file of the store at STORE_PATH and who holds it now."""
    holders = _flock_holders()
    files: list[tuple[str, str, str | None]] = [(path_in(store_path, LOCK), "store", None)]
    names_dir = path_in(store_path, NAMES)
    try:
        with os.scandir(names_dir) as it:
            for e in sorted(it, key=lambda e: e.name):
                if e.name.endswith(".lock") and e.is_file(follow_symlinks=False):
                    files.append((e.path, "name", e.name[:-5]))
    except FileNotFoundError:
        pass
    out = []
    for path, kind, name in files:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        out.append(LockInfo(path, kind, name, tuple(holders.get((st.st_dev, st.st_ino), []))))
    return out


def break_locks(store_path: str, names: list[str] | None, exists: Callable[[str], bool]) -> list[str]:
    """Remove the unheld lock files of NAMES (default: every name lock with no snapshot); refuse with
    LockError naming the holder while a live process holds one. Returns the paths removed."""
    removed = []
    for info in lock_status(store_path):
        if info.kind != "name" or (names is not None and info.name not in names):
            continue
        if info.held:
            pids = ", ".join(f"pid {p} ({m})" for p, m in info.holders)
            raise LockError(f"snapshot {info.name!r} is locked by a live process: {pids}; not broken")
        if names is None and info.name is not None and exists(info.name):
            continue
        os.unlink(info.path)
        removed.append(info.path)
    return removed
