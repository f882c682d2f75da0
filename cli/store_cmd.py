"""`gpusnap store ...`: files and directories as snapshots, and the store's own upkeep."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from typing import Any

from typing import TYPE_CHECKING, Any

import click

from storage.api import EXIT_DAMAGED, EXIT_FAILED, GpusnapError
from storage.api import validate_snapshot_name
from storage.api import StoreError
from storage.api import MARKER, SNAPSHOTS, path_in

from cli.common import (emit, expand_name, human, json_option, latest_options, one_line_errors, open_store,
                        parse_chunk_size, parse_size, rate, resolve_name, tag_option, terminate_cleanly)
from cli.common import LATEST, SNAPSHOT_KINDS
from cli.lazy import LazyGroup
from cli.progress import Progress

if TYPE_CHECKING:  # imported where used: `store ls` and `--help` need none of them (numpy, zstandard)
    from storage.api import FilesCache
    from storage.api import FileTreeSource
    from storage.api import Manifest, Stream
    from storage.api import DamagedCopy

# the store subcommands of cli/archive_cmd.py, imported only when one runs
ARCHIVE_COMMANDS = {
    "forget": ("cli.archive_cmd", "forget", "Remove snapshots a retention policy does not keep (restic's `forget` rules)."),
    "stats": ("cli.archive_cmd", "stats", "Raw, zero, deduplicated, stored, unique (\"freed by rm\") and shared bytes per snapshot, and totals."),
    "cat": ("cli.archive_cmd", "cat_cmd", "Write one file stream of NAME to stdout, every chunk verified before its bytes go out (any name of a hard-linked file)."),
    "diff": ("cli.archive_cmd", "diff_cmd", "Streams added (+), removed (-), changed (M) or with changed attributes (U) from A to B."),
    "export": ("cli.archive_cmd", "export_cmd", "Write snapshot NAME as one archive (zstd-compressed tar of its manifest and chunks) to..."),
    "import": ("cli.archive_cmd", "import_cmd", "Take in an archive made by `store export` (file or - for stdin); every chunk verified, the..."),
    "lock": ("cli.archive_cmd", "lock", "The store's locks: who holds them."),
    "break-lock": ("cli.archive_cmd", "break_lock", "Remove lock files whose holder is gone (of NAMES, default: every name with no snapshot);..."),
}


@click.group(cls=LazyGroup, lazy=ARCHIVE_COMMANDS)
def store() -> None:
    """Store files and directories as snapshots, and manage the store."""


@store.command("put")
@click.argument("name")
@click.argument("paths", nargs=-1, required=True)
@click.option("--replace", is_flag=True, help="Replace an existing snapshot of the same name.")
@click.option("--chunk-size", default="4M", show_default=True, help="Chunk size (K/M suffix).")
@click.option("--workers", type=click.IntRange(1, 256), default=None, help="Encoder threads (default: CPU count, at most 8: more only queue for the GIL; $GPUSNAP_PUT_WORKERS sets it for every put).")
@click.option("--no-compress", is_flag=True, help="Store chunks raw (zero chunks are still elided).")
@click.option("--exclude", "exclude", multiple=True, metavar="PATTERN",
              help="Leave out what matches this glob (repeatable). Without a /, it matches a base name "
                   "anywhere ('*.o', '.cache'); with one, the path from the top directory stored "
                   "('data/tmp/*'). An excluded directory is left out with all below it.")
@click.option("--exclude-file", "exclude_files", multiple=True, metavar="FILE", type=click.Path(dir_okay=False),
              help="Read --exclude patterns from FILE, one per line (blank lines and lines starting with # "
                   "are ignored; repeatable).")
@click.option("--force", is_flag=True, help="Read every file, even those the files cache says are unchanged "
                                             "(the cache is then rewritten from what was read).")
@click.option("--no-cache", is_flag=True, help="Neither use nor update the files cache: read every file.")
@click.option("--no-xattrs", is_flag=True, help="Do not store extended attributes or ACLs (stored by default: user.*, "
                                                "security.*/trusted.* where readable, and POSIX ACLs: "
                                                "system.posix_acl_access/_default).")
@click.option("--parent", default=None, metavar="SNAP",
              help="Store each changed chunk as a delta against the bytes SNAP held where it was (in the same-named "
                   "file, or wherever its unchanged neighbours were found), where that saves. Default: the newest "
                   "snapshot of the same PATHS written on this host (restic's choice); `latest` as in `store get`.")
@click.option("--no-parent", is_flag=True, help="Choose no parent: every changed chunk is stored whole.")
@tag_option
@click.option("--chunker", type=click.Choice(["fixed", "pages"]), default="fixed", show_default=True,
              help="fixed: CHUNK_SIZE pieces; pages: content-defined cuts on 4 KiB pages (dedups data that "
                   "moved by whole pages, e.g. memory images).")
@json_option
@click.pass_context
@one_line_errors
def store_put(ctx: click.Context, name: str, paths: tuple[str, ...], replace: bool, chunk_size: str,
              workers: int | None, no_compress: bool, exclude: tuple[str, ...], exclude_files: tuple[str, ...],
              force: bool, no_cache: bool, no_xattrs: bool, parent: str | None, no_parent: bool, tags: tuple[str, ...],
              chunker: str, as_json: bool) -> None:
    """Store PATHS (files or directories, each under its base name) as snapshot NAME.

    NAME may hold placeholders, filled in when the put starts: {now} (local time,
    2026-12-07T17-32-37), {utcnow}, {now:STRFTIME}, {hostname}: `store put 'data-{now}' /srv/data`
    from cron makes a new snapshot each run; `store get latest DEST` restores the newest.

    Regular files, directories, symlinks and FIFOs (as entries: a FIFO is never opened) are stored
    with their modes, owners, times, extended attributes, POSIX ACLs and hard links; sockets are skipped with a
    note on stderr (as tar does); devices are refused (--exclude them).

    A file whose path, size, mtime, ctime and inode are what the files cache recorded when it was
    last stored into this store is not read again: its chunks are taken from the cache, each checked
    to be present and sound (borg's files cache; --force or --no-cache read everything)."""
    from sandbox.ops import journal
    from sandbox.ops.snapshot_meta import FilesMeta
    from storage.api import put as pipeline
    from storage.api import FileTreeSource
    name = expand_name(name)
    size = parse_chunk_size(chunk_size)
    patterns = list(exclude) + [p for f in exclude_files for p in _read_patterns(f)]
    meta = FilesMeta(tuple(os.path.abspath(p) for p in paths)).to_json()
    with FileTreeSource(list(paths), exclude=patterns, xattrs=not no_xattrs) as source:  # scanned (and refused) before a store is made
        for note in source.skipped:
            click.echo(f"gpusnap: note: skipped {note}", err=True)
        st = open_store(ctx)
        journal.require_clean(st.path)  # an interrupted dump's workload comes first: `gpusnap recover`
        from storage.api import FilesCache
        cache = FilesCache() if no_cache or force else FilesCache.load(st)
        if parent is not None and no_parent:
            raise click.UsageError("--parent and --no-parent: give one")
        if parent is None and not no_parent:  # restic's: the newest snapshot of the same paths and host
            from storage.api import find_latest
            parent = find_latest(st, host=socket.gethostname(), paths=tuple(meta["paths"]))
        elif parent is not None:
            parent = resolve_name(st, parent, paths=tuple(meta["paths"]) if parent == LATEST else ())
        base = st.load(parent) if parent is not None else None
        with st.writer(name, replace=replace, meta=meta, tags=tags, direct_packs=pipeline.put_direct()) as w, \
                Progress(f"put {name}", ctx.obj["progress"]) as prog:
            prog.start(source.total_bytes)
            res = pipeline.put(w, source, chunk_size=size, workers=workers, compress=not no_compress,
                               progress=prog, chunker=chunker, known=None if no_cache else _lookup(source, cache),
                               parent=base)
            manifest = w.commit()
            pack_writes = w.pack_writes
        if not no_cache:
            _update_cache(st, source, manifest, force)
    report = {"name": name, "parent": parent, "raw_bytes": res.raw_bytes, "new_bytes": res.stored_bytes,
              "seconds": round(res.seconds, 3), "GBps": round(res.gbps, 3), **res.extra,
              "stages": res.stages.table(), "direct_io": st.direct, "pack_writes": pack_writes, "skipped": source.skipped,
              "excluded": source.excluded}
    emit(as_json, report, f"{name}: {human(res.raw_bytes)} in {res.seconds:.2f} s{rate(res.raw_bytes, res.seconds)}, "
         f"{human(res.stored_bytes)} written, {human(res.extra['bytes_dedup'])} deduplicated, "
         f"{human(res.extra['zero_bytes'])} zeros elided"
         + (f", {res.extra['files_unchanged']} unchanged files not read (files cache)"
            if res.extra.get("files_unchanged") else "")
         + (f"; parent {parent}" if parent else ""))


def _lookup(source: FileTreeSource, cache: "FilesCache") -> Any:
    """pipeline.put's `known`: the files cache's references for a file stream of SOURCE."""
    def known(spec: Any, chunker: dict[str, Any]) -> Any:
        k = source.keys.get(spec.name)
        return cache.lookup(k[0], k[1], chunker) if k else None
    return known


def _update_cache(st: Any, source: FileTreeSource, manifest: Manifest, force: bool) -> None:
    """Record MANIFEST's files in the store's files cache (entries under this put's inputs that it no
    longer saw are dropped); a cache that cannot be written is only a slower next put."""
    from storage.api import FilesCache
    cache = FilesCache.load(st)
    roots = [p for p, _ in source.roots]
    for path in [p for p in cache.entries if any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)]:
        del cache.entries[path]
    for s in manifest.streams:
        k = source.keys.get(s.name)
        if k is not None and s.attrs.get("type") == "file":
            cache.record(k[0], k[1], s.attrs.get("chunker", {}), s.chunks, source.scanned_ns)
    try:
        cache.save(st)
    except (OSError, GpusnapError) as e:
        click.echo(f"gpusnap: note: the files cache was not updated: {e}", err=True)


