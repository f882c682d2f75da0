"""The warm tier: the packs of snapshots a user marks warm held in host memory, within a budget.

`store warm NAME` (or `--keep-warm` on a dump or checkpoint) copies every pack holding a chunk of NAME
(and of the snapshot its deltas are against) onto a memory file system beside the store
(storage/repo/warmread.py has the layout and the read side); a restore then reads them from there at
memory speed, each entry checked against its id as ever. The tier is a cache: the store keeps every
byte, nothing in the store's format changes, and losing the tier (a reboot, an eviction, a killed
`store warm`) costs only speed.

Why copies on a tmpfs with transparent huge pages (`huge=always`): measured on the dev VM with
scripts/bench/bench_warm.py (512 MiB of packs, pread of 16 MiB runs in a fresh process as a restore
reads): locked page cache (mmap + mlock by a holder) 13.9-15.3 GB/s, a tmpfs of 4 KiB pages
(/dev/shm) 6.5-7.6 GB/s, a tmpfs mounted huge=always 13.5-18.9 GB/s, hugetlbfs 16.2-18.0 GB/s.
The locked page cache needs a process that lives as long as the tier (gpusnap has none) and hugetlbfs
needs huge pages reserved up front and has no write(2); the huge tmpfs reads as fast, survives the
command that filled it, and gives its memory back on eviction. Without root (no mount) the tier is a
directory on /dev/shm: half the rate, still no disk.

Budget: bytes of distinct packs held for all stores together: `--budget SIZE` on `store warm`
(remembered) or $GPUSNAP_WARM_BUDGET; default a quarter of the machine's memory. Warming past it
evicts the least recently used warm snapshots (a restore from the tier counts as a use) until the new
one fits; a snapshot larger than the whole budget is refused (nothing evicted). Every change holds
the tier's lock; a pack is copied to a temporary name and renamed once whole, and the state names a
snapshot only after all its packs are there; the next change removes whatever no state names (what a
killed `store warm` left).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from storage.base.errors import GpusnapError
from storage.base.names import validate_snapshot_name
from storage.base.pausepoint import pause_at
from storage.base.settings import SettingError, setting, switch
from storage.format.packs import open_pack
from storage.repo.store import SnapshotStore, chunk_refs
from storage.repo.warmread import (LOCK, PACKS, STATE, WarmError, open_private, read_state, store_key,
                                   warm_dir)

PAUSE_ENV = "GPUSNAP_WARM_PAUSE"  # STAGE:FILE (storage/base/pausepoint.py), for the crash tests
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B?)?", re.I)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'16G', '512M', '1.5T', '123456' -> bytes (binary units); ValueError otherwise."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise ValueError(text)
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def default_budget() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 8 << 30


def env_budget() -> int | None:
    b: int | None = setting("GPUSNAP_WARM_BUDGET", None, parse_size, lambda b: b > 0,
                            "a size in bytes (K, M, G, T: binary units)", SettingError)
    return b


@dataclass
class WarmReport:
    """What `store warm` did: bytes copied now, bytes of NAME's packs, snapshots evicted, the tier's use."""

    name: str
    copied: int = 0
    held: int = 0
    packs: int = 0
    evicted: list[str] = field(default_factory=list)
    used: int = 0
    budget: int = 0
    seconds: float = 0.0
    memory: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "copied": self.copied, "held": self.held, "packs": self.packs,
                "evicted": self.evicted, "used": self.used, "budget": self.budget,
                "seconds": round(self.seconds, 3), "memory": self.memory}


class WarmTier:
    """The warm tier as seen from one store (STORE): warm, cool, touch, status."""

    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        with store.root() as (root, _):
            self.key = store_key(root)

    @contextmanager
    def _locked(self, create: bool) -> Iterator[tuple[int, dict[str, Any]] | None]:
        """The tier's directory fd and state under its lock; None where there is no tier and not CREATE."""
        path = warm_dir()
        made = False
        if create and not os.path.lexists(path):
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            try:
                os.mkdir(path, 0o700)
                made = True
            except FileExistsError:
                pass
        if made and os.geteuid() == 0 and switch("GPUSNAP_WARM_MOUNT", True):
            # a private tmpfs with transparent huge pages: bench_warm.py measured it twice /dev/shm's rate
            subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,huge=always", "gpusnap-warm", path],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=30)
        try:
            base = open_private(None, path, f"the warm directory {path}")
        except FileNotFoundError:
            if create:
                raise
            yield None
            return
        except OSError as e:
            raise WarmError(f"warm tier {path}: {e.strerror or e}") from None
        try:
            lk = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600,
                         dir_fd=base)
            try:
                if not stat.S_ISREG(os.fstat(lk).st_mode):
                    raise WarmError(f"warm tier {path}: its lock is not a regular file")
                fcntl.flock(lk, fcntl.LOCK_EX)
                yield base, read_state(base)
            finally:
                os.close(lk)
        finally:
            os.close(base)

    # ---- what the state says
    def _mine(self, state: dict[str, Any]) -> dict[str, Any]:
        ent = state["stores"].get(self.key)
        if not isinstance(ent, dict) or not isinstance(ent.get("snapshots"), dict):
            ent = {"path": self.store.path, "snapshots": {}}
            state["stores"][self.key] = ent
        return ent

    @staticmethod
    def _held(state: dict[str, Any]) -> dict[tuple[str, str], int]:
        """(store key, pack) -> length, over every warm snapshot."""
        out: dict[tuple[str, str], int] = {}
        for key, ent in state["stores"].items():
            for snap in (ent.get("snapshots") or {}).values():
                for pack, n in (snap.get("packs") or {}).items():
                    if isinstance(n, int) and n >= 0:
                        out[(key, pack)] = n
        return out

    @staticmethod
    def budget(state: dict[str, Any]) -> int:
        b = env_budget()
        if b is not None:
            return b
        s = state.get("budget")
        return s if isinstance(s, int) and s > 0 else default_budget()

    def _packs_of(self, name: str) -> dict[str, int]:
        """Every pack holding a chunk of NAME or of the snapshot its deltas are against."""
        m = self.store.load(name)
        manifests = [m]
        parent = m.meta.get("parent") if isinstance(m.meta, dict) else None
        if isinstance(parent, str) and parent in self.store.names():
            manifests.append(self.store.load(parent))
        packs: dict[str, int] = {}
        for cid in chunk_refs(manifests):
            for loc in self.store.locate(cid)[:1]:
                if loc.pack:
                    packs[loc.pack] = self.store.pack_length(loc.pack)
        return packs

    # ---- changes
    def warm(self, name: str, budget: int | None = None) -> WarmReport:
        """Hold NAME's packs in the tier (evicting the least recently used others to fit)."""
        validate_snapshot_name(name)
        t0 = time.monotonic()
        packs = self._packs_of(name)
        rep = WarmReport(name, packs=len(packs), held=sum(packs.values()))
        with self._locked(create=True) as got:
            assert got is not None
            base, state = got
            if budget is not None:
                state["budget"] = budget
            rep.budget = self.budget(state)
            if rep.held > rep.budget:
                raise WarmError(f"{name}: its packs take {rep.held} bytes, more than the warm tier's budget "
                                f"of {rep.budget} (store warm --budget SIZE)")
            mine = self._mine(state)
            mine["path"] = self.store.path
            mine["snapshots"].pop(name, None)
            held = self._held(state)
            need = sum(n for p, n in packs.items() if (self.key, p) not in held)
            while sum(held.values()) + need > rep.budget:
                victim = self._lru(state)
                if victim is None:
                    break
                key, snap = victim
                del state["stores"][key]["snapshots"][snap]
                rep.evicted.append(snap if key == self.key else f"{state['stores'][key].get('path')}:{snap}")
                held = self._held(state)
                need = sum(n for p, n in packs.items() if (self.key, p) not in held)
            self._save(base, state)  # evictions first: their packs go before the new ones come
            self._sweep(base, state)
            kdir = self._dir(base, self.key, create=True)
            try:
                for pack, n in sorted(packs.items()):
                    rep.copied += self._copy(kdir, pack, n)
            finally:
                os.close(kdir)
            now = time.time()
            mine = self._mine(state)
            mine["snapshots"][name] = {"packs": packs, "warmed": now, "used": now}
            self._save(base, state)
            rep.used = sum(self._held(state).values())
            rep.memory = self._memory(base)
        rep.seconds = time.monotonic() - t0
        return rep

    def cool(self, names: list[str] | None) -> list[str]:
        """NAMES (None: every snapshot of this store) out of the tier; the names that were warm."""
        with self._locked(create=False) as got:
            if got is None:
                return []
            base, state = got
            mine = self._mine(state)
            gone = [n for n in (list(mine["snapshots"]) if names is None else names) if n in mine["snapshots"]]
            for n in gone:
                del mine["snapshots"][n]
            self._save(base, state)
            self._sweep(base, state)
            return gone

    def touch(self, name: str) -> bool:
        """NAME used now (a restore read it): last in line for eviction. Whether it is warm."""
        with self._locked(create=False) as got:
            if got is None:
                return False
            base, state = got
            snap = self._mine(state)["snapshots"].get(name)
            if not isinstance(snap, dict):
                return False
            snap["used"] = time.time()
            self._save(base, state)
            return True

    def status(self) -> dict[str, Any]:
        """{"dir", "budget", "used", "memory", "snapshots": {NAME: {"bytes", "packs", "used", "warmed"}}} of
        this store (the names are those the state names and whose packs are all present)."""
        out: dict[str, Any] = {"dir": warm_dir(), "budget": 0, "used": 0, "memory": "", "snapshots": {}}
        with self._locked(create=False) as got:
            if got is None:
                return out
            base, state = got
            out["budget"] = self.budget(state)
            out["used"] = sum(self._held(state).values())
            out["memory"] = self._memory(base)
            present = self._present(base)
            for name, snap in self._mine(state)["snapshots"].items():
                packs = snap.get("packs") or {}
                if all(present.get(p) == n for p, n in packs.items()):
                    out["snapshots"][name] = {"bytes": sum(packs.values()), "packs": len(packs),
                                              "used": snap.get("used"), "warmed": snap.get("warmed")}
        return out

    # ---- helpers
    @staticmethod
    def _lru(state: dict[str, Any]) -> tuple[str, str] | None:
        best: tuple[float, str, str] | None = None
        for key, ent in state["stores"].items():
            for name, snap in (ent.get("snapshots") or {}).items():
                used = snap.get("used") if isinstance(snap, dict) else None
                u = float(used) if isinstance(used, (int, float)) else 0.0
                if best is None or u < best[0]:
                    best = (u, key, name)
        return None if best is None else (best[1], best[2])

    @staticmethod
    def _dir(base: int, key: str, create: bool) -> int:
        """KEY/packs under the tier as a checked private directory fd."""
        if create:
            for parent, name in ((None, key), (key, PACKS)):
                try:
                    if parent is None:
                        os.mkdir(name, 0o700, dir_fd=base)
                    else:
                        k = open_private(base, key, "a store's warm directory")
                        try:
                            os.mkdir(name, 0o700, dir_fd=k)
                        finally:
                            os.close(k)
                except FileExistsError:
                    pass
        k = open_private(base, key, "a store's warm directory")
        try:
            return open_private(k, PACKS, "a store's warm packs")
        finally:
            os.close(k)

    def _present(self, base: int) -> dict[str, int]:
        try:
            d = self._dir(base, self.key, create=False)
        except (OSError, GpusnapError):
            return {}
        try:
            out = {}
            for e in os.scandir(d):
                if not e.name.startswith("."):
                    st = e.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        out[e.name] = st.st_size
            return out
        finally:
            os.close(d)

    def _copy(self, kdir: int, pack: str, n: int) -> int:
        """PACK (N bytes) copied from the store into KDIR unless a whole copy is there; bytes copied."""
        try:
            st = os.stat(pack, dir_fd=kdir, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_size == n:
                return 0
            os.unlink(pack, dir_fd=kdir)
        except FileNotFoundError:
            pass
        tmp = f".tmp.{pack}.{os.getpid()}"
        with self.store.subdir("packs") as packs:
            src = open_pack(packs, pack, "")
        try:
            dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                          dir_fd=kdir)
            try:
                off = 0
                while off < n:
                    k = os.sendfile(dst, src, off, min(n - off, 1 << 30))
                    if k == 0:
                        break
                    off += k
            finally:
                os.close(dst)
            pause_at(PAUSE_ENV, "copied")  # tests: a `store warm` killed with a copy not yet renamed
            if off != n:
                os.unlink(tmp, dir_fd=kdir)
                raise WarmError(f"pack {pack[:12]}…: {off} of its {n} bytes read (the store changed?)")
            os.rename(tmp, pack, src_dir_fd=kdir, dst_dir_fd=kdir)
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=kdir)
            except OSError:
                pass
            if e.errno == errno.ENOSPC:
                raise WarmError(f"warm tier {warm_dir()}: no space left for pack {pack[:12]}…") from None
            raise
        finally:
            os.close(src)
        return n

    def _sweep(self, base: int, state: dict[str, Any]) -> None:
        """Remove every pack copy (and temporary) of every store that no warm snapshot names."""
        held = self._held(state)
        for e in os.scandir(base):
            if e.name in (LOCK, STATE) or e.name.startswith("."):
                continue
            try:
                d = self._dir(base, e.name, create=False)
            except (OSError, GpusnapError):
                continue
            try:
                for f in os.scandir(d):
                    if (e.name, f.name) not in held:
                        try:
                            os.unlink(f.name, dir_fd=d)
                        except OSError:
                            pass
            finally:
                os.close(d)
        for key in [k for k, ent in state["stores"].items() if not ent.get("snapshots")]:
            del state["stores"][key]

    @staticmethod
    def _save(base: int, state: dict[str, Any]) -> None:
        tmp = f".state.{os.getpid()}"
        try:  # a leftover of a killed run (or anything planted there) goes; the new file is made fresh
            os.unlink(tmp, dir_fd=base)
        except FileNotFoundError:
            pass
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=base)
        try:
            os.write(fd, json.dumps(state).encode())
        finally:
            os.close(fd)
        os.rename(tmp, STATE, src_dir_fd=base, dst_dir_fd=base)

    @staticmethod
    def _memory(base: int) -> str:
        """What holds the tier: "tmpfs huge=always" (the mount), else the file system type."""
        want = os.fstat(base)
        try:
            with open("/proc/self/mountinfo") as f:
                for line in f:
                    parts = line.split()
                    sep = parts.index("-")
                    mnt = parts[4].replace("\\040", " ")
                    try:
                        st = os.stat(mnt)
                    except OSError:
                        continue
                    if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
                        opts = parts[sep + 3]
                        huge = [o for o in opts.split(",") if o.startswith("huge=")]
                        return parts[sep + 1] + (f" {huge[0]}" if huge else "")
        except (OSError, ValueError, IndexError):
            pass
        return "directory"
