"""`gpusnap hook install|status|uninstall`: make runc, Podman and CRI-O checkpoints run gpusnap's CRIU hook.

What install does (as root), each step idempotent (two installs = one):
- writes LIB_DIR/gpusnap-criu-hook, a small shell script that runs the `gpusnap-criu-hook` entry point
  with the Python and module path of this installation (CRIU execs a path; this one always exists),
  and checks that it starts;
- adds gpusnap's block (a marker comment and `action-script PATH`) to the CRIU config file the runtime's
  CRIU reads: CONFIG_DIR/runc.conf for all three (runc passes it to CRIU over RPC for every
  checkpoint/restore unless the container's `org.criu.config` annotation names another file; Podman
  and CRI-O checkpoint through runc);
- makes CRIU >= 4 the first `criu` on PATH, which is where runc and Podman look: only when the first
  one found is missing or older, by a link SBIN_DIR/criu to the CRIU gpusnap uses;
- records what it created in LIB_DIR/hook-install.json.
Uninstall removes exactly that: gpusnap's lines from the configs (a config that existed before is
byte-identical afterwards, one gpusnap created is deleted), the link it made, the script, the record.
"""
from __future__ import annotations

import enum
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from storage.errors import GpusnapError, UnavailableError

from sandbox.containers import config_block
from sandbox.containers.pinned_dir import PinnedDir, PinnedDirError, pinned, remove_if_empty
from sandbox.criu.runner import MIN_MAJOR, criu_version, cuda_plugin, find_criu

HOOK_NAME = "gpusnap-criu-hook"
RECORD_NAME = "hook-install.json"
ENTRY_POINT_DEFAULT = "criu_hooks.action_script:main"
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

    @property
    def hook_path(self) -> str:
        return os.path.join(self.lib_dir, HOOK_NAME)


@dataclass(frozen=True)
class ConfigRecord:
    path: str
    created_file: bool
    created_dir: bool
    added_newline: bool


@dataclass(frozen=True)
class Record:
    """What install created, so uninstall removes only that."""

    hook: str
    runtimes: tuple[str, ...]
    configs: tuple[ConfigRecord, ...]
    criu_link: str | None = None
    criu_link_target: str | None = None
    created_lib_dir: bool = False

    def to_json(self) -> bytes:
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Record":
        try:
            v = json.loads(data)
            configs = tuple(ConfigRecord(str(c["path"]), bool(c["created_file"]), bool(c["created_dir"]),
                                         bool(c["added_newline"])) for c in v["configs"])
            rec = cls(str(v["hook"]), tuple(str(r) for r in v["runtimes"]), configs,
                      v.get("criu_link") and str(v["criu_link"]), v.get("criu_link_target") and str(v["criu_link_target"]),
                      bool(v.get("created_lib_dir", False)))
        except (ValueError, KeyError, TypeError) as e:
            raise HookInstallError(f"{where}: not a gpusnap install record ({e}); remove gpusnap's lines by hand") from None
        if any(not os.path.isabs(p) for p in [rec.hook, *(c.path for c in rec.configs)]):
            raise HookInstallError(f"{where}: paths in the record must be absolute")
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


def require_root() -> None:
    if os.geteuid() != 0:
        raise HookInstallError("must run as root: it writes CRIU's configuration and a program CRIU runs as root")


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


def hook_script() -> bytes:
    """The shell script CRIU execs: this Python, isolated from the caller's environment (-I), with
    this installation's module path, calling the entry point."""
    module, func = _entry_point()
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        raise HookInstallError(f"the hook module {module} is not importable by {sys.executable}")
    levels = module.count(".") + (2 if os.path.basename(spec.origin) == "__init__.py" else 1)
    root = spec.origin
    for _ in range(levels):
        root = os.path.dirname(root)
    extra = list(dict.fromkeys([root, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                         if os.path.isabs(p) and os.path.isdir(p))]))
    for d in extra:
        st = os.stat(d)
        if st.st_mode & 0o022 or st.st_uid != 0:
            raise HookInstallError(f"{d} (where the hook's Python code is found) is not root-owned or is writable "
                                   f"by others; CRIU runs the hook as root: install gpusnap somewhere only root can write")
    code = (f"import sys; sys.path[:0] = {extra!r}; sys.argv[0] = {HOOK_NAME!r}; "
            f"from {module} import {func} as main; sys.exit(main())")
    return ("#!/bin/sh\n"
            f"# {HOOK_NAME}: written by `gpusnap hook install`, removed by `gpusnap hook uninstall`.\n"
            "# CRIU runs it as its action script; it runs gpusnap's hook with the Python that installed it.\n"
            f"exec {shlex.quote(os.path.abspath(sys.executable))} -I -c {shlex.quote(code)} \"$@\"\n").encode()


