"""The `gpusnap` command line, composed here from one module per command group.

Exit codes: 0 success; 1 the operation failed (the one-line reason is on stderr; under --json also
{"error", "exit_code"} on stdout); 2 usage error; 3 damage found; 4 something this command needs is
missing on this machine; 5 an interrupted operation must be finished first (`gpusnap recover`).
GPUSNAP_DEBUG=1 shows the traceback instead of the one line.
"""
from __future__ import annotations

import click

from storage.store import default_store_path

from sandbox.cli import criu_cmd, gpu_cmd, pool_cmd, remote_cmd, runsc_cmd, store_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--store", "store_path", envvar="GPUSNAP_STORE", default=None, metavar="DIR",
              help="Snapshot store directory (env GPUSNAP_STORE; default /var/lib/gpusnap as root, "
                   "else $XDG_DATA_HOME/gpusnap). Created 0700 on first use.")
@click.option("--progress/--no-progress", default=None,
              help="Show a progress bar (default: only when stderr is a terminal).")
@click.pass_context
def main(ctx: click.Context, store_path: str | None, progress: bool | None) -> None:
    """gpusnap: fast, safe snapshots of GPU processes and sandboxes.

    Snapshots live in a content-addressed store: chunks are deduplicated across snapshots,
    compressed where it pays, checksummed, and committed atomically.
    """
    ctx.obj = {"store": store_path or default_store_path(), "progress": progress}




for _module in (store_cmd, gpu_cmd, pool_cmd, criu_cmd, runsc_cmd, remote_cmd):
    for _command in _module.COMMANDS:
        main.add_command(_command)
