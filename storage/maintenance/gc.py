"""gc: delete what the store owns and no longer needs; report everything else, delete nothing of it.

Guarantees kept here (FORMAT.md, "What is atomic" and "Temporary entries and their owners"): gc holds
the store lock exclusively; a manifest that does not load keeps every chunk id its bytes mention
(reported as damage), and one whose bytes cannot be read stops gc before anything is deleted; it
deletes only chunk files no manifest names, tmp/ entries whose owner process is gone (and the staging
tree of a killed `get` its record names, if that is a real directory of the get's user carrying the
marker of the nonce the record holds, keyed with the host key for a root get: storage/fs/getmark.py,
and every entry in it is that user's), lock files
of names without a snapshot, and quarantined chunks no longer needed. Packs: a pack without an index is
deleted (a killed writer's), an indexed one whose entries nothing names is deleted index first, one
whose live fraction is below packs.REPACK_BELOW is repacked, its live entries durable and indexed in
a new pack before its index and then it are removed; a pack whose index is damaged is left. A chunk named by the
chunk-reference log of an operation still in the journal (storage.repo.reflog: data of a killed writer
that `gpusnap recover` may still restore) counts as in use; a log it cannot read stops it before
anything is deleted. A delta entry that is kept keeps a full entry of each base it names (the
closure over bases: depth 1, so one round). It descends into no link and no
directory the store's owner does not own; anything unexpected is reported as left or as damage.
"""
from __future__ import annotations

import os
import re
import shlex
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from storage.codecs import delta
from storage.codecs.registry import DELTA
from storage.format.chunkfile import ChunkError, file_kind, stored_check
from storage.fs.directio import AlignedBuffer
from storage.base.errors import GpusnapError
from storage.fs.directio import read_to_end
from storage.fs.getmark import NONCE, carries_marker
from storage.base.limits import MAX_MANIFEST
from storage.base.names import InvalidNameError, validate_snapshot_name
from storage.fs.owner import ProcessOwner
from storage.format.packs import PACK_NAME, REPACK_BELOW, Loc
from storage.repo.reflog import RefLogError, pinned
from storage.repo.store import CHUNK_ID, EntryUnknown, get_staging_name, read_record
from storage.format.storedir import (CHUNKS, INDEX, JOURNAL, NAMES, PACKS, QUARANTINE, SNAPSHOTS, TMP, StoreDamage, entries, lstat_at,
                       manifest_entry, open_dir, opened_dir, remove_tree)
from storage.fs.treewalk import empty_tree, foreign_entry

if TYPE_CHECKING:
    from storage.repo.store import SnapshotStore

# tmp/KIND.PID-START-BOOT.REST: an entry whose owner is written in its name
_OWNED = re.compile(r"([a-z]+)\.(\d+-\d+-[0-9a-f]{8})\.([A-Za-z0-9_.-]+)")
# what gpusnap versions before owner records left in tmp/: writers' files named by pid, the O_DIRECT probe
_ANY_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")  # a chunk id anywhere in a damaged manifest
_LEGACY = re.compile(r"(?:chunk|manifest)\.(\d+)\.\d+\.\d+|\.odirect-probe-(\d+)")


class GcStopped(GpusnapError):
    """gc found a snapshot it cannot read, so it cannot know what that snapshot needs: nothing deleted."""


@dataclass
class GcReport:
    chunks_removed: int = 0
    bytes_freed: int = 0
    tmp_removed: int = 0
    gets_cleaned: int = 0        # staging trees of killed `get`s removed
    locks_removed: int = 0
    quarantine_removed: int = 0
    packs_removed: int = 0       # packs deleted (no index, or no live entry, or repacked)
    packs_repacked: int = 0      # packs whose live entries were copied into new packs
    packs_unindexed: int = 0     # of packs_removed: never indexed (what a killed writer left; no chunk counted)
    in_use: int = 0              # tmp/ entries whose owner still runs
    left: list[str] = field(default_factory=list)     # entries gpusnap did not make: reported, kept
    damage: list[str] = field(default_factory=list)   # store entries that are not what they should be


