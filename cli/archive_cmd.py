"""`gpusnap store forget|stats|cat|diff|export|import|lock|break-lock`: keeping many snapshots on NVMe.

Attached to the `store` group by cli/__init__.py (STORE_COMMANDS).
"""
from __future__ import annotations

import sys
from datetime import datetime, timedelta, timezone
from typing import IO, Any

import click

from storage.api import EXIT_USAGE, GpusnapError
from storage.api import break_locks, lock_status
from storage.api import Manifest, validate_tag
from storage.api import validate_snapshot_name
from storage.api import Duration, Entry, Policy, companion_parent, decide, parse_created
from storage.api import compute, diff
from storage.api import SnapshotStore

from cli.common import SNAPSHOT_KINDS, emit, fail, human, json_option, latest_options, one_line_errors, open_store, resolve_name


def load_all(st: SnapshotStore) -> tuple[list[Manifest], list[str]]:
    """Every loadable manifest, and one line per snapshot that could not be loaded."""
    out, bad = [], []
    for n in st.names():
        try:
            out.append(st.load(n))
        except GpusnapError as e:
            bad.append(f"{n}: {e}")
    return out, bad


def matches(m: Manifest, tags: tuple[str, ...], kind: str | None, since: datetime | None = None) -> bool:
    """Whether M carries every tag in TAGS, is of KIND and was created at or after SINCE."""
    if any(t not in m.tags for t in tags):
        return False
    if kind is not None and m.meta.get("kind", "files") != kind:
        return False
    return since is None or parse_created(m.created) >= since


def parse_since(text: str | None) -> datetime | None:
    """--since: an ISO date/time, or an age like 90m, 36h, 7d, 2w."""
    if text is None:
        return None
    units = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
    if text[-1:] in units and text[:-1].isdigit():
        return datetime.now(timezone.utc) - timedelta(**{units[text[-1]]: int(text[:-1])})
    try:
        return parse_created(text)
    except GpusnapError:
        raise click.BadParameter(f"{text!r}: give an ISO time (2026-11-30T10:00) or an age (90m, 36h, 7d, 2w)") from None


def tag_option(fn: Any) -> Any:
    return click.option("--tag", "tags", multiple=True, metavar="TAG",
                        help="Only snapshots carrying this tag (repeatable: all must match).")(fn)


kind_option = click.option("--kind", default=None, type=click.Choice(SNAPSHOT_KINDS),
                           help="Only snapshots of this kind.")


@click.command("forget")
@click.option("--keep-last", default=0, type=click.IntRange(0), help="Keep the N most recent snapshots.")
@click.option("--keep-hourly", default=0, type=click.IntRange(0), help="Keep the last snapshot of each of the N latest hours.")
@click.option("--keep-daily", default=0, type=click.IntRange(0), help="... of each of the N latest days.")
@click.option("--keep-weekly", default=0, type=click.IntRange(0), help="... of each of the N latest ISO weeks.")
@click.option("--keep-monthly", default=0, type=click.IntRange(0), help="... of each of the N latest months.")
@click.option("--keep-yearly", default=0, type=click.IntRange(0), help="... of each of the N latest years.")
@click.option("--keep-within", default=None, metavar="DURATION",
              help="Keep every snapshot created within DURATION before the newest of its group (restic's: "
                   "years, months, days, hours, e.g. 1y5m7d2h, 30d, 36h; m is months).")
@click.option("--keep-tag", "keep_tags", multiple=True, metavar="TAG[,TAG...]",
              help="Keep every snapshot carrying this tag (with commas: all of these tags; repeatable).")
