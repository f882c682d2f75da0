"""The snapshot store: content-addressed chunks in pack files (or v1/v2 chunk files) and atomically committed manifests.

Guarantees kept here (FORMAT.md has the full contract):
- a snapshot becomes visible only after every chunk it names is durable: every pack holding one is
  fsynced and then indexed (storage/format/packs.py) before the link/rename of a fsynced manifest; a failed
  or killed writer leaves no visible snapshot, and at most a pack no index names (garbage for gc);
- every chunk read is checked before its bytes are returned (read_chunk: its stored bytes; read_raw,
  what get and restores use: its raw bytes bound to its id, FORMAT.md "Chunk files"); a chunk is
  reused by a writer only if its entry (or file) has a sane header and all its bytes, and `verify`
  sets a damaged chunk aside in quarantine/ (a chunk file moved there, a pack entry recorded there and
  skipped) so that the next put of the same bytes writes it again;
- host-path chunks are raw-addressed (GSNPCHK2): a writer hashes the raw bytes first and encodes and
  writes only chunks not present; a version 1 store is upgraded before its first such chunk;
- a delta entry (FORMAT.md, "Delta entries") is decoded only against bases read here, each a full
  entry of this store bound to its own id (delta_base: depth 1, bounded), and its raw bytes are then
  bound to the delta's id like any chunk's; the marker says version 5 before the first delta is
  written, and every base a delta names belongs to a committed snapshot;
- writers and readers hold the store lock shared, gc and repair hold it exclusively, so gc never
  deletes a chunk that a live snapshot or a commit in progress needs; one writer per name at a time;
- no link inside the store is ever followed: every store directory is opened relative to a checked
  directory fd (storage/format/storedir.py), and anything that is not the store owner's real directory is
  reported as damage and left alone;
- gc removes only what gpusnap owns: chunks no snapshot names, temporary entries whose owning process
  (recorded in their names, storage/fs/owner.py) is gone, the staging trees of killed `get`s recorded in
  tmp/, lock files of names that have no snapshot; everything else is reported, never deleted.
"""
from __future__ import annotations

import errno
import math
import random
import fcntl
import json
import mmap
import os
import re
import stat
import struct
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar, cast

from storage.base.progress import Progress
from storage.format.chunkfile import (HEADER_SIZE, ChunkError, ChunkHeader, chunk_id, file_kind, full_check, max_stored_len,
                        id_check, raw_chunk_id, read_chunk_file, reusable, stored_check)
from storage.fs.directio import AlignedBuffer, BufferPool, address_of, align_up, copy_into, direct_io_supported, read_to_end
from storage.fs.directio import unlink_quietly as _unlink_quietly, write_new_file as _write_file
from storage.codecs import delta
from storage.base import waits
from storage.codecs.registry import DELTA, CodecError, HostCodecChooser
from storage.fs.getmark import new_nonce
from storage.base.limits import MAX_MANIFEST, MAX_STORED_CHUNK
from storage.fs.treewalk import remove_tree
from storage.base.errors import EXIT_DAMAGED, DamageError, GpusnapError
from storage.format.manifest import ChunkRef, Manifest, ManifestError, Stream, validate_tag
from storage.base.names import InvalidNameError, validate_snapshot_name
from storage.fs.owner import owned_name, this_owner
from storage.fs.packfds import PackFds
from storage.format.packs import Loc, PackIndex, PackWriter, open_pack, read_entry
from storage.format.packs import pause as pause_pack
from storage.repo.tier import Landing, Verified
from storage.format import marker as requires_list
from storage.format.marker import CHUNK_FILES, DELTAS, REQUIRES_VERSION, codec_requirement
from storage.format.storedir import (CHUNKS, INDEX, LOCK, MARKER, NAMES, PACK_DIRS, PACKS, QUARANTINE, SNAPSHOTS, SUBDIRS, TMP,
                       StoreAccessError, StoreDamage, chunk_dir_name, entries, lstat_at, manifest_entry,
                       name_lock_entry, opened_child, quarantine_record, opened_dir, opened_root)

if TYPE_CHECKING:
    from storage.gpu.device import HostBuffer
    from storage.repo.warmread import WarmPacks

STORE_FORMAT = "gpusnap-store"
STORE_VERSION = 3  # what a new store's marker says
DELTA_VERSION = 4  # the marker once a delta entry may be in the store (FORMAT.md, "Store versions")
PLANES_VERSION = 5  # the marker once a delta's XOR may be byte planes
FLAGGED_VERSION = 6  # from here on the marker says whether deltas may be in the store ("deltas": true)
WRITE_VERSION = REQUIRES_VERSION  # 8: the marker before this gpusnap's first pack entry: `requires` lists
                                 # the codecs and features the store uses (storage/format/marker.py)
READ_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)  # 1: GSNPCHK1 chunk files only; 2: chunk files of both kinds; 3: packs;
                                          # 4: deltas; 5: deltas whose XOR may be byte planes; 6: shuffle2 layout 2;
                                          # 7: shuffle4-zstd chunks; 8: `requires` (no more bumps per codec)
BASE_CACHE = 256 << 20  # raw bytes of delta bases kept in memory per store object (a restore's deltas; a
                         # dump's candidates: neighbouring new chunks share their parent chunks, and the
                         # producers work at several places of an image at once) ...
BASE_CACHE_MOST = 1 << 30  # ... up to this much where memory allows (base_cache_bytes)

_T = TypeVar("_T")


def base_cache_bytes() -> int:
    """The bases cache's size: 1/32 of the memory available now, between BASE_CACHE and BASE_CACHE_MOST."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return BASE_CACHE
    return max(BASE_CACHE, min(BASE_CACHE_MOST, avail // 32))


CHUNK_ID = re.compile(r"[0-9a-f]{64}")
_RECORD_MAX = 1 << 16


class StoreError(GpusnapError):
    """A store operation that cannot be done; the message says what to do about it."""


class EntryUnknown(StoreError):
    """Whether a pack entry is a delta (and which bases it names) cannot be told: gc deletes nothing then."""


class SnapshotDamaged(StoreError, DamageError):
    """A snapshot that cannot be read back as it was committed (a chunk missing or damaged): exit 3."""

    exit_code = EXIT_DAMAGED


def default_store_path() -> str:
    """--store default: $GPUSNAP_STORE, else /var/lib/gpusnap as root, else $XDG_DATA_HOME/gpusnap."""
    env = os.environ.get("GPUSNAP_STORE")
    if env:
        return env
    if os.geteuid() == 0:
        return "/var/lib/gpusnap"
    xdg = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(xdg, "gpusnap")


def get_staging_name(dest: str, pid: int) -> str:
    """The hidden sibling of DEST that `get` process PID materializes into (storage/archive/filetree.py)."""
    return f".{os.path.basename(os.path.abspath(dest))}.gpusnap-{pid}"


@dataclass
class WriteStats:
    chunks_new: int = 0
    chunks_dedup: int = 0
    chunks_zero: int = 0
    chunks_compressed: int = 0  # chunks the host encoder ran on (a raw-addressed chunk found present: none)
    bytes_new: int = 0      # stored bytes of chunk files this writer created
    bytes_dedup: int = 0    # stored bytes found already present
    raw_bytes: int = 0      # logical bytes, zeros included
    zero_bytes: int = 0
    hash_s: float = 0.0     # thread-seconds hashing chunk payloads
    write_s: float = 0.0    # thread-seconds writing + fsyncing chunk files

    def add_zero(self, raw_len: int) -> ChunkRef:
        """Count an all-zero chunk (the caller holds its writer's lock); returns its reference."""
        self.chunks_zero += 1
        self.zero_bytes += raw_len
        self.raw_bytes += raw_len
        return ChunkRef(None, raw_len, "zero", 0)

    def add_chunk(self, raw_len: int, stored_len: int, new: bool, hash_s: float, write_s: float = 0.0) -> None:
        """Count a stored chunk, NEW or found already present (the caller holds its writer's lock)."""
        self.hash_s += hash_s
        self.write_s += write_s
        self.raw_bytes += raw_len
        if new:
            self.chunks_new += 1
            self.bytes_new += stored_len
        else:
            self.chunks_dedup += 1
            self.bytes_dedup += stored_len


@dataclass
class Problem:
    snapshot: str
    stream: str | None
    chunk: int | None
    what: str

    def __str__(self) -> str:
        where = self.snapshot
        if self.stream is not None:
            where += f": {self.stream}"
        if self.chunk is not None:
            where += f" chunk {self.chunk}"
        return f"{where}: {self.what}"


@dataclass(frozen=True)
class Stray:
    """An entry of snapshots/ that is not a snapshot (a bad name, or not a regular file)."""

    entry: str
    what: str

    def __str__(self) -> str:
        return f"{SNAPSHOTS}/{self.entry}: {self.what}"


@dataclass
class DamagedCopy:
    """A pack entry of a chunk that fails its check while another pack entry of the same id is sound
    (a gc repack cut short by a crash leaves two copies; a forged store may plant one): no reader uses
    it, so no snapshot needs it, but it is damage on disk and verify names it. SET_ASIDE: verify
    recorded it in quarantine/, so that the next gc drops it (FORMAT.md, "Quarantine inside packs")."""

    cid: str
    pack: str
    offset: int
    what: str
    set_aside: bool = False

    def __str__(self) -> str:
        return (f"chunk {self.cid[:16]}…: its copy in pack {self.pack} at offset {self.offset} {self.what} "
                "(another copy is sound and serves every reader)")


@dataclass
class VerifyReport:
    snapshots: list[str] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)
    strays: list[Stray] = field(default_factory=list)
    quarantined: list[str] = field(default_factory=list)   # chunk ids moved aside by this run
    not_quarantined: str | None = None                      # why damaged chunks stayed where they are
    chunks_total: int = 0       # distinct chunks the verified snapshots name
    chunks_unchecked: int = 0   # left out by a sample or by the time limit (not known to be sound)
    damaged_copies: list[DamagedCopy] = field(default_factory=list)  # redundant damage: not a problem

    @property
    def ok(self) -> bool:
        """Every snapshot verified is readable and nothing needs the user: a damaged duplicate copy of a
        chunk whose other copy is sound does not count (no reader uses it, and once verify has set it
        aside the next gc drops it), as the duplicates a crashed repack leaves are resolved by gc."""
        return not self.problems and not self.strays


class _FileLock:
    """flock(2) on a file opened without following a link; shared or exclusive, with a deadline or not."""

    def __init__(self, dir_fd: int, name: str, where: str) -> None:
        self.dir_fd, self.name, self.where = dir_fd, name, where
        self.fd = -1

    def _open(self, exclusive: bool) -> int:
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            return os.open(self.name, os.O_RDWR | os.O_CREAT | flags, 0o600, dir_fd=self.dir_fd)
        except PermissionError:
            if exclusive:
                raise StoreAccessError(f"{self.where}: permission denied") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StoreDamage(f"{self.where} is a symbolic link; left alone") from None
            raise
        try:  # a reader of a store it may not write still takes the shared lock
            return os.open(self.name, os.O_RDONLY | flags, dir_fd=self.dir_fd)
        except PermissionError:
            raise StoreAccessError(f"{self.where}: permission denied") from None

    def acquire(self, exclusive: bool, timeout: float | None) -> bool:
        self.fd = self._open(exclusive)
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            self.fd = -1
            raise StoreDamage(f"{self.where} is not a regular file; left alone")
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = None if timeout is None else time.monotonic() + timeout
        t0 = time.monotonic()
        while True:
            try:
                fcntl.flock(self.fd, mode | fcntl.LOCK_NB)
                if not self._still_linked():  # removed (name_lock, gc) between our open and flock
                    os.close(self.fd)
                    self.fd = self._open(exclusive)
                    continue
                waits.add(waits.LOCKS, time.monotonic() - t0)
                return True
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    waits.add(waits.LOCKS, time.monotonic() - t0)
                    os.close(self.fd)
                    self.fd = -1
                    return False
                time.sleep(0.05)

    def _still_linked(self) -> bool:
        """Whether the file locked is still the one at its name (a lock on an unlinked file locks nothing)."""
        try:
            now = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        st = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the flock
            self.fd = -1