def collect(store: "SnapshotStore", timeout: float = 30.0) -> GcReport:
    """Run gc on STORE (waiting at most TIMEOUT seconds for the store lock)."""
    report = GcReport()
    with store.exclusive(timeout):
        names, strays = store.scan()
        report.damage += [f"{s} (left alone; `gpusnap store rm -- {shlex.quote(s.entry)}` removes it)"
                          for s in strays]
        live: set[str] = set()
        named_delta = False  # a manifest names a delta entry: the store holds deltas, whatever its marker says
        for n in names:
            try:
                m = store.load(n)
            except GpusnapError as e:
                live |= _damaged_keeps(store, n, e, report)
                continue
            live |= m.chunk_ids()
            named_delta = named_delta or any(c.codec == DELTA for s in m.streams for c in s.chunks)
        with store.root() as (root, uid):
            live |= _journal_pins(root, uid)
            _packs(store, root, uid, report, live, named_delta)
            for part, fn in ((TMP, _tmp), (NAMES, lambda fd, u, r: _names(fd, r, names)),
                             (CHUNKS, lambda fd, u, r: _chunks(fd, u, r, live)),
                             (QUARANTINE, lambda fd, u, r: _quarantine(store, fd, r, live))):
                try:
                    with opened_dir(root, part, uid, part) as fd:
                        fn(fd, uid, report)
                except FileNotFoundError:
                    if part != QUARANTINE:
                        report.damage.append(f"{part}/ is missing")
                except StoreDamage as e:
                    report.damage.append(str(e))
    return report