def _read_patterns(path: str) -> list[str]:
    """--exclude-file: one pattern per line; blank lines and # comments ignored; at most 1 MiB."""
    try:
        with open(path, "rb") as f:
            data = f.read((1 << 20) + 1)
    except OSError as e:
        raise click.BadParameter(f"{path}: {e.strerror or e}", param_hint="--exclude-file") from None
    if len(data) > 1 << 20:
        raise click.BadParameter(f"{path}: over 1 MiB of patterns", param_hint="--exclude-file")
    lines = data.decode(errors="replace").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


@store.command("init")
@json_option
@click.pass_context
@one_line_errors
def store_init(ctx: click.Context, as_json: bool) -> None:
    """Create an empty store at --store (put and the dump commands also create it on first use)."""
    path = os.path.abspath(ctx.obj["store"])
    existed = os.path.isfile(path_in(path, MARKER))
    st = open_store(ctx, create=True)
    emit(as_json, {"store": st.path, "created": not existed},
         f"{st.path}: {'already a gpusnap store' if existed else 'empty gpusnap store created'}")


@store.command("get")
@click.argument("name")
@click.argument("dest")
@click.option("--include", "include", multiple=True, metavar="PATTERN",
              help="Only paths matching this glob (and the directories above them); repeatable. Paths start "
                   "at the top directory that was stored, without a leading /: after `store put NAME "
                   "/srv/data`, `--include 'data/models/*'` (`*` also matches /). `store ls NAME` lists them.")
