"""A process for the split-restore test: 24 MiB of known random bytes in a private anonymous mapping made
read-only after it was filled (process_vm_writev cannot write there). Control dir argv[1]: `ready`
(pid), then on `cmd` it writes `report.json` with whether the bytes are intact."""
import ctypes
import hashlib
import json
import mmap
import os
import random
import sys
import time

d = sys.argv[1]
size = 24 << 20
m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
rng = random.Random("rodata")
for off in range(0, size, 1 << 20):  # no large temporary elsewhere in the heap
    m[off:off + (1 << 20)] = rng.randbytes(1 << 20)
want = hashlib.sha256(m).hexdigest()
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mprotect(ctypes.c_void_p(addr), ctypes.c_size_t(size), mmap.PROT_READ) == 0
with open(os.path.join(d, "ready.tmp"), "w") as f:
    json.dump({"pid": os.getpid()}, f)
os.rename(os.path.join(d, "ready.tmp"), os.path.join(d, "ready"))
while True:
    if os.path.exists(os.path.join(d, "cmd")):
        os.unlink(os.path.join(d, "cmd"))
        ok = hashlib.sha256(ctypes.string_at(addr, size)).hexdigest() == want
        with open(os.path.join(d, "report.tmp"), "w") as f:
            json.dump({"ok": ok, "pid": os.getpid()}, f)
        os.rename(os.path.join(d, "report.tmp"), os.path.join(d, "report.json"))
    time.sleep(0.01)