class SnapshotStore:
    """A store directory (FORMAT.md). Cheap to open; safe to share between processes.

    create: make an empty store when PATH does not exist or is an empty directory (writers);
    readers pass False and get a clear error instead of an empty store at a mistyped path.
    """

    error = SnapshotDamaged  # what a damaged snapshot raises (storage/repo/tier.py: a ChunkTier)

    def __init__(self, path: str, create: bool = True) -> None:
        self.path = os.path.abspath(path)
        self._open(create)
        self._direct: bool | None = None
        self._probe_lock = threading.Lock()
        self._upgrade_lock = threading.Lock()
        self._index = PackIndex()
        self._index_lock = threading.Lock()
        self._index_loaded = False
        self._pending: dict[str, Loc] = {}  # entries this process's writers appended, not yet indexed
        self._warm: "WarmPacks | None" = None  # use_warm: the warm tier's copies of packs, for a restore
        # chunks/XY directories found empty, which a writer's dedup lookup then skips (present: two
        # opens and a stat per new chunk, GIL held). Version 3 writes no chunk files (only version 1/2
        # stores have them, and migration takes them away); a file that appears later (unquarantine
        # moves one back, another process's hand) is only not reused: a duplicate entry, never a wrong one
        self._no_chunk_files: set[str] = set()
        self._bases: OrderedDict[str, memoryview] = OrderedDict()  # delta bases read (raw, verified), newest last
        self._bases_total = 0
        self.bases_decoded = 0  # raw bytes of delta bases read and decoded (not from the cache), ever
        self._bases_most = BASE_CACHE  # a put with a parent raises it (keep_bases); a restore's fill
                                       # processes each have a store object of their own: not there
        self._bases_loading: dict[str, threading.Event] = {}  # bases one thread is reading for all who ask
        self._bases_lock = threading.Lock()
        self._base_reads = threading.local()  # each thread's buffer for the entries of bases it reads
        # packs opened once for the header look-ups and base reads of a put's threads (storage/fs/packfds.py:
        # while holding_packs() runs), closed when it ends, when the index is loaded again or with this object
        # (the opener holds this object weakly: a bound method would keep it, and its finalizer, alive)
        me = weakref.ref(self)
        self._pack_fds = PackFds(lambda pack, cid: _live(me)._open_pack_checked(pack, cid))
        weakref.finalize(self, self._pack_fds.forget)

    # ---- layout -------------------------------------------------------------------------------
    @property
    def snapshots_dir(self) -> str:
        return os.path.join(self.path, SNAPSHOTS)

    @property
    def chunks_dir(self) -> str:
        return os.path.join(self.path, CHUNKS)

    @property
    def tmp_dir(self) -> str:
        return os.path.join(self.path, TMP)

    def chunk_path(self, cid: str) -> str:
        return os.path.join(self.chunks_dir, chunk_dir_name(cid), cid)

    def manifest_path(self, name: str) -> str:
        return os.path.join(self.snapshots_dir, manifest_entry(validate_snapshot_name(name)))

    @property
    def direct(self) -> bool:
        """Whether chunk files here are written and read with O_DIRECT (probed once, on first use)."""
        with self._probe_lock:  # one probe, whichever worker thread asks first
            if self._direct is None:
                try:
                    with self.subdir(TMP) as tmp:
                        # the probe goes through the checked fd, never through a path that could be a link
                        self._direct = direct_io_supported(f"/proc/self/fd/{tmp}")
                except (OSError, GpusnapError):
                    self._direct = False
            return self._direct

    @contextmanager
    def subdir(self, *parts: str) -> Iterator[int]:
        """The store directory PARTS (e.g. "chunks", "ab") as a checked fd for the block."""
        with ExitStack() as stack:
            fd, uid = stack.enter_context(opened_root(self.path))
            where = []
            for p in parts:
                where.append(p)
                fd = stack.enter_context(opened_dir(fd, p, uid, "/".join(where)))
            yield fd

    @contextmanager
    def root(self) -> Iterator[tuple[int, int]]:
        with opened_root(self.path) as r:
            yield r

    def _open(self, create: bool) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if not create:
                raise StoreError(f"no gpusnap store at {self.path} (check --store or GPUSNAP_STORE; "
                                 "`gpusnap store init` creates one)") from None
            return self._create()
        except PermissionError:
            raise StoreAccessError(f"{self.path}: permission denied") from None
        if not stat.S_ISDIR(st.st_mode):
            raise StoreError(f"{self.path} is not a directory, so not a gpusnap store")
        with self.root() as (root, _):
            try:
                fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root)
            except FileNotFoundError:
                try:
                    empty = not os.listdir(root)
                except PermissionError:
                    raise StoreAccessError(f"{self.path}: permission denied") from None
                if not create or not empty:
                    raise StoreError(f"{self.path} exists, is not empty and is not a gpusnap store"
                                     if not empty else f"{self.path} is an empty directory, not a gpusnap store "
                                     "(`gpusnap store init` makes it one)") from None
                return self._create()
            except PermissionError:
                raise StoreAccessError(f"{self.path}: permission denied (the store is readable only by "
                                       f"uid {st.st_uid})") from None
            except OSError as e:
                raise StoreError(f"{self.path}/{MARKER}: {e.strerror or e}") from None
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise StoreDamage(f"{self.path}/{MARKER} is not a regular file")
                info = json.loads(os.read(fd, _RECORD_MAX))
            except (OSError, ValueError, RecursionError) as e:
                raise StoreError(f"{self.path}: unreadable store marker: "
                                 f"{'nested too deeply' if isinstance(e, RecursionError) else e}") from None
            finally:
                os.close(fd)
        if not isinstance(info, dict) or info.get("format") != STORE_FORMAT or info.get("version") not in READ_VERSIONS:
            got = info if not isinstance(info, dict) else f"{info.get('format')} v{info.get('version')}"
            raise StoreError(f"{self.path}: store format {got} is not {STORE_FORMAT} v{READ_VERSIONS[-1]} "
                             "or older")
        self.version: int = info["version"]
        self.requires: frozenset[str] | None = None  # version 8: what the marker lists
        if self.version >= REQUIRES_VERSION:
            self.requires = self._requires_of(info)
        try:
            self.deltas: bool = self._says_deltas(info)
        except StoreDamage as e:
            raise StoreDamage(f"{self.path}/{e}") from None
        self._created = info.get("created")

    def _requires_of(self, info: dict) -> frozenset[str]:
        """The `requires` of the version 8 marker INFO; StoreError (one line, as for every format
        refusal) when it is not a list of entries or names one this gpusnap does not know."""
        try:
            got = requires_list.parse_requires(info.get("requires"))
        except ValueError as e:
            raise StoreError(f"{self.path}: unreadable store marker: {e}") from None
        lacking = requires_list.missing(got)
        if lacking:
            raise StoreError(requires_list.refusal(self.path, lacking))
        return got

    @staticmethod
    def _says_deltas(info: dict) -> bool:
        """Whether the marker INFO says a delta entry may be in the store: versions 4 and 5 always, 6 and 7
        with `"deltas": true`, 8 with `codec:xor-zstd` in `requires` (FORMAT.md, "Store versions").
        Anything but true or absent for `deltas` is damage."""
        if info.get("version") == REQUIRES_VERSION:
            r = info.get("requires")
            return isinstance(r, list) and DELTAS in r
        d = info.get("deltas", False)
        if not isinstance(d, bool):
            raise StoreDamage(f"{MARKER}: deltas is {d!r}, not true or false")
        return info.get("version") in (DELTA_VERSION, PLANES_VERSION) or d

    def _write_marker(self, created: str | None, version: int = STORE_VERSION, deltas: bool = False,
                      requires: Iterable[str] = ()) -> str:
        """Write the store marker (VERSION; DELTAS: a delta may be in the store, said in versions 6 and 7:
        FLAGGED_VERSION; REQUIRES: version 8's list) through tmp/: fsynced, renamed, the store fsynced.
        Returns its `created` (CREATED, or now for a new store)."""
        with self.root() as (root, uid), opened_dir(root, TMP, uid, TMP) as tmp:
            name = owned_name("marker")
            info: dict = {"format": STORE_FORMAT, "version": version,
                          "created": created or datetime.now(timezone.utc).isoformat()}
            if version >= REQUIRES_VERSION:
                info["requires"] = sorted(requires)
            elif deltas and version >= FLAGGED_VERSION:
                info["deltas"] = True
            data = json.dumps(info).encode()
            _write_file(tmp, name, data)
            try:
                os.rename(name, MARKER, src_dir_fd=tmp, dst_dir_fd=root)
            except BaseException:
                _unlink_quietly(tmp, name)
                raise
            os.fsync(root)
            return str(info["created"])

    def upgrade(self, deltas: bool = False, needs: Iterable[str] = ()) -> None:
        """Make the store version 8 (WRITE_VERSION) before this gpusnap writes its first pack entry there,
        and make its marker's `requires` list NEEDS (and, DELTAS, `codec:xor-zstd`) before an entry that
        needs them is appended (FORMAT.md, "The marker's `requires`", "Store versions"): a store of an
        older version gets packs/ and index/, and a marker whose `requires` is what it holds
        (storage/format/marker.py held_requirements). Idempotent; several writers may race to do it:
        each takes an exclusive flock of the store directory, reads the marker again and writes the
        union of what is there and what it needs (the list never loses an entry), as one renamed file."""
        need = set(needs) | ({DELTAS} if deltas else set())
        have = self.requires
        if self.version >= WRITE_VERSION and have is not None and need <= have:
            return  # the common case, every entry after the first of its codec: no lock taken
        with self._upgrade_lock:
            self._rewrite_requires(lambda held: held | need)

    def _rewrite_requires(self, change: Callable[[frozenset[str]], set[str] | frozenset[str]]) -> None:
        """Under the store directory's exclusive flock: the marker read again (a store of an older
        version: its holdings computed), CHANGE applied to its `requires`, and the marker written
        (version 8) if that changed anything or the store was older."""
        try:
            with self.root() as (root, _):
                fcntl.flock(root, fcntl.LOCK_EX)
                on_disk, had_deltas, on_req = self._marker_on_disk(root)
                if on_disk is not None and on_disk not in READ_VERSIONS:
                    raise StoreError(f"{self.path}: store format {STORE_FORMAT} v{on_disk} (written since this "
                                     f"store was opened) is not {STORE_FORMAT} v{READ_VERSIONS[-1]} or older")
                if on_disk == REQUIRES_VERSION and on_req is None:
                    raise StoreError(f"{self.path}: unreadable store marker (its requires list)")
                if on_req is not None:
                    lacking = requires_list.missing(on_req)
                    if lacking:
                        raise StoreError(requires_list.refusal(self.path, lacking))
                    held = on_req
                else:  # version 1 to 7 (or a marker lost: what the store holds is the truth)
                    held = frozenset(requires_list.held_requirements(root) |
                                     ({DELTAS} if had_deltas or self.deltas else set()))
                want = frozenset(change(held))
                if on_disk == WRITE_VERSION and want == held:
                    self.version, self.requires, self.deltas = WRITE_VERSION, held, DELTAS in held
                    return
                for d in PACK_DIRS:
                    try:
                        os.mkdir(d, 0o700, dir_fd=root)
                    except FileExistsError:
                        pass
                os.fsync(root)
                self._write_marker(self._created, WRITE_VERSION, requires=want)
        except OSError as e:
            raise StoreError(_io_message(f"upgrading the store marker to version {WRITE_VERSION}", e,
                                         self.path)) from None
        self.version, self.requires, self.deltas = WRITE_VERSION, want, DELTAS in want

    def entry_codec(self, header: ChunkHeader) -> None:
        """Before an entry of HEADER's codec is appended to a pack (PackWriter's before_append): the
        marker lists that codec (FORMAT.md, "The marker's `requires`")."""
        self.upgrade(needs=(codec_requirement(header.codec),))

    def chunk_files_gone(self) -> None:
        """`store migrate` left no chunk file in chunks/XY/: the marker stops saying there may be some."""
        with self._upgrade_lock:
            self._rewrite_requires(lambda held: held - {CHUNK_FILES})

    @classmethod
    def _marker_on_disk(cls, root: int) -> tuple[int | None, bool, frozenset[str] | None]:
        """The version the marker in the store directory ROOT says now, whether it says a delta may be
        in the store, and its `requires` (version 8, a well-formed list; else None); (None, True, None)
        when it cannot be read (so: unknown, deltas included)."""
        try:
            fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=root)
            try:
                info = json.loads(os.read(fd, _RECORD_MAX))
            finally:
                os.close(fd)
            v = info.get("version") if isinstance(info, dict) else None
            if not isinstance(v, int) or isinstance(v, bool):
                return None, True, None
            req = None
            if v == REQUIRES_VERSION:
                try:
                    req = requires_list.parse_requires(info.get("requires"))
                except ValueError:
                    req = None
            return v, cls._says_deltas(info), req
        except (OSError, ValueError, RecursionError, GpusnapError):
            return None, True, None

    def _create(self) -> None:
        self.version, self.deltas, self.requires = STORE_VERSION, False, None
        self._created = None
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            os.chmod(self.path, 0o700)
            with self.root() as (root, uid):
                for d in SUBDIRS:
                    try:
                        os.mkdir(d, 0o700, dir_fd=root)
                    except FileExistsError:
                        pass
                with opened_dir(root, CHUNKS, uid, CHUNKS) as chunks:
                    for i in range(256):
                        try:
                            os.mkdir(f"{i:02x}", 0o700, dir_fd=chunks)
                        except FileExistsError:
                            pass
            self._created = self._write_marker(None)
        except OSError as e:
            raise StoreError(f"cannot create store at {self.path}: {e.strerror or e}") from None

    # ---- locks --------------------------------------------------------------------------------
    @contextmanager
    def shared(self) -> Iterator[None]:
        with self.root() as (root, _):
            lock = _FileLock(root, LOCK, LOCK)
            lock.acquire(exclusive=False, timeout=None)
        try:
            yield
        finally:
            lock.release()

    @contextmanager
    def exclusive(self, timeout: float) -> Iterator[None]:
        with self.root() as (root, _):
            lock = _FileLock(root, LOCK, LOCK)
            got = lock.acquire(exclusive=True, timeout=timeout)
        if not got:
            raise StoreError("store is busy (a put, get or verify is running); try again when it ends")
        try:
            yield
        finally:
            lock.release()

    @contextmanager
    def name_lock(self, name: str) -> Iterator[None]:
        """NAME's writer lock (names/NAME.lock), taken without waiting. Only writers and rm of an
        existing snapshot take it; when the holder is done and NAME has no snapshot (a failed put or
        dump, an rm), the file is removed while still held, so none is left behind for gc."""
        lock_name = name_lock_entry(validate_snapshot_name(name))
        with self.subdir(NAMES) as names:
            lock = _FileLock(names, lock_name, f"{NAMES}/{lock_name}")
            got = lock.acquire(exclusive=True, timeout=0)
        if not got:
            raise StoreError(f"snapshot {name!r} is being written by another process")
        try:
            yield
        finally:
            try:
                if not self.exists(name):
                    with self.subdir(NAMES) as names:
                        _unlink_quietly(names, lock_name)
            except (OSError, GpusnapError):
                pass
            finally:
                lock.release()

    # ---- snapshots ----------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        """Whether anything occupies NAME's manifest entry (a snapshot, or a damaged entry in its place)."""
        entry = manifest_entry(validate_snapshot_name(name))
        with self.subdir(SNAPSHOTS) as snaps:
            return lstat_at(snaps, entry) is not None

    def scan(self) -> tuple[list[str], list[Stray]]:
        """The snapshot names (sorted) and the stray entries of snapshots/."""
        names: list[str] = []
        strays: list[Stray] = []
        with self.subdir(SNAPSHOTS) as snaps:
            for e in entries(snaps):
                what = _stray_reason(e)
                if what is None:
                    names.append(e.name[:-5])
                else:
                    strays.append(Stray(e.name, what))
        return names, strays

    def names(self) -> list[str]:
        return self.scan()[0]

    def load(self, name: str) -> Manifest:
        entry = manifest_entry(validate_snapshot_name(name))
        with self.subdir(SNAPSHOTS) as snaps:
            try:
                fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=snaps)
            except FileNotFoundError:
                raise StoreError(f"no snapshot named {name!r} in {self.path}") from None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise StoreDamage(f"snapshot {name!r}: {SNAPSHOTS}/{entry} is a symbolic link, "
                                      "not a manifest") from None
                raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StoreDamage(f"snapshot {name!r}: {SNAPSHOTS}/{entry} is {file_kind(st.st_mode)}, not a manifest")
            data = read_to_end(fd, MAX_MANIFEST)
        finally:
            os.close(fd)
        m = Manifest.loads(data, where=f"snapshot {name!r}")
        if m.name != name:
            raise ManifestError(f"snapshot {name!r}: manifest says its name is {m.name!r}")
        return m

    def writer(self, name: str, *, replace: bool = False, meta: dict[str, Any] | None = None,
               tags: tuple[str, ...] | list[str] = (), created: str | None = None,
               host: str | None = None, direct_packs: bool = False) -> "SnapshotWriter":
        """CREATED and HOST keep the creation time and host of a snapshot copied from elsewhere (a pull,
        an import). DIRECT_PACKS: write this writer's packs with O_DIRECT where the store's file system
        takes it (PackWriter), for writers whose bytes are not read back soon through the page cache."""
        return SnapshotWriter(self, name, replace=replace, meta=meta or {}, tags=tags, created=created, host=host,
                              direct_packs=direct_packs)

    def remove(self, name: str) -> str:
        """Remove snapshot NAME, or the stray entry of snapshots/ listed as NAME (with or without its
        ".json"); returns what was removed. Chunks stay until gc."""
        try:
            valid = validate_snapshot_name(name)
        except InvalidNameError:
            valid = None
        with self.shared():
            if valid is not None:
                with self.subdir(SNAPSHOTS) as snaps:
                    st = lstat_at(snaps, manifest_entry(valid))
                if st is not None and stat.S_ISREG(st.st_mode):
                    with self.name_lock(valid), self.subdir(SNAPSHOTS) as snaps:
                        try:
                            os.unlink(manifest_entry(valid), dir_fd=snaps)
                        except FileNotFoundError:
                            raise StoreError(f"no snapshot named {name!r} in {self.path}") from None
                        os.fsync(snaps)
                    return f"snapshot {valid}"
            strays = {s.entry: s for s in self.scan()[1]}
            stray = strays.get(name) or strays.get(name + ".json")
            if stray is None:
                raise StoreError(f"no snapshot named {name!r} in {self.path}")
            with self.subdir(SNAPSHOTS) as snaps:
                st = lstat_at(snaps, stray.entry)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    remove_tree(snaps, stray.entry, f"{SNAPSHOTS}/{stray.entry}")  # fd-relative, iterative: no link followed
                elif st is not None:
                    os.unlink(stray.entry, dir_fd=snaps)
                os.fsync(snaps)
            return f"stray entry {SNAPSHOTS}/{stray.entry}"

    # ---- chunks -------------------------------------------------------------------------------
    @contextmanager
    def chunk_dir(self, cid: str) -> Iterator[int]:
        if not CHUNK_ID.fullmatch(cid):
            raise ChunkError(cid, "is not a chunk id (64 lowercase hex digits)")
        try:
            with self.subdir(CHUNKS, chunk_dir_name(cid)) as d:
                yield d
        except FileNotFoundError:
            raise ChunkError(cid, "missing (its directory is gone)") from None
        except StoreDamage as e:
            raise ChunkError(cid, str(e)) from None

    # ---- the pack index (FORMAT.md, "Pack files and the index") --------------------------------
    def refresh_index(self) -> PackIndex:
        """Load the index files written since the last look (and the quarantine records of entries);
        the packs held open are closed (reopened as the index names them now)."""
        self._pack_fds.forget()
        with self._index_lock:
            try:
                with self.subdir(INDEX) as idx:
                    self._index.refresh(idx)
            except FileNotFoundError:
                pass  # a version 1/2 store: no packs yet
            self._index.skip = self._quarantined_entries()
            self._index_loaded = True
            return self._index

    def locate(self, cid: str, refresh: bool = False) -> list[Loc]:
        """The pack entries of CID a reader may use (quarantined ones left out)."""
        with self._index_lock:
            if self._index_loaded and not refresh:
                return self._found(cid)
        self.refresh_index()
        with self._index_lock:
            return self._found(cid)

    def _found(self, cid: str) -> list[Loc]:
        got = self._index.find(cid)
        p = self._pending.get(cid)
        return got + [p] if p is not None and p not in got else got

    def index_added(self, pack: str, pack_len: int, ents: list[tuple[str, int, int]]) -> None:
        """A writer of this process indexed PACK: its entries are readable now."""
        with self._index_lock:
            if pack not in self._index.packs:
                self._index.add(pack, pack_len, ents)
            self._forget_pending(pack)

    def entry_appended(self, cid: str, loc: Loc) -> None:
        """A writer of this process appended CID at LOC (readable from this process before its index)."""
        with self._index_lock:
            self._pending.setdefault(cid, loc)

    def pack_dropped(self, pack: str) -> None:
        """PACK was removed (a failed seal, gc): not read as pending, and its fd held here closed."""
        self._pack_fds.drop(pack)
        with self._index_lock:
            self._forget_pending(pack)

    def _forget_pending(self, pack: str) -> None:
        for cid in [c for c, loc in self._pending.items() if loc.pack == pack]:
            del self._pending[cid]

    def pack_length(self, pack: str) -> int:
        with self._index_lock:
            return self._index.packs.get(pack, 0)

    def _quarantined_entries(self) -> set[tuple[str, int]]:
        out: set[tuple[str, int]] = set()
        try:
            with self.subdir(QUARANTINE) as q:
                for e in entries(q):
                    if e.name.endswith(".json") and CHUNK_ID.fullmatch(e.name[:-5]):
                        rec = read_record(q, e.name)
                        for ent in (rec.get("entries") or []) if isinstance(rec, dict) else []:
                            if (isinstance(ent, list) and len(ent) == 2 and isinstance(ent[0], str)
                                    and isinstance(ent[1], int)):
                                out.add((ent[0], ent[1]))
        except (FileNotFoundError, GpusnapError, OSError):
            pass
        return out

    def holding_packs(self) -> "AbstractContextManager[None]":
        """For the block, the packs this object's threads read stay open between reads (a put with a
        parent looks up headers and reads bases many times per pack); all closed when it ends."""
        return self._pack_fds.held()

    def prefetch(self, cid: str) -> None:
        """Ask the kernel to read CID's first pack entry into the page cache (posix_fadvise WILLNEED,
        through the packs held open): a hint, nothing checked, every error ignored. A put with a parent
        reads ahead the bases its next changed chunks will take, so their reads overlap the work."""
        from storage.repo.readstage import willneed
        with self._bases_lock:
            if cid in self._bases:
                return
        try:
            locs = self.locate(cid)
            if locs:
                with self._pack_fds.borrowed(locs[0].pack, cid) as fd:
                    willneed(fd, locs[0].offset, locs[0].length)
        except (OSError, GpusnapError):
            pass

    def use_warm(self) -> bool:
        """From now on, read the packs the warm tier holds a copy of from there (storage/repo/warmread.py):
        for a restore only (verify, repair and gc read the store's own packs). Whether there are any."""
        from storage.repo.warmread import WarmPacks
        with self.root() as (root, _):
            self._warm = WarmPacks.find(root)
        return self._warm is not None

    def open_warm(self, pack: str) -> int | None:
        """An fd of the warm copy of PACK (the caller closes it) where use_warm found the tier, else None."""
        w = self._warm
        return w.open(pack) if w is not None else None

    def warm_read(self, n: int) -> None:
        w = self._warm
        if w is not None:
            w.counted(n)

    @property
    def warm_in_use(self) -> bool:
        return self._warm is not None

    @property
    def warm_bytes(self) -> int:
        """Bytes this object read from the warm tier (entries that passed their check)."""
        w = self._warm
        return w.bytes_read if w is not None else 0

    def _first_warm(self, ref: ChunkRef, buf: AlignedBuffer, accept: Callable[[ChunkHeader, memoryview], _T],
                    check: bool) -> tuple[bool, Any]:
        """(True, ACCEPT's answer) for a warm copy of REF that reads, fits and is taken; (False, None)
        otherwise (then the store's own copies are read: a warm copy is a cache)."""
        assert ref.id is not None
        for loc in self.locate(ref.id):
            fd = self.open_warm(loc.pack)
            if fd is None:
                continue
            try:
                header, payload = read_entry(fd, loc, self.pack_length(loc.pack), ref.id, buf)
                if not header.fits(ref.codec, ref.raw_len, ref.stored_len):
                    continue
                if check:
                    stored_check(header, payload, ref.id)
                got = accept(header, payload)
                self.warm_read(loc.length)
                return True, got
            except ChunkError as e:
                if e.chunk_id != ref.id:
                    raise
            finally:
                os.close(fd)
        return False, None

    def _open_pack_checked(self, pack: str, cid: str) -> int:
        """PACK opened read-only through the checked packs/ directory (ChunkError naming CID otherwise)."""
        try:
            with self.subdir(PACKS) as packs:
                return open_pack(packs, pack, cid)
        except FileNotFoundError:
            raise ChunkError(cid, f"missing ({PACKS}/ is gone)") from None
        except StoreDamage as e:
            raise ChunkError(cid, str(e)) from None

    def read_entry(self, cid: str, loc: Loc, buf: AlignedBuffer, direct: bool) -> tuple[ChunkHeader, memoryview]:
        """The entry LOC of chunk CID read into BUF (header parsed, payload not yet checked); a
        buffered read through the pack held open (PackFds)."""
        if not direct:
            with self._pack_fds.borrowed(loc.pack, cid) as fd:
                return read_entry(fd, loc, self.pack_length(loc.pack), cid, buf)
        try:
            with self.subdir(PACKS) as packs:
                fd = open_pack(packs, loc.pack, cid) if not direct else self._open_pack_direct(packs, loc.pack, cid)
        except FileNotFoundError:
            raise ChunkError(cid, f"missing ({PACKS}/ is gone)") from None
        except StoreDamage as e:
            raise ChunkError(cid, str(e)) from None
        try:
            return read_entry(fd, loc, self.pack_length(loc.pack), cid, buf)
        finally:
            os.close(fd)

    @staticmethod
    def _open_pack_direct(packs: int, pack: str, cid: str) -> int:
        try:
            fd = os.open(pack, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_DIRECT, dir_fd=packs)
        except OSError:
            return open_pack(packs, pack, cid)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return open_pack(packs, pack, cid)  # raises the right error
        return fd

    def read_stored(self, ref: ChunkRef, buf: AlignedBuffer, check: bool = True,
                    cached: bool = False) -> tuple[ChunkHeader, memoryview]:
        """REF's entry (or version 1/2 chunk file) read into BUF: its header (checked against REF) and
        its payload, after the stored check unless not CHECK (the caller then makes the full check);
        ChunkError when damaged. CACHED: read through the page cache (restores: a repeated restore is
        served from memory, a cold one gets the kernel's readahead); otherwise around it where the
        store can (verify, repair, export)."""
        return self.first_sound(ref, buf, lambda header, payload: (header, payload), check, cached)

    def first_sound(self, ref: ChunkRef, buf: AlignedBuffer, accept: Callable[[ChunkHeader, memoryview], _T],
                    check: bool = True, cached: bool = False) -> _T:
        """ACCEPT(header, payload) of the first copy of REF (its pack entries in the order a reader tries
        them, then a version 1/2 chunk file) that reads, fits REF, passes the stored check where CHECK
        and that ACCEPT takes: a copy ACCEPT raises ChunkError about (a full check that fails) is passed
        over for the next, so one damaged or planted copy never hides a sound one; the first copy's
        ChunkError when none is taken. BUF holds the copy ACCEPT is given."""
        assert ref.id is not None
        cid = ref.id
        if self._warm is not None:
            took, got = self._first_warm(ref, buf, accept, check)
            if took:
                return cast(_T, got)
        direct = self.direct and not cached
        first: ChunkError | None = None
        for refresh in (False, True):
            for loc in self.locate(cid, refresh):
                try:
                    header, payload = self.read_entry(cid, loc, buf, direct)
                    if not header.fits(ref.codec, ref.raw_len, ref.stored_len):
                        raise ChunkError(cid, "header disagrees with the manifest's reference")
                    if check:
                        stored_check(header, payload, cid)
                    return accept(header, payload)
                except ChunkError as e:
                    if e.chunk_id != cid:
                        raise  # not this copy's damage (a base of a delta, a caller's own error)
                    first = first or e
            try:
                with self.chunk_dir(cid) as d:
                    header, payload = read_chunk_file(d, cid, buf, direct, check)
                if not header.fits(ref.codec, ref.raw_len, ref.stored_len):
                    raise ChunkError(cid, "header disagrees with the manifest's reference")
                if header.codec == DELTA:  # gc's closure looks at pack entries only
                    raise ChunkError(cid, "is a delta in a chunk file (delta entries are pack entries only)")
                return accept(header, payload)
            except ChunkError as e:
                if e.what.startswith("missing") and first is None and not refresh:
                    continue  # perhaps indexed by another process since: look once more
                raise first or e
        raise first or ChunkError(cid, "missing")

    def sound_copy(self, cid: str, locs: list[Loc]) -> list[Loc]:
        """Of LOCS (several pack entries of CID), the first that reads and passes the full check (its
        raw bytes derive CID), alone; all of LOCS when none does (evidence for `store repair`). What gc
        keeps of an id with more than one copy: the first in reading order may be the damaged or
        planted one, and keeping it alone would delete the only sound copy."""
        with AlignedBuffer(max(loc.length for loc in locs)) as buf:
            for loc in locs:
                try:
                    header, payload = self.read_entry(cid, loc, buf, direct=False)
                    full_check(header, payload, cid, base=self.delta_base)
                    return [loc]
                except ChunkError:
                    continue
                except CodecError:
                    break  # a codec this host cannot decode (nvCOMP's, say): which copy is sound is unknown
        return list(locs)

    def read_chunk(self, ref: ChunkRef, buf: AlignedBuffer) -> memoryview:
        """REF's payload (read into BUF) after the stored check (FORMAT.md: no decoding; a GSNPCHK2
        payload is not yet bound to its id: readers of the raw bytes use read_raw)."""
        return self.read_stored(ref, buf)[1]

    def read_raw(self, ref: ChunkRef, buf: AlignedBuffer, out: memoryview | None = None,
                 cached: bool = False) -> bytes | memoryview:
        """REF's raw bytes after the full check (decoded; GSNPCHK2: they derive the id); ChunkError
        when damaged, CodecError for a codec the host cannot decode. OUT: decoded into it (see
        chunkfile.full_check); CACHED: as read_stored."""
        cid = ref.id or ""
        return self.first_sound(ref, buf, lambda header, payload: full_check(header, payload, cid, out,
                                                                             base=self.delta_base),
                                check=False, cached=cached)

    # ---- delta entries (FORMAT.md, "Delta entries") --------------------------------------------
    def keep_bases(self, most: int) -> None:
        """Keep up to MOST bytes of delta bases decoded from now on (never fewer than BASE_CACHE)."""
        with self._bases_lock:
            self._bases_most = max(BASE_CACHE, most)

    def delta_base(self, bid: str, most: int) -> memoryview:
        """The raw bytes of BID as the base of a delta (storage/codecs/delta.py's BaseReader), verified: a
        raw-addressed entry of at most MOST raw bytes that is not itself a delta (depth 1: a base is
        never resolved further); ChunkError (about BID) otherwise. The last BASE_CACHE bytes of bases
        read are kept (a restore reads each base once; keep_bases raises it), and a base another
        thread is reading now is waited for, not read again (a dump's neighbouring new chunks ask for
        the same parent chunks at once); if that read fails, the next asker reads it itself."""
        mine = threading.Event()  # set when this thread's read (if it reads) has ended
        while True:
            with self._bases_lock:
                hit = self._bases.get(bid)
                if hit is not None:
                    self._bases.move_to_end(bid)
                    break
                other = self._bases_loading.get(bid)
                if other is None:
                    self._bases_loading[bid] = mine
                    break
            other.wait()  # set once that read ended, cached or failed: look again
        if hit is not None:  # the same answer as an uncached read: a base beyond MOST is damage
            if len(hit) > most:
                raise ChunkError(bid, f"holds {len(hit)} raw bytes, more than a delta's base may ({most})")
            return hit
        raw: memoryview | None = None
        try:
            raw = self._read_base(bid, most)
        finally:
            with self._bases_lock:
                del self._bases_loading[bid]
                if raw is not None:
                    self.bases_decoded += len(raw)
                if raw is not None and bid not in self._bases:
                    self._bases[bid] = raw
                    self._bases_total += len(raw)
                    while self._bases_total > self._bases_most and len(self._bases) > 1:
                        self._bases_total -= len(self._bases.popitem(last=False)[1])
            mine.set()
        return raw

    def _read_base(self, bid: str, most: int) -> memoryview:
        cap = HEADER_SIZE + align_up(max(most, 1))
        first: ChunkError | None = None
        for refresh in (False, True):
            for loc in self.locate(bid, refresh):
                if loc.length > cap:
                    first = first or ChunkError(bid, f"is an entry of {loc.length} bytes, more than a delta's base may hold")
                    continue
                # one buffer per thread, kept: the base's bytes are decoded or copied out of it into a
                # mapping of their own, so it is free again on return (a new mapping per base cost
                # its page faults every time: a second put's base reads were mostly system time)
                buf = getattr(self._base_reads, "buf", None)
                if buf is None or buf.size < loc.length:
                    if buf is not None:
                        buf.close()
                    buf = self._base_reads.buf = AlignedBuffer(max(loc.length, HEADER_SIZE + align_up(DEFAULT_BASE_READ)))
                try:
                    header, payload = self.read_entry(bid, loc, buf, False)
                    return _base_bytes(bid, header, payload, most)
                except ChunkError as e:
                    first = first or e
            try:
                with self.chunk_dir(bid) as d:
                    st = lstat_at(d, bid)
                    if st is None:
                        raise ChunkError(bid, "missing")
                    if st.st_size > cap:
                        raise ChunkError(bid, f"is a chunk file of {st.st_size} bytes, more than a delta's base may hold")
                    buf = AlignedBuffer(cap)
                    try:
                        header, payload = read_chunk_file(d, bid, buf, False, check=False)
                        return _base_bytes(bid, header, payload, most)
                    finally:
                        buf.close()
            except ChunkError as e:
                if e.what.startswith("missing") and first is None and not refresh:
                    continue
                raise first or e
        raise first or ChunkError(bid, "missing")

    def expanded(self, cid: str, header: ChunkHeader, payload: memoryview) -> tuple[ChunkHeader, memoryview]:
        """A delta entry of CID (HEADER, PAYLOAD) as the plain entry of the same raw bytes, after the
        full check (what leaves the store, export and push, never names a base: FORMAT.md); any other
        entry as it is."""
        if header.codec != DELTA:
            return header, payload
        raw = memoryview(full_check(header, payload, cid, base=self.delta_base))
        enc = HostCodecChooser().encode(raw)
        body = memoryview(enc.payload)
        return ChunkHeader(enc.codec, len(raw), len(body), raw_id=True).with_checksum(body), body

    def entry_segments(self, cid: str, loc: Loc) -> list[delta.Segment] | None:
        """The reference segments of the pack entry LOC of CID if it is a delta entry, else None (a
        header or table that does not parse is no delta here: its readers find the damage). Reads
        the header and the segment table (at most 4096 + delta.TABLE_MAX bytes). gc, which must not
        guess, uses entry_kind."""
        try:
            return self.entry_kind(cid, loc)
        except EntryUnknown:
            return None

    def entry_kind(self, cid: str, loc: Loc) -> list[delta.Segment] | None:
        """As entry_segments, but EntryUnknown when it cannot be told: the entry unreadable (an I/O
        error, too many open files), its header damaged (a delta's codec id may be what is damaged),
        or a delta's table that does not parse (which bases it names is unknown)."""
        try:
            with self._pack_fds.borrowed(loc.pack, cid) as fd:
                head = os.pread(fd, min(loc.length, HEADER_SIZE + delta.TABLE_MAX), loc.offset)
            header = ChunkHeader.unpack(head[:64], cid)
        except (ChunkError, OSError, GpusnapError, struct.error, ValueError) as e:
            raise EntryUnknown(f"chunk {cid[:16]}… in pack {loc.pack[:16]}…: its header cannot be read ({e})") from None
        if header.codec != DELTA:
            return None
        try:
            return delta.parse_table(head[HEADER_SIZE:] + bytes(delta.MIN_FRAME), header.raw_len)[0]
        except (ChunkError, GpusnapError, struct.error, ValueError) as e:
            raise EntryUnknown(f"delta chunk {cid[:16]}…: its table cannot be read ({e})") from None

    def may_hold_deltas(self) -> bool:
        """Whether this store's marker says a delta entry may be in the store (versions 4 and 5; 6 and 7 with
        `deltas`), read again: another process may have written the first delta since this object was
        opened. A store whose marker does not say it holds no delta entry."""
        if self.deltas:
            return True
        try:
            with self.root() as (root, _):
                version, deltas, _ = self._marker_on_disk(root)
                return deltas or version not in READ_VERSIONS  # unreadable or unknown: look at the entries
        except (OSError, GpusnapError):
            return True  # unknown: look at the entries

    def delta_bases(self, cids: Iterable[str]) -> dict[str, set[str]]:
        """delta id -> its base ids, for each of CIDS whose entry a reader takes first (in a pack) is a delta."""
        out: dict[str, set[str]] = {}
        if not self.may_hold_deltas():
            return out
        for cid in cids:
            locs = self.locate(cid)
            if locs:
                segs = self.entry_segments(cid, locs[0])
                if segs is not None:
                    out[cid] = delta.bases(segs)
        return out

    def base_ref(self, bid: str) -> ChunkRef | None:
        """A reference to the base BID as its first full (not delta) entry's header says (verify's
        closure over bases); None when it has no such entry."""
        for loc in self.locate(bid):
            if self.entry_segments(bid, loc) is not None:
                continue
            try:
                with self._pack_fds.borrowed(loc.pack, bid) as fd:
                    header = ChunkHeader.unpack(os.pread(fd, 64, loc.offset), bid)
            except (ChunkError, OSError, GpusnapError, struct.error):
                continue
            return ChunkRef(bid, header.raw_len, header.codec, header.stored_len)
        return None

    # ---- the chunk tier (storage/repo/tier.py) ------------------------------------------------------
    def has(self, cid: str) -> bool:
        """Whether an index entry (not quarantined) or a regular chunk file of CID is here (ChunkTier)."""
        if not CHUNK_ID.fullmatch(cid):
            return False
        if self.locate(cid):
            return True
        try:
            with self.chunk_dir(cid) as d:
                st = lstat_at(d, cid)
        except ChunkError:
            return False
        return st is not None and stat.S_ISREG(st.st_mode)

    def read_verified(self, ref: ChunkRef, frame: HostBuffer) -> Verified:
        """REF's payload read into FRAME (laid out like a chunk file) and bound to its id: the one
        verified read of the chunk tier (storage/repo/tier.py). A GSNPCHK1 chunk gets the stored check
        (its id covers the stored bytes), a GSNPCHK2 one is decoded once and its raw bytes hashed;
        read through the page cache (restores); ChunkError when damaged."""
        cid = ref.id or ""

        def bound(header: ChunkHeader, payload: memoryview) -> Verified:
            if header.codec == DELTA:  # its payload is no encoding of the raw bytes a caller could decode
                raise ChunkError(cid, "is a delta entry; the chunk tier's readers (the GPU path) take "
                                 "only the chunks they wrote, never a delta")
            id_check(header, payload, cid)
            return Verified(frame.ptr + HEADER_SIZE, payload, header,
                            "read+decode+verify" if header.raw_id else "read+verify")
        # every copy in turn: a damaged or planted one never hides a sound one
        return self.first_sound(ref, frame, bound, check=False, cached=True)  # type: ignore[arg-type]

    def missing(self, manifest: Manifest) -> list[str]:
        """Chunk ids MANIFEST names that have no index entry and no regular file here, and the deltas
        among them (as their references say) whose bases have no entry (a cheap pass before any
        output: a restore refuses such a snapshot before it starts a process)."""
        out = []
        self.refresh_index()
        deltas = {c.id for s in manifest.streams for c in s.chunks if c.codec == DELTA and c.id is not None}
        for did, bids in sorted(self.delta_bases(deltas).items()):
            if any(not self.locate(b) and not self.has(b) for b in bids):
                out.append(did)
        for cid in sorted(manifest.chunk_ids()):
            with self._index_lock:
                if self._found(cid):
                    continue
            try:
                with self.chunk_dir(cid) as d:
                    st = lstat_at(d, cid)
            except ChunkError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                out.append(cid)
        return out

    def absence(self, cid: str) -> str:
        """Why chunk CID cannot be read: what verify found when it quarantined it, or "missing"; for a
        delta entry here, why its base cannot be."""
        locs = self.locate(cid)
        if locs:
            segs = self.entry_segments(cid, locs[0])
            for b in sorted(delta.bases(segs or [])):
                if not self.has(b):
                    return f"{delta.BASE_WHY} {b[:16]}… {self.absence(b)}"
        try:
            with self.chunk_dir(cid) as d:
                st = lstat_at(d, cid)
        except ChunkError as e:
            return e.what
        if st is not None and not stat.S_ISREG(st.st_mode):
            return f"is {file_kind(st.st_mode)}, not a chunk file"
        why = self.quarantined(cid)
        return "missing" if why is None else f"{why} (moved to {QUARANTINE}/ by verify)"

    def chunk_buffer_size(self, manifests: list[Manifest]) -> int:
        most = max((max_stored_len(c.codec, c.raw_len, c.stored_len) for m in manifests for s in m.streams
                    for c in s.chunks), default=0)
        return HEADER_SIZE + align_up(max(most, 1))

    def present(self, cid: str, header: ChunkHeader, chunks_fd: int, pw: PackWriter | None) -> ChunkHeader | None:
        """The header of a copy of CID a writer about to store HEADER may reuse (FORMAT.md, "Damage and
        healing"): in PW's open pack, in an indexed pack (its entry's header sane, its bytes all there), or a version 1/2 chunk file (chunkfile.reusable). None: write it.
        The indexed pack is read through the fd held open (PackFds): a writer holds the store's shared
        lock and loaded the index after taking it (which forgot every fd held), and gc and repair,
        which remove packs, need the exclusive lock, so no pack it reads can have been removed since."""
        got = pw.pending(cid) if pw is not None else None
        if got is not None:
            return got if _reusable_header(got, header) else None
        for loc in self.locate(cid):
            try:
                with self._pack_fds.borrowed(loc.pack, cid) as fd:
                    if os.fstat(fd).st_size < loc.offset + loc.length:
                        continue  # truncated: written again
                    head = os.pread(fd, 64, loc.offset)
                got = ChunkHeader.unpack(head, cid)
            except (ChunkError, OSError, GpusnapError, struct.error):
                continue
            if HEADER_SIZE + got.stored_len <= loc.length and _reusable_header(got, header):
                return got
        xy = chunk_dir_name(cid)
        if xy in self._no_chunk_files:
            return None
        try:
            with opened_child(chunks_fd, xy, f"{CHUNKS}/{xy}") as d:
                got = reusable(d, cid, header)
                if got is None and _is_empty_dir(d):
                    self._no_chunk_files.add(xy)
                return got
        except FileNotFoundError:
            return None

    def store_chunk(self, pw: PackWriter, chunks_fd: int, header: ChunkHeader, frame: memoryview,
                    cid: str | None = None, checksum: bytes | None = None) -> tuple[str, ChunkHeader, bool, float]:
        """Make chunk HEADER + FRAME[HEADER_SIZE:] present: (id, the header of the copy there, whether
        it was written, hash seconds). For a raw-addressed HEADER, CID is the raw id (the caller
        hashed the raw bytes) and the stored checksum is computed here, if it is written (or is CHECKSUM,
        computed by the caller over this header and payload).

        A present copy is reused only if present() says so (a GSNPCHK2 one may encode the raw bytes
        otherwise: its header is returned); otherwise the chunk is appended to PW's open pack (durable
        once PW closes and indexes it: PackWriter.flush)."""
        t0 = time.perf_counter()
        payload = frame[HEADER_SIZE:HEADER_SIZE + header.stored_len]
        if cid is None:
            assert not header.raw_id, "a raw-addressed chunk's id is hashed from its raw bytes"
            cid = chunk_id(header, payload)
        hash_s = time.perf_counter() - t0
        got = self.present(cid, header, chunks_fd, pw)
        if got is not None:
            return cid, got, False, hash_s
        if header.raw_id and checksum is not None:
            if len(checksum) != 32:
                raise StoreError(f"a stored checksum of {len(checksum)} bytes")
            header = replace(header, checksum=checksum)
        elif header.raw_id:
            t1 = time.perf_counter()
            header = header.with_checksum(payload)
            hash_s += time.perf_counter() - t1
        pw.append(cid, header, frame)
        return cid, header, True, hash_s

    @contextmanager
    def packing(self, tmp_fd: int) -> Iterator[PackWriter]:
        """A pack writer for the block (repair, migrate): its packs are closed and indexed at the end;
        on an error the open pack is removed (closed packs stay for gc)."""
        self.upgrade()
        with self.subdir(PACKS) as packs, self.subdir(INDEX) as idx:
            pw = PackWriter(packs, idx, tmp_fd, lambda: owned_name("index"), self.index_added,
                            self.entry_appended, self.pack_dropped, before_append=self.entry_codec)
            try:
                yield pw
            except BaseException:
                pw.abort()
                raise
            pw.flush()

    # ---- quarantine ---------------------------------------------------------------------------
    def quarantined(self, cid: str) -> str | None:
        """What verify found wrong with CID when it moved it to quarantine/, None if it did not."""
        try:
            with self.subdir(QUARANTINE) as q:
                rec = read_record(q, quarantine_record(cid))
        except (FileNotFoundError, GpusnapError, OSError):
            return None
        if rec is None:
            return None
        return str(rec.get("why", "damaged")) if isinstance(rec, dict) else "damaged"

    def quarantine_chunk(self, cid: str, why: str) -> bool:
        """Move chunk CID (damaged: WHY) from chunks/XY/ to quarantine/, or record its damaged pack
        entries there so that nothing reads or reuses them (the caller holds the store exclusively);
        False if there was nothing to move."""
        locs = self.locate(cid, refresh=True)
        with self.root() as (root, uid):
            try:
                os.mkdir(QUARANTINE, 0o700, dir_fd=root)
            except FileExistsError:
                pass
            with opened_dir(root, QUARANTINE, uid, QUARANTINE) as q, self.chunk_dir(cid) as d:
                rec_obj: dict[str, Any] = {"id": cid, "why": why, "when": datetime.now(timezone.utc).isoformat()}
                if locs:
                    rec_obj["entries"] = [[loc.pack, loc.offset] for loc in locs]
                elif lstat_at(d, cid) is None:
                    return False
                else:
                    os.rename(cid, cid, src_dir_fd=d, dst_dir_fd=q)  # moves the entry itself, whatever it is
                    os.fsync(d)
                rec = json.dumps(rec_obj).encode()
                with opened_dir(root, TMP, uid, TMP) as tmp:
                    name = owned_name("record")
                    _write_file(tmp, name, rec)
                    os.rename(name, quarantine_record(cid), src_dir_fd=tmp, dst_dir_fd=q)
                os.fsync(q)
        if locs:
            with self._index_lock:
                self._index.skip |= {(loc.pack, loc.offset) for loc in locs}
        return True

    def unquarantine_chunk(self, ref: ChunkRef, buf: AlignedBuffer) -> bool:
        """Put quarantine/CID back if it verifies after all (the caller holds the store exclusively)."""
        assert ref.id is not None
        cid = ref.id
        if self._unquarantine_entries(ref, buf):
            return True
        try:
            with self.subdir(QUARANTINE) as q:
                header, payload = read_chunk_file(q, cid, buf, False, check=False)
                if not header.fits(ref.codec, ref.raw_len, ref.stored_len):
                    return False
                id_check(header, payload, cid, base=self.delta_base)
                with self.chunk_dir(cid) as d:
                    os.rename(cid, cid, src_dir_fd=q, dst_dir_fd=d)  # over whatever damaged file is there
                    os.fsync(d)
                _unlink_quietly(q, quarantine_record(cid))
        except (OSError, GpusnapError):
            return False
        return True

    def _unquarantine_entries(self, ref: ChunkRef, buf: AlignedBuffer) -> bool:
        """Drop CID's quarantine record of pack entries if one of them verifies after all."""
        cid = ref.id or ""
        try:
            with self.subdir(QUARANTINE) as q:
                rec = read_record(q, quarantine_record(cid))
                ents = rec.get("entries") if isinstance(rec, dict) else None
                if not isinstance(ents, list):
                    return False
                self.refresh_index()
                with self._index_lock:
                    locs = [loc for loc in self._index.locs.get(cid, []) if [loc.pack, loc.offset] in ents]
                for loc in locs:
                    try:
                        header, payload = self.read_entry(cid, loc, buf, False)
                        if header.fits(ref.codec, ref.raw_len, ref.stored_len):
                            id_check(header, payload, cid, base=self.delta_base)
                            break
                    except ChunkError:
                        continue
                else:
                    return False
                os.unlink(quarantine_record(cid), dir_fd=q)
                os.fsync(q)
        except (OSError, GpusnapError):
            return False
        self.refresh_index()
        return True

    # ---- verify / repair ----------------------------------------------------------------------
    def load_all(self, names: list[str], problems: list[Problem]) -> list[Manifest]:
        """The manifests of NAMES that load; a Problem in PROBLEMS for each that does not."""
        manifests: list[Manifest] = []
        for n in names:
            try:
                manifests.append(self.load(n))
            except GpusnapError as e:
                problems.append(Problem(n, None, None, str(e)))
        return manifests

    def check_chunks(self, refs: dict[str, ChunkRef], size: int, workers: int, progress: Progress | None,
                     counts: VerifyReport | None = None, deadline: float | None = None,
                     read_data: bool = False) -> dict[str, str]:
        """Read and verify every chunk of REFS (until DEADLINE, a time.monotonic() value, where one is
        given: the chunks not reached are counted in COUNTS.chunks_unchecked); returns id -> what is
        wrong, for the damaged ones. The stored check, or with READ_DATA the strongest check
        (chunkfile.id_check: GSNPCHK2 chunks decoded and their raw bytes hashed)."""
        if progress is not None:
            progress.start(sum(c.stored_len for c in refs.values()))
        from storage.repo.readstage import Want, read_chunks  # readstage reads through this module
        bad: dict[str, str] = {}
        lock = threading.Lock()
        # pack order: each pack read front to back in large reads, whatever the snapshots' order
        order = sorted(refs.values(), key=lambda r: [(loc.pack, loc.offset) for loc in self.locate(r.id or "")[:1]])
        wants = [Want(None, r) for r in order]

        def stop() -> bool:
            return deadline is not None and time.monotonic() >= deadline

        def count(ref: ChunkRef) -> None:
            with lock:
                if counts is not None:
                    counts.chunks_checked += 1
                    counts.bytes_checked += ref.stored_len
            if progress is not None:
                progress.advance(ref.stored_len)

        def damaged(w: Want, e: ChunkError) -> None:
            with lock:
                bad[w.ref.id or ""] = e.what
            count(w.ref)

        read_chunks(self, wants, lambda w, _: count(w.ref), stages=_NoStages(), decoders=workers,
                    check="id" if read_data else "stored", stop=stop, on_damage=damaged)
        if counts is not None:
            counts.chunks_unchecked += len(refs) - counts.chunks_checked
        return bad

    def _check_variants(self, manifests: list[Manifest], refs: dict[str, ChunkRef], bad: dict[str, str],
                        read_data: bool, deadline: float | None
                        ) -> tuple[set[str], dict[tuple[str, tuple[str, int, int]], str]]:
        """The ids of REFS (checked by check_chunks against REFS' reference: BAD) that MANIFESTS name with
        more than one (codec, raw length, stored length). Each copy of such an id is read once and
        checked on its own (sound_headers), and each reference is satisfied when a sound copy fits it.
        An id some of whose references are satisfied and others not is disputed: a snapshot names it
        wrongly (forged or damaged), so it is taken out of BAD (nothing of it is quarantined) and only
        the references no sound copy satisfies are reported. An id no reference of which is satisfied
        stays in BAD (damage as for any chunk: a delta built on it is damaged too); one every reference
        of which is satisfied is sound. Until DEADLINE. Returns (the disputed ids, (id, lengths) -> what
        is wrong); an id not reached by DEADLINE is counted disputed, with nothing reported."""
        variants: dict[str, set[tuple[str, int, int]]] = {}
        for m in manifests:
            for st in m.streams:
                for c in st.chunks:
                    if c.id is not None and c.id in refs:
                        variants.setdefault(c.id, set()).add((c.codec, c.raw_len, c.stored_len))
        disputed: set[str] = set()
        verdicts: dict[tuple[str, tuple[str, int, int]], str] = {}
        for cid in sorted(c for c, v in variants.items() if len(v) > 1):
            if deadline is not None and time.monotonic() >= deadline:
                disputed.add(cid)  # not sorted out in time: nothing of it set aside, nothing reported
                bad.pop(cid, None)
                continue
            most = HEADER_SIZE + align_up(max(max(max_stored_len(*v), 1) for v in variants[cid]))
            heads = self.sound_headers(cid, most, read_data)
            unmet = {v for v in variants[cid] if not any(h.fits(*v) for h in heads)}
            if not unmet or unmet == variants[cid]:
                continue  # sound under every reference, or under none: as any chunk
            disputed.add(cid)
            first = (refs[cid].codec, refs[cid].raw_len, refs[cid].stored_len)
            why = bad.pop(cid, None)
            verdicts.update({(cid, v): why if v == first and why else "has no sound copy of these lengths"
                             for v in unmet})
        return disputed, verdicts

    def _own_check(self, cid: str, loc: Loc, buf: AlignedBuffer, read_data: bool) -> ChunkHeader:
        """The entry LOC of CID read into BUF and put through its own check (the stored check; with
        READ_DATA chunkfile.id_check), not against any reference: its header, or ChunkError/OSError."""
        header, payload = self.read_entry(cid, loc, buf, self.direct)
        if read_data:
            id_check(header, payload, cid, base=self.delta_base)
        else:
            stored_check(header, payload, cid)
        return header

    def sound_headers(self, cid: str, most: int, read_data: bool) -> list[ChunkHeader]:
        """The headers of every copy of CID (its pack entries, a version 1/2 chunk file) of at most MOST
        bytes that passes its own check (the stored check; with READ_DATA the strongest,
        chunkfile.id_check), each read once: what a reference to CID may be satisfied by."""
        out: list[ChunkHeader] = []
        with AlignedBuffer(most) as buf:
            for loc in self.locate(cid):
                if loc.length > most:
                    continue
                try:
                    out.append(self._own_check(cid, loc, buf, read_data))
                except (GpusnapError, OSError):
                    continue  # damaged, a delta on a damaged base, a codec this host lacks: not sound here
            try:
                with self.chunk_dir(cid) as d:
                    header, payload = read_chunk_file(d, cid, buf, self.direct, True)
                if read_data:
                    id_check(header, payload, cid, base=self.delta_base)
                out.append(header)
            except (GpusnapError, OSError):
                pass
        return out

    def check_copies(self, refs: dict[str, ChunkRef], read_data: bool = False,
                     deadline: float | None = None) -> list[DamagedCopy]:
        """Every pack entry of each id of REFS that has more than one, each read and checked on its own
        (the stored check, or with READ_DATA chunkfile.id_check), since check_chunks reads only the
        first sound copy of an id (SnapshotStore.first_sound); returns the copies that fail their own
        check while another pack entry of the same id passes it and is what REFS' reference names (an
        entry longer than any that reference could name is not read: it cannot be that copy).
        Only an entry's own check makes it damaged: an entry that passes it but disagrees with the
        reference is not judged here (the reference may be the forged one: another snapshot's, or a
        planted manifest's, naming the id with other lengths), so verify never sets aside a sound
        copy because a manifest lies about it. An id none of whose entries passes is the chunk's own
        damage (check_chunks reports it), not a duplicate's. Stops at DEADLINE (time.monotonic())."""
        out: list[DamagedCopy] = []
        for cid, ref in sorted(refs.items()):
            every = self.locate(cid)
            if len(every) < 2:
                continue
            if deadline is not None and time.monotonic() >= deadline:
                break
            most = HEADER_SIZE + align_up(max(max_stored_len(ref.codec, ref.raw_len, ref.stored_len), 1))
            locs = [loc for loc in every if loc.length <= most]  # longer: cannot be what REF names
            bad: list[DamagedCopy] = []
            sound = 0
            with AlignedBuffer(most) as buf:
                for loc in locs:
                    try:
                        header = self._own_check(cid, loc, buf, read_data)
                    except ChunkError as e:
                        if e.chunk_id == cid:  # a delta's damaged base is the base's damage, found on its own
                            bad.append(DamagedCopy(cid, loc.pack, loc.offset, e.what))
                        continue
                    except OSError as e:
                        bad.append(DamagedCopy(cid, loc.pack, loc.offset, f"cannot be read ({e})"))
                        continue
                    sound += header.fits(ref.codec, ref.raw_len, ref.stored_len)
            if sound:
                out += bad
        return out

    def quarantine_entry(self, copy: DamagedCopy) -> bool:
        """Record the one damaged pack entry COPY in quarantine/ (its id's record, other entries it names
        kept), so that no reader or writer uses it and the next gc repacks its pack without it; the
        id's other entries stay readable (quarantine_chunk sets aside every entry of an id). The
        caller holds the store exclusively. False if the entry is no longer indexed."""
        if not any((loc.pack, loc.offset) == (copy.pack, copy.offset) for loc in self.locate(copy.cid, refresh=True)):
            return False
        with self.root() as (root, uid):
            try:
                os.mkdir(QUARANTINE, 0o700, dir_fd=root)
            except FileExistsError:
                pass
            with opened_dir(root, QUARANTINE, uid, QUARANTINE) as q:
                old = read_record(q, quarantine_record(copy.cid))
                rec: dict[str, Any] = old if isinstance(old, dict) else {}
                ents = rec.get("entries")
                ents = [e for e in ents if isinstance(e, list)] if isinstance(ents, list) else []
                if [copy.pack, copy.offset] not in ents:
                    ents.append([copy.pack, copy.offset])
                rec.update({"id": copy.cid, "entries": ents, "when": datetime.now(timezone.utc).isoformat()})
                rec.setdefault("why", f"a duplicate copy {copy.what}")
                with opened_dir(root, TMP, uid, TMP) as tmp:
                    name = owned_name("record")
                    _write_file(tmp, name, json.dumps(rec).encode())
                    os.rename(name, quarantine_record(copy.cid), src_dir_fd=tmp, dst_dir_fd=q)
                os.fsync(q)
        with self._index_lock:
            self._index.skip.add((copy.pack, copy.offset))
        return True

    def verify(self, names: list[str] | None = None, workers: int = 4, progress: Progress | None = None,
               quarantine: bool = True, quarantine_wait: float = 5.0, sample: float | tuple[int, int] | None = None,
               max_seconds: float | None = None, read_data: bool = False) -> VerifyReport:
        """Check every chunk of NAMES (default: every snapshot, and the strays of snapshots/ too).

        SAMPLE (0 < SAMPLE <= 1): read only that fraction of the distinct chunks, chosen at random
        anew each run (as restic's --read-data-subset), so that repeated runs cover the store; or
        (N, T): the N-th of T fixed groups (a chunk is in group int(id[:8], 16) % T + 1), so that the
        runs 1/T .. T/T read every chunk once;
        MAX_SECONDS: stop reading chunks after that long (as borg's --max-duration). Manifests are
        always all checked; what was not read is counted in chunks_unchecked. READ_DATA: the full
        check (FORMAT.md: GSNPCHK2 chunks decoded and bound to their ids), else the stored check.

        With QUARANTINE, damaged chunk files are then moved to quarantine/ (under the store lock held
        exclusively, waiting at most QUARANTINE_WAIT seconds), so that the next put of the same
        bytes writes them again instead of reusing them.

        Every pack entry of an id with several is checked (check_copies), within the same SAMPLE and
        MAX_SECONDS. A damaged one beside a sound one is listed in damaged_copies and, with
        QUARANTINE, set aside alone (quarantine_entry), so that the next gc repacks its pack without
        it. It is not a problem (report.ok stays true, `store verify` exits 0 naming it): no snapshot
        needs it, and the store removes it without the user, as it resolves the duplicates a crashed
        repack leaves; verify exits 3 only for what makes a snapshot unreadable or needs the user
        (a damaged manifest, chunk or index file, a stray entry of snapshots/)."""
        report = VerifyReport()
        with self.shared():
            manifests, refs = self._verify_scope(names, report)
            if isinstance(sample, tuple):  # restic's n/t: the n-th of t fixed groups, by chunk id
                n, t = sample
                picked = [cid for cid in sorted(refs) if int(cid[:8], 16) % t == n - 1]
                report.chunks_unchecked = len(refs) - len(picked)
                refs = {cid: refs[cid] for cid in picked}
            elif sample is not None and sample < 1:
                picked = random.SystemRandom().sample(sorted(refs), math.ceil(sample * len(refs)))
                report.chunks_unchecked = len(refs) - len(picked)
                refs = {cid: refs[cid] for cid in picked}
            deadline = None if max_seconds is None else time.monotonic() + max_seconds
            # the closure over delta bases: a delta is sound only if its base is (FORMAT.md, "Delta entries")
            bases = self.delta_bases(refs)
            no_base: dict[str, str] = {}
            from_store: set[str] = set()  # bases no snapshot names: their reference is an entry's header
            for bid in sorted(set().union(*bases.values()) - set(refs)):
                bref = self.base_ref(bid)
                if bref is None:
                    no_base[bid] = self.absence(bid) if not self.locate(bid) else "has no full entry (only deltas)"
                else:
                    refs[bid] = bref
                    from_store.add(bid)
                    report.chunks_total += 1
            skipped_before = report.chunks_unchecked
            bad = self.check_chunks(refs, self.chunk_buffer_size(manifests), workers, progress, report, deadline,
                                    read_data)
            # an id the snapshots name with different lengths: each snapshot judged by its own reference,
            # and nothing set aside (one of them names it wrongly: a sound entry must not be quarantined
            # because a forged or damaged manifest disagrees with it)
            conflicts, by_variant = self._check_variants(manifests, refs, bad, read_data, deadline)
            # a base judged by the header of its first full entry, which a planted entry may be: it is
            # damaged only if no full copy of it passes its own check (then set aside as any chunk)
            for bid in sorted(from_store & set(bad)):
                heads = self.sound_headers(bid, HEADER_SIZE + align_up(MAX_STORED_CHUNK), read_data)
                if any(h.codec != DELTA for h in heads):
                    del bad[bid]
            bad.update(no_base)
            for did, bids in bases.items():
                for bid in sorted(bids):
                    if bid in bad and did not in bad:
                        bad[did] = f"{delta.BASE_WHY} {bid[:16]}… {bad[bid]}"
            cut_short = report.chunks_unchecked > skipped_before  # --max-duration: not every ref was read
            # every copy of an id, not only the one that served: a damaged duplicate is named, not hidden
            report.damaged_copies = self.check_copies({c: r for c, r in refs.items() if c not in bad}, read_data,
                                                      deadline)
            for cid in list(bad):
                if bad[cid] == "missing":
                    bad[cid] = self.absence(cid)
            for m in manifests:
                for s in m.streams:
                    for i, c in enumerate(s.chunks):
                        if c.id in conflicts:
                            why = by_variant.get((c.id, (c.codec, c.raw_len, c.stored_len)))
                            if why is not None:
                                report.problems.append(Problem(m.name, s.name, i, f"chunk {c.id[:16]}… {why} "
                                                               "(snapshots name it with different lengths; "
                                                               "nothing set aside)"))
                        elif c.id in bad:
                            report.problems.append(Problem(m.name, s.name, i, f"chunk {c.id[:16]}… {bad[c.id]}"))
        damaged = {cid: why for cid, why in bad.items() if not why.startswith(("missing", delta.BASE_WHY))
                   and f"{QUARANTINE}/" not in why and cid in refs and cid not in conflicts}
        if quarantine and (damaged or report.damaged_copies):
            try:
                with self.exclusive(quarantine_wait):
                    again = self.check_chunks({cid: refs[cid] for cid in damaged},
                                              self.chunk_buffer_size(manifests), 1, None,
                                              read_data=read_data) if damaged else {}
                    for cid, why in again.items():
                        if not why.startswith("missing") and self.quarantine_chunk(cid, why):
                            report.quarantined.append(cid)
                    # a damaged duplicate still damaged beside a sound copy: that entry alone set aside
                    still = {(c.cid, c.pack, c.offset) for c in self.check_copies(
                        {c.cid: refs[c.cid] for c in report.damaged_copies}, read_data)}
                    for copy in report.damaged_copies:
                        if (copy.cid, copy.pack, copy.offset) in still:
                            copy.set_aside = self.quarantine_entry(copy)
            except (GpusnapError, OSError) as e:  # busy, or a store this user may only read
                report.not_quarantined = str(e)
        self._record_damage([] if cut_short else [c for c in refs if c not in bad and c not in conflicts], bad,
                            quarantine_wait)
        return report

    def _verify_scope(self, names: list[str] | None,
                      report: "VerifyReport") -> tuple[list[Manifest], dict[str, ChunkRef]]:
        """What verify and verify_quick both check first, under the caller's shared lock: the manifests of
        NAMES (default: every snapshot; the strays of snapshots/ into REPORT), each loaded and checked,
        the index's own damage, and the chunk references they name (REPORT.chunks_total)."""
        if names is None:
            names, report.strays = self.scan()
        report.snapshots = list(names)
        manifests = self.load_all(names, report.problems)
        report.problems += [Problem("(store)", None, None, why + " (the chunks it names read as missing)")
                            for why in self.refresh_index().damage.values()]
        refs = chunk_refs(manifests)
        report.chunks_total = len(refs)
        return manifests, refs

    def verify_quick(self, names: list[str] | None = None) -> VerifyReport:
        """The structural check (restic's `check` without --read-data): every manifest of NAMES
        (default: every snapshot, and the strays of snapshots/) loaded and checked whole, the index
        loaded (an index file that does not parse is a problem), and every chunk a snapshot names
        present, in the index (not quarantined) or as a chunk file. No chunk is read: a chunk whose
        bytes rotted is found by `verify` without --quick. Nothing is quarantined or marked."""
        report = VerifyReport()
        with self.shared():
            manifests, refs = self._verify_scope(names, report)
            absent = {cid: self.absence(cid) for cid in refs if not self.has(cid)}
            for m in manifests:
                for s in m.streams:
                    for i, c in enumerate(s.chunks):
                        if c.id in absent:
                            report.problems.append(Problem(m.name, s.name, i, f"chunk {c.id[:16]}… {absent[c.id]}"))
        return report

    def _record_damage(self, whole: list[str], bad: dict[str, str], wait: float) -> None:
        """Note BAD in damaged.json and clear WHOLE there (storage/repo/damage.py), for `store ls`; a busy or
        read-only store keeps the old record (it is only a listing's hint)."""
        from storage.repo import damage
        if not bad and not os.path.lexists(os.path.join(self.path, damage.RECORD)):
            return
        try:
            with self.exclusive(wait):
                damage.update(self, whole, bad)
        except (GpusnapError, OSError):
            pass

    # ---- temporary entries: staging directories and in-flight gets -----------------------------
    def new_staging_dir(self, kind: str = "staging") -> str:
        """A new private directory in tmp/ owned by this process (its owner is in its name: gc removes
        it once this process is gone). Returns its absolute path."""
        name = owned_name(kind)
        with self.subdir(TMP) as tmp:
            os.mkdir(name, 0o700, dir_fd=tmp)
        return os.path.join(self.tmp_dir, name)

    @contextmanager
    def inflight_get(self, dest: str) -> Iterator[str | None]:
        """Record in tmp/ that this process materializes into DEST, for the block: if it is killed, gc
        finds the record and removes the staging sibling it left (get_staging_name), if that carries
        the marker of the nonce the block is given (storage/fs/getmark.py; None: nothing was recorded)."""
        owner = this_owner()
        nonce = new_nonce()
        rec = {"pid": owner.pid, "start": owner.start, "boot": owner.boot, "uid": os.geteuid(),
               "dest": os.path.abspath(dest), "nonce": nonce}
        name: str | None = owned_name("get")
        try:
            with self.subdir(TMP) as tmp:
                _write_file(tmp, name, json.dumps(rec).encode())  # type: ignore[arg-type]
        except (PermissionError, StoreAccessError):
            name = None  # a reader of a store it may not write: nothing to record, nothing gc could do
        except OSError as e:
            if e.errno != errno.EROFS:
                raise
            name = None
        try:
            yield nonce if name is not None else None
        finally:
            if name is not None:
                with self.subdir(TMP) as tmp:
                    _unlink_quietly(tmp, name)


