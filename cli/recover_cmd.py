"""`gpusnap recover`: finish or undo the operations a killed gpusnap left, and say what was done."""
from __future__ import annotations

import click

from storage.api import EXIT_FAILED

from cli.common import emit, fail, json_option, one_line_errors, open_store
from sandbox.recover import recover


@click.command("recover")
@click.option("--wait", "wait_s", default=600.0, show_default=True, metavar="SECONDS",
              help="How long to let a CRIU or runsc the dead gpusnap left running finish before killing it.")
@click.option("--trust-old-key", is_flag=True,
              help="Also act on records an older gpusnap signed with the key it kept inside the store (STORE/journal/key). "
                   "Only for a store this host wrote and nobody copied: a copy carries that key.")
@json_option
@click.pass_context
@one_line_errors
def recover_cmd(ctx: click.Context, wait_s: float, trust_old_key: bool, as_json: bool) -> None:
    """Finish or undo every interrupted dump, checkpoint or restore (its gpusnap process died).

    A dump whose snapshot was committed is finished (the tree is killed, as asked); any other is
    undone (the stopped tree or sandbox runs again, GPU state restored and unlocked; GPU memory taken
    through custom storage is fed back from the chunks the operation recorded). Staging and
    temporary files are removed and the huge-pages setting is put back. Safe to run at any time:
    operations whose gpusnap is still running are left alone. A record that is not in force (no valid MAC
    under this host's key, written for another store directory, or replayed) is set aside and nothing it
    names is touched.
    """
    st = open_store(ctx, create=False)
    rep = recover(st, helper_wait_s=wait_s, trust_old_key=trust_old_key)
    lines = []
    for o in rep.operations:
        lines.append(f"{o.kind} of {o.snapshot!r} (stopped at {o.stage}): "
                     + ("; ".join(o.actions) or "nothing to do") + (f"; FAILED: {o.error}" if o.error else "")
                     + "".join(f"; LOST: {x}" for x in o.lost))
    for t in rep.thp_put_back:
        lines.append(f"transparent huge pages put back to {t['value']!r} ({t['path']})")
    emit(as_json, rep.as_dict(), "\n".join(lines) or "nothing to recover")
    if not rep.ok and all(o.error is None for o in rep.operations):
        fail("GPU memory that only the killed gpusnap held is lost (see above); those processes cannot run "
             "again; the records are cleared", EXIT_FAILED, False)
    if not rep.ok:
        fail("some operations could not be recovered (see above); run `gpusnap recover` again after fixing the cause",
             EXIT_FAILED, False)


COMMANDS = [recover_cmd]
