"""`gpusnap remote add|list|remove` (configured remotes, as `git remote`), `remote ls|verify|forget|gc` (what
is on one) and `gpusnap push|pull`: the store's snapshots in an S3 object store (`s3://`) or a shared
directory (`file://`).

Credentials (S3 only) are never options: GPUSNAP_S3_ACCESS_KEY_ID / GPUSNAP_S3_SECRET_ACCESS_KEY (or the
AWS_ names) in the environment, or a 0600 file named with `remote add --credentials-file`. Every command
that talks to a remote ends by its deadline (`--deadline`, GPUSNAP_REMOTE_DEADLINE_S, default an hour).
"""
from __future__ import annotations

import os
from typing import Any

import click

from cli.progress import Progress
from storage.api import DEFAULT_DEADLINE_S, DEFAULT_JOBS, Remote, RemoteDamageError, add_remote, remote_config
from storage.api import pull as pull_snapshot

from cli.common import emit, human, json_option, one_line_errors, open_store, terminate_cleanly

jobs_option = click.option("--jobs", "-j", default=DEFAULT_JOBS, show_default=True,
                           help="Requests in flight at once.")
deadline_option = click.option(
    "--deadline", type=click.FloatRange(min=0.001), default=None, metavar="SECONDS",
    help=f"End the command (exit 4, nothing committed) if it has not finished after SECONDS; default "
         f"GPUSNAP_REMOTE_DEADLINE_S or {DEFAULT_DEADLINE_S:.0f}.")


def _transfer_line(r: dict) -> str:
    if r["already_there"]:
        return f"{r['snapshot']}: already on both sides, nothing sent"
    verb = "sent" if r["direction"] == "push" else "fetched"
    return (f"{r['snapshot']}: {r['direction']} {r['remote']}: {r['chunks_sent']} of {r['chunks_total']} chunks "
            f"{verb}, {human(r['bytes_sent'])} in {r['seconds']:.2f} s (all its chunks: {human(r['bytes_total'])})")


@click.group()
def remote() -> None:
    """Remotes: S3-compatible object stores (s3://) or shared directories (file://, e.g. on NFS) this store
    pushes snapshots to and pulls them from."""


@remote.command("add")
@click.argument("name")
@click.argument("url", metavar="s3://BUCKET/PREFIX|file:///PATH")
@click.option("--endpoint", default=None, metavar="URL",
              help="The S3 endpoint, e.g. http://127.0.0.1:18480 (s3:// remotes only; required there).")
@click.option("--region", default="us-east-1", show_default=True,
              help="The S3 region the requests are signed for (Swift and MinIO take us-east-1).")
@click.option("--credentials-file", default=None, metavar="PATH",
              help="A 0600 file with `access_key_id = ...` and `secret_access_key = ...` lines "
                   "(used when the environment has no GPUSNAP_S3_ACCESS_KEY_ID).")
@click.option("--replace", is_flag=True, help="Replace the configuration of an existing remote of that name.")
@deadline_option
@json_option
@click.pass_context
@one_line_errors
def remote_add(ctx: click.Context, name: str, url: str, endpoint: str | None, region: str,
               credentials_file: str | None, replace: bool, deadline: float | None, as_json: bool) -> None:
    """Add remote NAME at URL (the bucket, or the directory, is created if missing) and check that it
    answers. A file:// path is resolved now (links in it followed once); later no link in it is. Adding
    the same remote again is a no-op."""
    from storage.api import RemoteError, list_remotes, remote_exists, validate_remote_name
    st = open_store(ctx)
    cf = os.path.abspath(credentials_file) if credentials_file else None
    cfg = remote_config(name, url, endpoint, region, cf)
    if remote_exists(st, validate_remote_name(name)) and not replace:
        if any(c.to_json() == cfg.to_json() for c in list_remotes(st) if c.name == name):  # the same again: done
            emit(as_json, cfg.to_json(), f"remote {name}: {cfg.url} (already so)")
            return
        raise RemoteError(f"remote {name!r} already exists with another configuration (use --replace to change "
                          "it; `gpusnap remote list` shows it)")
    Remote(cfg, deadline=deadline).init()
    add_remote(st, cfg)
    emit(as_json, cfg.to_json(), f"remote {name}: {cfg.url}" + (f" at {cfg.endpoint}" if cfg.endpoint else ""))


