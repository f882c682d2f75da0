"""The warm tier's layout and its read side: pack files of warm snapshots held in host memory.

The warm tier (storage/tiers/warm.py makes and evicts it; storage/FORMAT.md, "The warm tier") is a
cache beside a store, never part of it: copies of whole pack files on a memory file system, under

    WARM/                      GPUSNAP_WARM_DIR: /run/gpusnap/warm for root (a private tmpfs mounted
                               mode=0700,huge=always there), /dev/shm/gpusnap-warm-UID for anyone else
      lock                     flock(2) target of every change
      state.json               what is warm: per store key, snapshot names, their packs, last use
      <KEY>/packs/<P>          a copy of pack P of the store KEY names (written aside, renamed when whole)

KEY names the store: BLAKE2b of its directory's device and inode and its marker's "created". A restore
that opts in (SnapshotStore.use_warm) reads a pack from here when a copy exists, and checks every entry
as any read does (the chunk's id), so a stale, cut or planted copy costs a read from the store itself,
never wrong bytes. WARM, KEY and packs/ are used only if they are directories of this process's user
with no access for group or others, and a copy only if it is a regular file of that user: bytes of a
store are never readable here by anyone who could not read the store.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from typing import Any

from storage.base.errors import GpusnapError
from storage.base.settings import SettingError, setting

STATE = "state.json"
LOCK = "lock"
PACKS = "packs"
STATE_MOST = 16 << 20
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class WarmError(GpusnapError):
    """The warm tier cannot be used: its directory is not this user's private one, or it is over budget."""


def warm_dir() -> str:
    """$GPUSNAP_WARM_DIR, or the default for this user (an absolute path)."""
    default = "/run/gpusnap/warm" if os.geteuid() == 0 else f"/dev/shm/gpusnap-warm-{os.geteuid()}"
    d: str = setting("GPUSNAP_WARM_DIR", default, str, os.path.isabs, "an absolute path", SettingError)
    return d


def store_key(root_fd: int) -> str:
    """The key of the store whose root directory ROOT_FD is (its device, inode and marker's "created")."""
    st = os.fstat(root_fd)
    created = ""
    try:
        fd = os.open("gpusnap-store.json", _FILE, dir_fd=root_fd)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                rec = json.loads(os.read(fd, 65536) or b"{}")
                created = str(rec.get("created", "")) if isinstance(rec, dict) else ""
        finally:
            os.close(fd)
    except (OSError, ValueError):
        pass
    return hashlib.blake2b(f"{st.st_dev}:{st.st_ino}:{created}".encode(), digest_size=16).hexdigest()


def private_dir(fd: int, what: str) -> None:
    """WarmError unless FD is a directory of this user without group or other access."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise WarmError(f"warm tier: {what} is not a private directory of uid {os.geteuid()} "
                        f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): not used")


def open_private(parent: int | None, name: str, what: str) -> int:
    """NAME (under directory fd PARENT, or an absolute path) opened as a checked private directory."""
    fd = os.open(name, _DIR, dir_fd=parent) if parent is not None else os.open(name, _DIR)
    try:
        private_dir(fd, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


class WarmPacks:
    """The warm copies of one store's packs, for a restore: open(pack) -> an fd, or None."""

    MOST = 256  # fds kept open (a restore reads each pack many times); more are opened per read

    def __init__(self, packs_fd: int) -> None:
        self._packs = packs_fd
        self._fds: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    @classmethod
    def find(cls, root_fd: int) -> "WarmPacks | None":
        """The warm packs of the store at ROOT_FD, or None (no warm tier, none for this store, or one not
        private to this user: then nothing of it is read)."""
        try:
            base = open_private(None, warm_dir(), "the warm directory")
        except (OSError, GpusnapError):
            return None
        try:
            key = open_private(base, store_key(root_fd), "the store's warm directory")
            try:
                packs = open_private(key, PACKS, "the store's warm packs")
            finally:
                os.close(key)
        except (OSError, GpusnapError):
            return None
        finally:
            os.close(base)
        return cls(packs)

    def open(self, pack: str) -> int | None:
        """A new fd of the warm copy of PACK (the caller closes it), or None where there is none."""
        with self._lock:
            if pack in self._fds:
                fd = self._fds[pack]
                return None if fd is None else os.dup(fd)
        try:
            fd = os.open(pack, _FILE, dir_fd=self._packs)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                os.close(fd)
                fd = -1
        except OSError:
            fd = -1
        with self._lock:
            if len(self._fds) < self.MOST and pack not in self._fds:
                self._fds[pack] = fd if fd >= 0 else None
                return os.dup(fd) if fd >= 0 else None
        return fd if fd >= 0 else None

    def counted(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                if fd is not None:
                    os.close(fd)
            self._fds.clear()
            try:
                os.close(self._packs)
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def read_state(base_fd: int) -> dict[str, Any]:
    """state.json of the warm directory BASE_FD, checked; empty when absent or unreadable (it is a cache:
    the packs it does not name are removed by the next change)."""
    try:
        fd = os.open(STATE, _FILE, dir_fd=base_fd)
    except FileNotFoundError:
        return {"version": 1, "stores": {}}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > STATE_MOST:
            return {"version": 1, "stores": {}}
        rec = json.loads(os.read(fd, STATE_MOST + 1))
    except (OSError, ValueError):
        return {"version": 1, "stores": {}}
    finally:
        os.close(fd)
    if not (isinstance(rec, dict) and rec.get("version") == 1 and isinstance(rec.get("stores"), dict)):
        return {"version": 1, "stores": {}}
    return rec