@click.option("--workers", type=click.IntRange(1, 256), default=None, help="Worker threads (default: CPU count, max 16).")
@click.option("--no-same-owner", is_flag=True,
              help="Do not restore recorded owners (the default as root restores them); setuid/setgid bits "
                   "are then dropped, as they are whenever an owner is not restored.")
@click.option("--skip-damaged", is_flag=True,
              help="Restore every file whose chunks are sound and leave out those with a damaged or missing "
                   "chunk (each named on stderr; exit 3), as `restic restore` can. The snapshot is checked "
                   "first (every chunk read once more). Without it a get is all or nothing.")
@latest_options()
@json_option
@click.pass_context
@one_line_errors
def store_get(ctx: click.Context, name: str, dest: str, include: tuple[str, ...], workers: int | None,
              no_same_owner: bool, skip_damaged: bool, tags: tuple[str, ...], latest_paths: tuple[str, ...],
              latest_host: str | None, as_json: bool) -> None:
    """Materialize snapshot NAME into DEST (a new directory), every chunk verified; all or nothing.
    NAME `latest`: the newest files snapshot of this machine (--path, --tag, --host narrow it).

    While it runs, a record in the store's tmp/ names DEST: if the get is killed, `store gc` removes
    the partial hidden tree it left beside DEST; a SIGTERM'd get removes it and the record itself."""
    from storage.api import put as pipeline
    from storage.api import FileTreeSink
    st = open_store(ctx, create=False)
    damaged: list[str] = []
    with terminate_cleanly():
        name = resolve_name(st, name, tags, latest_paths, latest_host)
        if skip_damaged:
            with Progress(f"check {name}", ctx.obj["progress"]) as prog:
                rep = st.verify([name], progress=prog, quarantine=False, read_data=True)
            bad_at = {(p.stream, p.chunk) for p in rep.problems if p.snapshot == name and p.stream is not None}
            if any(p.stream is None and p.snapshot == name for p in rep.problems):
                raise StoreError(f"snapshot {name!r} cannot be read at all: {rep.problems[0]}")
    with terminate_cleanly(), st.shared():
        m = st.load(name)
        if skip_damaged:  # the chunks verify named, then every stream that names one of them
            bad = {s.chunks[i].id for s in m.streams for i in range(len(s.chunks)) if (s.name, i) in bad_at}
        if include:
            m = select_streams(m, include)
        if skip_damaged and bad:
            m, damaged = _without(m, bad)
        with st.inflight_get(dest) as nonce:
            sink = FileTreeSink(dest, same_owner=False if no_same_owner else None, marker=nonce)
            with Progress(f"get {name}", ctx.obj["progress"]) as prog:
                prog.start(m.size)
                res = pipeline.get(st, m, sink, workers=workers, progress=prog)
    emit(as_json, {"name": name, "dest": os.path.abspath(dest), "raw_bytes": res.raw_bytes,
                   "seconds": round(res.seconds, 3), "GBps": round(res.gbps, 3), "stages": res.stages.table(),
                   **({"damaged_not_restored": damaged} if skip_damaged else {})},
         f"{name} -> {dest}: {human(res.raw_bytes)} in {res.seconds:.2f} s{rate(res.raw_bytes, res.seconds)}, verified"
         + (f"; {len(damaged)} damaged file(s) left out" if damaged else ""))
    for d in damaged:
        click.echo(f"gpusnap: damaged, not restored: {d}", err=True)
    if damaged:
        sys.exit(EXIT_DAMAGED)


def _without(m: Manifest, bad: set[str | None]) -> tuple[Manifest, list[str]]:
    """M without the streams that name a chunk of BAD and the hard links to them; the names left out."""
    from storage.api import Manifest as _Manifest
    hit = {s.name for s in m.streams if any(c.id in bad for c in s.chunks)}
    gone = hit | {s.name for s in m.streams if s.attrs.get("type") == "hardlink" and s.attrs.get("target") in hit}
    kept = [s for s in m.streams if s.name not in gone]
    return _Manifest(m.name, kept, m.meta, m.created, m.tags, m.host, m.tool), sorted(gone)


