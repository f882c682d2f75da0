"""`gpusnap criu dump|restore`: a process tree's CPU and GPU state through CRIU into the store."""
from __future__ import annotations

import os
from typing import Any

import click

from cli.progress import Progress
from storage.api import UnavailableError

from cli.common import (emit, from_jobs_option, from_remote_option, human, json_option, one_line_errors, open_store,
                        split_map, tag_option)
from cli.criu_options import dump_criu_options, restore_criu_options
from sandbox.criu.criu_options import RestoreOptions
from sandbox.criu.runner import DumpOptions
from sandbox.criu.snapshot import criu_dump, criu_restore
from sandbox.containers.process_check import refuse_container_process
from sandbox.host.interrupts import undo_on_signals
from sandbox.ops import hooks, journal
from sandbox.ops.prepared import HookReport, prepared, restore_resume, resumed, tree_of
from cli.hook_options import hook_options, workload_hooks
from cli.warm_opts import keep_warm as _keep_warm, keep_warm_option, read_warm, warm_used



def need_root(what: str) -> None:
    """Exit 4 before anything is made (no store, no log) where CRIU cannot run: it needs root."""
    if os.geteuid() != 0:
        raise UnavailableError(f"{what} needs root: CRIU checkpoints and restores processes with ptrace, "
                               "namespaces and /proc/PID/map_files (run it with sudo)")


@click.group()
def criu() -> None:
    """Checkpoint a process tree (CPU through CRIU 4.x, GPU through the driver) into the store."""


@criu.command("dump")
@click.argument("pid", type=int)
@click.argument("name")
@click.option("--leave-running", is_flag=True, help="Keep the processes running after the dump.")
@click.option("--shell-job", is_flag=True, help="The tree was started from a shell (CRIU --shell-job).")
@click.option("--ext-unix-sk", is_flag=True, help="Allow external unix sockets (CRIU --ext-unix-sk).")
@click.option("--file-locks", is_flag=True, help="Dump file locks (CRIU --file-locks).")
@click.option("--link-remap", is_flag=True, help="Allow deleted/linked files (CRIU --link-remap).")
@click.option("--tcp-established", is_flag=True, help="Dump established TCP connections (CRIU "
              "--tcp-established; the restore then restores them).")
@click.option("--skip-in-flight", is_flag=True, help="Drop TCP connections not yet accepted (CRIU "
              "--skip-in-flight; without it CRIU refuses a server with connections in its accept queue: "
              "`In-flight connection`).")
@click.option("--staging", default=None, metavar="DIR",
              help="The directory CRIU works in (default /dev/shm when the images would fit, else the store's "
                   "tmp/). By default the images stream from CRIU straight into the store (criu --stream through "
                   "gpusnap's image streamer): only CRIU's log and socket are there. The alternative, "
                   "GPUSNAP_CRIU_IMAGES=staging, has CRIU write every image there first, then ingests them.")
@click.option("--replace", is_flag=True, help="Replace an existing snapshot of the same name.")
@click.option("--parent", default=None, metavar="SNAP",
              help="Store changed chunks as deltas against SNAP, an earlier criu snapshot of the same workload "
                   "(it writes about the changed bytes). Never chosen for you: the bytes of SNAP that the deltas "
                   "use stay stored while this snapshot lives, even after SNAP is removed.")
@hook_options(restore=False)
@dump_criu_options
@tag_option
@keep_warm_option
@json_option
@click.pass_context
@one_line_errors
def criu_dump_cmd(ctx: click.Context, pid: int, name: str, leave_running: bool, shell_job: bool,
                  ext_unix_sk: bool, file_locks: bool, link_remap: bool, tcp_established: bool,
                  skip_in_flight: bool, staging: str | None, replace: bool, parent: str | None,
                  prepare: str | None, resume: str | None, hook_timeout: float,
                  tags: tuple[str, ...], keep_warm: bool, as_json: bool, criu_opts: dict[str, Any]) -> None:
    """Dump PID and its descendants into snapshot NAME. On any failure the tree keeps running.

    The page images stream from CRIU into the store as CRIU writes them (no copy on disk first);
    the tree is killed only once the snapshot is committed (unless --leave-running). Needs root.

    With --prepare, the workload is told to prepare first (a failure: no snapshot, the workload resumed);
    --resume tells it to go on after a failure or --leave-running, and is recorded in the snapshot
    (MACed) for a plain `criu restore NAME`."""
    wh = workload_hooks(prepare, resume, hook_timeout)
    need_root("criu dump")
    if not criu_opts.get("root"):  # with --root the caller gives CRIU the tree's root (and its --external mounts)
        refuse_container_process(pid)
    st = open_store(ctx)
    opts = DumpOptions(shell_job=shell_job, ext_unix_sk=ext_unix_sk, file_locks=file_locks,
                       link_remap=link_remap, tcp_established=tcp_established,
                       skip_in_flight=skip_in_flight, **criu_opts)
    ran = HookReport()
    with undo_on_signals(), Progress(f"criu dump {pid}", ctx.obj["progress"]) as prog:
        with prepared(st.path, wh, name, pid, resume_after=leave_running, report=ran):
            r = criu_dump(st, pid, name, leave_running=leave_running, options=opts, replace=replace,
                          staging=staging, progress=prog, tags=tags, parent=parent, resume=wh.resume)
    d = {**r.as_dict(), **({"hooks": ran.as_list()} if ran.runs else {})}
    if keep_warm:
        d["warm"] = _keep_warm(st, name)
    emit(as_json, d, f"{name}: {len(r.pids)} process(es), {len(r.cuda_pids)} with CUDA; "
         f"{human(r.raw_bytes)} of images, {human(r.new_bytes)} written, {human(r.dedup_bytes)} deduplicated "
         f"({', '.join(f'{k} {v:.2f} s' for k, v in r.seconds.items())})"
         + (f"; its restore stages the images ({r.staged_restore})" if r.staged_restore else ""))


