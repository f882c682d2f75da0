"""Test helpers: real runc and Podman (runc runtime) containers running a counter on a busybox-static
root filesystem, each with its own names, state directories and storage, removed even on failure."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest

from sandbox.criu.runner import find_criu

BUSYBOX = "/bin/busybox"
# The counter writes "VALUE RUN" atomically (a temporary file renamed over /tmp/count: a checkpoint or a
# reader never meets a truncated file); RUN is drawn once per start, so a restore that started the
# program afresh shows a new one. At most 10 values a second (sleep 0.1 between them).
COUNTER = ("t=$(cat /proc/sys/kernel/random/uuid); i=0; while true; do i=$((i+1)); "
           "echo \"$i $t\" > /tmp/count.tmp; mv -f /tmp/count.tmp /tmp/count;{also} sleep 0.1; done")
PER_SECOND = 10
PODMAN_LIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=4096:4096"]


def need(*programs: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (containers, CRIU)")
    for p in programs:
        if not (shutil.which(p) or os.path.exists(p)):
            pytest.skip(f"{p} is not installed (scripts/setup.sh installs it)")


def runtime_env() -> dict[str, str]:
    """The environment runc/Podman run in: the project's CRIU >= 4 first on PATH (where they look)."""
    criu = find_criu()
    if criu is None:
        pytest.skip("no CRIU >= 4 (scripts/install-criu.sh)")
    return {**os.environ, "PATH": f"{os.path.dirname(criu)}:{os.environ.get('PATH', '')}"}


def make_rootfs(where: Path) -> Path:
    """A minimal root filesystem: busybox-static and the mount points a container needs."""
    for d in ("bin", "proc", "sys", "dev", "tmp", "etc"):
        (where / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, where / "bin" / "busybox")
    (where / "bin" / "sh").symlink_to("busybox")
    return where


class Count(NamedTuple):
    value: int
    run: str   # the counter's start: the same after a restore, new after a fresh start


def _parse(text: str) -> Count:
    value, run = text.split()
    return Count(int(value), run)


def read_count(path: Path) -> Count:
    for _ in range(100):
        try:
            return _parse(path.read_text())
        except (OSError, ValueError):   # not written yet
            time.sleep(0.05)
    raise AssertionError(f"{path}: no counter value")


def wait_count(path: Path, at_least: int, timeout: float = 60) -> int:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            v = _parse(path.read_text()).value
            if v >= at_least:
                return v
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"counter {path} did not reach {at_least} in {timeout} s")


def assert_continues(c: "RuncContainer", frozen: Count) -> None:
    """After C's restore the counter goes on from FROZEN: the same run (a fresh start draws a new
    one), values above FROZEN, and no further ahead than the time since the restore began allows
    (PER_SECOND values a second at most; a machine under load only makes it fewer)."""
    first = wait_count(c.count_file, frozen.value + 1)
    now = read_count(c.count_file)
    assert now.run == frozen.run, f"the counter started afresh (run {frozen.run} before, {now.run} after)"
    allowed = frozen.value + 2 + PER_SECOND * (time.monotonic() - c.restored_at)
    assert first <= allowed, f"counter jumped from {frozen.value} to {first} (at most {allowed:.0f} possible)"
    assert wait_count(c.count_file, first + 3) > first


