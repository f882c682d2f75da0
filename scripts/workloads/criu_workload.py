"""A process tree for CRIU tests: a parent with a thread, a pipe to a child, a file open at an offset,
and anonymous memory holding known data (argv: DIR MB [SEED [random|weights|mixed [private|cow|half]]]:
the child's copy its own bytes, shared with the parent copy-on-write, or half of each; both checked).
"mixed" is the shape of a real server's heap rather than one big buffer: MB spread over thousands of
separate private mappings (16 KiB to 8 MiB, log-uniform; a PROT_NONE guard page after each keeps the
kernel from merging them), each holding bf16 weights, random bytes, written zeros, or zeros with a few
random pages (a KV pool partly filled). It checks all of that from inside and reports through files
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
# share their weights), which a restore must keep shared; own (with mixed data): the child makes memory
# of its own at other addresses and unmaps what it inherited (a worker spawned rather than forked)
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
    regions = [memory]
elif data == "mixed":
    import ctypes
    import math
    import mmap
    import numpy as np
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    _maps, regions = [], []
    _spans: list = []  # (address, length) of each mapping, guard page included


def _mixed(rng: "random.Random", mb: int) -> tuple:
    """MB MiB in private mappings of 16 KiB to 8 MiB: (the mmap objects, views of each region's bytes
    with the guard page left out, (address, length) of each mapping)."""
    g = np.random.default_rng(rng.getrandbits(64))
    maps, views, spans = [], [], []
    left = mb << 20
    while left > 0:
        # 16 KiB .. 8 MiB, log-uniform, whole pages
        n = min(left, max(4096, int(math.exp(rng.uniform(math.log(16 << 10), math.log(8 << 20)))) & ~4095))
        m = mmap.mmap(-1, n + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if _libc.mprotect(addr + n, 4096, 0) != 0:  # the guard page: PROT_NONE
            raise OSError(ctypes.get_errno(), "mprotect")
        v = memoryview(m)[:n]
        kind = rng.random()
        if kind < 0.35:  # bf16 weights
            v[:] = (g.normal(0, 0.02, n // 2).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
        elif kind < 0.6:  # random bytes
            v[:] = rng.randbytes(n)
        elif kind < 0.85:  # zeros, written (pages present, as a zeroed buffer's are)
            v[:] = bytes(n)
        else:  # a pool partly filled: zeros written, a random page here and there
            v[:] = bytes(n)
            for p in range(0, n, 4096):
                if rng.random() < 0.1:
                    v[p:p + 4096] = rng.randbytes(4096)
        maps.append(m)
        views.append(v)
        spans.append((addr, n + 4096))
        left -= n
    return maps, views, spans


if data == "mixed":
    _maps, regions, _spans = _mixed(_rng, mb)
elif data != "weights":
    memory = bytearray(b"".join(_rng.randbytes(1 << 20) for _ in range(mb)))  # known, incompressible bytes
    regions = [memory]


def digest() -> str:
    h = hashlib.sha256()
    for region in regions:
        h.update(region)
    return h.hexdigest()


want = digest()

r, w = os.pipe()
settled_r, settled_w = os.pipe()  # the child says when its memory is what it will check
child = os.fork()
if child == 0:
    os.close(w)
    os.close(settled_r)
    if sharing == "own":  # a worker with memory of its own at other addresses (as a spawned one has)
        if data != "mixed":
            raise SystemExit("sharing 'own' needs data 'mixed'")
        _theirs = _spans
        _maps, regions, _spans = _mixed(random.Random(seed + "-child"), mb)  # made first: new addresses
        for _a, _n in _theirs:  # the parent's copies, unmapped here (never touched again)
            _libc.munmap(_a, _n)
    if sharing in ("private", "half"):  # half: the child rewrites the second half only, shares the first
        _flip = bytes(b ^ 0xA5 for b in range(256))
        _total = sum(len(region) for region in regions)
        _at = 0
        for region in regions:
            for _i in range(0 if sharing == "private" else max(0, _total // 2 - _at), len(region), 64 << 20):
                _piece = region[_i:_i + (64 << 20)]
                region[_i:_i + (64 << 20)] = (_piece if isinstance(_piece, bytearray) else bytes(_piece)).translate(_flip)
            _at += len(region)
    want_child = digest()
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
                f.write(f"{os.getpid()} {int(digest() == want_child)}")
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
        rep = {"pid": os.getpid(), "memory_ok": digest() == want,
               "child_memory_ok": said[1:] == ["1"],
               "file_offset": data.tell(), "pipe_ok": os.path.exists(got),
               "thread_ok": counter[0] > c0, "n": n, "counter": c0}
        time.sleep(0.05)
        rep["thread_ok"] = counter[0] > c0
        with open(os.path.join(d, "report.tmp"), "w") as f:
            json.dump(rep, f)
        os.rename(os.path.join(d, "report.tmp"), os.path.join(d, "report.json"))
    time.sleep(0.02)
