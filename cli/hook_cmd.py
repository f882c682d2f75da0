"""`gpusnap hook install|status|uninstall`: the CRIU hook for runc, Podman and CRI-O checkpoints."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

import click

from cli.common import emit, json_option, one_line_errors
from sandbox.containers.hook_install import Layout, Runtime, install, status, uninstall

RUNTIME_CHOICES = [r.value for r in Runtime] + ["all"]


def layout_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--config-dir/--lib-dir/--sbin-dir/--libexec-dir: where the hook's files go (the defaults are the
    real places)."""
    d = Layout()
    fn = click.option("--libexec-dir", default=d.libexec_dir, show_default=True, metavar="DIR",
                      help="Where the copy of CRIU goes when no CRIU >= 4 is first on PATH.")(fn)
    fn = click.option("--sbin-dir", default=d.sbin_dir, show_default=True, metavar="DIR",
                      help="Where a `criu` link (to that copy) goes when no CRIU >= 4 is first on PATH.")(fn)
    fn = click.option("--lib-dir", default=d.lib_dir, show_default=True, metavar="DIR",
                      help="Where the hook script, the copy of gpusnap's code and the install record go.")(fn)
    return click.option("--config-dir", default=d.config_dir, show_default=True, metavar="DIR",
                        help="CRIU's configuration directory.")(fn)


@click.group()
def hook() -> None:
    """Install gpusnap's CRIU hook for container runtimes (runc, Podman, CRI-O), show it, remove it."""


def runtime_option(verb: str) -> Callable[..., Any]:
    return click.option("--runtime", "runtimes", type=click.Choice(RUNTIME_CHOICES), multiple=True, default=["all"],
                        show_default=True, help=f"Runtime(s) to {verb} (repeatable).")


def chosen(runtimes: tuple[str, ...]) -> list[Runtime]:
    return list(Runtime) if "all" in runtimes else [Runtime(r) for r in runtimes]


@hook.command("install")
@runtime_option("install the hook for: their checkpoints run it")
@click.option("--criu", "criu", default=None, metavar="PATH",
              help="The CRIU >= 4 to copy and link on PATH if none is found first there (default: the one "
                   "gpusnap uses).")
@layout_options
@json_option
@one_line_errors
def hook_install(runtimes: tuple[str, ...], criu: str | None, config_dir: str, lib_dir: str, sbin_dir: str,
                 libexec_dir: str, as_json: bool) -> None:
    """Install the hook (as root; idempotent): a copy of gpusnap's code and the hook script in the
    lib dir, the `action-script` line in the CRIU config the runtime reads, and CRIU >= 4 first on
    PATH (a copy in the libexec dir, linked from the sbin dir, if none is). Nothing installed points
    into the tree or virtual env it was installed from."""
    r = install(chosen(runtimes), Layout(config_dir, lib_dir, sbin_dir, libexec_dir), criu=criu)
    for w in r.warnings:
        click.echo(f"gpusnap: warning: {w}", err=True)
    emit(as_json, asdict(r), (f"hook {r.hook} installed in {', '.join(r.configs)}" if r.changed
                              else f"hook {r.hook} already installed in {', '.join(r.configs)}")
         + f"; runc and Podman run {r.criu}")


@hook.command("status")
@layout_options
@json_option
@one_line_errors
def hook_status(config_dir: str, lib_dir: str, sbin_dir: str, libexec_dir: str, as_json: bool) -> None:
    """What is installed where, which criu each runtime runs, and what would break a checkpoint."""
    s = status(Layout(config_dir, lib_dir, sbin_dir, libexec_dir))
    lines = [f"hook            {'installed' if s['installed'] else 'not installed'} ({s['hook']})"]
    for c in s["configs"]:
        scripts = ", ".join(f"{a['path']}{' (gpusnap)' if a['gpusnap'] else ''}" for a in c["action_scripts"])
        lines.append(f"{c['path']:<15} {'missing' if not c['exists'] else (scripts or 'no action-script')}"
                     f"  [read by {', '.join(c['read_by'])}]")
    for name, r in s["runtimes"].items():
        lines.append(f"{name:<15} reads {r['config']}, runs {r['criu'] or 'no criu'} "
                     f"({r['criu_version'] or '-'}){'' if r['criu_ok'] else ' - TOO OLD OR MISSING'}")
    lines.append(f"CRIU cuda plugin {', '.join(s['cuda_plugins']) or 'none'}")
    lines += [f"problem: {p}" for p in s["problems"]]
    emit(as_json, s, "\n".join(lines))


@hook.command("uninstall")
@runtime_option("remove the hook for (the shared config block, code and CRIU go with the last one)")
@click.option("--criu", "criu", default=None, metavar="PATH",
              help="The CRIU install was given: uninstall refuses, removing nothing, if it copied another.")
@layout_options
@json_option
@one_line_errors
def hook_uninstall(runtimes: tuple[str, ...], criu: str | None, config_dir: str, lib_dir: str, sbin_dir: str,
                   libexec_dir: str, as_json: bool) -> None:
    """Remove exactly what `hook install` made, from its record (configs it edited are left as they
    were); with --runtime, only that runtime's part while others still use the rest."""
    done = uninstall(Layout(config_dir, lib_dir, sbin_dir, libexec_dir), chosen(runtimes), criu=criu)
    emit(as_json, {"undone": done}, "\n".join(done) or "nothing was installed")


COMMANDS = [hook]