def _damaged_keeps(store: "SnapshotStore", name: str, why: GpusnapError, report: GcReport) -> set[str]:
    """Every chunk id the damaged manifest of NAME mentions anywhere (a superset of what it needs), so gc
    keeps them and goes on; GcStopped only when its bytes cannot be read at all."""
    try:
        with store.subdir(SNAPSHOTS) as snaps:
            fd = os.open(manifest_entry(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=snaps)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{SNAPSHOTS}/{manifest_entry(name)} is not a regular file")
            data = read_to_end(fd, MAX_MANIFEST + 1)
        finally:
            os.close(fd)
        if len(data) > MAX_MANIFEST:
            raise OSError(f"{SNAPSHOTS}/{manifest_entry(name)} is larger than any manifest ({MAX_MANIFEST} bytes)")
    except (GpusnapError, OSError) as e:
        raise GcStopped(f"gc stopped, nothing deleted: {why}; its chunks cannot be told ({e}); "
                        f"`gpusnap store rm {name}` it first if it cannot be repaired") from None
    ids = set(_ANY_ID.findall(data.decode("latin-1")))
    report.damage.append(f"snapshot {name!r} is damaged ({str(why).splitlines()[0] if str(why) else why!r}); "
                         f"gc kept the {len(ids)} chunk(s) its manifest mentions and went on")
    return ids


def _packs(store: "SnapshotStore", root: int, uid: int, report: GcReport, live: set[str],
           named_delta: bool = False) -> None:
    """Packs (FORMAT.md, "Pack files and the index"): keep one entry of each live id (the one a reader
    uses; a quarantined one only if it is the id's only copy: evidence for repair); delete packs
    without an index and indexed packs with nothing live; repack those whose live bytes are below
    REPACK_BELOW of their length (new pack and index durable first, then the old index, then the old
    pack)."""
    try:
        packs_fd = open_dir(root, PACKS, uid, PACKS)
    except FileNotFoundError:
        return  # a version 1/2 store
    except StoreDamage as e:
        report.damage.append(str(e))
        return
    try:
        with opened_dir(root, INDEX, uid, INDEX) as idx_fd:
            index = store.refresh_index()
            report.damage += [f"{why} (left alone)" for why in index.damage.values()]
            keep: dict[str, set[int]] = {}
            bases: set[str] = set()
            # a store whose marker does not say it may hold deltas holds none (no entry header is read),
            # unless a manifest names one (a marker that lies must not cost a delta its bases)
            deltas = named_delta or store.may_hold_deltas()
            if deltas and index.damage:
                # a damaged index's pack may hold deltas whose bases lie in other packs: which those
                # are is unknown, so nothing may go (`store repair` first)
                raise GcStopped("gc stopped, nothing deleted: an index file is damaged and the store holds "
                                "delta entries, whose bases it may name; run `gpusnap store repair`")
            try:
                for cid in live:
                    every = index.locs.get(cid, [])
                    locs = index.find(cid) or every[:1]
                    if len(every) > 1:
                        # a sound one of its copies (all of them where none is), the quarantined ones
                        # tried last: a quarantine record may be planted, naming the sound entry
                        locs = store.sound_copy(cid, locs + [loc for loc in every if loc not in locs])
                        for loc in locs[1:]:
                            keep.setdefault(loc.pack, set()).add(loc.offset)
                    if locs:
                        keep.setdefault(locs[0].pack, set()).add(locs[0].offset)
                        segs = store.entry_kind(cid, locs[0]) if deltas else None
                        if segs is not None:  # a delta: its bases live as long as it does (FORMAT.md, "Delta entries")
                            bases |= delta.bases(segs)
            except EntryUnknown as e:
                raise GcStopped(f"gc stopped, nothing deleted: {e}; whether it is a delta, and which "
                                "bases it names, is unknown (`gpusnap store repair`)") from None
            for bid in bases:  # a full entry of each base (a base is never read through a delta entry)
                every = index.locs.get(bid, [])
                unq = index.find(bid)
                locs = unq + [loc for loc in every if loc not in unq]  # the quarantined ones last
                full = []
                for loc in locs:
                    try:
                        if store.entry_kind(bid, loc) is None:
                            full.append(loc)
                    except EntryUnknown:
                        continue
                if len(full) > 1:  # a sound one (all where none is): the first may be planted
                    full = store.sound_copy(bid, full)
                for loc in full or locs:  # none known to be full: every copy stays
                    keep.setdefault(loc.pack, set()).add(loc.offset)
            live |= bases  # chunk files and quarantine records of bases are kept too
            listed = entries(packs_fd)
            for name in sorted(set(index.packs) - {x.name for x in listed}):
                report.damage.append(f"{INDEX}/{name}: its pack is missing (the chunks it names are lost)")
            for ent in listed:
                if not PACK_NAME.fullmatch(ent.name):
                    report.left.append(f"{PACKS}/{ent.name}: not a pack file name; left alone")
                    continue
                st = ent.stat(follow_symlinks=False)
                if ent.name in index.damage:
                    continue  # its index is damaged: what it names is unknown, so nothing is deleted
                if ent.name not in index.packs:  # never indexed: a killed writer's garbage
                    if stat.S_ISDIR(st.st_mode):
                        report.damage.append(f"{PACKS}/{ent.name} is a directory; left alone")
                        continue
                    os.unlink(ent.name, dir_fd=packs_fd)
                    report.packs_removed += 1
                    report.packs_unindexed += 1
                    report.bytes_freed += _held(st)
                    continue
                ents = index.entries[ent.name]
                mine = keep.get(ent.name, set())
                live_bytes = sum(length for _, off, length in ents if off in mine)
                dead = sum(1 for _, off, _ in ents if off not in mine)
                size = index.packs[ent.name]
                set_aside = any((ent.name, off) in index.skip for _, off, _ in ents)
                if not mine:
                    _drop_pack(idx_fd, packs_fd, ent.name)
                    store.pack_dropped(ent.name)  # its fd, if this process read it, closed: the space freed
                elif live_bytes >= REPACK_BELOW * size and not (set_aside and dead):
                    continue  # (a pack holding a quarantined entry no reader needs is repacked without it)
                else:
                    try:
                        _repack(store, root, uid, packs_fd, idx_fd, ent.name, [x for x in ents if x[1] in mine])
                    except GpusnapError as ex:
                        report.damage.append(f"{PACKS}/{ent.name}: not repacked: {ex}")
                        continue
                    report.packs_repacked += 1
                report.packs_removed += 1
                report.chunks_removed += dead
                # what the pack really held on disk, not what its index claims (an index may say 1 GiB of an
                # 8 KiB pack), less what its live entries now take in the new packs
                report.bytes_freed += max(0, _held(st) - (live_bytes if mine else 0))
            store.refresh_index()
    except FileNotFoundError:
        report.damage.append(f"{INDEX}/ is missing")
    finally:
        os.close(packs_fd)


def _held(st: os.stat_result) -> int:
    """The bytes a file of ST really takes (its length, but never more than its allocated blocks: a sparse
    file frees only what it holds); 0 for anything but a regular file."""
    return min(st.st_size, st.st_blocks * 512) if stat.S_ISREG(st.st_mode) else 0


def _drop_pack(idx_fd: int, packs_fd: int, name: str) -> None:
    """Remove index/NAME (durably) and then packs/NAME: the pack is never indexed without its bytes."""
    os.unlink(name, dir_fd=idx_fd)
    os.fsync(idx_fd)
    try:
        os.unlink(name, dir_fd=packs_fd)
    except FileNotFoundError:
        pass
    os.fsync(packs_fd)


def _repack(store: "SnapshotStore", root: int, uid: int, packs_fd: int, idx_fd: int, name: str,
            ents: list[tuple[str, int, int]]) -> None:
    """Copy the entries ENTS of pack NAME (each passing the stored check) into new packs, then drop NAME."""
    most = max(length for _, _, length in ents)
    buf = AlignedBuffer(most)
    try:
        with opened_dir(root, TMP, uid, TMP) as tmp, store.packing(tmp) as pw:
            for cid, off, length in ents:
                header, payload = store.read_entry(cid, Loc(name, off, length), buf, False)
                stored_check(header, payload, cid)
                pw.append(cid, header, buf.view)
    finally:
        buf.close()
    _drop_pack(idx_fd, packs_fd, name)
    store.pack_dropped(name)  # read through the store's open packs above: its fd closed, the space freed


def _journal_pins(root: int, uid: int) -> set[str]:
    """Chunks the journal's reference logs name (FORMAT.md, "The journal"): kept, as if a manifest named them."""
    try:
        with opened_dir(root, JOURNAL, uid, JOURNAL) as j:
            return pinned(j)
    except FileNotFoundError:
        return set()
    except (RefLogError, StoreDamage, OSError) as e:
        raise GcStopped(f"gc stopped, nothing deleted: {e}; it may name chunks an interrupted operation needs "
                        "(`gpusnap recover` first)") from None


def _tmp(tmp: int, uid: int, report: GcReport) -> None:
    removed = False
    for e in entries(tmp):
        st = e.stat(follow_symlinks=False)
        m = _OWNED.fullmatch(e.name)
        legacy = _LEGACY.fullmatch(e.name)
        if m is not None:
            owner = ProcessOwner.parse(m.group(2))
            alive = owner is not None and owner.alive()
        elif legacy is not None and stat.S_ISREG(st.st_mode):
            pid = int(legacy.group(1) or legacy.group(2))
            alive = pid != os.getpid() and os.path.exists(f"/proc/{pid}")
        else:
            report.left.append(f"{TMP}/{e.name}: not made by gpusnap (no owner in its name); left alone")
            continue
        if alive:
            report.in_use += 1
            continue
        try:
            if stat.S_ISDIR(st.st_mode):
                remove_tree(tmp, e.name, uid, f"{TMP}/{e.name}")
            elif stat.S_ISREG(st.st_mode):
                if m is not None and m.group(1) == "get":
                    report.gets_cleaned += _get(tmp, e.name, report)
                os.unlink(e.name, dir_fd=tmp)
            else:
                report.damage.append(f"{TMP}/{e.name} is {file_kind(st.st_mode)}; left alone")
                continue
        except StoreDamage as ex:
            report.damage.append(str(ex))
            continue
        except OSError as ex:
            report.damage.append(f"{TMP}/{e.name}: cannot remove it: {ex.strerror or ex}")
            continue
        report.tmp_removed += 1
        removed = True
    if removed:
        os.fsync(tmp)

def _get(tmp: int, name: str, report: GcReport) -> int:
    """Remove the staging tree the dead `get` recorded in tmp/NAME left beside its DEST (1 if removed),
    only if it carries the marker of the record's nonce (storage/fs/getmark.py): else nothing is touched."""
    rec = read_record(tmp, name)
    try:
        dest, pid, uid, nonce = rec["dest"], int(rec["pid"]), int(rec["uid"]), rec["nonce"]
        if not isinstance(dest, str) or not os.path.isabs(dest) or os.path.normpath(dest) != dest or dest == "/":
            raise ValueError(dest)
        if not isinstance(nonce, str) or not NONCE.fullmatch(nonce):
            raise ValueError(nonce)
    except (TypeError, KeyError, ValueError):
        report.damage.append(f"{TMP}/{name}: not a valid record of a get; removed, nothing else touched")
        return 0
    staging = get_staging_name(dest, pid)
    where = os.path.join(os.path.dirname(dest), staging)
    try:
        parent = os.open(os.path.dirname(dest), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0  # its directory is gone, and the partial tree with it
    try:
        try:
            sfd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except FileNotFoundError:
            return 0
        except OSError as e:
            report.damage.append(f"{where}: not the directory the killed get (pid {pid}) made "
                                 f"({e.strerror}); left alone, record removed")
            return 0
        try:
            if os.fstat(sfd).st_uid != uid or not carries_marker(sfd, nonce, uid):
                report.damage.append(f"{where}: not the directory the killed get (pid {pid}) made (no marker "
                                     "matching its record); left alone, record removed")
                return 0
            # every entry the user's (a root get gives files their recorded owners as it writes them: there,
            # every directory root's, so that nothing another user put there is removed)
            foreign = foreign_entry(sfd, uid, where, dirs_only=uid == 0)
            if foreign is not None:  # the get's user put there what it could not remove itself
                report.damage.append(f"{where}: holds {foreign}, not an entry of uid {uid} that the killed get "
                                     f"(pid {pid}) made; left alone, record removed")
                return 0
            empty_tree(sfd, where, uid)
        finally:
            os.close(sfd)
        os.rmdir(staging, dir_fd=parent)
        os.fsync(parent)
        return 1
    except (GpusnapError, OSError) as e:
        report.damage.append(f"{where}: {e}")
        return 0
    finally:
        os.close(parent)

def _names(names_fd: int, report: GcReport, snapshots: list[str]) -> None:
    have = set(snapshots)
    removed = False
    for e in entries(names_fd):
        base = e.name[:-5] if e.name.endswith(".lock") else None
        try:
            valid = base is not None and validate_snapshot_name(base) == base
        except InvalidNameError:
            valid = False
        if not valid:
            report.left.append(f"{NAMES}/{e.name}: not a lock file gpusnap makes; left alone")
        elif not e.is_file(follow_symlinks=False):
            report.damage.append(f"{NAMES}/{e.name} is {file_kind(e.stat(follow_symlinks=False).st_mode)}; "
                                 "left alone")
        elif base not in have:
            os.unlink(e.name, dir_fd=names_fd)
            report.locks_removed += 1
            removed = True
    if removed:
        os.fsync(names_fd)

def _chunks(chunks: int, uid: int, report: GcReport, live: set[str]) -> None:
    for d in entries(chunks):
        if not re.fullmatch(r"[0-9a-f]{2}", d.name):
            report.left.append(f"{CHUNKS}/{d.name}: not a chunk directory; left alone")
            continue
        try:
            xy = open_dir(chunks, d.name, uid, f"{CHUNKS}/{d.name}")
        except StoreDamage as e:
            report.damage.append(str(e))
            continue
        try:
            removed = False
            for ent in entries(xy):
                if not (CHUNK_ID.fullmatch(ent.name) and ent.name.startswith(d.name)):
                    report.left.append(f"{CHUNKS}/{d.name}/{ent.name}: not a chunk file name; left alone")
                    continue
                if ent.name in live:
                    continue
                st = ent.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    report.damage.append(f"{CHUNKS}/{d.name}/{ent.name} is a directory; left alone")
                    continue
                os.unlink(ent.name, dir_fd=xy)  # a link or FIFO under a chunk's name goes too, unopened
                report.chunks_removed += 1
                report.bytes_freed += _held(st)
                removed = True
            if removed:
                os.fsync(xy)
        finally:
            os.close(xy)

def _quarantine(store: "SnapshotStore", q: int, report: GcReport, live: set[str]) -> None:
    """Quarantined chunks go once no snapshot names them or a good copy is back in chunks/."""
    removed = False
    for e in entries(q):
        cid = e.name[:-5] if e.name.endswith(".json") else e.name
        if not CHUNK_ID.fullmatch(cid):
            report.left.append(f"{QUARANTINE}/{e.name}: not made by gpusnap; left alone")
            continue
        rec = read_record(q, cid + ".json") if e.name.endswith(".json") else None
        ents = rec.get("entries") if isinstance(rec, dict) else None
        if isinstance(ents, list):
            index = store.refresh_index()
            if any(loc.pack == ent[0] and loc.offset == ent[1] for loc in index.locs.get(cid, [])
                   for ent in ents if isinstance(ent, list) and len(ent) == 2):
                continue  # the damaged entry is still in a pack: the record keeps it from being used
        elif cid in live:
            try:
                with store.chunk_dir(cid) as d:
                    st = lstat_at(d, cid)
            except ChunkError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                continue  # still the only copy of a wanted chunk: evidence for repair
        if e.is_dir(follow_symlinks=False):
            report.damage.append(f"{QUARANTINE}/{e.name} is a directory; left alone")
            continue
        os.unlink(e.name, dir_fd=q)
        report.quarantine_removed += e.name == cid or isinstance(ents, list)
        removed = True
    if removed:
        os.fsync(q)