class _NoStages:
    """Stage times nobody reads (verify reports counts, not stages)."""

    def add(self, stage: str, seconds: float, nbytes: int) -> None:
        pass


def _live(ref: "weakref.ref[SnapshotStore]") -> "SnapshotStore":
    store = ref()
    if store is None:  # a pack opened for a store being collected: nothing can still be reading it
        raise ChunkError("", "the store was closed")
    return store


DEFAULT_BASE_READ = 4 << 20  # the size each thread's base-read buffer starts at (store put's chunk size)


def _base_bytes(bid: str, header: ChunkHeader, payload: memoryview, most: int) -> memoryview:
    """The raw bytes of the entry BID (HEADER, PAYLOAD) as a delta's base: raw-addressed, not a delta,
    at most MOST raw bytes, full-checked; ChunkError otherwise. Read-only, in a mapping of their own
    (kept while referenced), decoded or copied into it with the GIL released: `bytes(...)` of the
    decoded view held the GIL for the copy and its page faults, 78% of this step's samples in a
    profile of a second put (BENCHMARKS.md section 29)."""
    if not header.raw_id:
        raise ChunkError(bid, "is not a raw-addressed chunk (a delta's base must be one)")
    if header.codec == DELTA:
        raise ChunkError(bid, "is itself a delta entry (a base must be a full entry: depth 1 only)")
    if header.raw_len > most:
        raise ChunkError(bid, f"holds {header.raw_len} raw bytes, more than a delta's base may ({most})")
    # populated at once (one fault-in pass in the kernel, not a fault per page as the decoder writes)
    populate = getattr(mmap, "MAP_POPULATE", 0)
    view = memoryview(mmap.mmap(-1, max(header.raw_len, 1),
                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate))[:header.raw_len]
    data = full_check(header, payload, bid, view)
    if len(data) and address_of(data) != address_of(view):
        copy_into(view, data)  # a `raw` payload, where it was read (its buffer is closed after this)
    return view[:len(data)].toreadonly()