@tag_option
@kind_option
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@click.option("--prune", is_flag=True, help="Run `store gc` afterwards to free the chunks no snapshot needs any more.")
@json_option
@click.pass_context
@one_line_errors
def forget(ctx: click.Context, keep_last: int, keep_hourly: int, keep_daily: int, keep_weekly: int,
           keep_monthly: int, keep_yearly: int, keep_within: str | None, keep_tags: tuple[str, ...],
           tags: tuple[str, ...], kind: str | None, dry_run: bool, prune: bool, as_json: bool) -> None:
    """Remove snapshots a retention policy does not keep (restic's `forget` rules).

    Per group of snapshots of the same kind and host, a snapshot is kept when it is one of the
    --keep-last most recent, or the most recent of one of the last N hours/days/weeks/months/years
    that have snapshots, or created within --keep-within of the group's newest, or carrying a
    --keep-tag. Only snapshots matching --tag/--kind are considered. A snapshot being
    written or removed by another process is kept; a NAME.gpu companion follows NAME. Chunks are
    freed by --prune (or a later `store gc`).
    """
    for t in tags:
        validate_tag(t)
    within = Duration.parse(keep_within) if keep_within is not None else None  # RetentionError: exit 2
    try:
        keep = tuple(tuple(validate_tag(t) for t in group.split(",")) for group in keep_tags)
    except GpusnapError as e:
        fail(f"--keep-tag: {e}", EXIT_USAGE, as_json)
    policy = Policy(keep_last, keep_hourly, keep_daily, keep_weekly, keep_monthly, keep_yearly, within, keep)
    st = open_store(ctx, create=False)
    manifests, bad = load_all(st)
    chosen = [m for m in manifests if matches(m, tags, kind)]
    names = {m.name for m in chosen}
    # a companion is judged with its parent even when the filters would leave it out
    chosen += [m for m in manifests if m.name not in names and companion_parent(m.name) in names]
    entries = [Entry(m.name, parse_created(m.created), m.meta.get("kind", "files"), m.host, m.tags) for m in chosen]
    decision = decide(entries, policy)
    removed, busy = [], []
    if not dry_run:
        for n in decision.remove:
            try:
                st.remove(n)
                removed.append(n)
            except GpusnapError as e:
                busy.append(f"{n}: {e}")
    report: dict[str, Any] = {"keep": [{"name": n, "reasons": r} for n, r in decision.keep],
                              "remove": decision.remove, "removed": removed, "not_removed": busy,
                              "dry_run": dry_run, "unreadable": bad}
    lines = [f"keep   {n:40} {', '.join(r)}" for n, r in decision.keep]
    lines += [f"{'would remove' if dry_run else 'remove'} {n}" for n in decision.remove]
    lines += [f"NOT removed {b}" for b in busy]
    lines += [f"unreadable (left alone) {b}" for b in bad]
    if prune and not dry_run:
        from storage.api import collect
        rep = collect(st)
        report["prune"] = {"chunks_removed": rep.chunks_removed, "bytes_freed": rep.bytes_freed}
        lines.append(f"prune: removed {rep.chunks_removed} unreferenced chunks and {rep.packs_removed} packs, "
                     f"freed {human(rep.bytes_freed)} on disk")
    emit(as_json, report, "\n".join(lines) or "no snapshots matched")
    if busy:
        sys.exit(1)


@click.command("stats")
@click.argument("names", nargs=-1)
@json_option
@click.pass_context
@one_line_errors
def stats(ctx: click.Context, names: tuple[str, ...], as_json: bool) -> None:
    """Raw, zero, deduplicated, stored, unique ("freed by rm") and shared bytes per snapshot, and totals.

    ZEROS are all-zero chunks, elided (nothing stored); DEDUP are bytes named more than once but stored
    once (within the snapshot; the totals across snapshots); compression is reported apart from both.
    STORED and UNIQUE are payload bytes: what `store rm` then `store gc` frees on disk differs by each
    entry's 4 KiB header and padding (more) and by the entries left in packs that gc does not repack
    because most of the pack is still needed (less)."""
    st = open_store(ctx, create=False)
    for n in names:
        validate_snapshot_name(n)
        if not st.exists(n):
            raise GpusnapError(f"no snapshot named {n!r} in {st.path}")
    with st.shared():
        manifests, bad = load_all(st)
    per, repo = compute(manifests, list(names) or None)
    data = {"snapshots": [s.to_json() for s in per], "repository": repo.to_json(), "unreadable": bad}
    lines = [f"{'NAME':32} {'RAW':>10} {'ZEROS':>10} {'DEDUP':>10} {'STORED':>10} {'UNIQUE':>10} {'SHARED':>10} {'CHUNKS':>7}"]
    for s in per:
        lines.append(f"{s.name:32} {human(s.raw_bytes):>10} {human(s.zero_bytes):>10} {human(s.dedup_bytes):>10} "
                     f"{human(s.stored_bytes):>10} {human(s.unique_bytes):>10} {human(s.shared_bytes):>10} {s.chunks:>7}")
    lines.append(f"store: {repo.snapshots} snapshots, {human(repo.raw_bytes)} raw: {human(repo.zero_bytes)} zeros "
                 f"elided, {human(repo.dedup_bytes)} deduplicated ({repo.dedup_ratio:.2f}x), "
                 f"{human(repo.distinct_raw_bytes)} distinct compressed to {human(repo.stored_bytes)} "
                 f"({repo.compression_ratio:.2f}x) in {repo.chunks} chunks")
    for codec, c in sorted(repo.codecs.items()):
        lines.append(f"  {codec:15} {c.chunks:7} chunks {human(c.raw_bytes):>10} raw {human(c.stored_bytes):>10} stored")
    lines += [f"unreadable: {b}" for b in bad]
    emit(as_json, data, "\n".join(lines))


@click.command("cat")
@click.argument("name")
@click.argument("stream")
@latest_options()
@click.pass_context
@one_line_errors
def cat_cmd(ctx: click.Context, name: str, stream: str, tags: tuple[str, ...], latest_paths: tuple[str, ...],
            latest_host: str | None) -> None:
    """Write one file stream of NAME to stdout, every chunk verified before its bytes go out (any
    name of a hard-linked file). NAME `latest`: the newest files snapshot of this machine (--path,
    --tag, --host narrow it)."""
    from storage.api import cat
    st = open_store(ctx, create=False)
    with st.shared():
        m = st.load(resolve_name(st, name, tags, latest_paths, latest_host))
        cat(st, m, stream, sys.stdout.buffer)


