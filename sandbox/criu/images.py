"""CRIU's images in a snapshot, and which of the two paths they take between CRIU and the store.

A CRIU snapshot holds the images as the directory stream `images` and one file stream per image
(`images/NAME`), whichever path made it, so either path restores what the other dumped:
- stream (the default): CRIU hands every image to gpusnap's image streamer (`criu --stream`:
  sandbox.criu.protocol, capture, serve): the pages flow from CRIU's pipe into the store on a dump
  and out of the store into CRIU's pipe on a restore; nothing is staged;
- staging (GPUSNAP_CRIU_IMAGES=staging): CRIU writes the images as files into the operation's
  private directory (tmpfs when it fits), whose page images are ingested as they grow
  (storage.archive.follow); a restore materializes the verified images there first.

Why the staging path stays: it is the fallback a user switches to without a new gpusnap where the
streamer cannot be used (a CRIU built without `--stream`, or a CRIU release whose streamer
misbehaves: the split restore already had to follow one pagemap format change), it leaves CRIU's
images as files that `crit` can read when a restore has to be debugged, and it is the reference the
stream path is measured and tested against (BENCHMARKS.md; tests/test_criu_stream.py restores
either path's snapshot through the other). It costs a staging copy and, on a restore, a
materialize step; nothing else depends on it.
"""
from __future__ import annotations

import os
import re
from typing import Mapping

from sandbox.criu.protocol import StreamerError

IMAGES = "images"          # the snapshot's directory stream, as on the staging path


def images_path() -> str:
    """Which path CRIU's images take: $GPUSNAP_CRIU_IMAGES ('stream' or 'staging'), default 'stream'."""
    want = os.environ.get("GPUSNAP_CRIU_IMAGES", "stream").strip().lower()
    if want not in ("stream", "staging"):
        raise StreamerError(f"GPUSNAP_CRIU_IMAGES={want!r}: expected 'stream' or 'staging'")
    return want


def is_page_image(name: str) -> bool:
    """NAME is a page image (pages-N.img: the bytes of a process's memory), not a small one."""
    return name.startswith("pages-") and name.endswith(".img")


# images CRIU reads whole by their size (img_raw_size: fstat), so that a pipe gives it nothing: a
# network namespace's nftables rules (criu/net.c, do_restore_nftables)
SIZED_NAME = re.compile(r"nftables-[0-9]{1,10}\.img")


def late_reads(small: Mapping[str, bytes]) -> str | None:
    """Why a restore of these images (SMALL: image name -> bytes, the mm-PID.img among them) needs them
    as files, or None: CRIU premaps and reads most memory in order from its image, but the pages of a
    MAP_HUGETLB area it reads later, with preadv() at an offset, which a streamed pipe cannot serve
    (`restorer.c: Can't read pages data (-29)`); and a non-empty image of SIZED_NAME it reads by its
    file size, which a pipe lacks. Found at dump time, recorded in the snapshot
    (`staged_restore`), so that the default restore stages such a snapshot's images."""
    from sandbox.criu.split import MAP_HUGETLB, MM_NAME, SplitError, vma_fields
    found: list[str] = []
    sized = [n for n in sorted(small) if SIZED_NAME.fullmatch(n) and small[n]]
    if sized:  # CRIU reads these by their file size (fstat), which a pipe does not have: it would read nothing
        return ("images CRIU reads by their file size, which a streamed pipe does not have: "
                + ", ".join(sized))[:512]
    for name in sorted(small):
        if not MM_NAME.fullmatch(name):
            continue
        try:
            huge = sum(f.get(2, 0) - f.get(1, 0) for f in vma_fields(small[name]) if f.get(6, 0) & MAP_HUGETLB)
        except SplitError as e:
            return f"{name} is not understood ({e}): its pages may be read late"
        if huge > 0:
            found.append(f"{name} ({huge >> 20} MiB)")
    if not found:
        return None
    return ("MAP_HUGETLB memory, whose pages CRIU reads late with preadv(): " + ", ".join(found))[:512]


def late_reads_in(directory: str) -> str | None:
    """late_reads of the mm images (and the images read by size) CRIU wrote as files into DIRECTORY
    (the staging path)."""
    from sandbox.criu.split import MAX_MM_BYTES, MM_NAME
    small: dict[str, bytes] = {}
    for name in os.listdir(directory):
        if MM_NAME.fullmatch(name) or SIZED_NAME.fullmatch(name):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                small[name] = f.read(MAX_MM_BYTES + 1)
    return late_reads(small)


def restore_path(staged_restore: str | None) -> str:
    """The path a restore takes: $GPUSNAP_CRIU_IMAGES when set, else 'staging' for a snapshot whose
    images CRIU reads late (STAGED_RESTORE: the snapshot's reason), else 'stream'."""
    if os.environ.get("GPUSNAP_CRIU_IMAGES", "").strip():
        return images_path()
    return "staging" if staged_restore else "stream"