def _is_empty_dir(fd: int) -> bool:
    """Whether the directory open at FD holds no entry (scandir reads a duplicate: FD stays open);
    False when it cannot be read (then nothing is cached about it)."""
    try:
        with os.scandir(fd) as it:
            return next(it, None) is None
    except OSError:
        return False


def _reusable_header(got: ChunkHeader, want: ChunkHeader) -> bool:
    """Whether a present copy whose header is GOT may serve a writer about to store WANT."""
    if want.raw_id:
        return got.raw_id and got.raw_len == want.raw_len
    return got.bound() == want.bound()


def _stray_reason(e: os.DirEntry[str]) -> str | None:
    """Why the snapshots/ entry E is not a snapshot, or None when it is one."""
    if not e.name.endswith(".json"):
        return "not a manifest (its name does not end in .json)"
    try:
        validate_snapshot_name(e.name[:-5])
    except InvalidNameError as ex:
        return f"not a snapshot: {ex}"
    st = e.stat(follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        return f"is {file_kind(st.st_mode)}, not a manifest"
    return None


def chunk_refs(manifests: list[Manifest]) -> dict[str, ChunkRef]:
    refs: dict[str, ChunkRef] = {}
    for m in manifests:
        for s in m.streams:
            for c in s.chunks:
                if c.id is not None:
                    refs.setdefault(c.id, c)
    return refs


def read_record(dir_fd: int, name: str) -> Any:
    """The JSON in the small regular file NAME of DIR_FD; None if absent, unreadable or not JSON."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return json.loads(os.read(fd, _RECORD_MAX))
    except (OSError, ValueError, RecursionError):
        return None
    finally:
        os.close(fd)


class SnapshotWriter:
    """Writes one snapshot: chunks as they come (any thread), then the manifest on commit().

    Used as a context manager; leaving it without commit() (an exception, a Ctrl-C) removes this
    writer's temporary files and leaves no snapshot. The chunks it stored stay until gc (its open
    pack is closed and indexed), because a concurrent writer or a retry may reuse them. A pack it
    fails to write or close (a full disk) is removed at once, not left for gc.
    """

    def __init__(self, store: SnapshotStore, name: str, *, replace: bool, meta: dict[str, Any],
                 tags: tuple[str, ...] | list[str] = (), created: str | None = None,
                 host: str | None = None, direct_packs: bool = False) -> None:
        self.store = store
        self.direct_packs = direct_packs
        self.name = validate_snapshot_name(name)
        self.replace = replace
        self.meta = meta
        self.tags = tuple(validate_tag(t) for t in tags)
        self.created = created  # the creation time to record (default: at commit)
        self.host = host        # the host to record (default: this one)
        self.streams: list[Stream] = []
        self.stats = WriteStats()
        self._lock = threading.Lock()
        self._touched: set[str] = set()
        self._committed = False
        self._stack = ExitStack()
        self._tmp = self._chunks = self._snaps = -1
        self._pw: PackWriter | None = None
        self._pw_lock = threading.Lock()

    def __enter__(self) -> "SnapshotWriter":
        try:
            self._stack.enter_context(self.store.shared())
            self._stack.enter_context(self.store.name_lock(self.name))
            self._tmp = self._stack.enter_context(self.store.subdir(TMP))
            self._chunks = self._stack.enter_context(self.store.subdir(CHUNKS))
            self._snaps = self._stack.enter_context(self.store.subdir(SNAPSHOTS))
            if lstat_at(self._snaps, manifest_entry(self.name)) is not None and not self.replace:
                raise StoreError(f"snapshot {self.name!r} already exists (use --replace to overwrite it)")
            self.store.refresh_index()  # what other writers indexed: this writer deduplicates against it
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        try:
            if self._pw is not None and not self._committed:
                # what this writer stored stays, indexed, until gc (a retry reuses it: a pull that
                # failed half-way); a pack that cannot be closed (a full disk) is removed instead
                try:
                    self._pw.flush()
                except OSError:
                    try:
                        self._pw.abort()
                    except OSError:
                        pass
        finally:
            self._stack.close()

    def packs(self) -> PackWriter:
        """This writer's pack stage, made on its first new chunk (a version 1/2 store is upgraded then)."""
        with self._pw_lock:
            if self._pw is None:
                self.store.upgrade()
                packs = self._stack.enter_context(self.store.subdir(PACKS))
                idx = self._stack.enter_context(self.store.subdir(INDEX))
                self._pw = PackWriter(packs, idx, self._tmp, lambda: owned_name("index"), self.store.index_added,
                                      self.store.entry_appended, self.store.pack_dropped,
                                      direct=self.direct_packs and self.store.direct,
                                      before_append=self.store.entry_codec)
            return self._pw

    @property
    def pack_writes(self) -> str:
        """How this writer wrote its packs: "direct" (O_DIRECT), "buffered", or "none" (nothing new)."""
        with self._pw_lock:
            return "none" if self._pw is None else "direct" if self._pw.direct else "buffered"

    @property
    def source(self) -> SnapshotStore:
        """Where this writer's chunks can be read back from, also before it commits."""
        return self.store

    def note_zero(self, raw_len: int) -> ChunkRef:
        with self._lock:
            return self.stats.add_zero(raw_len)

    def note_compressed(self) -> None:
        """Count one chunk the host encoder ran on (WriteStats.chunks_compressed)."""
        with self._lock:
            self.stats.chunks_compressed += 1

    def find_raw(self, data: memoryview) -> tuple[str, ChunkRef | None]:
        """The raw-addressed id of the raw bytes DATA and, when a sound file of that id is present
        (chunkfile.reusable), the reference to it, counted as deduplicated: the caller then neither
        encodes nor writes DATA. Otherwise (id, None): encode DATA and put_chunk(..., raw_id=id)."""
        t0 = time.perf_counter()
        cid = raw_chunk_id(data)
        return self.find_id(cid, len(data), time.perf_counter() - t0)

    def find_id(self, cid: str, raw_len: int, hash_s: float = 0.0) -> tuple[str, ChunkRef | None]:
        """find_raw for raw bytes of RAW_LEN whose raw id CID the caller hashed (in HASH_S seconds)."""
        t0 = time.perf_counter()
        want = ChunkHeader("raw", raw_len, raw_len, raw_id=True)
        try:
            got = self.store.present(cid, want, self._chunks, self._pw)
        except OSError as e:
            raise StoreError(_io_message("looking up a chunk", e, self.store.path)) from None
        with self._lock:
            if got is None:
                self.stats.hash_s += hash_s
                return cid, None
            self.stats.add_chunk(got.raw_len, got.stored_len, False, hash_s, time.perf_counter() - t0)
        return cid, ChunkRef(cid, got.raw_len, got.codec, got.stored_len)

    def reuse_ref(self, ref: ChunkRef) -> ChunkRef | None:
        """REF (a raw-addressed chunk a files cache remembers) as the reference to the sound chunk of
        its id present now (a pack entry or chunk file with a GSNPCHK2 header of its raw length); None when there
        is none: the caller then reads the file's bytes again. Counted by note_reused, not here."""
        if ref.id is None or not CHUNK_ID.fullmatch(ref.id):
            return None
        want = ChunkHeader("raw", ref.raw_len, ref.raw_len, raw_id=True)
        try:  # the same lookup as dedup's (find_raw): pack entries through the index, then chunk files
            got = self.store.present(ref.id, want, self._chunks, self._pw)
        except (OSError, GpusnapError):
            return None
        if got is None:
            return None
        return ChunkRef(ref.id, got.raw_len, got.codec, got.stored_len)

    def note_reused(self, ref: ChunkRef) -> None:
        """Count REF (from reuse_ref, or a zero chunk) as found present: deduplicated, nothing written."""
        with self._lock:
            if ref.is_zero:
                self.stats.add_zero(ref.raw_len)
            else:
                self.stats.add_chunk(ref.raw_len, ref.stored_len, False, 0.0)

    def put_chunk(self, codec: str, raw_len: int, frame: memoryview, stored_len: int,
                  raw_id: str | None = None, verified_id: str | None = None,
                  checksum: bytes | None = None) -> ChunkRef:
        """Store one encoded chunk (thread-safe) whose payload sits at FRAME[HEADER_SIZE:][:stored_len];
        RAW_ID: store it raw-addressed (GSNPCHK2) under that id, the raw id of its raw bytes (find_raw,
        or a caller that checked it), else stored-addressed (GSNPCHK1, the GPU path). VERIFIED_ID
        (GSNPCHK1): the caller has just hashed exactly this header and payload to that id (a chunk
        fetched from a remote), so it is not hashed again. CHECKSUM (with RAW_ID): the stored checksum
        of this header and payload, computed by gpusnap's own encoder process over these same bytes
        (storage/pipeline/encodeprocs.py), so it is not computed again.

        FRAME must have room up to the next 4096-byte boundary after the payload (see
        packs.PackWriter.append); the header is written into its first HEADER_SIZE bytes. The
        reference returned names the file now present (for GSNPCHK2, possibly another encoding)."""
        header = ChunkHeader(codec, raw_len, stored_len, raw_id is not None)
        t0 = time.perf_counter()
        try:
            cid, got, new, hash_s = self.store.store_chunk(self.packs(), self._chunks, header, frame,
                                                           raw_id or verified_id, checksum)
        except OSError as e:
            raise StoreError(_io_message("writing a chunk", e, self.store.path)) from None
        t2 = time.perf_counter()
        with self._lock:
            self.stats.add_chunk(raw_len, got.stored_len, new, hash_s, t2 - t0 - hash_s)
        return ChunkRef(cid, raw_len, got.codec, got.stored_len)

    def put_delta(self, raw_len: int, frame: memoryview, stored_len: int, cid: str) -> ChunkRef:
        """Store chunk CID (the raw id of its RAW_LEN raw bytes) as the delta entry whose payload
        (storage/codecs/delta.py: its segment table, then the XOR's encoding) sits at FRAME[HEADER_SIZE:]. The
        base is a full entry of a committed snapshot (the parent's, or its base), so it is durable
        before this entry is written; the store's marker lists `codec:xor-zstd` before the first delta
        (FORMAT.md, "The marker's `requires`")."""
        try:
            self.store.upgrade(deltas=True)
        except OSError as e:
            raise StoreError(_io_message("upgrading the store marker", e, self.store.path)) from None
        pause_pack("delta-marker")  # test hook: the marker lists the delta codec, no delta appended yet
        return self.put_chunk(DELTA, raw_len, frame, stored_len, raw_id=cid)

    # ---- as a TierWriter (storage/repo/tier.py): the GPU path's stored-addressed chunks ----
    def landing(self, frame: HostBuffer, stored_len: int) -> Landing:
        """The payload's place in FRAME, after the header's room (written from there by write())."""
        return Landing(frame.ptr + HEADER_SIZE, frame.view[HEADER_SIZE:HEADER_SIZE + stored_len], frame.view)

    def write(self, landing: Landing, codec: str, raw_len: int, stored_len: int) -> ChunkRef:
        landing.view.release()
        assert landing.frame is not None
        return self.put_chunk(codec, raw_len, landing.frame, stored_len)

    def drop(self, landing: Landing) -> None:
        landing.view.release()

    def sync_chunks(self, refs: list[ChunkRef]) -> None:
        """Make REFS durable and indexed now: the open pack is closed and indexed (commit() does it too;
        a chunk-reference log, storage.repo.reflog, names chunks before any commit)."""
        try:
            if self._pw is not None:
                t0 = time.perf_counter()
                self._pw.flush()
                with self._lock:
                    self.stats.write_s += time.perf_counter() - t0
        except OSError as e:
            raise StoreError(_io_message("syncing chunk directories", e, self.store.path)) from None

    def add_stream(self, stream: Stream) -> None:
        with self._lock:
            self.streams.append(stream)

    def commit(self) -> Manifest:
        """Make the snapshot visible, atomically and durably (FORMAT.md, "What is atomic")."""
        manifest = Manifest(self.name, self.streams, self.meta, tags=self.tags)
        if self.created is not None:
            manifest.created = self.created
        if self.host is not None:
            manifest.host = self.host
        final = manifest_entry(self.name)
        tmp = owned_name("manifest")
        data = manifest.dumps_bounded("committed", shed_hints=True)  # no reader would load a larger one
        t0 = time.perf_counter()
        try:
            if self._pw is not None:
                t1 = time.perf_counter()
                self._pw.flush()  # every pack this snapshot's chunks went to: fsynced, then indexed
                self.stats.write_s += time.perf_counter() - t1
            _write_file(self._tmp, tmp, data)
            try:
                if self.replace:
                    os.rename(tmp, final, src_dir_fd=self._tmp, dst_dir_fd=self._snaps)
                else:
                    try:
                        os.link(tmp, final, src_dir_fd=self._tmp, dst_dir_fd=self._snaps, follow_symlinks=False)
                    except FileExistsError:
                        raise StoreError(f"snapshot {self.name!r} was created by another writer meanwhile") from None
            finally:
                _unlink_quietly(self._tmp, tmp)
            os.fsync(self._snaps)
        except OSError as e:
            raise StoreError(_io_message("committing the manifest", e, self.store.path)) from None
        finally:
            waits.add(waits.FSYNC, time.perf_counter() - t0)
        self._committed = True
        return manifest


def _io_message(doing: str, e: OSError, store: str) -> str:
    if e.errno == errno.ENOSPC:
        return (f"no space left on the store's disk while {doing}; nothing was committed "
                f"(what this attempt wrote was removed; `gpusnap --store {store} store gc` reclaims "
                "chunks no snapshot needs)")
    if e.errno == errno.EDQUOT:
        return f"disk quota exceeded while {doing}; nothing was committed"
    return f"I/O error while {doing}: {e.strerror or e}"
