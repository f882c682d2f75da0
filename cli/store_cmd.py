"""`gpusnap store ...`: files and directories as snapshots, and the store's own upkeep."""
from __future__ import annotations

import contextlib
import json
import os
import sys

import click

from storage import pipeline
from storage.errors import EXIT_DAMAGED, EXIT_FAILED, GpusnapError
from storage.filetree import FileTreeSink, FileTreeSource
from storage.gc import collect
from storage.manifest import Manifest
from storage.names import validate_snapshot_name
from cli.progress import Progress
from storage.repair import repair as repair_store
from storage.store import Problem, StoreError

from sandbox.ops import journal
from sandbox.ops.snapshot_meta import FilesMeta, meta_problems, remove_with_companions
from cli.common import emit, human, json_option, one_line_errors, open_store, parse_chunk_size, tag_option

@click.group()
def store() -> None:
    """Store files and directories as snapshots, and manage the store."""


@store.command("put")
@click.argument("name")
@click.argument("paths", nargs=-1, required=True)
@click.option("--replace", is_flag=True, help="Replace an existing snapshot of the same name.")
@click.option("--chunk-size", default="4M", show_default=True, help="Chunk size (K/M suffix).")
@click.option("--workers", type=click.IntRange(1, 256), default=None, help="Worker threads (default: CPU count, max 16).")
@click.option("--no-compress", is_flag=True, help="Store chunks raw (zero chunks are still elided).")
@tag_option
@click.option("--chunker", type=click.Choice(["fixed", "pages"]), default="fixed", show_default=True,
              help="fixed: CHUNK_SIZE pieces; pages: content-defined cuts on 4 KiB pages (dedups data that "
                   "moved by whole pages, e.g. memory images).")
@json_option
@click.pass_context
@one_line_errors
def store_put(ctx: click.Context, name: str, paths: tuple[str, ...], replace: bool, chunk_size: str,
              workers: int | None, no_compress: bool, tags: tuple[str, ...], chunker: str, as_json: bool) -> None:
    """Store PATHS (files or directories, each under its base name) as snapshot NAME."""
    validate_snapshot_name(name)
    size = parse_chunk_size(chunk_size)
    meta = FilesMeta(tuple(os.path.abspath(p) for p in paths)).to_json()
    with FileTreeSource(list(paths)) as source:  # scanned (and refused) before a store is made
        st = open_store(ctx)
        journal.require_clean(st.path)  # an interrupted dump's workload comes first: `gpusnap recover`
        with st.writer(name, replace=replace, meta=meta, tags=tags) as w, \
                Progress(f"put {name}", ctx.obj["progress"]) as prog:
            prog.start(source.total_bytes)
            res = pipeline.put(w, source, chunk_size=size, workers=workers, compress=not no_compress,
                               progress=prog, chunker=chunker)
            w.commit()
    report = {"name": name, "raw_bytes": res.raw_bytes, "new_bytes": res.stored_bytes,
              "seconds": round(res.seconds, 3), "GBps": round(res.gbps, 3), **res.extra,
              "stages": res.stages.table(), "direct_io": st.direct}
    emit(as_json, report, f"{name}: {human(res.raw_bytes)} in {res.seconds:.2f} s ({res.gbps:.2f} GB/s), "
         f"{human(res.stored_bytes)} written, {human(res.extra['bytes_dedup'])} deduplicated, "
         f"{human(res.extra['zero_bytes'])} zeros elided")


@store.command("init")
@json_option
@click.pass_context
@one_line_errors
def store_init(ctx: click.Context, as_json: bool) -> None:
    """Create an empty store at --store (put and the dump commands also create it on first use)."""
    path = os.path.abspath(ctx.obj["store"])
    existed = os.path.isfile(os.path.join(path, "gpusnap-store.json"))
    st = open_store(ctx, create=True)
    emit(as_json, {"store": st.path, "created": not existed},
         f"{st.path}: {'already a gpusnap store' if existed else 'empty gpusnap store created'}")


@store.command("get")
@click.argument("name")
@click.argument("dest")
@click.option("--include", "include", multiple=True, metavar="PATTERN",
              help="Only streams matching this glob (and the directories above them); repeatable.")
@click.option("--workers", type=click.IntRange(1, 256), default=None, help="Worker threads (default: CPU count, max 16).")
@click.option("--no-same-owner", is_flag=True,
              help="Do not restore recorded owners (the default as root restores them); setuid/setgid bits "
                   "are then dropped, as they are whenever an owner is not restored.")