def run(argv: list[str], env: dict[str, str], check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return p


class RuncContainer:
    """A runc container running the counter; its rootfs/tmp/count is the counter's value."""

    def __init__(self, base: Path, env: dict[str, str], criu_config: str | None = None) -> None:
        self.id = f"gpusnap-test-{uuid.uuid4().hex[:10]}"
        self.base, self.env = base, env
        self.restored_at = 0.0
        self.root = base / "runc-root"
        self.bundle = base / "bundle"
        make_rootfs(self.bundle / "rootfs")
        run(["runc", "spec", "--bundle", str(self.bundle)], env)
        cfg = json.loads((self.bundle / "config.json").read_text())
        cfg["process"]["terminal"] = False
        cfg["process"]["args"] = ["/bin/busybox", "sh", "-c", COUNTER.format(also="")]
        cfg["root"]["readonly"] = False
        if criu_config is not None:
            cfg["annotations"] = {"org.criu.config": criu_config}
        (self.bundle / "config.json").write_text(json.dumps(cfg))

    @property
    def count_file(self) -> Path:
        return self.bundle / "rootfs" / "tmp" / "count"

    def runc(self, *args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return run(["runc", "--root", str(self.root), *args], env or self.env, check)

    def start(self) -> None:
        # the container's stdio must not be a host file or a pipe we wait on: /dev/null (CRIU dumps it)
        log = self.base / "runc.log"
        p = subprocess.run(["runc", "--root", str(self.root), "--log", str(log), "run", "-d", "--bundle",
                            str(self.bundle), self.id], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, env=self.env, timeout=120)
        if p.returncode != 0:
            raise AssertionError(f"runc run exited {p.returncode}: {log.read_text()[-2000:] if log.exists() else ''}")

    def state(self) -> dict | None:
        p = self.runc("state", self.id, check=False)
        return json.loads(p.stdout) if p.returncode == 0 else None

    def pid(self) -> int:
        s = self.state()
        assert s is not None, f"container {self.id} is not there"
        return int(s["pid"])

    def checkpoint(self, images: Path, work: Path, *extra: str, env: dict[str, str] | None = None,
                   check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.runc("checkpoint", "--image-path", str(images), "--work-path", str(work), *extra, self.id,
                         check=check, env=env)

    def restore(self, images: Path, work: Path, env: dict[str, str] | None = None) -> None:
        self.restored_at = time.monotonic()
        log = self.base / "runc.log"
        p = subprocess.run(["runc", "--root", str(self.root), "--log", str(log), "restore", "-d", "--image-path",
                            str(images), "--work-path", str(work), "--bundle", str(self.bundle), self.id],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=env or self.env, timeout=120)
        if p.returncode != 0:
            tail = (work / "restore.log").read_text()[-1500:] if (work / "restore.log").exists() else ""
            raise AssertionError(f"runc restore exited {p.returncode}: {log.read_text()[-1000:]} {tail}")

    def delete(self) -> None:
        self.runc("delete", "-f", self.id, check=False)


@contextmanager
def runc_container(base: Path, env: dict[str, str], criu_config: str | None = None) -> Iterator[RuncContainer]:
    c = RuncContainer(base, env, criu_config)
    try:
        c.start()
        yield c
    finally:
        c.delete()


class Podman:
    """Podman with its own storage, run root and a local image made from the busybox rootfs."""

    def __init__(self, base: Path, env: dict[str, str]) -> None:
        self.base, self.env = base, env
        self.tag = uuid.uuid4().hex[:10]
        self.image = f"localhost/gpusnap-test-busybox:{self.tag}"
        self.runroot = Path(tempfile.mkdtemp(prefix="gpusnap-pr-"))   # Podman: at most 50 characters
        self.argv = ["podman", "--root", str(base / "storage"), "--runroot", str(self.runroot),
                     "--tmpdir", str(base / "tmp"), "--runtime", "runc", "--cgroup-manager", "cgroupfs",
                     "--events-backend", "file"]

    def import_image(self) -> None:
        rootfs = make_rootfs(self.base / "image-rootfs")
        tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], capture_output=True, check=True).stdout
        p = subprocess.run([*self.argv, "import", "-", self.image], input=tar, capture_output=True, env=self.env)
        if p.returncode != 0:
            raise AssertionError(f"podman import: {p.stderr.decode()[-2000:]}")

    def __call__(self, *args: str, check: bool = True, env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return run([*self.argv, *args], env or self.env, check, timeout)

    def count_file(self, name: str) -> int:
        """The counter's last value, read from the container's stopped root filesystem (after a
        checkpoint the container is not running, so `exec` cannot read it)."""
        upper = self("inspect", "-f", "{{.GraphDriver.Data.UpperDir}}", name).stdout.strip()
        return read_count(Path(upper) / "tmp" / "count").value

    def start_counter(self, name: str, *extra: str) -> None:
        self("run", "-d", "--name", name, "--network", "none", *PODMAN_LIMITS, *extra, self.image,
             "/bin/busybox", "sh", "-c", COUNTER.format(also=" echo $i;"))

    def count(self, name: str) -> int:
        for _ in range(50):
            p = self("exec", name, "/bin/busybox", "cat", "/tmp/count", check=False)
            if p.returncode == 0 and p.stdout.split()[:1] and p.stdout.split()[0].isdigit():
                return int(p.stdout.split()[0])
            time.sleep(0.1)
        raise AssertionError(f"no counter in container {name}")

    def wait_count(self, name: str, at_least: int, timeout: float = 60) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            v = self.count(name)
            if v >= at_least:
                return v
            time.sleep(0.1)
        raise AssertionError(f"counter in {name} did not reach {at_least}")

    def cleanup(self) -> None:
        self("rm", "-af", "-t", "0", check=False)
        self("rmi", "-af", check=False)
        subprocess.run(["umount", "-R", "-l", str(self.base / "storage" / "overlay")], capture_output=True)
        shutil.rmtree(self.base / "storage", ignore_errors=True)
        shutil.rmtree(self.runroot, ignore_errors=True)


@contextmanager
def podman(base: Path, env: dict[str, str]) -> Iterator[Podman]:
    (base / "tmp").mkdir(parents=True, exist_ok=True)
    p = Podman(base, env)
    try:
        p.import_image()
        yield p
    finally:
        p.cleanup()


def snapshot_dir(d: Path) -> dict[str, bytes] | None:
    if not d.exists():
        return None
    return {p.name: (p.read_bytes() if not p.is_symlink() else b"->" + os.readlink(p).encode())
            for p in sorted(d.iterdir())}


@contextmanager
def real_etc_criu() -> Iterator[Path]:
    """The real /etc/criu, put back exactly as it was after the block even if the test failed."""
    d = Path("/etc/criu")
    before = snapshot_dir(d)
    try:
        yield d
    finally:
        if snapshot_dir(d) != before:
            shutil.rmtree(d, ignore_errors=True)
            if before is not None:
                d.mkdir(mode=0o755)
                for name, data in before.items():
                    (d / name).write_bytes(data)
            pytest.fail("/etc/criu was not left as it was; restored it")
