"""`gpusnap runsc run|checkpoint|restore|delete`: gVisor sandboxes through the store."""
from __future__ import annotations

import os
from typing import Any

import click

from storage.api import UnavailableError
from storage.api import LOGS, path_in
from cli.progress import Progress

from sandbox.ops import journal
from sandbox.host import netns as nets
from sandbox.host.interrupts import undo_on_signals
from sandbox.runsc import snapshot as rs
from sandbox.runsc.records import check_id
from sandbox.runsc.snapshot import check_bundle
from cli.common import emit, human, json_option, one_line_errors, open_store, tag_option


def runsc_arg_option(what: str) -> Any:
    """--runsc-arg, with help that says truly what the command does with the flags."""
    return click.option("--runsc-arg", "runsc_args", multiple=True, metavar="ARG",
                        help=f"A runsc global flag (repeatable), e.g. --runsc-arg=--root=/run/mine; {what}")


RUN_FLAGS = ("passed to `runsc run`. Give the same ones (at least --root) to checkpoint and delete, which "
             "find the sandbox through them.")
CHECKPOINT_FLAGS = "recorded in the snapshot, and used by restore unless restore is given its own."
RESTORE_FLAGS = "used instead of the ones recorded in the snapshot."
DELETE_FLAGS = "used to find the sandbox (the ones it was started with, at least --root)."


def parse_gpus(spec: str | None, dev_root: str = "/dev") -> list[int]:
    """'all' -> every /dev/nvidiaN here (none: UnavailableError, exit 4); '0,1' -> [0, 1]; None -> []."""
    if not spec:
        return []
    if spec == "all":
        found = sorted(int(n[6:]) for n in os.listdir(dev_root) if n.startswith("nvidia") and n[6:].isdigit())
        if not found:
            raise UnavailableError("--gpus all: no NVIDIA GPU here (no /dev/nvidiaN device)")
        return found
    try:
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise click.UsageError(f"--gpus {spec!r}: expected 'all' or GPU indices like 0,1") from None


@click.group()
def runsc() -> None:
    """Run gVisor sandboxes and checkpoint/restore them through the store."""


@runsc.command("run")
@click.argument("container")
@click.option("--bundle", required=True, help="OCI bundle directory (config.json).")
@click.option("--net-subnet", default=None, metavar="CIDR",
              help="Give the sandbox its own network namespace with a veth pair in CIDR (e.g. 10.77.0.0/24).")
@click.option("--output", default=None, help="File for the sandbox's stdout/stderr (default: the store's logs/).")
@click.option("--gpus", default=None, metavar="LIST",
              help="GPUs for the sandbox: 'all' or indices like 0,1. Adds the NVIDIA devices to the bundle and "
                   "runsc's nvproxy flags (refused where the installed runsc has no nvproxy), and bind-mounts gpusnap's "
                   "GPU agent (its code, read-only) inside, so that checkpoint can handle the GPU state. The "
                   "store is never mounted in the sandbox: the agent hands the GPU memory to gpusnap over a "
                   "pipe, and gpusnap writes the store.")
@click.option("--gpu-agent", is_flag=True,
              help="Bind-mount the GPU agent (read-only; the store is never mounted) without adding devices (GPUs "
                   "given to the sandbox by other means, e.g. CDI); checkpoint then runs the agent.")
@click.option("--nvproxy-driver-version", default=None, metavar="VER",
              help="Pin nvproxy's driver ABI (runsc --nvproxy-driver-version), where runsc has the flag.")
