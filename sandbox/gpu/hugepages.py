"""Transparent huge pages for the duration of a driver host copy, put back afterwards even on failure.

On an H200 the driver's own checkpoint of 16 GB ran at 1.64 GB/s with THP `madvise` and 2.43 GB/s
with `always` (restore 4.99 -> 6.48 GB/s; docs/PLATFORM.md): the driver's host buffers are not
madvised, so only `always` gives them huge pages. The kernel has no per-process "always" switch (prctl only disables THP), so
this changes the system setting and restores the previous value on exit.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

from storage.errors import GpusnapError

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


class HugePagesError(GpusnapError):
    """The THP setting could not be read or changed."""


def thp_mode(path: str = THP_ENABLED) -> str | None:
    try:
        with open(path) as f:
            m = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


@contextmanager
def thp(mode: str | None, path: str = THP_ENABLED) -> Iterator[str | None]:
    """Set THP to MODE ('always', 'madvise', 'never'; None: leave alone) inside the block."""
    before = thp_mode(path)
    if mode is None or before is None or before == mode:
        yield before
        return
    try:
        with open(path, "w") as f:
            f.write(mode)
    except OSError as e:
        raise HugePagesError(f"cannot set transparent huge pages to {mode!r}: {e.strerror} (need root)") from None
    try:
        yield before
    finally:
        with open(path, "w") as f:
            f.write(before)


def hugetlb_pages() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(("HugePages_Total", "HugePages_Free", "Hugepagesize")):
                    k, v = line.split(":", 1)
                    out[k] = int(v.split()[0])
    except OSError:
        pass
    return out
