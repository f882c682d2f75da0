"""`gpusnap doctor` and `gpusnap gpu checkpoint|restore`."""
from __future__ import annotations

from typing import Any

import click

from cli.progress import Progress


from sandbox.ops import journal
from cli.warm_opts import keep_warm as _keep_warm, keep_warm_option, read_warm, warm_used
from cli.common import emit, from_remote_option, json_option, one_line_errors, open_store, split_map, tag_option
from sandbox.doctor import render, report
from sandbox.gpu.snapshot import gpu_checkpoint, gpu_restore
from sandbox.gpu.pool_daemon import request
from sandbox.host.interrupts import undo_on_signals
from sandbox.ops import hooks
from sandbox.ops.prepared import HookReport, prepared, restore_resume, resumed, tree_of
from cli.hook_options import hook_options, workload_hooks


THP_CHOICE = click.Choice(["always", "keep"])


def tier_options(fn: Any) -> Any:
    """--tier store|memory and --pool-socket, shared by `gpu checkpoint` and `gpu restore`."""
    fn = click.option("--pool-socket", default=None, metavar="PATH",
                      help="The pool daemon's socket (with --tier memory; env GPUSNAP_POOL_SOCKET).")(fn)
    return click.option("--tier", type=click.Choice(["store", "memory"]), default="store", show_default=True,
                        help="'memory': the resident pool of `gpusnap pool serve` (custom storage only).")(fn)



def _socket(path: str | None) -> str:
    import os
    from sandbox.gpu.pool_daemon import DEFAULT_SOCKET
    return path or os.environ.get("GPUSNAP_POOL_SOCKET", DEFAULT_SOCKET)


@click.command()
@json_option
@one_line_errors
def doctor(as_json: bool) -> None:
    """What this machine can do: driver, checkpoint API, custom storage, GPUs, nvCOMP, CRIU, runsc."""
    import shutil
    from sandbox.criu.runner import find_criu
    r = report(criu=find_criu() or "criu", runsc=shutil.which("runsc") or "runsc")
    emit(as_json, r, render(r))


@click.group()
def gpu() -> None:
    """Swap a process's GPU state out to the store and back in (model swapping)."""


@gpu.command("checkpoint")
@click.argument("pid", type=int)
@click.argument("name")
@click.option("--lock-timeout", default=10.0, show_default=True, help="Seconds to wait for running CUDA work.")
@click.option("--thp", type=THP_CHOICE, default="always", show_default=True,
              help="Transparent huge pages during the driver's host copy ('always' is measured faster; "
                   "the previous setting is put back; 'keep' leaves the setting alone).")
@click.option("--replace", is_flag=True, help="Replace an existing snapshot of the same name.")
@hook_options(restore=False)
@tag_option
@tier_options
@keep_warm_option
@json_option
@click.pass_context
@one_line_errors
def gpu_checkpoint_cmd(ctx: click.Context, pid: int, name: str, lock_timeout: float,
                       thp: str, replace: bool, prepare: str | None, resume: str | None, hook_timeout: float,
                       tags: tuple[str, ...], tier: str, pool_socket: str | None,
                       keep_warm: bool, as_json: bool) -> None:
    """Swap out the GPU state of PID and its CUDA children into snapshot NAME.

    With a driver that has custom storage (CUDA 13.4+), the GPU memory streams into the store,
    compressed on the GPU; otherwise the driver's own host copy keeps it inside the process, and the
    snapshot records that. The processes are left locked and CHECKPOINTED (their GPU memory
    released) until `gpu restore`. On failure, SIGTERM, SIGHUP or Ctrl-C every process is left running
    with its memory intact; if gpusnap is killed, `gpusnap recover` gives it back.

    With --prepare, the workload is told to prepare before its GPU is locked (a failure: no snapshot,
    the workload resumed); --resume runs after a failure and is recorded in the snapshot (MACed) for
    `gpu restore`.
    """
    wh = workload_hooks(prepare, resume, hook_timeout)
    if tier == "memory" and wh:
        raise click.UsageError("--prepare/--resume are not supported with --tier memory")
    if tier == "memory":
        r = request(_socket(pool_socket), {"op": "swap_out", "pid": pid, "name": name})
        emit(as_json, r, f"{name}: {len(r['pids'])} CUDA process(es) {r['pids']} swapped out to the memory tier "
             f"({r['seconds']['total']:.2f} s); `gpusnap gpu restore {name} {pid} --tier memory` brings them back")
        return
    st = open_store(ctx)
    journal.require_clean(st.path)
    ran = HookReport()
    with undo_on_signals(), Progress(f"gpu checkpoint {pid}", ctx.obj["progress"]) as prog:
        with prepared(st.path, wh, name, pid, resume_after=False, report=ran):
            rep = gpu_checkpoint(st, pid, name, lock_timeout_s=lock_timeout, replace=replace, tags=tags,
                                 thp_mode=None if thp == "keep" else thp, progress=prog, resume=wh.resume)
    d = {**rep.as_dict(), **({"hooks": ran.as_list()} if ran.runs else {})}
    if keep_warm:
        d["warm"] = _keep_warm(st, name)
    emit(as_json, d, f"{name}: {len(rep.pids)} CUDA process(es) {rep.pids} checkpointed via {rep.path} "
         f"({', '.join(f'{k} {v:.2f} s' for k, v in rep.seconds.items())}); they stay locked until "
         f"`gpusnap gpu restore {name} {pid}`")


