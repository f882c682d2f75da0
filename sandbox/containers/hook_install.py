"""`gpusnap hook install|status|uninstall`: make runc, Podman and CRI-O checkpoints run gpusnap's CRIU hook.

What install does (as root), each step idempotent (two installs = one), nothing of it pointing into the
tree or the virtual env gpusnap was installed from (delete that and the hook still works):
- copies gpusnap's packages and the dependencies installed with them into LIB_DIR/python
  (hook_bundle.py), and writes LIB_DIR/gpusnap-criu-hook, a small shell script that runs the hook from
  there with /usr/bin/python3 (or this Python's root-owned base interpreter when the versions differ),
  isolated (-I -S: no site-packages, no PYTHON* variables), and checks that it starts. Actions the hook
  has no work at end in the shell script without starting Python;
- adds gpusnap's block (a marker comment and `action-script PATH`) to the CRIU config file the runtime's
  CRIU reads: CONFIG_DIR/runc.conf for all three (runc passes it to CRIU over RPC for every
  checkpoint/restore unless the container's `org.criu.config` annotation names another file; Podman
  and CRI-O checkpoint through runc);
- makes CRIU >= 4 the first `criu` on PATH, which is where runc and Podman look: only when the first
  one found is missing or older, by copying the CRIU gpusnap uses to LIBEXEC_DIR/criu (its libraries
  must be system ones) and linking SBIN_DIR/criu to that copy;
- records what it created in LIB_DIR/hook-install.json (the manifest uninstall works from).
Uninstall removes exactly that: gpusnap's lines from the configs (a config that existed before is
byte-identical afterwards, one gpusnap created is deleted), the link and the CRIU copy, the code copy,
the script, the record, and the directories install created. `uninstall --runtime R` takes only R off;
the shared config block, the hook and CRIU stay while another runtime installed still reads them.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from storage.api import GpusnapError, UnavailableError

from sandbox.containers import config_block, hook_bundle
from sandbox.containers.hook_bundle import BundleError
from sandbox.containers.pinned_dir import PinnedDir, PinnedDirError, pinned, remove_if_empty
from sandbox.criu.runner import MIN_MAJOR, criu_version, cuda_plugin, find_criu

HOOK_NAME = "gpusnap-criu-hook"
RECORD_NAME = "hook-install.json"
ENTRY_POINT_DEFAULT = "criu_hooks.action_script:main"
PYTHON_DIR = "python"                  # under LIB_DIR: the copy of gpusnap's code and dependencies
CRIU_NAME = "criu"                     # under LIBEXEC_DIR: the copy of CRIU
HOOK_ACTIONS = ("pre-dump", "post-dump", "network-unlock", "post-resume")   # the ones the hook acts at
PODMAN_MIN = (3, 11, 0)          # Podman refuses older CRIU: "requires at least CRIU 31100"


class HookInstallError(GpusnapError):
    """The hook cannot be installed, inspected or removed as asked (the message says what to do)."""


class Runtime(enum.Enum):
    RUNC = "runc"
    PODMAN = "podman"
    CRIO = "crio"


# The CRIU config file each runtime's CRIU reads (all through runc's RPC call to CRIU).
CONFIG_FILE = {Runtime.RUNC: "runc.conf", Runtime.PODMAN: "runc.conf", Runtime.CRIO: "runc.conf"}


@dataclass(frozen=True)
class Layout:
    """Where install puts things (the defaults are the real locations; tests point them elsewhere)."""

    config_dir: str = "/etc/criu"
    lib_dir: str = "/usr/local/lib/gpusnap"
    sbin_dir: str = "/usr/local/sbin"
    libexec_dir: str = "/usr/local/libexec/gpusnap"

    @property
    def hook_path(self) -> str:
        return os.path.join(self.lib_dir, HOOK_NAME)

    @property
    def python_dir(self) -> str:
        return os.path.join(self.lib_dir, PYTHON_DIR)

    @property
    def criu_copy(self) -> str:
        return os.path.join(self.libexec_dir, CRIU_NAME)


@dataclass(frozen=True)
class ConfigRecord:
    path: str
    created_file: bool
    created_dir: bool
    added_newline: bool


@dataclass(frozen=True)
class Record:
    """What install created, so uninstall removes only that (LIB_DIR/hook-install.json)."""

    hook: str
    runtimes: tuple[str, ...]
    configs: tuple[ConfigRecord, ...]
    criu_link: str | None = None
    criu_link_target: str | None = None
    created_lib_dir: bool = False
    python_dir: str | None = None        # the code copy (a directory install made whole)
    python_signature: str | None = None  # what was copied (hook_bundle.signature)
    interpreter: str | None = None       # the Python the hook script runs
    criu_copy: str | None = None         # LIBEXEC_DIR/criu, when install copied CRIU
    criu_source: str | None = None       # the CRIU it was copied from
    created_libexec_dir: bool = False
    created_sbin_dir: bool = False

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Record":
        def opt(v: dict[str, Any], k: str) -> str | None:
            x = v.get(k)
            if x is not None and not isinstance(x, str):
                raise TypeError(f"{k} is not a string")
            return x

        try:
            if len(data) > 1 << 20:
                raise ValueError("over 1 MiB")
            v = json.loads(data)
            configs = tuple(ConfigRecord(str(c["path"]), bool(c["created_file"]), bool(c["created_dir"]),
                                         bool(c["added_newline"])) for c in v["configs"])
            rec = cls(str(v["hook"]), tuple(str(r) for r in v["runtimes"]), configs,
                      opt(v, "criu_link"), opt(v, "criu_link_target"), bool(v.get("created_lib_dir", False)),
                      opt(v, "python_dir"), opt(v, "python_signature"), opt(v, "interpreter"),
                      opt(v, "criu_copy"), opt(v, "criu_source"), bool(v.get("created_libexec_dir", False)),
                      bool(v.get("created_sbin_dir", False)))
        except (ValueError, KeyError, TypeError) as e:
            raise HookInstallError(f"{where}: not a gpusnap install record ({e}); remove gpusnap's lines by hand") from None
        paths = [rec.hook, *(c.path for c in rec.configs), *(p for p in (rec.criu_link, rec.python_dir, rec.criu_copy) if p)]
        if any(not os.path.isabs(p) or ".." in p.split("/") for p in paths):
            raise HookInstallError(f"{where}: paths in the record must be absolute")
        if any(r not in {x.value for x in Runtime} for r in rec.runtimes):
            raise HookInstallError(f"{where}: names an unknown runtime")
        return rec


@dataclass(frozen=True)
class CriuOnPath:
    path: str | None
    version: tuple[int, int, int] | None

    @property
    def usable(self) -> bool:
        return self.version is not None and self.version[0] >= MIN_MAJOR

    def describe(self) -> str:
        if self.path is None:
            return "no criu on PATH"
        v = ".".join(map(str, self.version)) if self.version else "version unknown"
        return f"{self.path} ({v})"


@dataclass(frozen=True)
class InstallReport:
    hook: str
    configs: tuple[str, ...]
    changed: tuple[str, ...]       # what this run created or modified (empty: already installed)
    criu: str                      # the criu runc and Podman will find on PATH
    warnings: tuple[str, ...] = field(default=())


class HookNeedsRoot(HookInstallError, UnavailableError):
    """Install/uninstall run by another user: what this command needs is missing here (exit 4, as a
    non-root `criu dump`)."""


def require_root() -> None:
    if os.geteuid() != 0:
        raise HookNeedsRoot("must run as root: it writes CRIU's configuration and a program CRIU runs as root")


def criu_on_path(path_env: str | None = None) -> CriuOnPath:
    """The `criu` that runc and Podman exec: the first one on PATH."""
    found = shutil.which("criu", path=path_env if path_env is not None else os.environ.get("PATH", ""))
    return CriuOnPath(found, criu_version(found) if found else None)


def cuda_plugins() -> list[str]:
    """CRIU's cuda plugin where CRIU would load it (one place decides: sandbox.criu.runner.cuda_plugin)."""
    p = cuda_plugin()
    return [p] if p else []


