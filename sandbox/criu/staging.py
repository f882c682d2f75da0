"""An operation's private directory (CRIU's images, or only its socket and log on the stream path, and
runsc's checkpoint): where it goes, recorded in the journal before it is made, and CRIU's log copied out
of it before it is removed.

Guarantees kept here: the directory is named after the operation (`gpusnap-op-OP`) and recorded in
its journal record before it exists, so `gpusnap recover` finds and removes it whenever it exists,
and removes nothing else; it is made 0700.
"""
from __future__ import annotations

import os
import shutil
import time

from storage.api import SnapshotStore
from storage.api import LOGS, path_in

from sandbox.criu.runner import CriuError
from sandbox.ops import journal


def rss_bytes(pids: list[int]) -> int:
    """The resident memory of PIDS now (what a dump's images will about take)."""
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def _staging_base(store: SnapshotStore, need: int, prefer: str | None) -> str:
    """Where CRIU's images are staged: PREFER, else /dev/shm when NEED fits twice, else the store's tmp/."""
    if prefer:
        return prefer
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * need + (256 << 20):
        return "/dev/shm"
    return store.tmp_dir


def new_staging(store: SnapshotStore, need: int, prefer: str | None, op: journal.Op) -> str:
    """A fresh private directory for operation OP's images, named after it and recorded in its journal before it is made
    (so that recovery finds it whenever it exists)."""
    path = os.path.join(os.path.abspath(_staging_base(store, need, prefer)), f"gpusnap-op-{op.id}")
    op.advance(staging=path)
    os.mkdir(path, 0o700)
    return path


def keep_log(store: SnapshotStore, e: CriuError, what: str) -> str:
    """Copy CRIU's log out of the staging directory (removed afterwards) into STORE/logs/."""
    logs = path_in(store.path, LOGS)
    os.makedirs(logs, mode=0o700, exist_ok=True)
    dst = os.path.join(logs, f"criu-{what}-{time.strftime('%Y%m%dT%H%M%S')}.log")
    try:
        shutil.copyfile(e.log_path or "", dst)
    except OSError:
        return e.log_path or "(no log)"
    return dst
