"""Snapshot manifests: the versioned, self-checksummed JSON record naming a snapshot's streams.

Guarantees kept here: Manifest.loads accepts only a manifest whose checksum matches its content,
whose format and version this code knows (FORMAT.md, "Manifests"), whose `meta` is a JSON object with
a `kind`, and whose streams form a tree that can be materialized without following a link: no
stream lies under a stream that is not a directory (a symlink `x/l` and then `x/l/file` is damage),
every attribute has its documented type, and a hard link names an earlier file stream (check_tree).
"""
from __future__ import annotations

import functools
import json
import re
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import blake3

from storage.codecs.registry import CODEC_IDS, ZERO
from storage.base.names import STREAM_PATH_MAX, validate_snapshot_name, validate_stream_name

from storage.base.errors import DamageError, GpusnapError
from storage.base import limits
from storage.base.limits import MAX_RAW_CHUNK, MAX_STORED_CHUNK

_SURROGATE_ESCAPE = re.compile(rb"\\[uU][dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate

FORMAT = "gpusnap-manifest"
VERSION = 4               # the newest this code writes: v2 added owners (uid/gid) and `hardlink`
                          # streams, v3 `fifo` streams and `xattrs`, v4 POSIX ACLs in `xattrs`; a
                          # manifest is written as the lowest version that expresses it (2:
                          # BASE_VERSION when it uses none of them), which older readers take
BASE_VERSION = 2
READABLE = (1, 2, 3, 4)   # what it reads
STREAM_TYPES = ("file", "dir", "symlink", "blob", "hardlink", "fifo")
_NO_DATA = ("dir", "symlink", "hardlink", "fifo")
_KIND_RE = re.compile(r"[a-z][a-z0-9_-]{0,31}")


class ManifestError(GpusnapError):
    """A manifest that does not parse, fails its checksum, or is of an unknown format."""


class ManifestTooLarge(GpusnapError):
    """A manifest whose encoding would be larger than any reader loads (limits.MAX_MANIFEST)."""


class ManifestDamage(ManifestError, DamageError):
    """A stored or received manifest that does not load: damage (exit 3)."""

    exit_code = DamageError.exit_code


_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:=@+-]{0,63}")
MAX_TAGS = 32


def validate_tag(tag: str) -> str:
    """TAG if it is a valid tag (1-64 of letters, digits and _.:=@+-, not starting with a symbol)."""
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag):
        raise ManifestError(f"bad tag {tag!r}: use 1-64 letters, digits and _.:=@+- (not first)")
    return tag


@functools.cache
def tool_version() -> str:
    """This gpusnap's version, recorded in every manifest it writes."""
    from storage.base.version import VERSION
    return VERSION


@dataclass(frozen=True)
class ChunkRef:
    id: str | None
    raw_len: int
    codec: str
    stored_len: int

    @property
    def is_zero(self) -> bool:
        return self.codec == ZERO

    def to_json(self) -> list[Any]:
        return [self.id, self.raw_len, self.codec, self.stored_len]

    @classmethod
    def from_json(cls, v: Any) -> "ChunkRef":
        if not (isinstance(v, list) and len(v) == 4):
            raise ManifestError(f"bad chunk reference {v!r}")
        cid, raw_len, codec, stored = v
        if codec == ZERO:
            if cid is not None or stored != 0:
                raise ManifestError("zero chunk with an id or stored bytes")
        elif codec not in CODEC_IDS or not isinstance(cid, str) or len(cid) != 64:
            raise ManifestError(f"bad chunk reference {v!r}")
        if not isinstance(raw_len, int) or not isinstance(stored, int) or raw_len < 0 or stored < 0:
            raise ManifestError(f"bad chunk lengths in {v!r}")
        if raw_len > MAX_RAW_CHUNK or stored > MAX_STORED_CHUNK:
            raise ManifestError(f"chunk reference {str(cid)[:16]}… claims {raw_len} raw / {stored} stored bytes; "
                                f"a chunk holds at most {MAX_RAW_CHUNK} raw / {MAX_STORED_CHUNK} stored bytes")
        return cls(cid, raw_len, codec, stored)


@dataclass
class Stream:
    name: str
    attrs: dict[str, Any]
    chunks: list[ChunkRef] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(c.raw_len for c in self.chunks)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "attrs": self.attrs,
                "chunks": [c.to_json() for c in self.chunks]}

    @classmethod
    def from_json(cls, v: dict[str, Any]) -> "Stream":
        s = cls(validate_stream_name(v["name"]), dict(v["attrs"]), [ChunkRef.from_json(c) for c in v["chunks"]])
        if s.size != v["size"]:
            raise ManifestError(f"stream {s.name!r}: size {v['size']} but chunks add up to {s.size}")
        return s


