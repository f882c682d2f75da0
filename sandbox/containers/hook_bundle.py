"""What `gpusnap hook install` copies so that the hook outlives the tree it was installed from: the
packages the hook runs (criu_hooks, sandbox, storage) and the installed dependencies they need (into
LIB_DIR/python), run by a Python every user can
run and only root can change, and the CRIU binary (into LIBEXEC_DIR/criu).

Guarantees kept here:
- a copy is made aside (NAME.new) and renamed into place, so the hook runs the old code or the new,
  never a mix; a copy equal to the one in place (same files, sizes, modification times) is not redone;
- everything copied is owned by root and writable by no one else; nothing copied is a symbolic link
  (a link could point back into the tree it came from);
- the interpreter named is root-owned, not writable by group or others, and executable by everyone:
  /usr/bin/python3 where its version matches the running one (the copied compiled dependencies are
  built for that version), else this Python's own base interpreter;
- the CRIU copied needs only libraries in the system's library directories (root-owned); one that
  needs a library elsewhere (a build tree, a home directory) is refused, naming it.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass

from storage.api import GpusnapError

PACKAGES = ("criu_hooks", "sandbox", "storage")   # what the hook imports (layers: criu_hooks -> sandbox -> storage)
ALL_PACKAGES = ("criu_hooks", "sandbox", "storage", "agents", "cli")   # never copied from a dependency's RECORD
DIST = "gpusnap"
EXTRAS = ("gpu",)              # optional dependency groups copied too when they are installed
# gpusnap's requirements the hook never imports (the command line, the remote tier, network
# namespaces): left out with whatever only they need
NOT_FOR_THE_HOOK = ("click", "rich", "boto3", "pyroute2")
SYSTEM_PYTHON = "/usr/bin/python3"
SYSTEM_LIB_DIRS = ("/lib/", "/lib64/", "/usr/lib/", "/usr/lib64/")


class BundleError(GpusnapError):
    """The hook's code or CRIU cannot be copied safely (the message names what and why)."""


@dataclass(frozen=True)
class Source:
    path: str      # absolute, a regular file
    rel: str       # where it goes under the copy


def _safe_for_root(path: str, what: str, executable_by_all: bool = False) -> None:
    st = os.stat(path)
    if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise BundleError(f"{what} {path} is not owned by root or is writable by others; CRIU runs the hook as "
                          f"root: use a Python only root can change")
    if executable_by_all and not st.st_mode & stat.S_IXOTH:
        raise BundleError(f"{what} {path} cannot be run by other users")


def _version_of(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2])"], capture_output=True,
                             text=True, timeout=30).stdout.split()
        return (int(out[0]), int(out[1])) if len(out) == 2 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def interpreter() -> str:
    """The Python the installed hook runs (see the module's guarantees)."""
    if os.path.isfile(SYSTEM_PYTHON) and _version_of(SYSTEM_PYTHON) == sys.version_info[:2]:
        _safe_for_root(os.path.realpath(SYSTEM_PYTHON), "the system Python", executable_by_all=True)
        return SYSTEM_PYTHON
    base = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    _safe_for_root(base, "the Python running this install", executable_by_all=True)
    d = os.path.dirname(base)
    while d != "/":
        _safe_for_root(d, "the directory", executable_by_all=True)
        d = os.path.dirname(d)
    return base


def _own_packages() -> list[Source]:
    out = []
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise BundleError(f"gpusnap's package {pkg} is not importable by {sys.executable}")
        top = list(spec.submodule_search_locations)[0]
        for d, dirs, files in os.walk(top):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__")
            for f in sorted(files):
                if f.endswith((".pyc", ".pyo")):
                    continue
                p = os.path.join(d, f)
                out.append(Source(p, os.path.join(pkg, os.path.relpath(p, top))))
    return out


def _requirement_names(dist: importlib.metadata.Distribution, extras: tuple[str, ...] = ()) -> list[str]:
    names = []
    for r in dist.requires or []:
        req, _, marker = r.partition(";")
        m = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
        if m and m.group(1) not in extras:
            continue
        name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        if name:
            names.append(name.group(1))
    return names


