"""What the Python scripts share: where the repository is, the environment a child process needs to
import the checkout, and cold-cache measurements (sync, then drop the kernel's page cache).

The scripts are a package: run them as modules from the repository root, e.g.
`python3 -m scripts.bench.bench_e2e --help`; no script patches sys.path."""
from __future__ import annotations

import os
import sys
import time
from typing import Any

FLOOR_READ = 16 << 20  # the read size of the disk floor's readers
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
    """os.environ with the checkout first on PYTHONPATH (for `python -m cli` children)."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def drop_caches(required: bool = False) -> bool:
    """Sync and drop the page cache (root only). Without root: raise if REQUIRED, else warn once."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError as e:
        if required:
            raise SystemExit(f"cannot drop the page cache ({e.strerror}): run the benchmark as root") from None
        print("(cannot drop caches: not root; read figures include the page cache)", file=sys.stderr)
        return False


def report_json(result: dict, path: str | None) -> None:
    """A benchmark's RESULT printed as indented JSON, and written to PATH too when one is given."""
    import json
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)


def disk_floor(work: str, gb: float) -> dict:
    """The disk's own rates on WORK's file system, measured now: buffered write + fsync of GB
    gigabytes, then (page cache dropped) one sequential reader and four readers of it."""
    path = os.path.join(work, "floor.bin")
    n = int(gb * (1 << 30)) // FLOOR_READ * FLOOR_READ
    block = os.urandom(FLOOR_READ)  # incompressible, not zero: what a file system cannot elide
    out: dict = {"bytes": n}
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(n // FLOOR_READ):
            os.write(fd, block)
        os.fsync(fd)
    finally:
        os.close(fd)
    out["write_gbps"] = n / (time.perf_counter() - t0) / 1e9

    def read(readers: int) -> float:
        drop_caches(required=True)
        fd = os.open(path, os.O_RDONLY)
        part = n // readers // FLOOR_READ * FLOOR_READ

        def one(i: int) -> None:
            buf = bytearray(FLOOR_READ)
            for off in range(i * part, (i + 1) * part, FLOOR_READ):
                os.preadv(fd, [buf], off)
        t0 = time.perf_counter()
        try:
            from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415
            with ThreadPoolExecutor(readers) as ex:
                list(ex.map(one, range(readers)))
        finally:
            os.close(fd)
        return part * readers / (time.perf_counter() - t0) / 1e9
    out["read1_gbps"] = read(1)
    out["read4_gbps"] = read(4)
    os.unlink(path)
    return out


def second_dump_pages(store: str, parent: str, child: str) -> dict[str, Any]:
    """Where CHILD's page images find PARENT's pages (both CRIU snapshots of STORE), streamed through
    `gpusnap store cat` in 64 MiB reads: nowhere_bytes (non-zero pages found in no page image of the
    parent), and per image of the child its pages, zero pages, the parent image holding most of its
    non-zero pages ("best"), how many of them sit at the same page index there ("same_place"), how many
    elsewhere in the parent ("elsewhere"), how many nowhere, and the most common page shifts against
    "best" (child index - parent index: a layout that moved between the dumps shows as several)."""
    import collections
    import json
    import subprocess

    import numpy as np

    from storage.pipeline.put import page_keys

    def run(*args: str) -> "subprocess.Popen[bytes]":
        return subprocess.Popen([sys.executable, "-m", "cli", "--store", store, *args], stdout=subprocess.PIPE,
                                env=child_env(), cwd=REPO)

    def images(snap: str) -> list[str]:
        p = run("store", "ls", "--json", snap)
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"gpusnap store ls {snap} failed ({p.returncode})")
        return [e["path"] for e in json.loads(out) if "/pages-" in e["path"]]

    def keys(snap: str, name: str) -> "np.ndarray":
        p = run("store", "cat", snap, name)
        assert p.stdout is not None
        parts = []
        try:
            while True:
                block = p.stdout.read(64 << 20)
                if not block:
                    break
                parts.append(page_keys(block))  # the images are whole pages: a full read ends on a page
        finally:
            p.stdout.close()
            if p.wait(timeout=600) != 0:
                raise SystemExit(f"gpusnap store cat {snap} {name} failed ({p.returncode})")
        return np.concatenate(parts) if parts else np.zeros(0, np.uint64)

    zero = page_keys(bytes(4096))[0]
    where: dict[int, tuple[str, int]] = {}  # a parent page's key -> its first image and index
    for name in images(parent):
        k = keys(parent, name)
        for idx in np.flatnonzero(k != zero).tolist()[::-1]:  # the first occurrence wins
            where[int(k[idx])] = (name, idx)
    rows, nowhere = [], 0
    for name in images(child):
        k = keys(child, name)
        nz = np.flatnonzero(k != zero).tolist()
        hits = [(i, where.get(int(k[i]))) for i in nz]
        found = [(i, w) for i, w in hits if w is not None]
        best = collections.Counter(w[0] for _, w in found).most_common(1)
        best_name = best[0][0] if best else None
        shifts = collections.Counter(i - w[1] for i, w in found if w[0] == best_name)
        same = shifts.get(0, 0)
        nowhere += len(nz) - len(found)
        rows.append({"image": name, "pages": int(len(k)), "zero_pages": int(len(k) - len(nz)), "best": best_name,
                     "same_place": same, "elsewhere": len(found) - same, "nowhere": len(nz) - len(found),
                     "shifts": shifts.most_common(8)})
    return {"nowhere_bytes": 4096 * nowhere, "images": rows}
