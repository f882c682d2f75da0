"""Changing a snapshot's tags after it was made (`store tag`, restic's `tag --add/--remove/--set`).

Guarantees kept here: a retag rewrites only the manifest's `tags` (and so its checksum, recomputed
over the canonical encoding as FORMAT.md says); name, creation time, host, version, meta and streams
stay exactly as loaded and validated. The rewrite is atomic and durable: the new manifest is written
to a new file in tmp/ and fsynced, renamed over snapshots/NAME.json, and snapshots/ is fsynced, while
the store lock is held shared (so gc and repair, which hold it exclusively, never see it half done)
and names/NAME.lock exclusively (so no put, rm or other retag of NAME runs meanwhile). A reader sees
the old manifest or the new one, never neither.
"""
from __future__ import annotations

import os
from typing import Sequence

from storage.format.manifest import MAX_TAGS, Manifest, ManifestError, validate_tag
from storage.base.names import validate_snapshot_name
from storage.repo.store import SnapshotStore, StoreError, _unlink_quietly, _write_file, owned_name
from storage.format.storedir import SNAPSHOTS, TMP, manifest_entry


def new_tags(old: Sequence[str], add: Sequence[str] = (), remove: Sequence[str] = (),
             set_to: Sequence[str] | None = None) -> tuple[str, ...]:
    """restic's rules: --set replaces the list (and is not combined with --add/--remove); --add
    appends tags not yet there, in order; --remove drops tags that are there (absent ones: no-op)."""
    if set_to is not None and (add or remove):
        raise ManifestError("--set replaces every tag; give it without --add/--remove")
    tags = list(dict.fromkeys(validate_tag(t) for t in set_to)) if set_to is not None else list(old)
    for t in add:
        if validate_tag(t) not in tags:
            tags.append(t)
    drop = {validate_tag(t) for t in remove}
    tags = [t for t in tags if t not in drop]
    if len(tags) > MAX_TAGS:
        raise ManifestError(f"at most {MAX_TAGS} tags per snapshot")
    return tuple(tags)


def retag(store: SnapshotStore, name: str, add: Sequence[str] = (), remove: Sequence[str] = (),
          set_to: Sequence[str] | None = None) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """Change NAME's tags; returns (old tags, new tags, whether the manifest was rewritten)."""
    validate_snapshot_name(name)
    with store.shared(), store.name_lock(name):
        m = store.load(name)
        tags = new_tags(m.tags, add, remove, set_to)
        if tags == m.tags:
            return m.tags, tags, False
        new = Manifest(m.name, m.streams, m.meta, m.created, tags, m.host, m.tool)
        data = new.dumps_bounded("retagged", shed_hints=True)  # a foreign layout may grow when written anew
        Manifest.loads(data, where=f"snapshot {name!r}")  # what is renamed into place is what a reader accepts
        tmp = owned_name("manifest")
        try:
            with store.subdir(TMP) as tmp_fd, store.subdir(SNAPSHOTS) as snaps:
                _write_file(tmp_fd, tmp, data)
                try:
                    os.rename(tmp, manifest_entry(name), src_dir_fd=tmp_fd, dst_dir_fd=snaps)
                except BaseException:
                    _unlink_quietly(tmp_fd, tmp)
                    raise
                os.fsync(snaps)
        except OSError as e:
            raise StoreError(f"rewriting the manifest of {name!r}: {e.strerror or e}") from None
        return m.tags, tags, True
