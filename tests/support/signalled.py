"""A process that handles SIGUSR1 (counting) while it holds 48 MiB of random bytes, for the split
restore's signal test: a handled signal pending when CRIU froze it is delivered, once restored, before
the stop CRIU leaves pending, and the kernel writes its frame on the stack then. Usage: signalled.py DIR;
writes DIR/ready (JSON: pid, the data's BLAKE2 digest) atomically, then, between sleeps at changing
depths of its stack, every ~20 ms DIR/beat (the signals counted, whether the data still has its digest)."""
import hashlib
import json
import os
import signal
import sys
import time


def deep(k: int) -> int:
    """Sleep K calls deep in C frames (map calling back), so that the stack below the point where a
    signal finds the process differs from one sleep to the next (Python calls alone use no C stack)."""
    if k == 0:
        time.sleep(0.001)
        return 0
    return sum(map(deep, (k - 1,)))


d = sys.argv[-1]
got = [0]
signal.signal(signal.SIGUSR1, lambda *_: got.__setitem__(0, got[0] + 1))
data = bytearray(os.urandom(48 << 20))
digest = hashlib.blake2b(data).hexdigest()
tmp = os.path.join(d, "ready.tmp")
with open(tmp, "w") as f:
    json.dump({"pid": os.getpid(), "digest": digest}, f)
os.rename(tmp, os.path.join(d, "ready"))
n, intact = 0, True
while True:
    n += 1
    deep(n * 7 % 40)
    if n % 50 == 0:  # once lost, said in every beat after
        intact = intact and hashlib.blake2b(data).hexdigest() == digest
    beat = json.dumps({"signals": got[0], "n": n, "intact": intact})
    with open(os.path.join(d, "beat.tmp"), "w") as f:
        f.write(beat)
    os.rename(os.path.join(d, "beat.tmp"), os.path.join(d, "beat"))
    time.sleep(0.02)
