"""Bytes that look like a model's memory: bf16 weights and a paged KV pool in 64 KiB blocks (the delta
block size); shared by the delta and page-key tests."""
from __future__ import annotations

import numpy as np

BLOCK = 64 << 10


def weights(rng: np.random.Generator, n: int) -> bytes:
    """N bytes of bf16 N(0, 0.02): what model weights look like (few zeros, ~1.5x compressible)."""
    return (rng.normal(0, 0.02, n // 2).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def kv_pool(rng: np.random.Generator, n: int, filled: float) -> bytearray:
    """N bytes of a paged KV pool: FILLED of its 64 KiB blocks hold bf16 values, at random places."""
    pool = bytearray(n)
    blocks = n // BLOCK
    for b in rng.choice(blocks, int(blocks * filled), replace=False):
        pool[b * BLOCK:(b + 1) * BLOCK] = weights(rng, BLOCK)
    return pool