@remote.command("list")
@json_option
@click.pass_context
@one_line_errors
def remote_list(ctx: click.Context, as_json: bool) -> None:
    """The remotes this store has configured (as `git remote -v`); `remote ls` lists a remote's snapshots."""
    from storage.api import list_remotes
    cfgs = list_remotes(open_store(ctx, create=False))
    rows = [c.to_json() for c in cfgs]
    lines = [f"{'NAME':20} {'URL':40} ENDPOINT"] + [f"{c.name:20} {c.url:40} {c.endpoint or '-'}" for c in cfgs]
    emit(as_json, rows, "\n".join(lines) if cfgs else "(no remotes: `gpusnap remote add NAME s3://BUCKET/PREFIX "
         "--endpoint URL` or `gpusnap remote add NAME file:///PATH`)")


@remote.command("remove")
@click.argument("name")
@json_option
@click.pass_context
@one_line_errors
def remote_remove(ctx: click.Context, name: str, as_json: bool) -> None:
    """Remove remote NAME's configuration from this store (as `git remote remove`); nothing on the
    remote is deleted (`remote forget` deletes a snapshot there)."""
    from storage.api import remove_remote
    remove_remote(open_store(ctx, create=False), name)
    emit(as_json, {"removed": name}, f"remote {name}: configuration removed (nothing on it was deleted)")


@remote.command("ls")
@click.argument("name", required=False)
@deadline_option
@json_option
@click.pass_context
@one_line_errors
def remote_ls(ctx: click.Context, name: str | None, deadline: float | None, as_json: bool) -> None:
    """The snapshots on remote NAME (the only remote when there is one); `remote list` lists the remotes."""
    r = Remote.open(open_store(ctx), name, deadline=deadline)
    r.check()
    rows: list[dict[str, Any]] = []
    for n in r.names():
        try:
            m = r.load(n)
            rows.append({"name": n, "size": m.size, "created": m.created, "kind": m.meta.get("kind")})
        except RemoteDamageError as e:
            rows.append({"name": n, "error": str(e)})
    lines = [f"{'NAME':32} {'KIND':8} {'SIZE':>12}  CREATED"]
    lines += [f"{x['name']:32} DAMAGED: {x['error']}" if "error" in x else
              f"{x['name']:32} {x['kind'] or '':8} {human(x['size']):>12}  {x['created']}" for x in rows]
    emit(as_json, rows, "\n".join(lines) if rows else "(no snapshots)")


@remote.command("verify")
@click.argument("name", required=False)
@click.option("--read-data", is_flag=True, help="Fetch and hash every chunk (else: presence and size).")
@click.option("--snapshot", "snapshots", multiple=True, help="Only these snapshots (repeatable).")
@jobs_option
@deadline_option
@json_option
@click.pass_context
@one_line_errors
def remote_verify(ctx: click.Context, name: str | None, read_data: bool, snapshots: tuple[str, ...],
                  jobs: int, deadline: float | None, as_json: bool) -> None:
    """Check remote NAME's manifests and chunks; exit 3 when anything is damaged or missing."""
    r = Remote.open(open_store(ctx), name, jobs, deadline=deadline)
    with terminate_cleanly(), Progress(f"remote verify {r.cfg.name}", ctx.obj["progress"]) as prog:
        rep = r.verify(list(snapshots) or None, read_data=read_data, progress=prog)
    d = {"ok": rep.ok, "snapshots": rep.snapshots, "chunks_checked": rep.chunks_checked,
         "bytes_checked": rep.bytes_checked, "read_data": read_data, "problems": [str(p) for p in rep.problems]}
    emit(as_json, d, "\n".join([f"{len(rep.snapshots)} snapshot(s), {rep.chunks_checked} chunk(s) "
                                f"{'read and hashed' if read_data else 'present'}: "
                                f"{'ok' if rep.ok else f'{len(rep.problems)} problem(s)'}",
                                *map(str, rep.problems)]))
    if not rep.ok:
        raise SystemExit(3)