@dataclass
class Manifest:
    name: str
    streams: list[Stream]
    meta: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())
    tags: tuple[str, ...] = ()
    host: str = field(default_factory=socket.gethostname)
    tool: str = field(default_factory=tool_version)

    @property
    def size(self) -> int:
        return sum(s.size for s in self.streams)

    def chunk_ids(self) -> set[str]:
        return {c.id for s in self.streams for c in s.chunks if c.id is not None}

    def version_needed(self) -> int:
        """The lowest format version that expresses this manifest (3 for FIFOs or xattrs, 4 for ACLs)."""
        from storage.fs.xattrs import has_acl
        if any(has_acl(s.attrs.get("xattrs")) for s in self.streams):
            return VERSION
        v3 = any(s.attrs.get("type") == "fifo" or "xattrs" in s.attrs for s in self.streams)
        return 3 if v3 else BASE_VERSION

    def _body(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": self.version_needed(), "name": self.name, "created": self.created,
                "hash": "blake3", "meta": self.meta, "tags": list(self.tags), "host": self.host,
                "gpusnap_version": self.tool, "summary": {"size": self.size, "streams": len(self.streams)},
                "streams": [s.to_json() for s in self.streams]}

    def dumps_bounded(self, doing: str, shed_hints: bool = False) -> bytes:
        """dumps(), refused (ManifestTooLarge, naming DOING) when it is larger than any reader loads: what
        writes a manifest (a commit, a retag, a push, an export) writes only what can be read back. With
        SHED_HINTS (a commit or a retag, which write the snapshot's manifest anew) the streams' page keys,
        hints only, are dropped first rather than the snapshot refused."""
        data = self.dumps()
        if len(data) > limits.MAX_MANIFEST and shed_hints and any("pagekeys" in s.attrs for s in self.streams):
            for s in self.streams:
                s.attrs.pop("pagekeys", None)
            data = self.dumps()
        if len(data) > limits.MAX_MANIFEST:
            raise ManifestTooLarge(f"snapshot {self.name!r}: its manifest would be {len(data)} bytes, more than "
                                   f"any manifest may be ({limits.MAX_MANIFEST}); nothing was {doing}")
        return data

    def dumps(self) -> bytes:
        """The file: every field but `streams` first (sorted), then `streams` last, so that a reader of the
        summary (storage/maintenance/summary.py) stops before them; the checksum does not depend on the layout."""
        body = self._body()
        body["checksum"] = _checksum(body)
        streams = body.pop("streams")
        # one line (json's indent= runs the pure-Python encoder: 0.5 s for a tree of 2000 files)
        head = json.dumps(body, sort_keys=True)
        return (head[:-1] + ', "streams": ' + json.dumps(streams) + "}").encode()

    @classmethod
    def loads(cls, data: bytes, where: str = "manifest") -> "Manifest":
        """The manifest DATA holds, validated; ManifestDamage (exit 3) if it is not one."""
        try:
            return cls._loads(data, where)
        except ManifestDamage:
            raise
        except ManifestError as e:
            raise ManifestDamage(str(e)) from None

    @classmethod
    def _loads(cls, data: bytes, where: str) -> "Manifest":
        try:
            # decoded strictly first: json.loads(bytes) would let UTF-8-encoded surrogates through
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(f"{where} does not parse (truncated or corrupted): {e.msg if hasattr(e, 'msg') else e}") from None
        except RecursionError:
            raise ManifestError(f"{where} does not parse: nested too deeply") from None
        if _SURROGATE_ESCAPE.search(data):
            # JSON may spell a lone UTF-16 surrogate (\ud800). A name that is not UTF-8 is kept as
            # Python's file system encoding keeps it (surrogateescape: U+DC80-U+DCFF, one per byte,
            # as `put` writes it); any other is a str no path, link target or xattr name can be
            # encoded from, and such a manifest is damaged as a whole
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raise ManifestError(f"{where} is damaged: it holds text that is not UTF-8 (a lone surrogate)") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ManifestError(f"{where} is not a gpusnap manifest")
        if body.get("version") not in READABLE:
            raise ManifestError(f"{where} has format version {body.get('version')!r}; this gpusnap reads "
                                f"{', '.join(map(str, READABLE))}")
        want = body.pop("checksum", None)
        if want != _checksum(body):
            raise ManifestError(f"{where} fails its checksum (corrupted)")
        try:
            streams = [Stream.from_json(s) for s in body["streams"]]
            tags = body.get("tags", [])
            if not isinstance(tags, list) or len(tags) > MAX_TAGS:
                raise ManifestError(f"{where} has a bad tag list")
            host, tool = body.get("host", ""), body.get("gpusnap_version", "")
            if not isinstance(host, str) or not isinstance(tool, str) or len(host) > 255 or len(tool) > 64:
                raise ManifestError(f"{where} has a bad host or version field")
            m = cls(validate_snapshot_name(body["name"]), streams, dict(body["meta"]), body["created"],
                    tuple(validate_tag(t) for t in tags), host, tool)
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where} is malformed: {e}") from None
        if len({s.name for s in streams}) != len(streams):
            raise ManifestError(f"{where} names a stream twice")
        summary = body.get("summary")
        if summary is not None and summary != {"size": m.size, "streams": len(streams)}:
            raise ManifestError(f"{where} is damaged: its summary {summary!r:.80} does not match its streams")
        problems = check_meta(m.meta) + check_tree(streams, body["version"])
        if problems:
            raise ManifestError(f"{where} is damaged: {problems[0]}")
        return m