@store.command("ls")
@click.argument("name", required=False)
@click.argument("prefix", required=False)
@click.option("--tag", "tags", multiple=True, metavar="TAG", help="Only snapshots carrying this tag (repeatable).")
@click.option("--kind", default=None, type=click.Choice(SNAPSHOT_KINDS), help="Only this kind.")
@click.option("--since", default=None, metavar="WHEN", help="Only snapshots created since WHEN (ISO time, or an age: 36h, 7d).")
@latest_options(with_tag=False)
@json_option
@click.pass_context
@one_line_errors
def store_ls(ctx: click.Context, name: str | None, prefix: str | None, tags: tuple[str, ...], kind: str | None,
             since: str | None, latest_paths: tuple[str, ...], latest_host: str | None, as_json: bool) -> None:
    """List snapshots, or with NAME the files of snapshot NAME (as `restic ls`, `borg list ARCHIVE`).

    \b
    gpusnap store ls                      the snapshots (--tag/--kind/--since: those that match)
    gpusnap store ls NAME                 every file, directory and link of NAME
    gpusnap store ls NAME data/sub        only data/sub and what lies under it
    gpusnap store ls latest               the files of the newest snapshot of this machine

    Snapshots that do not load, entries of snapshots/ that are not snapshots, and snapshots naming a
    chunk that the last `store verify` found damaged are marked DAMAGED. Paths start at the top
    directory that was stored (`store put NAME /srv/data` stores data/...): the same paths that
    `store get --include` and `store cat` take."""
    if name is not None:
        if kind or since or (tags and name != LATEST):
            raise click.UsageError("--tag/--kind/--since select snapshots; give them without NAME "
                                   "(--tag also with NAME latest)")
        _list_files(ctx, name, prefix, as_json, (tags, latest_paths, latest_host))
        return
    if latest_paths or latest_host is not None:
        raise click.UsageError("--path/--host choose what `latest` is; give them with NAME latest")
    from cli.archive_cmd import matches, parse_since
    from storage.api import DamageMarks
    from storage.api import read_summary
    since_t = parse_since(since)
    st = open_store(ctx, create=False)
    names, strays = st.scan()
    marks = DamageMarks.load(st)
    warm = _warm_names(st)
    rows = []
    for n in names:
        try:
            with st.subdir(SNAPSHOTS) as snaps:
                summ = read_summary(snaps, n)  # a big manifest: its head only (storage/maintenance/summary.py)
            m = summ if summ is not None else st.load(n)
            if not matches(m, tags, kind, since_t):  # type: ignore[arg-type]
                continue
            # a big manifest read by its summary has no chunk list: loaded whole only where marks exist
            bad = marks.damaged_in(st.load(n) if summ is not None and marks.chunks else m)  # type: ignore[arg-type]
            paths = m.meta.get("paths") if m.meta.get("kind") == "files" else None
            rows.append({"name": n, "created": m.created, "size": m.size, "warm": n in warm,
                         "streams": summ.stream_count if summ is not None else len(m.streams),  # type: ignore[union-attr]
                         "kind": m.meta.get("kind", ""), "tags": list(m.tags), "host": m.host,
                         "paths": [str(p) for p in paths] if isinstance(paths, list) else [],
                         "damaged_chunks": len(bad)})
        except GpusnapError as e:
            rows.append({"name": n, "error": str(e)})
    rows += [{"name": s.entry, "error": str(s), "stray": True} for s in strays]
    emit(as_json, rows, "\n".join(_snapshot_lines(rows)))


def _local_time(created: str) -> str:
    """A manifest's creation time as restic shows it: local time to the second (2026-12-07 17:32:37)."""
    from storage.api import parse_created
    try:
        return parse_created(created).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    except GpusnapError:
        return created


def _snapshot_lines(rows: list[dict[str, Any]]) -> list[str]:
    """`store ls`: one line per snapshot, every column as wide as its widest value."""
    heads = ("NAME", "KIND", "SIZE", "STREAMS", "CREATED", "HOST", "PATHS")
    table = [[r["name"], r["kind"] or "-", human(r["size"]), str(r["streams"]), _local_time(r["created"]),
              r["host"] or "-", ",".join(r["paths"]) or "-"] for r in rows if "error" not in r]
    width = [max([len(h)] + [len(t[i]) for t in table]) for i, h in enumerate(heads)]
    right = (2, 3)  # SIZE and STREAMS align right

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(width[i]) if i in right else c.ljust(width[i]) for i, c in enumerate(cells)).rstrip()
    lines = [line(list(heads))]
    it = iter(table)
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name'].ljust(width[0])}  DAMAGED: {r['error']}")
            continue
        lines.append(line(next(it))
                     + (f"  [{','.join(r['tags'])}]" if r["tags"] else "") + ("  WARM" if r["warm"] else "")
                     + (f"  DAMAGED: {r['damaged_chunks']} damaged chunk(s) found by verify; "
                        "`store repair` rewrites them" if r["damaged_chunks"] else ""))
    return lines


def _warm_names(st: Any) -> set[str]:
    """Snapshots of ST whose packs the warm tier holds (none where the tier cannot be read)."""
    from storage.api import WarmTier
    try:
        return set(WarmTier(st).status()["snapshots"])
    except (GpusnapError, OSError):
        return set()


@store.command("warm")
@click.argument("names", nargs=-1)
@click.option("--budget", default=None, metavar="SIZE", help="The warm tier's budget for all stores "
              "together (e.g. 64G; remembered; $GPUSNAP_WARM_BUDGET overrides it). Default: a quarter of "
              "the machine's memory.")