@click.command("diff")
@click.argument("a")
@click.argument("b")
@json_option
@click.pass_context
@one_line_errors
def diff_cmd(ctx: click.Context, a: str, b: str, as_json: bool) -> None:
    """Streams added (+), removed (-), changed (M) or with changed attributes (U) from A to B.

    The bytes shown are those of the chunks that differ (read from the manifests, no data read): a
    chunk in which one byte changed counts whole (`changed_bytes` in --json)."""
    st = open_store(ctx, create=False)
    with st.shared():
        d = diff(st.load(validate_snapshot_name(a)), st.load(validate_snapshot_name(b)))
    marks = {"added": "+", "removed": "-", "changed": "M", "attrs": "U"}
    lines = [f"{marks[c.change]} {c.name}" + (f"  ({human(c.changed_bytes)} in changed chunks)" if c.change == "changed" else "")
             for c in d.changes]
    lines.append(f"{len(d.changes)} stream(s) differ, {d.unchanged} unchanged, {human(d.changed_bytes)} in changed "
                 "chunks (a chunk with one byte changed counts whole)")
    emit(as_json, d.to_json(), "\n".join(lines))


def _open_out(path: str) -> IO[bytes]:
    if path == "-":
        return sys.stdout.buffer
    import os
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    return os.fdopen(fd, "wb")


@click.command("export")
@click.argument("name")
@click.argument("archive", default="-")
@json_option
@click.pass_context
@one_line_errors
def export_cmd(ctx: click.Context, name: str, archive: str, as_json: bool) -> None:
    """Write snapshot NAME as one archive (zstd-compressed tar of its manifest and chunks) to
    ARCHIVE (a new file; default stdout), for `store import` into another store."""
    import os
    from storage.api import export
    if archive == "-" and sys.stdout.isatty():
        raise click.UsageError("stdout is a terminal: give an ARCHIVE file, or redirect (`> NAME.gpusnap`, "
                               "`| ssh host gpusnap store import`)")
    st = open_store(ctx, create=False)
    out = _open_out(archive)
    try:
        rep = export(st, name, out)
    except BaseException:
        if archive != "-":
            out.close()
            os.unlink(archive)
        raise
    if archive != "-":
        out.flush()
        os.fsync(out.fileno())
        out.close()
        emit(as_json, {"name": name, "archive": archive, **rep},
             f"{name} -> {archive}: {rep['chunks']} chunks, {human(rep['stored_bytes'])} stored, {human(rep['raw_bytes'])} raw")


@click.command("import")
@click.argument("archive", default="-")
@click.option("--name", default=None, help="Import under this name (default: the archive's).")
@click.option("--replace", is_flag=True, help="Replace an existing snapshot of the same name.")
@json_option
@click.pass_context
@one_line_errors
def import_cmd(ctx: click.Context, archive: str, name: str | None, replace: bool, as_json: bool) -> None:
    """Take in an archive made by `store export` (file or - for stdin); every chunk verified, the
    snapshot visible only once complete."""
    from storage.api import import_
    st = open_store(ctx)
    if archive == "-":
        rep = import_(st, sys.stdin.buffer, name, replace=replace)
    else:
        with open(archive, "rb") as f:
            rep = import_(st, f, name, replace=replace)
    emit(as_json, rep, f"imported {rep['name']}: {rep['chunks']} chunks ({rep['chunks_received']} received), "
         f"{human(int(rep['raw_bytes']))} raw")  # type: ignore[call-overload]


@click.group("lock")
def lock() -> None:
    """The store's locks: who holds them."""


@lock.command("status")
@click.option("--all", "show_all", is_flag=True, help="Also the lock files nobody holds (`break-lock` removes those).")
@json_option
@click.pass_context
@one_line_errors
def lock_status_cmd(ctx: click.Context, show_all: bool, as_json: bool) -> None:
    """The locks held now and the live processes holding them (with --all, every lock file too)."""
    st = open_store(ctx, create=False)
    infos = [i for i in lock_status(st.path) if show_all or i.held]
    rows = [{"lock": i.kind, "name": i.name, "held": i.held, "holders": [{"pid": p, "mode": m} for p, m in i.holders]}
            for i in infos]
    lines = [f"{(i.name or '(store)'):32} " + (", ".join(f"pid {p} {m}" for p, m in i.holders) if i.held else "free")
             for i in infos]
    emit(as_json, rows, "\n".join(lines) or "no locks held")


@click.command("break-lock")
@click.argument("names", nargs=-1)
@json_option
@click.pass_context
@one_line_errors
def break_lock(ctx: click.Context, names: tuple[str, ...], as_json: bool) -> None:
    """Remove lock files whose holder is gone (of NAMES, default: every name with no snapshot);
    refuses while a live process holds one."""
    st = open_store(ctx, create=False)
    removed = break_locks(st.path, [validate_snapshot_name(n) for n in names] or None, st.exists)
    emit(as_json, {"removed": removed}, f"removed {len(removed)} lock file(s)")


STORE_COMMANDS = [forget, stats, cat_cmd, diff_cmd, export_cmd, import_cmd, lock, break_lock]