@runsc_arg_option(RUN_FLAGS)
@click.pass_context
@one_line_errors
def runsc_run(ctx: click.Context, container: str, bundle: str, net_subnet: str | None, output: str | None,
              gpus: str | None, gpu_agent: bool, nvproxy_driver_version: str | None,
              runsc_args: tuple[str, ...]) -> None:
    """Start sandbox CONTAINER from BUNDLE (detached)."""
    check_id(container)
    check_bundle(bundle)
    st = open_store(ctx)
    net = nets.NetConfig.for_sandbox(f"gpusnap-{container}", net_subnet) if net_subnet else None
    out = output or path_in(st.path, LOGS, f"runsc-{container}.out")
    os.makedirs(os.path.dirname(out), mode=0o700, exist_ok=True)
    journal.require_clean(st.path)
    with undo_on_signals():
        rs.run(container, bundle, runsc_args, out, net, gpus=parse_gpus(gpus), gpu_agent=gpu_agent,
               driver_version=nvproxy_driver_version)
    click.echo(f"{container}: running" + (f" at {net.address} (netns {net.name})" if net else "")
               + f"; output goes to {os.path.abspath(out)}")


@runsc.command("checkpoint")
@click.argument("container")
@click.argument("name")
@click.option("--leave-running", is_flag=True, help="Keep the sandbox running after the checkpoint.")
@click.option("--replace", is_flag=True, help="Replace an existing snapshot of the same name (the old one "
              "stays until the new one is committed).")
@runsc_arg_option(CHECKPOINT_FLAGS)
@tag_option
@json_option
@click.pass_context
@one_line_errors
def runsc_checkpoint(ctx: click.Context, container: str, name: str, leave_running: bool, replace: bool,
                     runsc_args: tuple[str, ...], tags: tuple[str, ...], as_json: bool) -> None:
    """Checkpoint sandbox CONTAINER into snapshot NAME; on failure it keeps running."""
    st = open_store(ctx)
    with undo_on_signals(), Progress(f"runsc checkpoint {container}", ctx.obj["progress"]) as prog:
        r = rs.checkpoint(st, container, name, runsc_args, leave_running=leave_running, replace=replace, progress=prog,
                          tags=tags)
    emit(as_json, r.as_dict(), f"{name}: {human(r.raw_bytes)} of images, {human(r.new_bytes)} written, "
         f"{human(r.dedup_bytes)} deduplicated ({', '.join(f'{k} {v:.2f} s' for k, v in r.seconds.items())})")


@runsc.command("restore")
@click.argument("name")
@click.argument("container")
@click.option("--bundle", required=True, help="OCI bundle directory to restore with.")
@click.option("--output", default=None, help="File for the sandbox's stdout/stderr (default: the store's "
              "logs/runsc-CONTAINER.out; restore says where, and where the checkpointed sandbox wrote).")
@runsc_arg_option(RESTORE_FLAGS)
@json_option
@click.pass_context
@one_line_errors
def runsc_restore(ctx: click.Context, name: str, container: str, bundle: str, output: str | None,
                  runsc_args: tuple[str, ...], as_json: bool) -> None:
    """Restore snapshot NAME as a new sandbox CONTAINER (network recreated at the same address)."""
    check_id(container)
    st = open_store(ctx, create=False)
    out = output or path_in(st.path, LOGS, f"runsc-{container}.out")
    os.makedirs(os.path.dirname(out), mode=0o700, exist_ok=True)
    with undo_on_signals(), Progress(f"runsc restore {name}", ctx.obj["progress"]) as prog:
        r = rs.restore(st, name, container, bundle, runsc_args=runsc_args or None, output=out, progress=prog)
    moved = (f"; the checkpointed sandbox wrote to {r.recorded_output} (--output to continue there)"
             if r.recorded_output and r.recorded_output != r.output and r.recorded_output.isprintable() else "")
    emit(as_json, r.as_dict(), f"{container}: restored from {name}" + (f" at {r.address}" if r.address else "")
         + f"; output goes to {r.output}{moved}")


@runsc.command("delete")
@click.argument("container")
@runsc_arg_option(DELETE_FLAGS)
@click.pass_context
@one_line_errors
def runsc_delete(ctx: click.Context, container: str, runsc_args: tuple[str, ...]) -> None:
    """Delete sandbox CONTAINER and the network gpusnap made for it."""
    rs.delete(container, runsc_args)


COMMANDS = [runsc]
