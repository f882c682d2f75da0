"""Build the native helpers next to their sources (scripts/setup.sh runs this): `python3 -m storage.native.build`.

Idempotent: a library newer than its source is kept. Written to a temporary name in this directory
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

from storage.native import HERE
# (source, library): storage/shufflelib.py and storage/delta.py load them by these names, from here only
LIBRARIES = (("shuffle2.c", "libgpusnap_shuffle2.so"), ("pages.c", "libgpusnap_pages.so"),
             ("fdread.c", "libgpusnap_fdread.so"))
CFLAGS = ("-O3", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-fstack-protector-strong",
          "-Wl,-z,relro,-z,now", "-Wl,-z,noexecstack")


class BuildError(Exception):
    """The compiler is missing or refused a source."""


def build(force: bool = False) -> list[str]:
    """Every library of LIBRARIES built (or kept, when newer than its source): their paths."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    out = []
    for src, lib in LIBRARIES:
        s, dst = os.path.join(HERE, src), os.path.join(HERE, lib)
        if not force and os.path.exists(dst) and os.stat(dst).st_mtime >= os.stat(s).st_mtime:
            out.append(dst)
            continue
        if cc is None:
            raise BuildError(f"no C compiler (cc) to build {lib}; gpusnap uses numpy in its place")
        fd, tmp = tempfile.mkstemp(prefix=f".{lib}.", dir=HERE)
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
