"""Make tests/data/store-v7/: a small store as gpusnap wrote it at store version 7 (commit b864b72).

Run with that commit's tree (`git worktree add /tmp/v7 b864b72`, then from it
`python tests/data/make_store_v7.py OUT`): a later gpusnap would write its own marker. It stores
five files whose chunks take every host codec version 7 wrote (raw, zstd, shuffle2-zstd layout 2,
shuffle4-zstd) and an all-zero one, then a second snapshot of them a little changed with --parent
(delta entries, `"deltas": true`). tests/test_store_requires.py reads it back against
tests/data/store-v7.sha256 (the files' digests, written here), migrates it and reads it again.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import numpy as np


def files(seed: int, changed: bool) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    n = 1 << 17
    w = (rng.standard_normal(n // 2) * 0.02).astype(np.float32)
    bf16 = (w.view(np.uint32) >> 16).astype("<u2").tobytes()              # bf16-like: shuffle2-zstd
    fp32 = (rng.standard_normal(n // 4) * 0.02).astype("<f4").tobytes()   # shuffle4-zstd
    text = b"".join(b"line %d of a log, status ok\n" % (i % 977) for i in range(n // 28))[:n]  # zstd
    rand = rng.bytes(n)                                                    # raw
    out = {"bf16.bin": bf16, "fp32.bin": fp32, "log.txt": text, "random.bin": rand, "zeros.bin": bytes(n)}
    if changed:  # a few 4 KiB pages rewritten: the second snapshot's chunks become deltas
        for k in ("bf16.bin", "fp32.bin"):
            b = bytearray(out[k])
            for p in (3, 17):
                b[p * 4096:(p + 1) * 4096] = rng.bytes(4096)
            out[k] = bytes(b)
    return out


def write(top: str, data: dict[str, bytes]) -> None:
    os.makedirs(top, exist_ok=True)
    for k, v in data.items():
        with open(os.path.join(top, k), "wb") as f:
            f.write(v)
        os.utime(os.path.join(top, k), ns=(1_764_000_000_000_000_000, 1_764_000_000_000_000_000))


def main(out: str) -> None:
    work = out + ".src"
    store = os.path.join(out)
    digests = []
    for name, changed, parent in (("first", False, None), ("second", True, "first")):
        top = os.path.join(work, name, "model")
        data = files(7, changed)
        write(top, data)
        cmd = [sys.executable, "-m", "cli", "--store", store, "store", "put", "--chunk-size", "64K", "--no-cache"]
        if parent:
            cmd += ["--parent", parent]
        subprocess.run(cmd + [name, top], check=True)
        digests += [f"{hashlib.sha256(v).hexdigest()}  {name}/model/{k}" for k, v in sorted(data.items())]
    with open(out + ".sha256", "w") as f:
        f.write("\n".join(digests) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
