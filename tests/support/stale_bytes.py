"""Finding an earlier buffer's bytes inside a later file: the check that no stale bytes leak into chunks.

A leak copies a contiguous run of the earlier bytes; any run of 23 bytes or more contains two
consecutive 8-byte words that are 8-aligned in the earlier buffer, and the later file is searched for
such a pair at every byte offset. Use an earlier buffer of random bytes, so that a pair found by chance
(about 2^-128 per offset) never happens.
"""
from __future__ import annotations

import numpy as np


def word_index(earlier: bytes | memoryview) -> np.ndarray:
    """The sorted 8-aligned 64-bit words of EARLIER (what leaked_runs looks for)."""
    a = np.frombuffer(earlier, dtype=np.uint8)
    return np.unique(a[: len(a) // 8 * 8].view(np.uint64))


def leaked_runs(words: np.ndarray, later: bytes | memoryview) -> list[int]:
    """Offsets in LATER where two consecutive words of the earlier buffer (WORDS from word_index) start."""
    b = np.frombuffer(later, dtype=np.uint8)
    found: list[int] = []
    for k in range(8):
        n = (len(b) - k) // 8
        if n < 2:
            continue
        w = b[k:k + n * 8].view(np.uint64)
        pos = np.minimum(np.searchsorted(words, w), len(words) - 1)
        hit = words[pos] == w
        both = np.nonzero(hit[:-1] & hit[1:])[0]
        found.extend(int(k + 8 * i) for i in both)
    return sorted(found)
