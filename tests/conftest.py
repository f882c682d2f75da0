"""Shared fixtures: a real store on the real disk, the CLI run as a real subprocess, GPU skipping."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
GPUSNAP = [sys.executable, "-m", "cli"]
# the code packages of the project, from the top layer down (pyproject.toml installs the same)
CODE_PACKAGES = ("cli", "agents", "criu_hooks", "sandbox", "storage")


def pythonpath() -> str:
    """The repo first, then whatever the caller had (the GPU machine carries wheels on PYTHONPATH)."""
    return os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)


def _link_tree(src: Path, dst: Path) -> None:
    """DST: SRC's files hard-linked (copied across file systems) under world-readable directories."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)
    shutil.copytree(src, dst, symlinks=True, copy_function=link, ignore=shutil.ignore_patterns("__pycache__"))
    for d, _, _ in os.walk(dst):
        os.chmod(d, 0o755)


@pytest.fixture(scope="session")
def nobody_pythonpath() -> Iterator[str]:
    """A PYTHONPATH from which an unprivileged user (uid 65534) imports gpusnap and its dependencies,
    wherever this checkout and its venv sit: a clone under a 0700 directory (where CI may put it) is
    not readable by other users, so the code packages and the running interpreter's site-packages are
    linked into a world-readable temporary directory for the session."""
    import sysconfig
    import tempfile
    top = Path(tempfile.mkdtemp(prefix="gpusnap-nobody-", dir="/var/tmp"))
    try:
        top.chmod(0o755)
        for pkg in CODE_PACKAGES:
            _link_tree(REPO / pkg, top / "code" / pkg)
        _link_tree(Path(sysconfig.get_paths()["purelib"]), top / "site")
        yield os.pathsep.join((str(top / "code"), str(top / "site")))
    finally:
        shutil.rmtree(top, ignore_errors=True)


@contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of SIZE mounted at WHERE for the block (a disk that fills up); needs root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    except BaseException:
        subprocess.run(["umount", "-l", str(where)], check=False)
        raise
    r = subprocess.run(["umount", str(where)], capture_output=True, text=True, check=False)
    if r.returncode:  # something still holds a file open there (a store object's packs, once): a leak
        subprocess.run(["umount", "-l", str(where)], check=False)
        pytest.fail(f"the tmpfs at {where} did not unmount: {r.stderr.strip()}")


def require_root(why: str = "needs root (CRIU, runsc, namespaces, mounts); CI runs as root") -> None:
    """Skip the calling test without root."""
    if os.geteuid() != 0:
        pytest.skip(why)


# The requirements a whole test module has, defined once: a module names them with
# `pytestmark = [..., pytest.mark.usefixtures("need_criu")]`, a test as an argument.
@pytest.fixture(scope="module")
def need_root() -> None:
    """Root (CRIU, runsc, namespaces, mounts): skip without it."""
    require_root()


@pytest.fixture(scope="module")
def need_criu() -> None:
    """Root and CRIU >= 4: skip without root, fail without CRIU (CI must not skip these)."""
    from support.criu import require_criu
    require_criu()


@pytest.fixture(scope="module")
def need_runsc() -> None:
    """Root and runsc: skip without root, fail without runsc (CI must not skip these)."""
    from support.runsc import require_runsc
    require_runsc()


def have_gpu() -> bool:
    if not (os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi")):
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if have_gpu():
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU/driver here (GPU tests run on the H200 via scripts/gpu-tests.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class Cli:
    def __init__(self, store: Path) -> None:
        self.store = store

    def run(self, *args: str, check: bool = True, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
        e = {**os.environ, "PYTHONPATH": pythonpath(), **(env or {})}
        p = subprocess.run([*GPUSNAP, "--store", str(self.store), *args], capture_output=True, text=True,
                           cwd=REPO, env=e, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"gpusnap {' '.join(args)} exited {p.returncode}: {p.stderr}")
        return p

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "--json").stdout)


@pytest.fixture
def child() -> Iterator[int]:
    """A real process that only sleeps: a pid for the driver stand-in to treat as a CUDA process."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p.pid
    p.kill()
    p.wait()


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    # tmp_path is on the real disk here (not tmpfs): see test_store_on_real_disk
    return tmp_path / "store"


@pytest.fixture
def cli(store_dir: Path) -> Cli:
    return Cli(store_dir)


def make_mixed_tree(root: Path, mb: int = 24, seed: int = 0) -> Path:
    """A directory of the data mixes that matter: zeros, random, bf16-like N(0, 0.02), small files."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    n = mb << 20
    (root / "zeros.bin").write_bytes(bytes(n // 3))
    (root / "random.bin").write_bytes(rng.bytes(n // 3))
    w = rng.normal(0, 0.02, n // 6).astype(np.float32)
    (root / "weights.bf16").write_bytes((w.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    sub = root / "sub" / "deeper"
    sub.mkdir(parents=True)
    (sub / "small.txt").write_text("hello gpusnap\n")
    (sub / "empty").write_bytes(b"")
    (root / "exec.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "exec.sh").chmod(0o750)
    (root / "link").symlink_to("sub/deeper/small.txt")
    (root / "emptydir").mkdir()
    return root


def tree_digest(root: Path) -> dict[str, Any]:
    """Everything get must reproduce: relative path -> (type, mode, mtime, content or link target)."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode & 0o7777)
            else:
                out[rel] = ("file", st.st_mode & 0o7777, st.st_mtime_ns, p.read_bytes())
    return out


def chunk_files(store: Path) -> list[Path]:
    """The files that hold chunks: pack files (format v3) and chunk files (v1/v2). To look at or damage
    one chunk, use tests.support.entries.chunk_entries."""
    return sorted(p for d in ("packs", "chunks") for p in (store / d).rglob("*") if p.is_file())
