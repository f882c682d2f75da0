"""What `store ls` shows of a big snapshot, read from the head of its manifest without its streams.

Guarantees kept here: a manifest of at most FULL_CHECK_MAX bytes is not read here (ls loads and checks
it whole, as before); a bigger one that this version wrote (fields first, `summary`, then `streams`
last: FORMAT.md, "Manifests") is read only up to its `streams` key, at most HEAD_MAX bytes, and its
fields are type-checked; anything else (no summary, an unexpected layout, bad types) gives None, and
the caller loads the manifest whole. A summary is not checked against the checksum (that needs every
stream): `verify`, `get` and every restore check the whole manifest, and ls says the size it shows is
the summary's.
"""
from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from storage.fs.directio import read_to_end
from storage.format.manifest import validate_tag
from storage.base.names import validate_snapshot_name

FULL_CHECK_MAX = 8 << 20   # manifests up to this size are loaded and checked whole by ls
HEAD_MAX = 1 << 20         # the most of a big manifest's head read for its summary


@dataclass(frozen=True)
class Summary:
    name: str
    created: str
    size: int
    stream_count: int
    meta: dict[str, Any] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    host: str = ""


def read_summary(snaps_fd: int, name: str) -> Summary | None:
    """The summary of snapshot NAME (manifest in the checked directory SNAPS_FD), or None: see above."""
    try:
        fd = os.open(f"{validate_snapshot_name(name)}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=snaps_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= FULL_CHECK_MAX:
            return None
        head = read_to_end(fd, HEAD_MAX).decode("utf-8", "replace")
    finally:
        os.close(fd)
    fields = _fields_before_streams(head)
    try:
        s = fields["summary"]
        out = Summary(fields["name"], fields["created"], s["size"], s["streams"], fields.get("meta", {}),
                      tuple(validate_tag(t) for t in fields.get("tags", [])), fields.get("host", ""))
    except (KeyError, TypeError, ValueError, Exception):  # noqa: BLE001 - any surprise: load it whole
        return None
    ok = (fields.get("format") == "gpusnap-manifest" and out.name == name and isinstance(out.created, str)
          and type(out.size) is int and type(out.stream_count) is int and out.size >= 0 and out.stream_count >= 0
          and isinstance(out.meta, dict) and isinstance(out.host, str))
    return out if ok else None


def _fields_before_streams(text: str) -> dict[str, Any]:
    """The top-level fields of the JSON object TEXT begins, up to its `streams` key ({} if none)."""
    dec = json.JSONDecoder()
    i = _ws(text, 0)
    if not text.startswith("{", i):
        return {}
    i += 1
    out: dict[str, Any] = {}
    try:
        while True:
            i = _ws(text, i)
            key, i = dec.raw_decode(text, i)
            i = _ws(text, i)
            if not isinstance(key, str) or not text.startswith(":", i):
                return {}
            if key == "streams":
                return out
            value, i = dec.raw_decode(text, _ws(text, i + 1))
            out[key] = value
            i = _ws(text, i)
            if not text.startswith(",", i):
                return {}
            i += 1
    except (ValueError, RecursionError):
        return {}


def _ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def find_latest(st: Any, *, kind: str = "files", host: str | None = None, paths: tuple[str, ...] | None = None,
                tags: tuple[str, ...] = ()) -> str | None:
    """The name of the newest snapshot (by `created`) of KIND in store ST written on HOST (None: any
    host; a manifest without a host matches none but None), whose meta `paths` are exactly PATHS (as
    a set; None: any), carrying every tag in TAGS; None when no snapshot matches. A manifest that does
    not load is passed over (`store ls` and `verify` name it). What `latest` means (restic's), and
    the parent a `store put` chooses for itself."""
    from storage.base.errors import GpusnapError
    from storage.format.storedir import SNAPSHOTS
    from storage.maintenance.retention import parse_created
    best: tuple[Any, str] | None = None
    want = None if paths is None else sorted(set(paths))
    for n in st.names():
        try:
            with st.subdir(SNAPSHOTS) as snaps:
                m = read_summary(snaps, n) or st.load(n)
            if m.meta.get("kind", "files") != kind or (host is not None and m.host != host):
                continue
            if any(t not in m.tags for t in tags):
                continue
            got = m.meta.get("paths")
            if want is not None and not (isinstance(got, list) and sorted(set(map(str, got))) == want):
                continue
            when = parse_created(m.created)
        except GpusnapError:
            continue
        if best is None or when > best[0]:
            best = (when, n)
    return best[1] if best else None
