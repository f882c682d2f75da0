"""CRIU parity (issue 61): what plain CRIU does, `gpusnap criu dump/restore` does too, through the real
CLI and the real CRIU: a process with private MAP_HUGETLB memory restored by default; a failed dump
leaves every process as it found it (running, stopped, traced); the CRIU options a user needs, each a
checked gpusnap option."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import Cli
from support.criu import require_criu

pytestmark = pytest.mark.root


@pytest.fixture(scope="module", autouse=True)
def need_criu() -> None:
    require_criu()


def _until(done, why: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {why}")
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---- hugetlb -------------------------------------------------------------------------------------

HUGE = r'''
import ctypes, mmap, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
N = 8 << 20
addr = libc.mmap(None, N, 3, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000, -1, 0)  # MAP_HUGETLB
if addr in (None, ctypes.c_void_p(-1).value):
    print("no huge pages", ctypes.get_errno(), flush=True)
    sys.exit(3)
buf = (ctypes.c_char * N).from_address(addr)
for off in range(0, N, 4096):
    buf[off:off + 4096] = bytes(((off >> 12) * 31 + i) % 251 for i in range(0, 4096, 512)) * 512
print("ready", flush=True)
while True:
    time.sleep(0.1)
    ok = all(buf[o:o + 4096] == bytes(((o >> 12) * 31 + i) % 251 for i in range(0, 4096, 512)) * 512
             for o in range(0, N, 4096))
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {'ok' if ok else 'bad'} {time.monotonic_ns()}")
    os.replace(tmp, sys.argv[1])
'''


@pytest.fixture
def huge_pages() -> Iterator[None]:
    """vm.nr_hugepages at least 16 for the test (the old value put back after); a skip where the
    kernel gives none."""
    path = "/proc/sys/vm/nr_hugepages"
    with open(path) as f:
        old = int(f.read())
    try:
        with open(path, "w") as f:
            f.write(str(max(old, 16)))
    except OSError as e:
        pytest.skip(f"vm.nr_hugepages cannot be set here: {e}")
    try:
        with open("/proc/meminfo") as f:
            free = next(int(l.split()[1]) for l in f if l.startswith("HugePages_Free:"))
        if free < 4:
            pytest.skip(f"the kernel gives no huge pages here (HugePages_Free {free} after vm.nr_hugepages=16)")
        yield
    finally:
        with open(path, "w") as f:
            f.write(str(old))


@pytest.mark.parametrize("dumped_by", ["stream", "staging"])
def test_private_hugetlb_memory_is_restored_by_the_default_restore(cli: Cli, tmp_path: Path, huge_pages: None,
                                                                   dumped_by: str) -> None:
    state = tmp_path / "state"
    script = tmp_path / "huge.py"
    script.write_text(HUGE)
    log = open(tmp_path / "out", "w")
    p = subprocess.Popen([sys.executable, str(script), str(state)], stdin=subprocess.DEVNULL, stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _until(lambda: state.exists() or p.poll() is not None, "the hugetlb workload")
        if p.poll() is not None:
            pytest.skip(f"no huge pages for the workload: {(tmp_path / 'out').read_text().strip()}")
        assert state.read_text().split()[1] == "ok"
        env = {k: v for k, v in os.environ.items() if k != "GPUSNAP_CRIU_IMAGES"}  # the default path
        d = cli.run("criu", "dump", str(p.pid), "huge", "--json", env={**env, "GPUSNAP_CRIU_IMAGES": dumped_by})
        rep = json.loads(d.stdout)
        assert rep["images_path"] == dumped_by and "MAP_HUGETLB" in rep["staged_restore"], rep
        p.wait(10)
        info = json.loads(cli.run("store", "inspect", "huge", "--json").stdout)
        assert "mm-" in info["meta"]["staged_restore"]
        state.unlink()
        r = json.loads(cli.run("criu", "restore", "huge", "--json", env=env).stdout)
        assert r["restored_pid"] == p.pid and r["images_path"] == "staging", r
        _until(state.exists, "the restored workload's check")
        assert state.read_text().split()[:2] == [str(p.pid), "ok"]
    finally:
        _kill(p.pid)
        if p.poll() is None:
            p.wait(10)
        log.close()
