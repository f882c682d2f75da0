"""The CRIU options a user may ask for through `gpusnap criu dump/restore`, each checked here: gpusnap
runs CRIU as root, so no free string reaches its command line, only values of the shapes CRIU
documents (`criu --help`): sizes, absolute directories, and `--external` resources by kind.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from storage.api import GpusnapError, EXIT_USAGE


class CriuOptionError(GpusnapError):
    """A CRIU option's value is not of the shape CRIU documents (exit 2)."""

    exit_code = EXIT_USAGE


_SIZE = re.compile(r"([0-9]{1,15})\s*([KMGT]?)(i?B)?", re.IGNORECASE)
MAX_GHOST = 1 << 40
MANAGE_CGROUPS = ("none", "props", "soft", "full", "strict", "ignore")  # CRIU --manage-cgroups MODE
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.@+=-]{0,63}"          # a device NAME, a net/pid KEY
_COOKIE = r"[A-Za-z0-9_./@+=-]{1,255}"                  # a mount's cookie (runc uses the mount point)
_IF = r"[A-Za-z0-9_.-]{1,15}"                           # an interface name (IFNAMSIZ)
# kind -> (the grammar on dump, on restore); PATH marks where an absolute path goes
_EXTERNAL: dict[str, tuple[str | None, str | None]] = {
    "tty": (r"tty\[[0-9]{1,10}:[0-9]{1,10}\]", None),
    "file": (r"file\[[0-9]{1,10}:[0-9]{1,20}\]", None),
    "unix": (r"unix\[[0-9]{1,20}\]", None),
    "net": (rf"net\[[0-9]{{1,20}}\]:{_NAME}", None),
    "pid": (rf"pid\[[0-9]{{1,20}}\]:{_NAME}", None),
    "dev": (rf"dev\[[0-9]{{1,10}}/[0-9]{{1,10}}\]:{_NAME}", rf"dev\[{_NAME}\]:(?P<path>/.*)"),
    # mnt[]{:FLAGS} (external mounts found automatically) on both: CRIU takes it on restore too
    "mnt": (rf"mnt\[(?P<path>/.*)\]:{_COOKIE}|mnt\[\](?::[a-z]{{1,8}})?",
            rf"mnt\[{_COOKIE}\]:(?P<path>/.*)|mnt\[\](?::[a-z]{{1,8}})?"),
    "veth": (None, rf"veth\[{_IF}\]:{_IF}(?:@{_IF})?"),
    "macvlan": (None, rf"macvlan\[{_IF}\]:{_IF}"),
    "netdev": (None, rf"netdev\[{_IF}\]:{_IF}"),
}


def ghost_limit(text: str) -> int:
    """--ghost-limit SIZE: bytes, or with K, M, G, T (powers of 1024; an optional iB/B), up to 1 TiB."""
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise CriuOptionError(f"--ghost-limit {text!r}: expected a size such as 1048576, 64K, 16M or 1G")
    n = int(m.group(1)) << (10 * "KMGT".find(m.group(2).upper()) + 10 if m.group(2) else 0)
    if n > MAX_GHOST:
        raise CriuOptionError(f"--ghost-limit {text!r}: at most 1T")
    return n


def plain_path(text: str, what: str, *, directory: bool = True) -> str:
    """TEXT as an absolute path without '.', '..', doubled slashes, or control characters (what CRIU
    will resolve is what the user named); with DIRECTORY, an existing directory reached without a
    symbolic link. (--irmap-scan-path is only a hint where CRIU looks for watched names: any plain
    absolute path, as CRIU takes it.)"""
    if (not text.startswith("/") or any(ord(c) < 32 or c == "\x7f" for c in text) or len(text) > 4095
            or os.path.normpath(text) != text.rstrip("/") and text != "/"):
        raise CriuOptionError(f"{what} {text!r}: expected an absolute path without '.', '..' or '//'")
    if directory:
        if not os.path.isdir(text):
            raise CriuOptionError(f"{what} {text!r}: no such directory")
        if os.path.realpath(text) != os.path.normpath(text):
            raise CriuOptionError(f"{what} {text!r}: reached through a symbolic link "
                                  f"({os.path.realpath(text)}): name the directory itself")
    return text


def external(text: str, on: str) -> str:
    """One --external RES for ON ('dump' or 'restore'), of the shape `criu --help` documents for its
    KIND: tty[rdev:dev], file[mnt_id:inode], dev[major/minor]:NAME, unix[ino], mnt[MOUNTPOINT]:COOKIE,
    mnt[]{:FLAGS}, net[ino]:KEY, pid[ino]:KEY on dump; dev[NAME]:DEVPATH, veth[IFNAME]:OUTNAME{@BRIDGE},
    macvlan[IFNAME]:OUTNAME, mnt[COOKIE]:ROOT, netdev[IFNAME]:ORIGNAME on restore. Paths are absolute
    and plain (plain_path; a restore's mount ROOT an existing directory or file)."""
    kind = text.split("[", 1)[0]
    if kind not in _EXTERNAL:
        raise CriuOptionError(f"--external {text!r}: unknown kind {kind!r} (expected one of "
                              f"{', '.join(sorted(_EXTERNAL))}, as KIND[ID]:VALUE)")
    grammar = _EXTERNAL[kind][0 if on == "dump" else 1]
    if grammar is None:
        raise CriuOptionError(f"--external {text!r}: {kind}[...] is a {'restore' if on == 'dump' else 'dump'} "
                              f"resource, not one of `criu {on}`")
    m = re.fullmatch(grammar, text)
    if not m:
        raise CriuOptionError(f"--external {text!r}: not of the shape CRIU documents for {kind} on {on} "
                              f"(see `gpusnap criu {on} --help`)")
    path = m.groupdict().get("path")
    if path is not None:
        plain_path(path, f"--external {text!r}:", directory=False)
        if on == "restore" and not os.path.exists(path):
            raise CriuOptionError(f"--external {text!r}: {path} does not exist")
    return text


@dataclass(frozen=True)
class RestoreOptions:
    """What a user may add to `criu restore` (checked): --tcp-close, --root, --external, --network-lock,
    --manage-cgroups."""

    tcp_close: bool = False
    root: str | None = None
    external: tuple[str, ...] = ()
    network_lock: str | None = None
    manage_cgroups: str | None = None

    def argv(self) -> tuple[str, ...]:
        a: list[str] = ["--tcp-close"] if self.tcp_close else []
        if self.root:
            a += ["--root", self.root]
        for e in self.external:
            a += ["--external", e]
        if self.network_lock:
            a += ["--network-lock", self.network_lock]
        if self.manage_cgroups:
            a += [f"--manage-cgroups={self.manage_cgroups}"]
        return tuple(a)