# --- the hook script ---------------------------------------------------------------------------

def _entry_point() -> tuple[str, str]:
    """(module, function) of the installed `gpusnap-criu-hook` entry point (the package's default if
    this copy is used without being pip-installed)."""
    eps = importlib.metadata.entry_points(group="console_scripts", name=HOOK_NAME)
    value = next(iter(eps)).value if eps else ENTRY_POINT_DEFAULT
    module, _, func = (v.strip() for v in value.partition(":"))
    func = func or "main"
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module) or not func.isidentifier():
        raise HookInstallError(f"the {HOOK_NAME} entry point {value!r} is not module:function")
    return module, func


def hook_script(layout: Layout, python: str) -> bytes:
    """The shell script CRIU execs: PYTHON, isolated (-I -S: neither the caller's PYTHON* variables nor
    any site-packages), with the installed copy of gpusnap's code first on its path, calling the entry
    point; the actions the hook has no work at end here, without starting Python."""
    module, func = _entry_point()
    code = (f"import sys; sys.path[:0] = [{layout.python_dir!r}]; sys.argv[0] = {HOOK_NAME!r}; "
            f"from {module} import {func} as main; sys.exit(main())")
    return ("#!/bin/sh\n"
            f"# {HOOK_NAME}: written by `gpusnap hook install`, removed by `gpusnap hook uninstall`.\n"
            "# CRIU runs it as its action script; it runs gpusnap's hook from the copy install made.\n"
            "case \"${CRTOOLS_SCRIPT_ACTION:-}\" in\n"
            f"  {'|'.join(HOOK_ACTIONS)}|\"\") ;;\n"
            "  *) exit 0 ;;\n"
            "esac\n"
            f"exec {shlex.quote(python)} -I -S -c {shlex.quote(code)} \"$@\"\n").encode()


