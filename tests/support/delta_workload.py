"""A process whose memory is mostly a weights-like buffer (bf16 N(0, 0.02), 64 KiB blocks), for the
delta tests: argv[1] its control dir, argv[2] MiB. `cmd` = `change SEED` rewrites 5% of its 64 KiB
blocks at random places (in place: the same pages), `report` writes report.json: whether the buffer
holds what the process last wrote (checked from inside, after a restore)."""
import hashlib
import json
import os
import sys
import time

import numpy as np

d = sys.argv[1]
mb = int(sys.argv[2]) if len(sys.argv) > 2 else 64
BLOCK = 64 << 10


def weights(rng: np.random.Generator, n: int) -> bytes:
    return (rng.normal(0, 0.02, n // 2).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


memory = bytearray(weights(np.random.default_rng(7), mb << 20))
want = hashlib.sha256(memory).hexdigest()


def out(name: str, obj: object) -> None:
    with open(os.path.join(d, name + ".tmp"), "w") as f:
        json.dump(obj, f)
    os.rename(os.path.join(d, name + ".tmp"), os.path.join(d, name))


out("ready", {"pid": os.getpid()})
while True:
    cmd = os.path.join(d, "cmd")
    if os.path.exists(cmd):
        what = open(cmd).read().split()
        if not what:  # written but not yet filled (the tests rename it into place; a writer may not)
            time.sleep(0.02)
            continue
        os.unlink(cmd)
        if what[0] == "change":
            rng = np.random.default_rng(int(what[1]))
            blocks = len(memory) // BLOCK
            picked = sorted(int(b) for b in rng.choice(blocks, blocks // 20, replace=False))
            for b in picked:
                memory[b * BLOCK:(b + 1) * BLOCK] = weights(rng, BLOCK)
            want = hashlib.sha256(memory).hexdigest()
            out("changed.json", {"blocks": picked, "bytes": len(picked) * BLOCK})
        else:
            out("report.json", {"pid": os.getpid(), "memory_ok": hashlib.sha256(memory).hexdigest() == want})
    time.sleep(0.02)