def _dependencies() -> list[Source]:
    """The files of every installed distribution gpusnap needs (the `gpu` extras where installed),
    as their RECORDs list them, without console scripts or .pth files."""
    try:
        top = importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        raise BundleError(f"{DIST} is not installed in {sys.executable} (its dependencies are copied from "
                          f"there): `pip install .` first") from None
    seen: set[str] = set()
    todo = [n for n in _requirement_names(top, EXTRAS) if n.lower() not in NOT_FOR_THE_HOOK]
    out: list[Source] = []
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue   # an optional one that is not installed
        todo += _requirement_names(dist)
        for f in dist.files or []:
            rel = os.path.normpath(str(f))
            if rel.startswith("..") or os.path.isabs(rel) or "__pycache__" in rel.split(os.sep) or rel.endswith(".pth"):
                continue
            p = str(dist.locate_file(f))
            if os.path.isfile(p) and not os.path.islink(p):
                out.append(Source(os.path.abspath(p), rel))
    return out


def sources() -> list[Source]:
    """Everything the hook's copy holds: gpusnap's packages, then their dependencies."""
    own = _own_packages()
    taken = {s.rel for s in own}
    return own + [s for s in _dependencies() if s.rel not in taken and s.rel.split(os.sep)[0] not in ALL_PACKAGES]


def signature(srcs: list[Source]) -> str:
    h = hashlib.sha256()
    for s in sorted(srcs, key=lambda s: s.rel):
        st = os.stat(s.path)
        h.update(f"{s.rel}\0{st.st_size}\0{st.st_mtime_ns}\0{stat.S_IMODE(st.st_mode)}\n".encode())
    return h.hexdigest()


def copy_tree(srcs: list[Source], dest: str) -> None:
    """SRCS into directory DEST (replaced whole: made as DEST.new, then renamed over it)."""
    new, old = dest + ".new", dest + ".old"
    for d in (new, old):
        if os.path.lexists(d):
            _remove_tree(d)
    os.mkdir(new, 0o755)
    try:
        for s in srcs:
            target = os.path.join(new, s.rel)
            os.makedirs(os.path.dirname(target), 0o755, exist_ok=True)
            shutil.copy2(s.path, target, follow_symlinks=False)
            mode = stat.S_IMODE(os.stat(target).st_mode)
            os.chown(target, 0, 0)
            os.chmod(target, (mode | 0o444) & ~0o022)
        if os.path.lexists(dest):
            os.rename(dest, old)
        os.rename(new, dest)
    except BaseException:
        if os.path.lexists(new):
            _remove_tree(new)
        if os.path.lexists(old) and not os.path.lexists(dest):
            os.rename(old, dest)
        raise
    if os.path.lexists(old):
        _remove_tree(old)


def _remove_tree(path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        raise BundleError(f"{path} is not a directory gpusnap made; refusing to remove it")
    shutil.rmtree(path)


def remove_tree(path: str) -> bool:
    """Remove a copy copy_tree made (True), or nothing if it is not there (False)."""
    if not os.path.lexists(path):
        return False
    _remove_tree(path)
    return True


def criu_libraries(criu: str) -> list[str]:
    """The shared libraries CRIU loads (resolved by ldd); refuses one outside the system's library
    directories or not root-owned."""
    try:
        p = subprocess.run(["ldd", criu], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BundleError(f"cannot list the libraries {criu} needs (ldd: {e})") from None
    if p.returncode != 0:
        if "not a dynamic executable" in p.stdout + p.stderr:
            return []
        raise BundleError(f"cannot list the libraries {criu} needs: {(p.stderr.strip() or p.stdout.strip())[:200]}")
    libs = []
    for line in p.stdout.splitlines():
        if "=> not found" in line:
            raise BundleError(f"{criu} needs {line.split()[0]}, which is not installed")
        m = re.search(r"(?:=>\s*)?(/\S+)\s+\(0x", line)
        if not m:
            continue
        real = os.path.realpath(m.group(1))
        if not real.startswith(SYSTEM_LIB_DIRS):
            raise BundleError(f"{criu} needs {real}, outside the system's library directories; install CRIU "
                              f"built against system libraries (scripts/setup/install-criu.sh)")
        _safe_for_root(real, "the library")
        libs.append(real)
    return libs


def copy_file(src: str, dest_dir: str, name: str, mode: int = 0o755) -> bool:
    """SRC as DEST_DIR/NAME (atomically; root-owned, MODE); False if an identical copy is there."""
    dest = os.path.join(dest_dir, name)
    if os.path.isfile(dest) and not os.path.islink(dest) and _same_bytes(src, dest):
        return False
    tmp = os.path.join(dest_dir, f".{name}.gpusnap-{os.getpid()}")
    shutil.copyfile(src, tmp, follow_symlinks=True)
    os.chown(tmp, 0, 0)
    os.chmod(tmp, mode)
    os.rename(tmp, dest)
    return True


def _same_bytes(a: str, b: str) -> bool:
    if os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True