def _check_hook_runs(path: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CRTOOLS_", "PYTHON"))}
    try:
        p = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=60, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HookInstallError(f"{path} does not run: {e}") from None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        raise HookInstallError(f"{path} does not run: {last}")


# --- install / uninstall -----------------------------------------------------------------------

def _load_record(lib: PinnedDir) -> Record | None:
    data = lib.read(RECORD_NAME)
    return None if data is None else Record.from_json(data, os.path.join(lib.path, RECORD_NAME))


def _source_criu(explicit: str | None) -> str:
    c = explicit or find_criu()
    if c is None:
        raise UnavailableError(f"no CRIU >= {MIN_MAJOR} on this machine: install it (scripts/install-criu.sh) "
                               f"and pass --criu PATH")
    v = criu_version(c)
    if v is None or v[0] < MIN_MAJOR:
        raise HookInstallError(f"{c}: not CRIU >= {MIN_MAJOR} (criu --version says {v})")
    return os.path.realpath(c)


def _criu_plan(old: Record | None, explicit: str | None, path_env: str) -> tuple[bool, str | None]:
    """(keep the CRIU copy and link an earlier install made, CRIU to copy and link now or None); raises
    before anything is written when a copy is needed and no usable CRIU >= 4 exists."""
    if (old and old.criu_link and old.criu_copy and old.criu_link_target == old.criu_copy
            and os.path.islink(old.criu_link) and os.readlink(old.criu_link) == old.criu_copy
            and os.path.isfile(old.criu_copy)):
        return True, None
    if criu_on_path(path_env).usable and not _ours_elsewhere(old, path_env):
        return False, None
    src = _source_criu(explicit)
    hook_bundle.criu_libraries(src)
    return False, src


def _ours_elsewhere(old: Record | None, path_env: str) -> bool:
    """Whether the criu PATH finds first is a link an earlier gpusnap made into some other tree (what
    installs before the copy did): then it is replaced by a copy."""
    first = criu_on_path(path_env).path
    return bool(old and old.criu_link and first == old.criu_link and old.criu_link_target != old.criu_copy)


def install(runtimes: list[Runtime], layout: Layout = Layout(), criu: str | None = None,
            path_env: str | None = None) -> InstallReport:
    """Install for RUNTIMES (idempotent). On any failure everything this run changed is put back."""
    require_root()
    path_env = os.environ.get("PATH", "") if path_env is None else path_env
    changed: list[str] = []
    warnings: list[str] = []
    undo: list[Callable[[], Any]] = []
    if cuda_plugins():
        warnings.append(f"a CRIU cuda plugin is installed ({', '.join(cuda_plugins())}): it checkpoints GPU "
                        f"processes too; keep only one of the plugin and this hook")
    try:
        with pinned(layout.lib_dir, create=True) as lib:
            if lib.created:
                undo.append(lambda: remove_if_empty(layout.lib_dir))
            old = _load_record(lib)
            keep_criu, criu_src = _criu_plan(old, criu, path_env)
            python = hook_bundle.interpreter()
            srcs = hook_bundle.sources()
            sig = hook_bundle.signature(srcs)
            if not (old and old.python_signature == sig and os.path.isdir(layout.python_dir)
                    and not os.path.islink(layout.python_dir)):
                had = os.path.lexists(layout.python_dir)
                hook_bundle.copy_tree(srcs, layout.python_dir)
                if not had:
                    undo.append(lambda: hook_bundle.remove_tree(layout.python_dir))
                changed.append(layout.python_dir)
            script, before_script = hook_script(layout, python), lib.read(HOOK_NAME)
            if before_script != script:
                lib.write(HOOK_NAME, script, 0o755)
                undo.append(lambda: _put_back(layout.lib_dir, HOOK_NAME, before_script))
                changed.append(layout.hook_path)
            _check_hook_runs(layout.hook_path)
            link = target = copy = source = None
            created_libexec = bool(old and old.created_libexec_dir)
            created_sbin = bool(old and old.created_sbin_dir)
            if keep_criu and old:
                link, target, copy, source = old.criu_link, old.criu_link_target, old.criu_copy, old.criu_source
            elif criu_src:
                if old and old.criu_link and _remove_link(old):   # an older install's link into a tree
                    changed.append(old.criu_link)
                copy, made_dir = _copy_criu(layout, criu_src, changed, undo)
                created_libexec = created_libexec or made_dir
                source = criu_src
                link, target, made_sbin = _link_criu(layout, copy, path_env, warnings)
                created_sbin = created_sbin or made_sbin
                undo.append(lambda: _remove_link(Record("", (), (), link, target)))
                if made_sbin:
                    undo.append(lambda: remove_if_empty(layout.sbin_dir))
                changed.append(link)
            configs = {c.path: c for c in (old.configs if old else ())}
            with pinned(layout.config_dir, create=True) as cfg:
                if cfg.created:
                    undo.append(lambda: remove_if_empty(layout.config_dir))
                for name in sorted({CONFIG_FILE[r] for r in runtimes}):
                    path = os.path.join(cfg.path, name)
                    before = cfg.read(name)
                    try:
                        added = config_block.add(before or b"", layout.hook_path)
                    except config_block.BadHookPath as e:
                        raise HookInstallError(str(e)) from None
                    if added.changed:
                        cfg.write(name, added.data, 0o644)
                        undo.append(functools.partial(_put_back, layout.config_dir, name, before))
                        changed.append(path)
                    if path not in configs:
                        configs[path] = ConfigRecord(path, before is None, cfg.created, added.added_newline)
            all_runtimes = sorted({*(old.runtimes if old else ()), *(r.value for r in runtimes)})
            rec = Record(layout.hook_path, tuple(all_runtimes), tuple(configs.values()), link, target,
                         old.created_lib_dir if old else lib.created, layout.python_dir, sig, python, copy,
                         source, created_libexec, created_sbin)
            if old != rec:
                lib.write(RECORD_NAME, rec.to_json(), 0o644)
    except BundleError as e:
        _undo(undo)
        raise HookInstallError(str(e)) from None
    except BaseException:
        _undo(undo)
        raise
    return InstallReport(layout.hook_path, tuple(configs), tuple(changed), criu_on_path(path_env).describe(),
                         tuple(warnings))


def _undo(steps: list[Callable[[], Any]]) -> None:
    for step in reversed(steps):
        try:
            step()
        except (OSError, GpusnapError):
            pass


def _copy_criu(layout: Layout, src: str, changed: list[str], undo: list[Callable[[], Any]]) -> tuple[str, bool]:
    """SRC copied to LIBEXEC_DIR/criu; (the copy, whether the directory was made now)."""
    with pinned(layout.libexec_dir, create=True) as d:
        if d.created:
            undo.append(lambda: remove_if_empty(layout.libexec_dir))
        existed = d.lstat(CRIU_NAME) is not None
        if hook_bundle.copy_file(src, layout.libexec_dir, CRIU_NAME):
            changed.append(layout.criu_copy)
            if not existed:
                undo.append(lambda: _put_back(layout.libexec_dir, CRIU_NAME, None))
        return layout.criu_copy, d.created


def _put_back(directory: str, name: str, data: bytes | None) -> None:
    """NAME in DIRECTORY as it was: DATA, or absent when DATA is None."""
    with pinned(directory) as d:
        if data is None:
            d.unlink(name)
        else:
            d.write(name, data)


def _link_criu(layout: Layout, target: str, path_env: str, warnings: list[str]) -> tuple[str, str, bool]:
    """SBIN_DIR/criu -> TARGET; (the link, TARGET, whether SBIN_DIR was made now)."""
    link = os.path.join(layout.sbin_dir, "criu")
    with pinned(layout.sbin_dir, create=True) as sbin:
        if sbin.lstat("criu") is not None:
            raise HookInstallError(f"{link} exists and was not made by gpusnap ({criu_on_path(path_env).describe()} "
                                   f"is first on PATH); replace it with CRIU >= {MIN_MAJOR} yourself, or put one "
                                   f"earlier on PATH")
        sbin.symlink("criu", target)
        made = sbin.created
    now = criu_on_path(path_env)
    if not now.usable:
        warnings.append(f"{link} -> {target} is not what PATH finds first ({now.describe()}); put "
                        f"{layout.sbin_dir} before it on PATH for runc and Podman")
    return link, target, made


def _remove_config(c: ConfigRecord) -> list[str]:
    d, name = os.path.split(c.path)
    done = []
    try:
        with pinned(d) as cfg:
            data = cfg.read(name)
            if data is not None:
                new = config_block.remove(data, c.added_newline)
                if c.created_file and not new.strip():
                    cfg.unlink(name)
                    done.append(f"removed {c.path}")
                elif new != data:
                    cfg.write(name, new)
                    done.append(f"restored {c.path}")
    except PinnedDirError:
        return done
    if c.created_dir and remove_if_empty(d):
        done.append(f"removed {d}")
    return done


def _remove_link(rec: Record) -> list[str]:
    if not rec.criu_link:
        return []
    d, name = os.path.split(rec.criu_link)
    try:
        with pinned(d) as sbin:
            if sbin.readlink(name) == rec.criu_link_target and sbin.unlink(name):
                return [f"removed {rec.criu_link}"]
    except PinnedDirError:
        pass
    return []


def uninstall(layout: Layout = Layout(), runtimes: list[Runtime] | None = None, criu: str | None = None) -> list[str]:
    """Remove what install made for RUNTIMES (default: all); returns what was done ("removed PATH",
    "restored PATH", "kept PATH ..."; [] if nothing was installed). While another installed runtime
    still reads a config, the block there, the hook, its code and CRIU stay. CRIU: the CRIU the
    install was made with, if given: refused (nothing removed) when the record names another."""
    require_root()
    if not os.path.lexists(layout.lib_dir):
        return []
    with pinned(layout.lib_dir) as lib:
        rec = _load_record(lib)
        if rec is None:
            return []
        if criu is not None and rec.criu_source and os.path.realpath(criu) != rec.criu_source:
            raise HookInstallError(f"the hook was installed with CRIU {rec.criu_source}, not {os.path.realpath(criu)}; "
                                   f"nothing removed")
        drop = {r.value for r in runtimes} if runtimes is not None else set(rec.runtimes)
        remaining = tuple(r for r in rec.runtimes if r not in drop)
        if remaining:
            still_read = {CONFIG_FILE[Runtime(r)] for r in remaining}
            done: list[str] = []
            keep = []
            for c in rec.configs:
                if os.path.basename(c.path) in still_read:
                    keep.append(c)
                    done.append(f"kept {c.path} (read by {', '.join(remaining)} too)")
                else:
                    done += _remove_config(c)
            lib.write(RECORD_NAME, dataclasses.replace(rec, runtimes=remaining, configs=tuple(keep)).to_json())
            return [f"removed runtime {r}" for r in sorted(drop & set(rec.runtimes))] + done
        done = [p for c in rec.configs for p in _remove_config(c)] + _remove_link(rec)
        if rec.created_sbin_dir and rec.criu_link and remove_if_empty(os.path.dirname(rec.criu_link)):
            done.append(f"removed {os.path.dirname(rec.criu_link)}")
        if rec.criu_copy and rec.criu_copy == layout.criu_copy and rec.criu_link_target == rec.criu_copy:
            with pinned(layout.libexec_dir) as d:
                if d.unlink(CRIU_NAME):
                    done.append(f"removed {rec.criu_copy}")
            if rec.created_libexec_dir and remove_if_empty(layout.libexec_dir):
                done.append(f"removed {layout.libexec_dir}")
        if rec.python_dir == layout.python_dir and hook_bundle.remove_tree(layout.python_dir):
            done.append(f"removed {layout.python_dir}")
        if lib.lstat(HOOK_NAME) is not None and lib.unlink(HOOK_NAME):
            done.append(f"removed {rec.hook}")
        lib.unlink(RECORD_NAME)
    if rec.created_lib_dir and remove_if_empty(layout.lib_dir):
        done.append(f"removed {layout.lib_dir}")
    return done


# --- status ------------------------------------------------------------------------------------

def status(layout: Layout = Layout(), path_env: str | None = None) -> dict[str, Any]:
    """What is installed where, which criu each runtime uses, and anything that would break a checkpoint."""
    path_env = os.environ.get("PATH", "") if path_env is None else path_env
    first = criu_on_path(path_env)
    hook = layout.hook_path
    hook_ok = os.path.isfile(hook) and os.access(hook, os.X_OK)
    rec = None
    problems: list[str] = []
    try:
        with pinned(layout.lib_dir) as lib:
            rec = _load_record(lib)
    except (PinnedDirError, HookInstallError) as e:
        if not isinstance(e, PinnedDirError) or "no such directory" not in str(e):
            problems.append(str(e))
    configs: list[dict[str, Any]] = []
    for name in sorted({*CONFIG_FILE.values(), "default.conf"}):
        path = os.path.join(layout.config_dir, name)
        try:
            with pinned(layout.config_dir) as cfg:
                data = cfg.read(name)
        except PinnedDirError as e:
            data = None
            if "no such directory" not in str(e):
                problems.append(str(e))
        scripts = config_block.action_scripts(data or b"")
        for p, _ in scripts:
            if not (os.path.isfile(p) and os.access(p, os.X_OK)):
                problems.append(f"{path}: action-script {p} does not exist or is not executable; every "
                                f"checkpoint that reads this file fails (criu: type NOTIFY errno 0)")
        configs.append({"path": path, "exists": data is not None,
                        "read_by": [r.value for r in Runtime if CONFIG_FILE[r] == name] if name != "default.conf"
                        else ["every plain criu command line", "runc's CRIU too"],
                        "action_scripts": [{"path": p, "gpusnap": ours} for p, ours in scripts]})
    installed = hook_ok and any(s["gpusnap"] and s["path"] == hook for c in configs for s in c["action_scripts"])
    if rec and rec.python_dir and not os.path.isdir(rec.python_dir):
        problems.append(f"the hook's code copy {rec.python_dir} is missing: run `gpusnap hook install` again")
    if rec and rec.interpreter and not os.access(rec.interpreter, os.X_OK):
        problems.append(f"the hook's Python {rec.interpreter} is missing: run `gpusnap hook install` again")
    runtimes = {}
    for r in Runtime:
        need = PODMAN_MIN if r is Runtime.PODMAN else (MIN_MAJOR, 0, 0)
        ok = first.version is not None and first.version >= need and first.usable
        runtimes[r.value] = {"config": os.path.join(layout.config_dir, CONFIG_FILE[r]), "criu": first.path,
                             "criu_version": ".".join(map(str, first.version)) if first.version else None,
                             "criu_ok": ok}
    if not first.usable:
        problems.append(f"runc and Podman run the first criu on PATH: {first.describe()}; CRIU >= {MIN_MAJOR} "
                        f"is needed (`gpusnap hook install` copies and links one)")
    plugins = cuda_plugins()
    if plugins and installed:
        problems.append(f"both a CRIU cuda plugin ({', '.join(plugins)}) and gpusnap's hook handle GPUs; keep one")
    return {"installed": installed, "hook": hook, "hook_executable": hook_ok,
            "record": asdict(rec) if rec else None, "configs": configs, "runtimes": runtimes,
            "criu_on_path": first.describe(), "criu_for_gpusnap": find_criu(),
            "cuda_plugins": plugins, "problems": problems}
