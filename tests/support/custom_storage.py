"""The custom-storage path's test inputs: the driver features the stand-in reports (one stand-in GPU
with the checkpoint API and custom storage) and GPU memory that looks like a model's (bf16 weights,
zeros, random bytes); shared by the custom-storage, hook, remote, pool and agent tests."""
from __future__ import annotations

import numpy as np

from sandbox.gpu.driver import Features, GpuInfo

FEATS = Features(bindings="stand-in", driver_version="stand-in", checkpoint_api=True, custom_storage=True,
                 gpus=[GpuInfo(0, "Stand-in GPU", "GPU-00000000-0000-0000-0000-000000000000", 1 << 30, (9, 0), None, False)])


def gpu_bytes(seed: int, mb: int) -> bytes:
    rng = np.random.default_rng(seed)
    n = mb << 20
    w = (rng.normal(0, 0.02, n // 5).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return w + bytes(n // 2) + rng.bytes(n - len(w) - n // 2)
