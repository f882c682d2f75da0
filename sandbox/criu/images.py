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
