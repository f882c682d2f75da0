"""The `gpusnap` command line, composed here from one module per command group.

Exit codes: 0 success; 1 the operation failed (the one-line reason is on stderr; under --json also
{"error", "exit_code"} on stdout); 2 usage error; 3 damage found; 4 something this command needs is
missing on this machine; 5 an interrupted operation must be finished first (`gpusnap recover`).
GPUSNAP_DEBUG=1 shows the traceback instead of the one line.
"""
from __future__ import annotations

import os

# numpy's OpenBLAS starts a spinning thread per core when it is imported (measured on a 16-core
# host: ~10 busy cores for 0.1 s at every start, and again in each split-fill worker); gpusnap does
# no linear algebra with it. Set before any numpy import; the workers inherit it. A value set by the
# caller is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402 - after the setting above

from storage.api import (EXIT_DAMAGED, EXIT_FAILED, EXIT_OK, EXIT_RECOVER, EXIT_UNAVAILABLE,
                            EXIT_USAGE)

from cli.lazy import LazyGroup

# name -> (module, attribute, short help); one module per command group, imported only when used
COMMANDS: dict[str, tuple[str, str, str]] = {
    "store": ("cli.store_cmd", "store", "Store files and directories as snapshots, and manage the store."),
    "doctor": ("cli.gpu_cmd", "doctor", "What this machine can do: driver, checkpoint API, custom storage, GPUs, nvCOMP, CRIU, runsc."),
    "gpu": ("cli.gpu_cmd", "gpu", "Swap a process's GPU state out to the store and back in (model swapping)."),
    "swap": ("cli.swap_cmd", "swap", "Front several model servers sharing a GPU; swap them out and in as requests come."),
    "pool": ("cli.pool_cmd", "pool", "The memory tier: a resident pool of pinned host memory for swapping GPU state out and in."),
    "criu": ("cli.criu_cmd", "criu", "Checkpoint a process tree (CPU through CRIU 4.x, GPU through the driver) into the store."),
    "runsc": ("cli.runsc_cmd", "runsc", "Run gVisor sandboxes and checkpoint/restore them through the store."),
    "hook": ("cli.hook_cmd", "hook", "Install gpusnap's CRIU hook for container runtimes (runc, Podman, CRI-O), show it, remove it."),
    "import": ("cli.container_cmd", "import_group", "Store a container runtime's checkpoint (chunked and deduplicated) as a snapshot."),
    "export": ("cli.container_cmd", "export_cmd", "Write runtime checkpoint NAME to DEST (new): a Podman archive for `podman container restore --import DEST`, or a runc image directory for `runc..."),
    "recover": ("cli.recover_cmd", "recover_cmd", "Finish or undo every interrupted dump, checkpoint or restore (its gpusnap process died)."),
    "remote": ("cli.remote_cmd", "remote", "Remotes: S3-compatible object stores (s3://) or shared directories (file://, e.g. on NFS) this store pushes snapshots to and pulls them from."),
    "push": ("cli.remote_cmd", "push", "Send SNAPSHOT to remote NAME: only the chunks it lacks, then the manifest."),
    "pull": ("cli.remote_cmd", "pull", "Fetch SNAPSHOT from remote NAME: only the chunks this store lacks, each verified on arrival."),
}


EPILOG = f"""\b
Exit codes:
  {EXIT_OK}  success
  {EXIT_FAILED}  the operation failed (the reason in one line on stderr; with --json also
     {{"error": ..., "exit_code": ...}} on stdout)
  {EXIT_USAGE}  usage error: a bad command, option or argument
  {EXIT_DAMAGED}  damage found: a snapshot or the store is not what it claims to be
  {EXIT_UNAVAILABLE}  this machine lacks something the command needs (a GPU, CRIU, runsc, a driver feature)
  {EXIT_RECOVER}  an interrupted operation must be finished first (`gpusnap recover`)
  141  the reader of the output went away (`... | head`): nothing is said, as for SIGPIPE

\b
Environment:
  GPUSNAP_STORE   the store directory (as --store)
  GPUSNAP_CRIU    the CRIU binary to use; default: the first CRIU >= 4 on PATH, then the
                  project's own build (.cache/criu/bin/criu, made by scripts/setup.sh);
                  `gpusnap doctor` says which one is used and why
  GPUSNAP_DEBUG   set to 1 to print the traceback instead of the one-line error
  GPUSNAP_POOL_SOCKET  the memory tier's socket (`gpusnap pool`)
  Every other GPUSNAP_* setting (tuning, CRIU, remotes): docs/GUIDE.md, "Environment variables".
"""


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from storage.api import tool_version
    click.echo(f"gpusnap {tool_version()}")
    ctx.exit(0)


@click.group(cls=LazyGroup, lazy=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print gpusnap's version (the one every manifest it writes records) and exit.")
@click.option("--store", "store_path", envvar="GPUSNAP_STORE", default=None, metavar="DIR",
              help="Snapshot store directory (env GPUSNAP_STORE; default /var/lib/gpusnap as root, "
                   "else $XDG_DATA_HOME/gpusnap). Created 0700 on first use.")
@click.option("--progress/--no-progress", default=None,
              help="Report progress on stderr. Default: a bar when stderr is a terminal, nothing "
                   "otherwise. --progress where stderr is not a terminal (CI, journald, a log): one plain "
                   "line every 5 s (stage, bytes done of total, GB/s) and one when done. --no-progress: "
                   "nothing.")
@click.option("--json", "as_json", is_flag=True,
              help="Print JSON reports (as --json after the command; every command that reports takes it).")
@click.pass_context
def main(ctx: click.Context, store_path: str | None, progress: bool | None, as_json: bool) -> None:
    """gpusnap: fast, safe snapshots of GPU processes and sandboxes.

    Snapshots live in a content-addressed store: chunks are deduplicated across snapshots,
    compressed where it pays, checksummed, and committed atomically.
    """
    from storage.api import default_store_path
    ctx.obj = {"store": store_path or default_store_path(), "progress": progress, "json": as_json}