@criu.command("restore")
@click.argument("name")
@click.option("--staging", default=None, metavar="DIR",
              help="The directory CRIU works in (default /dev/shm when the images fit, else the store's tmp/). "
                   "By default CRIU reads the images streamed from the store, each chunk verified, with no "
                   "copy on disk; the alternative, GPUSNAP_CRIU_IMAGES=staging, materializes every image there "
                   "first.")
@click.option("--device-map", multiple=True, metavar="OLD=NEW",
              help="Restore GPU OLD's state onto GPU NEW (index or UUID; repeatable or comma-separated); "
                   "list every checkpointed GPU. Checked before any process is restored.")
@click.option("--tcp-established", is_flag=True, help="Restore established TCP connections (CRIU "
              "--tcp-established; given anyway when the dump used it).")
@hook_options(restore=True)
@restore_criu_options
@from_remote_option
@from_jobs_option
@json_option
@click.pass_context
@one_line_errors
def criu_restore_cmd(ctx: click.Context, name: str, staging: str | None, device_map: tuple[str, ...],
                     tcp_established: bool, prepare: str | None, resume: str | None, no_resume: bool,
                     hook_timeout: float, from_remote: str | None, jobs: int, as_json: bool,
                     criu_opts: RestoreOptions) -> None:
    """Restore snapshot NAME (every chunk verified before its bytes reach CRIU); GPU state is restored
    and unlocked. With --from REMOTE, a snapshot this store lacks is fetched while CRIU restores (the
    images CRIU reads first, first), and committed locally once all of it is here. Needs root.

    Then the resume step runs: --resume's, or the one the snapshot recorded when this store's gpusnap
    recorded it (a step it cannot verify is refused before anything is restored)."""
    wh = workload_hooks(prepare, resume, hook_timeout, no_resume)
    need_root("criu restore")
    st = open_store(ctx, create=False)
    journal.require_clean(st.path)  # before the prepare step: a restore that will refuse prepares nothing
    local = st.exists(name)
    step = restore_resume(st, name, wh, no_resume)  # refused here, before anything is restored
    ran = HookReport()
    read_warm(st)
    with undo_on_signals(), Progress(f"criu restore {name}", ctx.obj["progress"]) as prog:
        if wh.prepare is not None:
            ran.runs.append(hooks.run(wh.prepare, hooks.Step.PREPARE, wh.timeout_s, snapshot=name))
        r = criu_restore(st, name, staging=staging, progress=prog, from_remote=from_remote, jobs=jobs,
                         device_map=split_map(device_map), tcp_established=tcp_established,
                         options=criu_opts)
        if not local:  # fetched from a remote: its record is checked now that it is here
            step = restore_resume(st, name, wh, no_resume,
                                  restored=f"snapshot {name!r} was restored (root pid {r.restored_pid})")
        if step is not None and r.restored_pid is not None:
            resumed(st.path, step, wh.timeout_s, name, r.restored_pid, tree_of(r.restored_pid), ran)
    skipped = r.stages.get("served", {}).get("split_skipped_because")
    emit(as_json, {**r.as_dict(), "warm": warm_used(st, name), **({"hooks": ran.as_list()} if ran.runs else {})},
         f"{name}: restored, root pid {r.restored_pid} "
         f"({', '.join(f'{k} {v:.2f} s' for k, v in r.seconds.items())})"
         + (f"; no split restore: {skipped}" if skipped else ""))


COMMANDS = [criu]