@remote.command("rm", hidden=True, context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def remote_rm_gone(args: tuple[str, ...]) -> None:
    """`remote rm` read as `git remote rm` (remove a remote) and removed a snapshot: it is gone."""
    raise click.UsageError("`remote rm` is ambiguous: `remote forget SNAPSHOT [REMOTE]` deletes a snapshot on a "
                           "remote, `remote remove REMOTE` removes a remote's configuration")


@remote.command("forget")
@click.argument("snapshot")
@click.argument("name", required=False)
@deadline_option
@json_option
@click.pass_context
@one_line_errors
def remote_forget(ctx: click.Context, snapshot: str, name: str | None, deadline: float | None, as_json: bool) -> None:
    """Delete SNAPSHOT on remote NAME (as `restic forget`; its chunks stay until `remote gc`)."""
    r = Remote.open(open_store(ctx), name, deadline=deadline)
    r.check()
    r.remove(snapshot)
    emit(as_json, {"removed": snapshot, "remote": r.cfg.name}, f"{snapshot}: removed from {r.cfg.name}")


@remote.command("gc")
@click.argument("name", required=False)
@jobs_option
@deadline_option
@json_option
@click.pass_context
@one_line_errors
def remote_gc(ctx: click.Context, name: str | None, jobs: int, deadline: float | None, as_json: bool) -> None:
    """Delete the packs (and old chunk objects) on remote NAME that no remote snapshot needs (refused while a push runs)."""
    r = Remote.open(open_store(ctx), name, jobs, deadline=deadline)
    with terminate_cleanly():  # SIGTERM unwinds: the gc lock object is removed
        rep = r.gc()
    emit(as_json, dict(rep.__dict__), f"{r.cfg.name}: {rep.chunks_removed} chunk(s) removed "
         f"({rep.packs_removed} pack(s)), "
         f"{human(rep.bytes_freed)} freed, {rep.stale_locks_removed} stale lock(s) removed")


@click.command()
@click.argument("snapshot")
@click.argument("name", required=False)
@click.option("--replace", is_flag=True, help="Overwrite a different remote snapshot of the same name.")
@jobs_option
@deadline_option
@json_option
@click.pass_context
@one_line_errors
def push(ctx: click.Context, snapshot: str, name: str | None, replace: bool, jobs: int, deadline: float | None,
         as_json: bool) -> None:
    """Send SNAPSHOT to remote NAME: only the chunks it lacks, then the manifest."""
    st = open_store(ctx, create=False)
    r = Remote.open(st, name, jobs, deadline=deadline)
    with terminate_cleanly(), Progress(f"push {snapshot}", ctx.obj["progress"]) as prog:
        rep = r.push(st, snapshot, replace=replace, progress=prog).as_dict()
    emit(as_json, rep, _transfer_line(rep))


@click.command()
@click.argument("snapshot")
@click.argument("name", required=False)
@click.option("--replace", is_flag=True, help="Overwrite a different local snapshot of the same name.")
@jobs_option
@deadline_option
@json_option
@click.pass_context
@one_line_errors
def pull(ctx: click.Context, snapshot: str, name: str | None, replace: bool, jobs: int, deadline: float | None,
         as_json: bool) -> None:
    """Fetch SNAPSHOT from remote NAME: only the chunks this store lacks, each verified on arrival."""
    st = open_store(ctx)
    r = Remote.open(st, name, jobs, deadline=deadline)
    with terminate_cleanly(), Progress(f"pull {snapshot}", ctx.obj["progress"]) as prog:
        rep = pull_snapshot(r, st, snapshot, replace=replace, progress=prog).as_dict()
    emit(as_json, rep, _transfer_line(rep))


COMMANDS = [remote, push, pull]