@json_option
@click.pass_context
@one_line_errors
def store_warm(ctx: click.Context, names: tuple[str, ...], budget: str | None, as_json: bool) -> None:
    """Hold the packs of snapshots NAMES in host memory (the warm tier), so that a restore reads them at
    memory speed; without NAMES, show what is warm.

    \b
    The tier is a cache beside the store (a private tmpfs with huge pages at /run/gpusnap/warm for root,
    $GPUSNAP_WARM_DIR to move it): the store keeps every byte, and every byte read from the tier is
    checked as any read. Past the budget, the least recently used warm snapshots (a restore is a use)
    are evicted first. `store cool NAME` gives the memory back."""
    from storage.api import WarmTier
    st = open_store(ctx, create=False)
    tier = WarmTier(st)
    size = parse_size(budget) if budget is not None else None
    if not names:
        s = tier.status()
        lines = [f"warm tier {s['dir']} ({s['memory'] or 'not made yet'}): {human(s['used'])} of "
                 f"{human(s['budget'])} used"] + [f"  {n:32} {human(v['bytes']):>12} {v['packs']:>5} pack(s)"
                                                 for n, v in sorted(s["snapshots"].items())]
        emit(as_json, s, "\n".join(lines))
        return
    reps = []
    for n in names:
        validate_snapshot_name(n)
        r = tier.warm(n, size)
        reps.append(r.as_dict())
        if not as_json:
            click.echo(f"{n}: warm, {human(r.held)} in {r.packs} pack(s) ({human(r.copied)} copied in "
                       f"{r.seconds:.2f} s; tier {human(r.used)} of {human(r.budget)}, {r.memory})"
                       + (f"; evicted {', '.join(r.evicted)}" if r.evicted else ""))
    if as_json:
        emit(True, reps, "")


@store.command("cool")
@click.argument("names", nargs=-1)
@click.option("--all", "everything", is_flag=True, help="Every warm snapshot of this store.")
@json_option
@click.pass_context
@one_line_errors
def store_cool(ctx: click.Context, names: tuple[str, ...], everything: bool, as_json: bool) -> None:
    """Take snapshots NAMES out of the warm tier (their memory given back; the store keeps them)."""
    from storage.api import WarmTier
    if not names and not everything:
        raise click.UsageError("name the snapshots to cool, or give --all")
    for n in names:
        validate_snapshot_name(n)
    st = open_store(ctx, create=False)
    gone = WarmTier(st).cool(None if everything else list(names))
    emit(as_json, {"cooled": gone}, f"cooled: {', '.join(gone)}" if gone else "nothing was warm")


_TYPE_CHARS = {"file": "-", "dir": "d", "symlink": "l", "hardlink": "h", "blob": "b", "fifo": "p"}


def _mode_text(attrs: dict[str, object]) -> str:
    """`ls -l`'s mode column for a stream: its type letter and rwx bits (h: a hard link, b: a blob)."""
    import stat as _stat
    t = str(attrs.get("type"))
    mode = attrs.get("mode")
    bits = _stat.filemode(mode)[1:] if isinstance(mode, int) else "?????????"
    return _TYPE_CHARS.get(t, "?") + bits


def _list_files(ctx: click.Context, name: str, prefix: str | None, as_json: bool,
                latest: tuple[tuple[str, ...], tuple[str, ...], str | None]) -> None:
    st = open_store(ctx, create=False)
    name = resolve_name(st, name, *latest)
    m = st.load(name)
    want = (prefix or "").strip("/")
    streams = [s for s in m.streams if not want or s.name == want or s.name.startswith(want + "/")]
    if want and not streams:
        raise StoreError(f"snapshot {name!r} has no path {want!r} (`gpusnap store ls {name}` lists them all)")
    by_name = {s.name: s for s in m.streams}
    rows, shown = [], []
    for s in streams:
        a = s.attrs
        # another name of a hard-linked file shows the file's mode, owner, time and size (as `ls -l`
        # does); its type stays `hardlink` and `target` names the first name, where the bytes are
        f = by_name.get(a["target"], s) if a.get("type") == "hardlink" else s
        rows.append({"path": s.name, "type": a.get("type"), "mode": f.attrs.get("mode"), "size": f.size,
                     "uid": f.attrs.get("uid"), "gid": f.attrs.get("gid"), "mtime_ns": f.attrs.get("mtime_ns"),
                     **({"target": a["target"]} if "target" in a else {})})
        shown.append(f)
    lines = [f"{'MODE':10} {'OWNER':>11} {'SIZE':>10}  PATH"]
    for r, f in zip(rows, shown):
        owner = f"{r['uid']}:{r['gid']}" if r["uid"] is not None else "-"
        link = f" -> {r['target']}" if r["type"] == "symlink" else (f" (hard link of {r['target']})" if r["type"] == "hardlink" else "")
        lines.append(f"{_mode_text(f.attrs)} {owner:>11} {r['size']:>10}  {r['path']}{link}")
    emit(as_json, rows, "\n".join(lines))


@store.command("tag")
@click.argument("names", nargs=-1, required=True)
@click.option("--add", "add", multiple=True, metavar="TAG", help="Add TAG (repeatable; a tag already there stays once).")
@click.option("--remove", "remove", multiple=True, metavar="TAG", help="Remove TAG (repeatable; an absent tag is no error).")
@click.option("--set", "set_to", multiple=True, metavar="TAG",
              help="Replace every tag with these (repeatable; --set '' removes them all). Not with --add/--remove.")
@json_option
@click.pass_context
@one_line_errors
def store_tag(ctx: click.Context, names: tuple[str, ...], add: tuple[str, ...], remove: tuple[str, ...],
              set_to: tuple[str, ...], as_json: bool) -> None:
    """Change the tags of snapshots NAMES (as `restic tag`): --add, --remove, or --set.

    \b
    gpusnap store tag model-v3 --add release --remove nightly
    gpusnap store tag model-v3 --set prod --set llama

    The manifest is rewritten atomically (FORMAT.md, "Changing tags"); its streams are untouched."""
    from storage.api import retag
    if not (add or remove or set_to):
        raise click.UsageError("give --add, --remove or --set")
    if set_to and (add or remove):
        raise click.UsageError("--set replaces every tag; give it without --add/--remove")
    st = open_store(ctx, create=False)
    rows: list[dict[str, Any]] = []
    for n in names:
        old, new, changed = retag(st, n, add, remove, [t for t in set_to if t] if set_to else None)
        rows.append({"name": n, "old_tags": list(old), "tags": list(new), "changed": changed})
    emit(as_json, rows, "\n".join(f"{r['name']}: [{','.join(r['tags'])}]" + ("" if r["changed"] else " (unchanged)")
                                  for r in rows))


