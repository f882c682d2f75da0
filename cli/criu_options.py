"""The CRIU options `gpusnap criu dump` and `criu restore` pass on, each a checked click option
(sandbox.criu.criu_options says which shapes are accepted): added by one decorator per command, and
handed to the command as one keyword (`criu_opts`: a dict of DumpOptions fields, or a RestoreOptions)."""
from __future__ import annotations

import functools
from typing import Any, Callable

import click

from sandbox.criu import criu_options as co
from sandbox.criu.netlock import METHODS

_LOCK_HELP = ("How CRIU holds the packets of established connections (--tcp-established) while the tree is "
              "dumped and restored: iptables (CRIU's default: needs iptables-restore), nftables (the library "
              "linked into CRIU), or skip (no lock: only where you know the peers send nothing meanwhile, "
              "else a peer's packet can reset a connection). A restore uses the dump's unless given.")
_EXTERNAL_HELP = ("An external resource, as `criu --help` documents it (repeatable): on dump tty[RDEV:DEV], "
                  "file[MNT_ID:INODE], dev[MAJOR/MINOR]:NAME, unix[INODE], mnt[MOUNTPOINT]:COOKIE, mnt[], "
                  "net[INODE]:KEY, pid[INODE]:KEY; on restore dev[NAME]:DEVPATH, veth[IFNAME]:OUTNAME[@BRIDGE], "
                  "macvlan[IFNAME]:OUTNAME, mnt[COOKIE]:ROOT, netdev[IFNAME]:ORIGNAME. Paths absolute.")
_CGROUPS_HELP = ("How CRIU dumps and restores the tree's cgroups (CRIU --manage-cgroups MODE): none, props, soft "
                 "(CRIU's default), full, strict or ignore.")
_ROOT_HELP = ("The root directory of the tree's mount namespace (CRIU --root): needed for a process in its own "
              "mount namespace, with --external mnt[...] for the mounts that come from outside it.")


def _checked(fn: Callable[..., Any], what: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def cb(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        try:
            if value is None or value == ():
                return value
            return tuple(fn(v) for v in value) if isinstance(value, tuple) else fn(value)
        except co.CriuOptionError as e:
            raise click.BadParameter(str(e).split(": ", 1)[-1], param_hint=what) from None
    return cb


def dump_criu_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The dump's CRIU options; the command gets them as `criu_opts` (DumpOptions fields)."""
    names = ("network_lock", "ghost_limit", "no_ghost_fiemap", "force_irmap", "irmap_scan_paths", "root", "external",
             "manage_cgroups", "tcp_close")

    @functools.wraps(f)
    def wrapped(*args: Any, **kw: Any) -> Any:
        kw["criu_opts"] = {n: kw.pop(n) for n in names}
        kw["criu_opts"]["irmap_scan_paths"] = tuple(kw["criu_opts"]["irmap_scan_paths"])
        kw["criu_opts"]["external"] = tuple(kw["criu_opts"]["external"])
        return f(*args, **kw)

    for opt in reversed([
        click.option("--network-lock", type=click.Choice(METHODS), default=None, help=_LOCK_HELP),
        click.option("--ghost-limit", default=None, metavar="SIZE", callback=_checked(co.ghost_limit, "--ghost-limit"),
                     help="The largest deleted-but-open file whose contents CRIU keeps in the images (CRIU "
                          "--ghost-limit; default 1M): bytes or 64K, 16M, 1G."),
        click.option("--no-ghost-fiemap", is_flag=True, help="Dump deleted files' contents without fiemap "
                     "(CRIU --no-ghost-fiemap: for file systems whose fiemap misleads)."),
        click.option("--force-irmap", is_flag=True, help="Resolve the paths of inotify/fanotify watches even "
                     "where the kernel could give handles (CRIU --force-irmap)."),
        click.option("--irmap-scan-path", "irmap_scan_paths", multiple=True, metavar="DIR",
                     callback=_checked(lambda d: co.plain_path(d, "--irmap-scan-path", directory=False),
                                       "--irmap-scan-path"),
                     help="A directory CRIU scans to name inotify watches (CRIU --irmap-scan-path; repeatable)."),
        click.option("--root", default=None, metavar="DIR", callback=_checked(lambda d: co.plain_path(d, "--root"), "--root"),
                     help=_ROOT_HELP),
        click.option("--external", multiple=True, metavar="KIND[ID]:VALUE",
                     callback=_checked(lambda e: co.external(e, "dump"), "--external"), help=_EXTERNAL_HELP),
        click.option("--manage-cgroups", type=click.Choice(co.MANAGE_CGROUPS), default=None, help=_CGROUPS_HELP),
        click.option("--tcp-close", is_flag=True, help="Neither dump nor lock established TCP connections (CRIU "
                     "--tcp-close): the restore brings them back closed."),
    ]):
        wrapped = opt(wrapped)
    return wrapped


def restore_criu_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The restore's CRIU options; the command gets them as `criu_opts` (a RestoreOptions)."""

    @functools.wraps(f)
    def wrapped(*args: Any, **kw: Any) -> Any:
        kw["criu_opts"] = co.RestoreOptions(tcp_close=kw.pop("tcp_close"), root=kw.pop("root"),
                                            external=tuple(kw.pop("external")), network_lock=kw.pop("network_lock"),
                                            manage_cgroups=kw.pop("manage_cgroups"))
        return f(*args, **kw)

    for opt in reversed([
        click.option("--tcp-close", is_flag=True, help="Restore the dump's established TCP connections closed "
                     "(CRIU --tcp-close): the process sees each one fail, as after a network outage."),
        click.option("--network-lock", type=click.Choice(METHODS), default=None, help=_LOCK_HELP),
        click.option("--root", default=None, metavar="DIR", callback=_checked(lambda d: co.plain_path(d, "--root"), "--root"),
                     help=_ROOT_HELP),
        click.option("--external", multiple=True, metavar="KIND[ID]:VALUE",
                     callback=_checked(lambda e: co.external(e, "restore"), "--external"), help=_EXTERNAL_HELP),
        click.option("--manage-cgroups", type=click.Choice(co.MANAGE_CGROUPS), default=None, help=_CGROUPS_HELP),
    ]):
        wrapped = opt(wrapped)
    return wrapped
