"""A process tree for CRIU tests: a parent with a thread, a pipe to a child, a file open at an offset,
and anonymous memory holding known data (argv: DIR MB [SEED [random|weights [private|cow|half]]]: the
child's copy its own bytes, shared with the parent copy-on-write, or half of each; both checked). It checks all of that from inside and reports through files
in its control directory (argv[1]): `ready` (pids), then on `cmd` = report it writes `report.json`.
Started with stdin/stdout/stderr on /dev/null or files and in its own session, as CRIU wants."""
import hashlib
import json
import os
import sys
import threading
import time

d = sys.argv[1]
mb = int(sys.argv[2]) if len(sys.argv) > 2 else 32
seed = sys.argv[3] if len(sys.argv) > 3 else "gpusnap"
data = sys.argv[4] if len(sys.argv) > 4 else "random"
# private: the child rewrites its copy after the fork (each process holds its own bytes at the same
# addresses); cow: the child keeps sharing the parent's pages copy-on-write (forked workers that
# share their weights), which a restore must keep shared
sharing = sys.argv[5] if len(sys.argv) > 5 else "private"
import random
_rng = random.Random(seed)
if data == "weights":  # bf16 weights, N(0, 0.02): few zeros, compressible as weights are (byte planes)
    import numpy as np
    _g = np.random.default_rng(_rng.getrandbits(64))
    memory = bytearray(mb << 20)
    _w = np.frombuffer(memory, dtype=np.uint16)
    for _i in range(0, len(_w), 1 << 22):
        _w[_i:_i + (1 << 22)] = (_g.normal(0, 0.02, min(1 << 22, len(_w) - _i)).astype(np.float32).view(np.uint32) >> 16)
    del _w
else:
    memory = bytearray(b"".join(_rng.randbytes(1 << 20) for _ in range(mb)))  # known, incompressible bytes
want = hashlib.sha256(memory).hexdigest()

r, w = os.pipe()
settled_r, settled_w = os.pipe()  # the child says when its memory is what it will check
child = os.fork()
if child == 0:
    os.close(w)
    os.close(settled_r)
    if sharing in ("private", "half"):  # half: the child rewrites the second half only, shares the first
        _flip = bytes(b ^ 0xA5 for b in range(256))
        for _i in range(len(memory) // 2 if sharing == "half" else 0, len(memory), 64 << 20):
            memory[_i:_i + (64 << 20)] = memory[_i:_i + (64 << 20)].translate(_flip)
    want_child = hashlib.sha256(memory).hexdigest()
    os.write(settled_w, b"s")
    os.close(settled_w)
    with os.fdopen(r, "rb", buffering=0) as rp:
        while True:
            line = b""
            while not line.endswith(b"\n"):
                c = rp.read(1)
                if not c:
                    os._exit(0)
                line += c
            name = os.path.join(d, "child-" + line.decode().strip())
            with open(name + ".tmp", "w") as f:   # whole or absent: written aside, then renamed
                f.write(f"{os.getpid()} {int(hashlib.sha256(memory).hexdigest() == want_child)}")
            os.rename(name + ".tmp", name)

os.close(r)
os.close(settled_w)
os.read(settled_r, 1)  # `ready` only once the child's memory is settled: a dump sees the tree as it stays
os.close(settled_r)
counter = [0]


def tick() -> None:
    while True:
        counter[0] += 1
        time.sleep(0.01)


threading.Thread(target=tick, daemon=True).start()
data = open(os.path.join(d, "data.txt"), "w+")
data.write("0123456789" * 100)
data.flush()
data.seek(1234 % 1000)
with open(os.path.join(d, "ready.tmp"), "w") as f:
    json.dump({"pid": os.getpid(), "child": child}, f)
os.rename(os.path.join(d, "ready.tmp"), os.path.join(d, "ready"))
n = 0
while True:
    cmd = os.path.join(d, "cmd")
    if os.path.exists(cmd):
        os.unlink(cmd)
        n += 1
        c0 = counter[0]
        os.write(w, f"{n}\n".encode())
        deadline = time.time() + 120  # the child hashes its memory first (seconds for GiBs on a small host)
        while not os.path.exists(os.path.join(d, f"child-{n}")) and time.time() < deadline:
            time.sleep(0.01)
        got = os.path.join(d, f"child-{n}")
        said = open(got).read().split() if os.path.exists(got) else []
        rep = {"pid": os.getpid(), "memory_ok": hashlib.sha256(memory).hexdigest() == want,
               "child_memory_ok": said[1:] == ["1"],
               "file_offset": data.tell(), "pipe_ok": os.path.exists(got),
               "thread_ok": counter[0] > c0, "n": n, "counter": c0}
        time.sleep(0.05)
        rep["thread_ok"] = counter[0] > c0
        with open(os.path.join(d, "report.tmp"), "w") as f:
            json.dump(rep, f)
        os.rename(os.path.join(d, "report.tmp"), os.path.join(d, "report.json"))
    time.sleep(0.02)