@store.command("inspect")
@click.argument("name")
@latest_options()
@json_option
@click.pass_context
@one_line_errors
def store_inspect(ctx: click.Context, name: str, tags: tuple[str, ...], latest_paths: tuple[str, ...],
                  latest_host: str | None, as_json: bool) -> None:
    """Show a snapshot's metadata (kind, tags, host, the gpusnap version that wrote it), codecs, sizes
    and stream names.

    Per codec: chunk references, their raw bytes, and the bytes stored for its distinct chunks (a
    chunk named twice is stored once). `store ls NAME` lists the files with modes and owners.
    NAME `latest`: the newest files snapshot of this machine (--path, --tag, --host narrow it)."""
    st = open_store(ctx, create=False)
    m = st.load(resolve_name(st, name, tags, latest_paths, latest_host))
    codecs: dict[str, dict[str, int]] = {}
    unique: dict[str, int] = {}
    for s in m.streams:
        for c in s.chunks:
            e = codecs.setdefault(c.codec, {"chunks": 0, "unique_chunks": 0, "raw_bytes": 0, "stored_bytes": 0})
            e["chunks"] += 1
            e["raw_bytes"] += c.raw_len
            if c.id and c.id not in unique:
                unique[c.id] = c.stored_len
                e["unique_chunks"] += 1
                e["stored_bytes"] += c.stored_len
    info: dict[str, Any] = {"name": m.name, "created": m.created, "meta": m.meta, "size": m.size, "tags": list(m.tags),
            "host": m.host, "gpusnap_version": m.tool,
            "stored_bytes_unique": sum(unique.values()), "codecs": codecs,
            "streams": [{"name": s.name, "size": s.size, "type": s.attrs.get("type"), "chunks": len(s.chunks)}
                        for s in m.streams]}
    text = [f"snapshot {m.name}  created {m.created}",
            f"  host {m.host or 'unknown'}, written by gpusnap {m.tool or 'unknown'}, "
            f"tags: {', '.join(m.tags) if m.tags else '(none)'}",
            f"  logical size {human(m.size)}, "
            f"{len(m.streams)} streams, {human(info['stored_bytes_unique'])} stored (unique chunks)",
            f"  meta: {json.dumps({k: v for k, v in m.meta.items() if not k.endswith('stages')}, sort_keys=True)}"]
    for k, v in sorted(codecs.items()):
        text.append(f"  {k:15} {v['chunks']:7} chunks  {human(v['raw_bytes']):>10} raw  "
                    f"{human(v['stored_bytes']):>10} stored ({v['unique_chunks']} unique)")
    text.append("  streams:")
    text += [f"    {str(s.attrs.get('type')):8} {human(s.size):>10}  {s.name}" for s in m.streams]
    emit(as_json, info, "\n".join(text))


_from_option = click.option("--from", "sources", multiple=True, metavar="PATH",
                            help="Where lost chunks may still be: another gpusnap store, or the files and "
                                 "directories that were stored (re-read and kept where they give the wanted "
                                 "chunk ids). Repeatable.")


def _percent(ctx: click.Context, param: click.Parameter, value: str | None) -> float | tuple[int, int] | None:
    if value is None:
        return None
    if "/" in value:  # restic's n/t: group n of t
        a, _, b = value.partition("/")
        if a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b) <= 1 << 20:
            return int(a), int(b)
        raise click.BadParameter(f"{value!r}: give n/t with 1 <= n <= t (e.g. 2/5), or a percentage (10%)")
    try:
        v = float(value.rstrip("%"))
    except ValueError:
        v = -1.0
    if not value.endswith("%") or not 0 < v <= 100:
        raise click.BadParameter(f"{value!r}: give a percentage above 0 and at most 100 (e.g. 10%), or n/t (e.g. 2/5)")
    return v / 100


