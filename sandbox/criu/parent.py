"""Which committed snapshot a new `criu dump` stores its changed chunks against (delta entries).

A dump of a process that was dumped before changes only part of its memory; storing the changed
chunks of its page images as deltas against the bytes of the earlier dump (storage/FORMAT.md, "Delta
entries") writes about the changed bytes. The parent is only ever the snapshot the user names
(`--parent SNAP`): gpusnap does not guess one by root pid, because a pid is reused, possibly by
another tenant's process, and a delta keeps its bases (the parent's bytes) stored for as long as it
lives. A wrong parent costs only the base reads: a chunk is stored as a delta only where that saves
(storage.codecs.registry.DELTA_PAYS_OFF).

Guarantees kept here: the parent is a committed snapshot of this store, loaded and validated as every
manifest is; one that does not load fails the dump before anything starts.
"""
from __future__ import annotations

from storage.api import GpusnapError
from storage.api import Manifest
from storage.api import SnapshotStore

from sandbox.criu.images import IMAGES

PAGE_IMAGE_PREFIX = f"{IMAGES}/pages-"


class ParentError(GpusnapError):
    """The parent named for a dump is not a criu snapshot of this store."""


def has_page_images(m: Manifest) -> bool:
    return any(s.name.startswith(PAGE_IMAGE_PREFIX) for s in m.streams)


def choose_parent(store: SnapshotStore, named: str | None) -> Manifest | None:
    """The parent manifest of a dump: NAMED, which must be a criu snapshot with page images
    (ParentError otherwise), or None when none is named."""
    if named is None:
        return None
    try:
        m = store.load(named)
    except GpusnapError as e:
        raise ParentError(f"--parent {named}: {e}") from None
    if m.meta.get("kind") != "criu" or not has_page_images(m):
        raise ParentError(f"--parent {named}: not a criu snapshot with page images")
    return m
