"""`gpusnap store ...`: files and directories as snapshots, and the store's own upkeep."""
from __future__ import annotations

import json
import os
import sys

import click

from storage import pipeline
from storage.errors import EXIT_DAMAGED
from storage.filetree import FileTreeSink, FileTreeSource
from storage.manifest import ManifestError
from storage.names import validate_snapshot_name
from storage.progress import Progress
from storage.store import StoreError

from sandbox.cli.common import emit, human, json_option, one_line_errors, open_store, parse_chunk_size

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
@click.option("--chunker", type=click.Choice(["fixed", "pages"]), default="fixed", show_default=True,
              help="fixed: CHUNK_SIZE pieces; pages: content-defined cuts on 4 KiB pages (dedups data that "
                   "moved by whole pages, e.g. memory images).")
@json_option
@click.pass_context
@one_line_errors
def store_put(ctx: click.Context, name: str, paths: tuple[str, ...], replace: bool, chunk_size: str,
              workers: int | None, no_compress: bool, chunker: str, as_json: bool) -> None:
    """Store PATHS (files or directories, each under its base name) as snapshot NAME."""
    validate_snapshot_name(name)
    size = parse_chunk_size(chunk_size)
    source = FileTreeSource(list(paths))
    st = open_store(ctx)
    with st.writer(name, replace=replace, meta={"kind": "files", "paths": [os.path.abspath(p) for p in paths]}) as w, \
            Progress(f"put {name}", ctx.obj["progress"]) as prog:
        prog.start(source.total_bytes)
        res = pipeline.put(w, source, chunk_size=size, workers=workers, compress=not no_compress, progress=prog,
                           chunker=chunker)
        w.commit()
    report = {"name": name, "raw_bytes": res.raw_bytes, "new_bytes": res.stored_bytes,
              "seconds": round(res.seconds, 3), "GBps": round(res.gbps, 3), **res.extra,
              "stages": res.stages.table(), "direct_io": st.direct}
    emit(as_json, report, f"{name}: {human(res.raw_bytes)} in {res.seconds:.2f} s ({res.gbps:.2f} GB/s), "
         f"{human(res.stored_bytes)} written, {human(res.extra['bytes_dedup'])} deduplicated, "
         f"{human(res.extra['zero_bytes'])} zeros elided")


@store.command("get")
@click.argument("name")
@click.argument("dest")
@click.option("--workers", type=click.IntRange(1, 256), default=None, help="Worker threads (default: CPU count, max 16).")
@json_option
@click.pass_context
@one_line_errors
def store_get(ctx: click.Context, name: str, dest: str, workers: int | None, as_json: bool) -> None:
    """Materialize snapshot NAME into DEST (a new directory), every chunk verified; all or nothing."""
    st = open_store(ctx, create=False)
    with st.shared():
        m = st.load(validate_snapshot_name(name))
        sink = FileTreeSink(dest)
        with Progress(f"get {name}", ctx.obj["progress"]) as prog:
            prog.start(m.size)
            res = pipeline.get(st, m, sink, workers=workers, progress=prog)
    emit(as_json, {"name": name, "dest": os.path.abspath(dest), "raw_bytes": res.raw_bytes,
                   "seconds": round(res.seconds, 3), "GBps": round(res.gbps, 3), "stages": res.stages.table()},
         f"{name} -> {dest}: {human(res.raw_bytes)} in {res.seconds:.2f} s ({res.gbps:.2f} GB/s), verified")


@store.command("ls")
@json_option
@click.pass_context
@one_line_errors
def store_ls(ctx: click.Context, as_json: bool) -> None:
    """List snapshots."""
    st = open_store(ctx)
    rows = []
    for n in st.names():
        try:
            m = st.load(n)
            rows.append({"name": n, "created": m.created, "size": m.size, "streams": len(m.streams),
                         "kind": m.meta.get("kind", "")})
        except (ManifestError, StoreError) as e:
            rows.append({"name": n, "error": str(e)})
    lines = [f"{'NAME':32} {'KIND':8} {'SIZE':>12} {'STREAMS':>8}  CREATED"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:32} DAMAGED: {r['error']}")
        else:
            lines.append(f"{r['name']:32} {r['kind']:8} {human(r['size']):>12} {r['streams']:>8}  {r['created']}")
    emit(as_json, rows, "\n".join(lines))