def _check_hook_runs(path: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRTOOLS_")}
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
    """(keep the link an earlier install made, CRIU to link now or None); raises before anything is
    written when a link is needed and no CRIU >= 4 exists."""
    if old and old.criu_link and os.path.islink(old.criu_link) and os.readlink(old.criu_link) == old.criu_link_target:
        return True, None
    if criu_on_path(path_env).usable:
        return False, None
    return False, _source_criu(explicit)


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
            keep_link, link_target = _criu_plan(old, criu, path_env)
            script, before_script = hook_script(), lib.read(HOOK_NAME)
            if before_script != script:
                lib.write(HOOK_NAME, script, 0o755)
                undo.append(lambda: _put_back(layout.lib_dir, HOOK_NAME, before_script))
                changed.append(layout.hook_path)
            _check_hook_runs(layout.hook_path)
            link = target = None
            if keep_link and old:
                link, target = old.criu_link, old.criu_link_target
            elif link_target:
                link, target = _link_criu(layout, link_target, path_env, warnings)
                undo.append(lambda: _remove_link(Record("", (), (), link, target)))
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
                         old.created_lib_dir if old else lib.created)
            if old != rec:
                lib.write(RECORD_NAME, rec.to_json(), 0o644)
    except BaseException:
        for step in reversed(undo):
            try:
                step()
            except (OSError, GpusnapError):
                pass
        raise
    return InstallReport(layout.hook_path, tuple(configs), tuple(changed), criu_on_path(path_env).describe(),
                         tuple(warnings))


def _put_back(directory: str, name: str, data: bytes | None) -> None:
    """NAME in DIRECTORY as it was: DATA, or absent when DATA is None."""
    with pinned(directory) as d:
        if data is None:
            d.unlink(name)
        else:
            d.write(name, data)


def _link_criu(layout: Layout, target: str, path_env: str, warnings: list[str]) -> tuple[str, str]:
    link = os.path.join(layout.sbin_dir, "criu")
    with pinned(layout.sbin_dir, create=True) as sbin:
        if sbin.lstat("criu") is not None:
            raise HookInstallError(f"{link} exists and was not made by gpusnap ({criu_on_path(path_env).describe()} "
                                   f"is first on PATH); replace it with CRIU >= {MIN_MAJOR} yourself, or put one "
                                   f"earlier on PATH")
        sbin.symlink("criu", target)
    now = criu_on_path(path_env)
    if not now.usable:
        warnings.append(f"{link} -> {target} is not what PATH finds first ({now.describe()}); put "
                        f"{layout.sbin_dir} before it on PATH for runc and Podman")
    return link, target


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


def uninstall(layout: Layout = Layout()) -> list[str]:
    """Remove what install made; returns what was done ("removed PATH", "restored PATH"; [] if nothing
    was installed)."""
    require_root()
    if not os.path.lexists(layout.lib_dir):
        return []
    with pinned(layout.lib_dir) as lib:
        rec = _load_record(lib)
        if rec is None:
            return []
        done = [p for c in rec.configs for p in _remove_config(c)] + _remove_link(rec)
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
    runtimes = {}
    for r in Runtime:
        need = PODMAN_MIN if r is Runtime.PODMAN else (MIN_MAJOR, 0, 0)
        ok = first.version is not None and first.version >= need and first.usable
        runtimes[r.value] = {"config": os.path.join(layout.config_dir, CONFIG_FILE[r]), "criu": first.path,
                             "criu_version": ".".join(map(str, first.version)) if first.version else None,
                             "criu_ok": ok}
    if not first.usable:
        problems.append(f"runc and Podman run the first criu on PATH: {first.describe()}; CRIU >= {MIN_MAJOR} "
                        f"is needed (`gpusnap hook install` links one)")
    plugins = cuda_plugins()
    if plugins and installed:
        problems.append(f"both a CRIU cuda plugin ({', '.join(plugins)}) and gpusnap's hook handle GPUs; keep one")
    return {"installed": installed, "hook": hook, "hook_executable": hook_ok,
            "record": asdict(rec) if rec else None, "configs": configs, "runtimes": runtimes,
            "criu_on_path": first.describe(), "criu_for_gpusnap": find_criu(),
            "cuda_plugins": plugins, "problems": problems}
