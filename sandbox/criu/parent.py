"""Which committed snapshot a new `criu dump` stores its changed chunks against (delta entries).

A dump of a process that was dumped before changes only part of its memory; storing the changed
chunks of its page images as deltas against the chunks at the same places of the earlier dump
(storage/FORMAT.md, "Delta entries") writes about the changed bytes. The parent is the snapshot the
user names (`--parent SNAP`) or, by default, the newest committed `criu` snapshot of the same root
pid that holds page images (`--no-parent`: none). A wrong guess costs only the base reads: a chunk is
stored as a delta only where that saves (storage.codecs.DELTA_PAYS_OFF).

Guarantees kept here: the parent is a committed snapshot of this store, loaded and validated as every
manifest is; a snapshot that does not load is never chosen automatically (a named one that does not
load fails the dump before anything starts).
"""
from __future__ import annotations

from storage.errors import GpusnapError
from storage.manifest import Manifest
from storage.store import SnapshotStore
from storage.storedir import SNAPSHOTS
from storage.summary import read_summary

from sandbox.criu.images import IMAGES

PAGE_IMAGE_PREFIX = f"{IMAGES}/pages-"


class ParentError(GpusnapError):
    """The parent named for a dump is not a criu snapshot of this store."""


def has_page_images(m: Manifest) -> bool:
    return any(s.name.startswith(PAGE_IMAGE_PREFIX) for s in m.streams)


def choose_parent(store: SnapshotStore, root_pid: int, named: str | None, auto: bool = True,
                  exclude: str | None = None) -> Manifest | None:
    """The parent manifest of a dump of ROOT_PID: NAMED (ParentError unless it is a criu snapshot
    with page images), else with AUTO the newest criu snapshot of that root pid that has page images
    (EXCLUDE: a name never taken automatically), else None."""
    if named is not None:
        try:
            m = store.load(named)
        except GpusnapError as e:
            raise ParentError(f"--parent {named}: {e}") from None
        if m.meta.get("kind") != "criu" or not has_page_images(m):
            raise ParentError(f"--parent {named}: not a criu snapshot with page images")
        return m
    if not auto:
        return None
    found: list[tuple[str, str]] = []  # (created, name) of the criu snapshots of ROOT_PID
    with store.subdir(SNAPSHOTS) as snaps:
        for n in store.names():
            if n == exclude:
                continue
            head = read_summary(snaps, n)  # a big manifest: its head only (storage/summary.py)
            if head is not None:
                if head.meta.get("kind") == "criu" and head.meta.get("root_pid") == root_pid:
                    found.append((head.created, n))
                continue
            try:
                m = store.load(n)
            except GpusnapError:
                continue  # a damaged snapshot is never a parent (verify reports it)
            if m.meta.get("kind") == "criu" and m.meta.get("root_pid") == root_pid:
                found.append((m.created, n))
    for _, n in sorted(found, reverse=True):  # the newest that loads whole and has page images
        try:
            m = store.load(n)
        except GpusnapError:
            continue
        if m.meta.get("kind") == "criu" and m.meta.get("root_pid") == root_pid and has_page_images(m):
            return m
    return None