@json_option
@click.pass_context
@one_line_errors
def store_get(ctx: click.Context, name: str, dest: str, include: tuple[str, ...], workers: int | None,
              no_same_owner: bool, as_json: bool) -> None:
    """Materialize snapshot NAME into DEST (a new directory), every chunk verified; all or nothing.

    While it runs, a record in the store's tmp/ names DEST: if the get is killed, `store gc` removes
    the partial hidden tree it left beside DEST."""
    st = open_store(ctx, create=False)
    with st.shared():
        m = st.load(validate_snapshot_name(name))
        if include:
            m = select_streams(m, include)
        with st.inflight_get(dest):
            sink = FileTreeSink(dest, same_owner=False if no_same_owner else None)
            with Progress(f"get {name}", ctx.obj["progress"]) as prog:
                prog.start(m.size)
                res = pipeline.get(st, m, sink, workers=workers, progress=prog)
    emit(as_json, {"name": name, "dest": os.path.abspath(dest), "raw_bytes": res.raw_bytes,
                   "seconds": round(res.seconds, 3), "GBps": round(res.gbps, 3), "stages": res.stages.table()},
         f"{name} -> {dest}: {human(res.raw_bytes)} in {res.seconds:.2f} s ({res.gbps:.2f} GB/s), verified")


@store.command("ls")
@click.option("--tag", "tags", multiple=True, metavar="TAG", help="Only snapshots carrying this tag (repeatable).")
@click.option("--kind", default=None, type=click.Choice(["files", "gpu", "criu", "runsc"]), help="Only this kind.")
@click.option("--since", default=None, metavar="WHEN", help="Only snapshots created since WHEN (ISO time, or an age: 36h, 7d).")
@json_option
@click.pass_context
@one_line_errors
def store_ls(ctx: click.Context, tags: tuple[str, ...], kind: str | None, since: str | None, as_json: bool) -> None:
    """List snapshots (with --tag/--kind/--since, those that match) and, marked DAMAGED, snapshots that
    do not load and entries of snapshots/ that are not snapshots."""
    from cli.archive_cmd import matches, parse_since
    since_t = parse_since(since)
    st = open_store(ctx, create=False)
    names, strays = st.scan()
    rows = []
    for n in names:
        try:
            m = st.load(n)
            if not matches(m, tags, kind, since_t):
                continue
            rows.append({"name": n, "created": m.created, "size": m.size, "streams": len(m.streams),
                         "kind": m.meta.get("kind", ""), "tags": list(m.tags), "host": m.host})
        except GpusnapError as e:
            rows.append({"name": n, "error": str(e)})
    rows += [{"name": s.entry, "error": str(s), "stray": True} for s in strays]
    lines = [f"{'NAME':32} {'KIND':8} {'SIZE':>12} {'STREAMS':>8}  CREATED"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:32} DAMAGED: {r['error']}")
        else:
            lines.append(f"{r['name']:32} {r['kind']:8} {human(r['size']):>12} {r['streams']:>8}  {r['created']}"
                         + (f"  [{','.join(r['tags'])}]" if r["tags"] else ""))
    emit(as_json, rows, "\n".join(lines))


@store.command("inspect")
@click.argument("name")
@json_option
@click.pass_context
@one_line_errors
def store_inspect(ctx: click.Context, name: str, as_json: bool) -> None:
    """Show a snapshot's streams, codecs, sizes and metadata.

    Per codec: chunk references, their raw bytes, and the bytes stored for its distinct chunks (a
    chunk named twice is stored once)."""
    st = open_store(ctx, create=False)
    m = st.load(validate_snapshot_name(name))
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
    info = {"name": m.name, "created": m.created, "meta": m.meta, "size": m.size,
            "stored_bytes_unique": sum(unique.values()), "codecs": codecs,
            "streams": [{"name": s.name, "size": s.size, "type": s.attrs.get("type"), "chunks": len(s.chunks)}
                        for s in m.streams]}
    text = [f"snapshot {m.name}  created {m.created}", f"  logical size {human(m.size)}, "
            f"{len(m.streams)} streams, {human(info['stored_bytes_unique'])} stored (unique chunks)",
            f"  meta: {json.dumps({k: v for k, v in m.meta.items() if not k.endswith('stages')}, sort_keys=True)}"]
    for k, v in sorted(codecs.items()):
        text.append(f"  {k:15} {v['chunks']:7} chunks  {human(v['raw_bytes']):>10} raw  "
                    f"{human(v['stored_bytes']):>10} stored ({v['unique_chunks']} unique)")
    emit(as_json, info, "\n".join(text))


_from_option = click.option("--from", "sources", multiple=True, metavar="PATH",
                            help="Where lost chunks may still be: another gpusnap store, or the files and "
                                 "directories that were stored (re-read and kept where they give the wanted "
                                 "chunk ids). Repeatable.")


