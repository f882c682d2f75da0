#!/usr/bin/env python3
"""The demo's workload: counts up, writing each number to a file, while holding 256 MiB of state."""
import hashlib
import os
import sys
import time

out = sys.argv[1]
state = bytearray(os.urandom(128 << 20)) + bytearray(128 << 20)  # 128 MiB data + 128 MiB zeros
digest = hashlib.sha256(state).hexdigest()[:16]
n = 0
while True:
    n += 1
    with open(out, "a") as f:
        f.write(f"{n} {digest}\n")
    time.sleep(0.2)