def _duration(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        v = float(value[:-1]) * units[value[-1]] if value[-1:] in units else float(value)
    except ValueError:
        v = -1.0
    if v < 0:
        raise click.BadParameter(f"{value!r}: give seconds, or a number with s, m or h (e.g. 90s, 10m)")
    return v


@store.command("verify")
@click.argument("name", required=False)
@click.option("--repair", is_flag=True, help="Then rewrite what can be rewritten (as `store repair`).")
@click.option("--read-data", "read_data", is_flag=True,
              help="Also decode every chunk read and check its raw bytes against its id (slower; the default "
                   "check of the stored bytes finds every flipped or lost byte without decompressing).")
@click.option("--read-data-subset", "subset", default=None, metavar="N%|n/t", callback=_percent,
              help="Read only N% of the chunks, a new random choice each run (repeated runs cover the store); "
                   "or n/t (restic's): the n-th of t fixed groups, so that 1/t .. t/t read every chunk once.")
@click.option("--max-duration", "max_duration", default=None, metavar="TIME", callback=_duration,
              help="Stop reading chunks after TIME (seconds, or 90s/10m/2h); what was not read is reported.")
@click.option("--quick", is_flag=True,
              help="Only the structure (restic's `check`): every manifest loaded and checked, the index "
                   "loaded, every chunk a snapshot names present; no chunk read (rot is found without it).")
@_from_option
@json_option
@click.pass_context
@one_line_errors
def store_verify(ctx: click.Context, name: str | None, repair: bool, read_data: bool,
                 subset: float | tuple[int, int] | None,
                 max_duration: float | None, quick: bool, sources: tuple[str, ...], as_json: bool) -> None:
    """Read and check every chunk of NAME (or of every snapshot); exit 3 and name what is damaged.

    Damaged chunk files are moved to the store's quarantine/ so that the next put of the same data
    writes them again (which heals every snapshot that names them); --repair rewrites them now."""
    from sandbox.ops.snapshot_meta import meta_problems
    from storage.api import Problem
    if quick and (repair or sources or read_data or subset is not None or max_duration is not None):
        raise click.UsageError("--quick reads no chunk: give it without --repair/--from/--read-data*/--max-duration")
    if repair or sources:
        ctx.invoke(store_repair, sources=sources, wait=30.0, as_json=as_json)
        return
    st = open_store(ctx, create=False)
    names = [validate_snapshot_name(name)] if name else None
    if name and not st.exists(name):
        raise StoreError(f"no snapshot named {name!r} in {st.path}")
    if quick:
        rep = st.verify_quick(names)
    else:
        with Progress("verify", ctx.obj["progress"]) as prog:
            rep = st.verify(names, progress=prog, sample=subset, max_seconds=max_duration, read_data=read_data)
    for n in rep.snapshots:  # what each sandbox kind's metadata must be (storage does not know it)
        with contextlib.suppress(GpusnapError):  # an unreadable manifest is already a problem
            rep.problems += [Problem(n, None, None, p) for p in meta_problems(st.load(n))]
    problems = [str(p) for p in rep.strays] + [str(p) for p in rep.problems]
    data = {"ok": rep.ok, "snapshots": rep.snapshots, "chunks_checked": rep.chunks_checked,
            "bytes_checked": rep.bytes_checked, "problems": problems, "quarantined": rep.quarantined,
            "not_quarantined": rep.not_quarantined, "chunks_total": rep.chunks_total,
            "chunks_unchecked": rep.chunks_unchecked,
            "damaged_copies": [{"id": c.cid, "pack": c.pack, "offset": c.offset, "why": c.what,
                                "set_aside": c.set_aside} for c in rep.damaged_copies]}
    data["quick"] = quick
    text = [(f"{len(rep.snapshots)} snapshot(s), {rep.chunks_total} chunks present (--quick: none read): " if quick
             else f"{len(rep.snapshots)} snapshot(s), {rep.chunks_checked} chunks, {human(rep.bytes_checked)} checked: ")
            + ("OK" if rep.ok else f"{len(problems)} problem(s)") + _damaged_copies_note(rep.damaged_copies)]
    if rep.chunks_unchecked:
        text.append(f"{rep.chunks_unchecked} of {rep.chunks_total} chunks not read this run "
                    f"({'--read-data-subset' if subset is not None else '--max-duration'}); run again to cover them")
    text += [f"DAMAGED {p}" for p in problems]
    text += [f"DAMAGED COPY {c}" + ("; set aside in quarantine/, the next gc drops it" if c.set_aside else
                                    "; not set aside (the next verify that can lock the store does)")
             for c in rep.damaged_copies]
    if rep.quarantined:
        text.append(f"{len(rep.quarantined)} damaged chunk file(s) moved to quarantine/: the next put of the "
                    "same data rewrites them; `gpusnap store repair --from PATH` rewrites them from PATH")
    if rep.not_quarantined:
        text.append(f"damaged chunks not moved to quarantine/: {rep.not_quarantined}")
    emit(as_json, data, "\n".join(text))
    if not rep.ok:
        sys.exit(EXIT_DAMAGED)


def _damaged_copies_note(copies: list[DamagedCopy]) -> str:
    """The summary line's note of damaged duplicate copies (a sound copy of each serves: exit 0)."""
    if not copies:
        return ""
    where = ", ".join(f"pack {c.pack} offset {c.offset}" for c in copies[:3]) + (", …" if len(copies) > 3 else "")
    gone = ("removed by the next gc" if all(c.set_aside for c in copies) else
            "set aside by the next verify that can lock the store, then removed by gc")
    return f", {len(copies)} damaged duplicate cop{'y' if len(copies) == 1 else 'ies'} ({where}), {gone}"


@store.command("repair")
@_from_option
@click.option("--wait", default=30.0, show_default=True, help="Seconds to wait for running puts/gets.")
@json_option
@click.pass_context
@one_line_errors
def store_repair(ctx: click.Context, sources: tuple[str, ...], wait: float, as_json: bool) -> None:
    """Verify every snapshot and rewrite each missing or damaged chunk from wherever its exact bytes
    still are (a quarantined copy that is fine after all, or --from PATH); report what is lost.

    Exit 0 when every snapshot is whole again, 3 when something is lost (the report names it)."""
    from storage.api import repair as repair_store
    st = open_store(ctx, create=False)
    with Progress("repair", ctx.obj["progress"]) as prog:
        rep = repair_store(st, list(sources), timeout=wait, progress=prog)
    lost = [str(p) for p in rep.strays] + [str(p) for p in rep.lost]
    data = {"ok": rep.ok, "damaged_chunks": rep.damaged, "repaired": rep.repaired, "lost": lost}
    text = [f"{rep.damaged} chunk(s) missing or damaged, {len(rep.repaired)} rewritten, "
            + ("every snapshot is whole" if rep.ok else f"{len(lost)} problem(s) remain")]
    text += [f"REPAIRED {cid[:16]}… from {where}" for cid, where in sorted(rep.repaired.items())]
    text += [f"LOST {p}" for p in lost]
    emit(as_json, data, "\n".join(text))
    if not rep.ok:
        sys.exit(EXIT_DAMAGED)


@store.command("migrate")
@click.option("--wait", default=30.0, show_default=True, help="Seconds to wait for running puts/gets.")
@json_option
@click.pass_context
@one_line_errors
def store_migrate(ctx: click.Context, wait: float, as_json: bool) -> None:
    """Move the chunk files of a version 1/2 store into pack files (store format v3 and later).

    Not needed to use an old store (its chunk files are read as they are); it makes reads sequential.
    A chunk file that fails its check is left in place and named (exit 3)."""
    from storage.api import migrate
    from sandbox.ops import journal
    st = open_store(ctx, create=False)
    journal.require_clean(st.path)
    rep = migrate(st, wait)
    data = {"moved": rep.moved, "bytes_moved": rep.bytes_moved, "left": rep.left}
    emit(as_json, data, "\n".join([f"moved {rep.moved} chunk files ({human(rep.bytes_moved)}) into packs"]
                                  + [f"LEFT {x}" for x in rep.left]))
    if rep.left:
        sys.exit(EXIT_DAMAGED)


@store.command("rm")
@click.argument("names", nargs=-1, required=True)
@json_option
@click.pass_context
@one_line_errors
def store_rm(ctx: click.Context, names: tuple[str, ...], as_json: bool) -> None:
    """Remove snapshots and their companions (`NAME.gpu` of a GPU sandbox), or stray entries that `ls`
    lists as DAMAGED; chunks are reclaimed by `gc`.

    Every NAME is tried; those that cannot be removed are reported and the exit status is 1."""
    from sandbox.ops import journal
    from sandbox.ops.snapshot_meta import remove_with_companions
    st = open_store(ctx, create=False)
    journal.require_clean(st.path)
    removed: list[str] = []
    errors: list[dict[str, str]] = []
    for n in names:
        try:
            removed += remove_with_companions(st, n)  # a runsc snapshot's NAME.gpu goes with it
        except GpusnapError as e:
            errors.append({"name": n, "error": str(e)})
    text = [f"removed {r}" for r in removed]
    emit(as_json, {"removed": removed, "errors": errors}, "\n".join(text))
    for err in errors:
        click.echo(f"gpusnap: {err['error']}", err=True)
    if errors:
        sys.exit(EXIT_FAILED)


@store.command("gc")
@click.option("--wait", default=30.0, show_default=True, help="Seconds to wait for running puts/gets.")
@json_option
@click.pass_context
@one_line_errors
def store_gc(ctx: click.Context, wait: float, as_json: bool) -> None:
    """Delete what gpusnap owns and no longer needs: chunks no snapshot references, leftovers of
    interrupted puts and gets whose process is gone, lock files of names without a snapshot.

    Anything else found in the store is reported and left alone; damage found exits 3."""
    from sandbox.ops import journal
    from storage.api import collect
    st = open_store(ctx, create=False)
    journal.require_clean(st.path)
    rep = collect(st, wait)
    data = {"chunks_removed": rep.chunks_removed, "bytes_freed": rep.bytes_freed, "tmp_removed": rep.tmp_removed,
            "gets_cleaned": rep.gets_cleaned, "locks_removed": rep.locks_removed,
            "quarantine_removed": rep.quarantine_removed, "packs_removed": rep.packs_removed,
            "packs_repacked": rep.packs_repacked, "packs_unindexed": rep.packs_unindexed, "in_use": rep.in_use,
            "left": rep.left, "damage": rep.damage}
    text = [f"freed {human(rep.bytes_freed)}: {rep.chunks_removed} unreferenced chunks removed, "
            f"{rep.packs_removed} packs removed ({rep.packs_repacked} of them repacked, {rep.packs_unindexed} "
            f"never indexed: left by a killed put), {rep.quarantine_removed} quarantined chunks, "
            f"{rep.tmp_removed} temporary entries ({rep.gets_cleaned} partial get trees), "
            f"{rep.locks_removed} stale lock files"]
    if rep.in_use:
        text.append(f"kept {rep.in_use} temporary entries of processes still running")
    text += [f"LEFT {x}" for x in rep.left] + [f"DAMAGED {x}" for x in rep.damage]
    emit(as_json, data, "\n".join(text))
    if rep.damage:
        sys.exit(EXIT_DAMAGED)


COMMANDS = [store]


def select_streams(m: Manifest, patterns: tuple[str, ...]) -> Manifest:
    """M restricted to the streams matching any glob in PATTERNS, plus the directories above them."""
    import fnmatch
    picked = {s.name for s in m.streams if any(fnmatch.fnmatchcase(s.name, p) for p in patterns)}
    if not picked:
        raise StoreError(f"no stream of {m.name!r} matches {', '.join(patterns)} (`gpusnap store ls {m.name}` lists them)")
    from storage.api import Manifest, Stream
    parents = {"/".join(n.split("/")[:i]) for n in picked for i in range(1, n.count("/") + 1)}
    keep = picked | parents
    by_name = {s.name: s for s in m.streams}
    out = []
    for s in m.streams:
        if s.name not in keep:
            continue
        if s.attrs.get("type") == "hardlink" and s.attrs.get("target") not in keep:
            # a link chosen without the name it links to: restored as that file (its data and attributes)
            target = by_name[s.attrs["target"]]
            s = Stream(s.name, dict(target.attrs), list(target.chunks))
        out.append(s)
    return Manifest(m.name, out, m.meta, m.created, m.tags, m.host, m.tool)