def _percent(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        v = float(value.rstrip("%"))
    except ValueError:
        v = -1.0
    if not value.endswith("%") or not 0 < v <= 100:
        raise click.BadParameter(f"{value!r}: give a percentage above 0 and at most 100, e.g. 10%")
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
@click.option("--read-data-subset", "subset", default=None, metavar="N%", callback=_percent,
              help="Read only N% of the chunks, a new random choice each run (repeated runs cover the store).")
@click.option("--max-duration", "max_duration", default=None, metavar="TIME", callback=_duration,
              help="Stop reading chunks after TIME (seconds, or 90s/10m/2h); what was not read is reported.")
@_from_option
@json_option
@click.pass_context
@one_line_errors
def store_verify(ctx: click.Context, name: str | None, repair: bool, read_data: bool, subset: float | None,
                 max_duration: float | None, sources: tuple[str, ...], as_json: bool) -> None:
    """Read and check every chunk of NAME (or of every snapshot); exit 3 and name what is damaged.

    Damaged chunk files are moved to the store's quarantine/ so that the next put of the same data
    writes them again (which heals every snapshot that names them); --repair rewrites them now."""
    if repair or sources:
        ctx.invoke(store_repair, sources=sources, wait=30.0, as_json=as_json)
        return
    st = open_store(ctx, create=False)
    names = [validate_snapshot_name(name)] if name else None
    if name and not st.exists(name):
        raise StoreError(f"no snapshot named {name!r} in {st.path}")
    with Progress("verify", ctx.obj["progress"]) as prog:
        rep = st.verify(names, progress=prog, sample=subset, max_seconds=max_duration, read_data=read_data)
    for n in rep.snapshots:  # what each sandbox kind's metadata must be (storage does not know it)
        with contextlib.suppress(GpusnapError):  # an unreadable manifest is already a problem
            rep.problems += [Problem(n, None, None, p) for p in meta_problems(st.load(n))]
    problems = [str(p) for p in rep.strays] + [str(p) for p in rep.problems]
    data = {"ok": rep.ok, "snapshots": rep.snapshots, "chunks_checked": rep.chunks_checked,
            "bytes_checked": rep.bytes_checked, "problems": problems, "quarantined": rep.quarantined,
            "not_quarantined": rep.not_quarantined, "chunks_total": rep.chunks_total,
            "chunks_unchecked": rep.chunks_unchecked}
    text = [f"{len(rep.snapshots)} snapshot(s), {rep.chunks_checked} chunks, {human(rep.bytes_checked)} checked: "
            + ("OK" if rep.ok else f"{len(problems)} problem(s)")]
    if rep.chunks_unchecked:
        text.append(f"{rep.chunks_unchecked} of {rep.chunks_total} chunks not read this run "
                    f"({'--read-data-subset' if subset is not None else '--max-duration'}); run again to cover them")
    text += [f"DAMAGED {p}" for p in problems]
    if rep.quarantined:
        text.append(f"{len(rep.quarantined)} damaged chunk file(s) moved to quarantine/: the next put of the "
                    "same data rewrites them; `gpusnap store repair --from PATH` rewrites them from PATH")
    if rep.not_quarantined:
        text.append(f"damaged chunks not moved to quarantine/: {rep.not_quarantined}")
    emit(as_json, data, "\n".join(text))
    if not rep.ok:
        sys.exit(EXIT_DAMAGED)


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
    """Move the chunk files of a version 1/2 store into pack files (store format v3).

    Not needed to use an old store (its chunk files are read as they are); it makes reads sequential.
    A chunk file that fails its check is left in place and named (exit 3)."""
    from storage.migrate import migrate
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
    for e in errors:
        click.echo(f"gpusnap: {e['error']}", err=True)
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
    st = open_store(ctx, create=False)
    journal.require_clean(st.path)
    rep = collect(st, wait)
    data = {"chunks_removed": rep.chunks_removed, "bytes_freed": rep.bytes_freed, "tmp_removed": rep.tmp_removed,
            "gets_cleaned": rep.gets_cleaned, "locks_removed": rep.locks_removed,
            "quarantine_removed": rep.quarantine_removed, "packs_removed": rep.packs_removed,
            "packs_repacked": rep.packs_repacked, "in_use": rep.in_use, "left": rep.left, "damage": rep.damage}
    text = [f"removed {rep.chunks_removed} chunks ({human(rep.bytes_freed)}), {rep.tmp_removed} temporary entries "
            f"({rep.gets_cleaned} partial get trees), {rep.locks_removed} stale lock files, "
            f"{rep.quarantine_removed} quarantined chunks; {rep.packs_removed} packs removed "
            f"({rep.packs_repacked} of them repacked)"]
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
        raise StoreError(f"no stream of {m.name!r} matches {', '.join(patterns)} (`store inspect` lists them)")
    parents = {"/".join(n.split("/")[:i]) for n in picked for i in range(1, n.count("/") + 1)}
    keep = picked | parents
    return Manifest(m.name, [s for s in m.streams if s.name in keep], m.meta, m.created, m.tags, m.host, m.tool)
