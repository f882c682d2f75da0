"""Build the native helpers next to their sources (scripts/setup.sh runs this): `python3 -m storage.native.build`.

Idempotent: a library newer than its source that answers the interface version its module was
written for is kept (one carried from another tree, newer than its source but of another version,
is built again instead of being refused at every load). Written to a temporary name in this directory
and renamed over the old one, so a process loading it sees the old file or the new one, whole. Exit
status 0 when every library is there afterwards; 1 (and one line on stderr) when the compiler is
missing or fails, in which case gpusnap still works, through numpy.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from storage import native
from storage.native import HERE
# (source, library, version function, the version the loading module asks for): storage/codecs/shufflelib.py,
# storage/codecs/delta.py and storage/fs/fdread.py load them by these names, from here only (tests/test_native_pages.py
# checks the versions against theirs)
LIBRARIES = (("shuffle2.c", "libgpusnap_shuffle2.so", "gs_shuffle2_version", 3),
             ("pages.c", "libgpusnap_pages.so", "gs_pages_version", 1),
             ("fdread.c", "libgpusnap_fdread.so", "gs_fdread_version", 3))
CFLAGS = ("-O3", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-fstack-protector-strong",
          "-Wl,-z,relro,-z,now", "-Wl,-z,noexecstack")


class BuildError(Exception):
    """The compiler is missing or refused a source."""


def _current(src: str, dst: str, version: str, abi: int) -> bool:
    """Whether DST may be kept: newer than SRC and (unless $GPUSNAP_NO_NATIVE turns loading off)
    loadable by native.load at ABI."""
    if not os.path.exists(dst) or os.stat(dst).st_mtime < os.stat(src).st_mtime:
        return False
    return bool(os.environ.get("GPUSNAP_NO_NATIVE")) or native.load(dst, version, abi, []) is not None


def build(force: bool = False, directory: str = HERE) -> list[str]:
    """Every library of LIBRARIES built in DIRECTORY (or kept: _current): their paths."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    out = []
    for src, lib, version, abi in LIBRARIES:
        s, dst = os.path.join(directory, src), os.path.join(directory, lib)
        if not force and _current(s, dst, version, abi):
            out.append(dst)
            continue
        if cc is None:
            raise BuildError(f"no C compiler (cc) to build {lib}; gpusnap uses numpy in its place")
        fd, tmp = tempfile.mkstemp(prefix=f".{lib}.", dir=directory)
        os.close(fd)
        try:
            p = subprocess.run([cc, *CFLAGS, "-o", tmp, s], capture_output=True, text=True)
            if p.returncode:
                raise BuildError(f"{cc} failed on {src}: {p.stderr.strip().splitlines()[0] if p.stderr.strip() else p.returncode}")
            os.chmod(tmp, 0o755)
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        out.append(dst)
    return out


def main() -> None:
    try:
        for path in build(force="--force" in sys.argv[1:]):
            print(path)
    except (BuildError, OSError) as e:
        print(f"storage.native.build: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