def check_meta(meta: Any) -> list[str]:
    """What is wrong with a manifest's META: a JSON object whose `kind` (when present; snapshots
    written through the library without one are untyped) is a short lowercase word. What each kind
    holds is validated by the layer that made it (sandbox/ops/snapshot_meta.py)."""
    if not isinstance(meta, dict):
        return ["meta is not a JSON object"]
    kind = meta.get("kind")
    if kind is not None and not (isinstance(kind, str) and _KIND_RE.fullmatch(kind)):
        return [f"meta kind {kind!r} is not a snapshot kind"]
    return []


def _is_int(v: Any, low: int, high: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and low <= v <= high


def check_tree(streams: list[Stream], version: int = VERSION) -> list[str]:
    """Problems that make STREAMS unsafe or impossible to materialize as a tree (empty: none).

    Each stream's attributes must have their documented types; a stream may lie only under streams
    of type `dir` (never under a symlink, file, blob or hard link the manifest itself defines, which
    would make a restore write through a link); a hard link must name an earlier `file` stream."""
    problems: list[str] = []
    types: dict[str, str] = {}
    for s in streams:
        a = s.attrs
        t = a.get("type")
        if t not in STREAM_TYPES or (t == "hardlink" and version < 2) or (t == "fifo" and version < 3):
            problems.append(f"stream {s.name!r} has unknown type {t!r}")
            continue
        for key, low, high in (("mode", 0, 0o7777), ("mtime_ns", -(1 << 63), (1 << 63) - 1),
                               ("uid", 0, 0xFFFFFFFE), ("gid", 0, 0xFFFFFFFE)):
            if key in a and not _is_int(a[key], low, high):
                problems.append(f"stream {s.name!r} has a bad {key} {a[key]!r}")
        if "xattrs" in a:
            from storage.fs.xattrs import check as check_xattrs
            why = check_xattrs(a["xattrs"], version, t) if version >= 3 else "xattrs in a manifest before version 3"
            if why:
                problems.append(f"stream {s.name!r} has {why}")
        if "pagekeys" in a:
            from storage.codecs.pagekeys import check as check_pagekeys
            why = check_pagekeys(a["pagekeys"], s.size) if t in ("file", "blob") else f"page keys on a {t}"
            if why:
                problems.append(f"stream {s.name!r} has bad page keys: {why}")
        if t in _NO_DATA and s.chunks:
            problems.append(f"stream {s.name!r} is a {t} but has data")
        if t in ("symlink", "hardlink") and not (isinstance(a.get("target"), str) and a["target"]
                                                 and "\x00" not in a["target"]
                                                 and len(a["target"].encode(errors="replace")) < STREAM_PATH_MAX):
            problems.append(f"stream {s.name!r} has a bad link target")
            continue
        if t == "hardlink" and types.get(a["target"]) != "file":
            problems.append(f"hard link {s.name!r} names {a['target']!r}, which is not an earlier file stream")
        types[s.name] = t
    for s in streams:  # order-independent: a child listed before the link it lies under is as bad
        parts = s.name.split("/")
        for i in range(1, len(parts)):
            above = "/".join(parts[:i])
            if types.get(above, "dir") != "dir":
                problems.append(f"stream {s.name!r} lies under {above!r}, a {types[above]}: restoring it "
                                "would write through a link or into a non-directory")
                break
    return problems


def _checksum(body: dict[str, Any]) -> str:
    return blake3.blake3(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