@store.command("inspect")
@click.argument("name")
@json_option
@click.pass_context
@one_line_errors
def store_inspect(ctx: click.Context, name: str, as_json: bool) -> None:
    """Show a snapshot's streams, codecs, sizes and metadata."""
    st = open_store(ctx, create=False)
    m = st.load(validate_snapshot_name(name))
    codecs: dict[str, dict[str, int]] = {}
    unique: dict[str, int] = {}
    for s in m.streams:
        for c in s.chunks:
            e = codecs.setdefault(c.codec, {"chunks": 0, "raw_bytes": 0, "stored_bytes": 0})
            e["chunks"] += 1
            e["raw_bytes"] += c.raw_len
            e["stored_bytes"] += c.stored_len
            if c.id:
                unique[c.id] = c.stored_len
    info = {"name": m.name, "created": m.created, "meta": m.meta, "size": m.size,
            "stored_bytes_unique": sum(unique.values()), "codecs": codecs,
            "streams": [{"name": s.name, "size": s.size, "type": s.attrs.get("type"), "chunks": len(s.chunks)}
                        for s in m.streams]}
    text = [f"snapshot {m.name}  created {m.created}", f"  logical size {human(m.size)}, "
            f"{len(m.streams)} streams, {human(info['stored_bytes_unique'])} stored (unique chunks)",
            f"  meta: {json.dumps({k: v for k, v in m.meta.items() if not k.endswith('stages')}, sort_keys=True)}"]
    for k, v in sorted(codecs.items()):
        text.append(f"  {k:15} {v['chunks']:7} chunks  {human(v['raw_bytes']):>10} raw  {human(v['stored_bytes']):>10} stored")
    emit(as_json, info, "\n".join(text))


@store.command("verify")
@click.argument("name", required=False)
@json_option
@click.pass_context
@one_line_errors
def store_verify(ctx: click.Context, name: str | None, as_json: bool) -> None:
    """Read and check every chunk of NAME (or of every snapshot); exit 3 and name what is damaged."""
    st = open_store(ctx, create=False)
    names = [validate_snapshot_name(name)] if name else None
    if name and not st.exists(name):
        raise StoreError(f"no snapshot named {name!r} in {st.path}")
    with Progress("verify", ctx.obj["progress"]) as prog:
        rep = st.verify(names, progress=prog)
    data = {"ok": rep.ok, "snapshots": rep.snapshots, "chunks_checked": rep.chunks_checked,
            "bytes_checked": rep.bytes_checked, "problems": [str(p) for p in rep.problems]}
    text = [f"{len(rep.snapshots)} snapshot(s), {rep.chunks_checked} chunks, {human(rep.bytes_checked)} checked: "
            + ("OK" if rep.ok else f"{len(rep.problems)} problem(s)")]
    text += [f"DAMAGED {p}" for p in rep.problems]
    emit(as_json, data, "\n".join(text))
    if not rep.ok:
        sys.exit(EXIT_DAMAGED)


@store.command("rm")
@click.argument("names", nargs=-1, required=True)
@click.pass_context
@one_line_errors
def store_rm(ctx: click.Context, names: tuple[str, ...]) -> None:
    """Remove snapshots (their chunks are reclaimed by `gc`)."""
    st = open_store(ctx, create=False)
    for n in names:
        st.remove(validate_snapshot_name(n))


@store.command("gc")
@click.option("--wait", default=30.0, show_default=True, help="Seconds to wait for running puts/gets.")
@json_option
@click.pass_context
@one_line_errors
def store_gc(ctx: click.Context, wait: float, as_json: bool) -> None:
    """Delete chunks no snapshot references, and leftovers of interrupted writes."""
    st = open_store(ctx, create=False)
    rep = st.gc(timeout=wait)
    emit(as_json, {"chunks_removed": rep.chunks_removed, "bytes_freed": rep.bytes_freed,
                   "tmp_removed": rep.tmp_removed},
         f"removed {rep.chunks_removed} chunks ({human(rep.bytes_freed)}) and {rep.tmp_removed} temporary files")



COMMANDS = [store]
