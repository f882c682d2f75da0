"""The command line of a helper process gpusnap starts from its own code (the split fill's workers,
the dump's encoder processes): this interpreter in isolated mode, importing only from where
gpusnap itself was imported. gpusnap runs as root in directories users control; a helper must not
import a module from the working directory or follow PYTHON* variables."""
from __future__ import annotations

import os
import sys

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # storage/fs/ -> the root


def module_path() -> list[str]:
    """The module path a helper gets: this process's own, less the working directory (`python -m`
    puts it first, and a root process must not import from a directory a user may control) unless
    that is where gpusnap itself was imported from."""
    cwd = os.getcwd()
    out = [p for p in sys.path if p and (os.path.abspath(p) != cwd or os.path.abspath(p) == PACKAGE_ROOT)]
    return out if PACKAGE_ROOT in (os.path.abspath(p) for p in out) else [PACKAGE_ROOT, *out]


def python_argv(module: str, *args: str) -> list[str]:
    """Run MODULE as __main__ with ARGS (sys.argv[1:]): this interpreter with -I (no working
    directory, no PYTHON* variables, no user site on the path), given exactly module_path() and this
    process's byte-code settings."""
    boot = (f"import sys, runpy; sys.path[:] = {module_path()!r}; "
            f"sys.pycache_prefix = {sys.pycache_prefix!r}; "
            f"sys.dont_write_bytecode = {sys.dont_write_bytecode!r}; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")
    return [sys.executable, "-I", "-c", boot, *args]
