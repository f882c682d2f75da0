"""The `gpusnap` command line, composed here from one module per command group.

Exit codes: 0 success; 1 the operation failed (the one-line reason is on stderr; under --json also
{"error", "exit_code"} on stdout); 2 usage error; 3 damage found; 4 something this command needs is
missing on this machine; 5 an interrupted operation must be finished first (`gpusnap recover`).
GPUSNAP_DEBUG=1 shows the traceback instead of the one line.
"""
from __future__ import annotations

import click

from storage.errors import (EXIT_DAMAGED, EXIT_FAILED, EXIT_OK, EXIT_RECOVER, EXIT_UNAVAILABLE,
                            EXIT_USAGE)
from storage.store import default_store_path

from cli import (archive_cmd, container_cmd, criu_cmd, gpu_cmd, hook_cmd, pool_cmd, recover_cmd, remote_cmd,
                         runsc_cmd, store_cmd)


EPILOG = f"""\b
Exit codes:
  {EXIT_OK}  success
  {EXIT_FAILED}  the operation failed (the reason in one line on stderr; with --json also
     {{"error": ..., "exit_code": ...}} on stdout)
  {EXIT_USAGE}  usage error: a bad command, option or argument
  {EXIT_DAMAGED}  damage found: a snapshot or the store is not what it claims to be
  {EXIT_UNAVAILABLE}  this machine lacks something the command needs (a GPU, CRIU, runsc, a driver feature)
  {EXIT_RECOVER}  an interrupted operation must be finished first (`gpusnap recover`)

\b
Environment:
  GPUSNAP_STORE   the store directory (as --store)
  GPUSNAP_CRIU    the CRIU binary to use; default: the first CRIU >= 4 on PATH, then the
                  project's own build (.cache/criu/bin/criu, made by scripts/setup.sh);
                  `gpusnap doctor` says which one is used and why
  GPUSNAP_DEBUG   set to 1 to print the traceback instead of the one-line error
  GPUSNAP_POOL_SOCKET  the memory tier's socket (`gpusnap pool`)
"""


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from storage.manifest import tool_version
    click.echo(f"gpusnap {tool_version()}")
    ctx.exit(0)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EPILOG)
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
@click.pass_context
def main(ctx: click.Context, store_path: str | None, progress: bool | None) -> None:
    """gpusnap: fast, safe snapshots of GPU processes and sandboxes.

    Snapshots live in a content-addressed store: chunks are deduplicated across snapshots,
    compressed where it pays, checksummed, and committed atomically.
    """
    ctx.obj = {"store": store_path or default_store_path(), "progress": progress}




for _module in (store_cmd, gpu_cmd, pool_cmd, criu_cmd, runsc_cmd, hook_cmd, container_cmd, recover_cmd, remote_cmd):
    for _command in _module.COMMANDS:
        main.add_command(_command)
for _command in archive_cmd.STORE_COMMANDS:
    store_cmd.store.add_command(_command)
