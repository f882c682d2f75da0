"""`gpusnap import podman|runc` and `gpusnap export`: runtime checkpoints in and out of the store."""
from __future__ import annotations

import click

from cli.progress import Progress

from cli.common import emit, human, json_option, one_line_errors, open_store
from sandbox.containers.checkpoint_archive import Moved, export, import_podman, import_runc


def _report(as_json: bool, r: Moved, verb: str) -> None:
    emit(as_json, r.as_dict(), f"{r.name} ({r.kind.value}) {verb} {r.path}: {human(r.raw_bytes)} in "
         f"{r.seconds:.2f} s" + (f", {human(r.new_bytes)} new in the store" if verb == "from" else ""))


@click.group("import")
def import_group() -> None:
    """Store a container runtime's checkpoint (chunked and deduplicated) as a snapshot."""


@import_group.command("podman")
@click.argument("archive")
@click.argument("name")
@click.option("--replace", is_flag=True, help="Replace an existing snapshot of the same name.")
@json_option
@click.pass_context
@one_line_errors
def import_podman_cmd(ctx: click.Context, archive: str, name: str, replace: bool, as_json: bool) -> None:
    """Store ARCHIVE, made by `podman container checkpoint --export ARCHIVE`, as snapshot NAME."""
    with Progress(f"import {name}", ctx.obj["progress"]) as prog:
        r = import_podman(open_store(ctx), archive, name, replace=replace, progress=prog)
    _report(as_json, r, "from")


@import_group.command("runc")
@click.argument("image_dir")
@click.argument("name")
@click.option("--replace", is_flag=True, help="Replace an existing snapshot of the same name.")
@json_option
@click.pass_context
@one_line_errors
def import_runc_cmd(ctx: click.Context, image_dir: str, name: str, replace: bool, as_json: bool) -> None:
    """Store IMAGE_DIR, made by `runc checkpoint --image-path IMAGE_DIR`, as snapshot NAME."""
    with Progress(f"import {name}", ctx.obj["progress"]) as prog:
        r = import_runc(open_store(ctx), image_dir, name, replace=replace, progress=prog)
    _report(as_json, r, "from")


@click.command("export")
@click.argument("name")
@click.argument("dest")
@json_option
@click.pass_context
@one_line_errors
def export_cmd(ctx: click.Context, name: str, dest: str, as_json: bool) -> None:
    """Write runtime checkpoint NAME to DEST (new): a Podman archive for `podman container restore
    --import DEST`, or a runc image directory for `runc restore --image-path DEST`."""
    with Progress(f"export {name}", ctx.obj["progress"]) as prog:
        r = export(open_store(ctx, create=False), name, dest, progress=prog)
    _report(as_json, r, "->")


COMMANDS = [import_group, export_cmd]