@gpu.command("restore")
@click.argument("name")
@click.argument("pid", type=int)
@click.option("--device-map", multiple=True, metavar="OLD=NEW",
              help="Restore GPU OLD's state onto GPU NEW (index or UUID; repeatable or comma-separated); "
                   "list every checkpointed GPU. Checked before any process is restored.")
@click.option("--thp", type=THP_CHOICE, default="always", show_default=True,
              help="Transparent huge pages while the driver copies the state back ('always' is measured "
                   "faster; the previous setting is put back; 'keep' leaves the setting alone).")
@hook_options(restore=True)
@tier_options
@from_remote_option
@json_option
@click.pass_context
@one_line_errors
def gpu_restore_cmd(ctx: click.Context, name: str, pid: int, device_map: tuple[str, ...], thp: str,
                    prepare: str | None, resume: str | None, no_resume: bool, hook_timeout: float,
                    tier: str, pool_socket: str | None, from_remote: str | None, as_json: bool) -> None:
    """Swap the GPU state of snapshot NAME back into PID's processes and unlock them.

    On failure, SIGTERM, SIGHUP or Ctrl-C every process whose memory is back is unlocked and the
    others stay CHECKPOINTED (run this again); if gpusnap is killed, `gpusnap recover` does the same.
    Then the resume step runs: --resume's, or the one the snapshot recorded when this store's gpusnap
    recorded it (one it cannot verify is refused before anything is restored).
    """
    wh = workload_hooks(prepare, resume, hook_timeout, no_resume)
    if tier == "memory" and (wh or no_resume):
        raise click.UsageError("--prepare/--resume are not supported with --tier memory")
    if tier == "memory":
        if device_map:
            raise click.UsageError("--device-map is not supported with --tier memory")
        r = request(_socket(pool_socket), {"op": "swap_in", "pid": pid, "name": name})
        emit(as_json, r, f"{name}: {len(r['pids'])} process(es) swapped in from the memory tier and running")
        return
    st = open_store(ctx, create=False)
    journal.require_clean(st.path)
    local = st.exists(name)
    step = restore_resume(st, name, wh, no_resume)  # refused here, before anything is restored
    ran = HookReport()
    read_warm(st)
    with undo_on_signals(), Progress(f"gpu restore {name}", ctx.obj["progress"]) as prog:
        if wh.prepare is not None:
            ran.runs.append(hooks.run(wh.prepare, hooks.Step.PREPARE, wh.timeout_s, snapshot=name))
        rep = gpu_restore(st, name, pid, device_map=split_map(device_map), thp_mode=None if thp == "keep" else thp,
                          progress=prog, from_remote=from_remote)
        if not local:
            step = restore_resume(st, name, wh, no_resume,
                                  restored=f"snapshot {name!r} was restored into pid {pid}'s processes")
        if step is not None:
            resumed(st.path, step, wh.timeout_s, name, pid, tree_of(pid), ran)
    emit(as_json, {**rep.as_dict(), "warm": warm_used(st, name), **({"hooks": ran.as_list()} if ran.runs else {})}, f"{name}: {len(rep.pids)} process(es) restored via {rep.path} and running "
         f"({', '.join(f'{k} {v:.2f} s' for k, v in rep.seconds.items())})")


COMMANDS = [doctor, gpu]
