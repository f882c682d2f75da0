"""The remote tier: a store's snapshots pushed to and pulled from an S3-compatible object store.

Guarantees kept here (FORMAT.md, "Remote stores", has the layout and the protocol):
- a remote snapshot is visible only once its manifest object exists, and a push writes that object
  only after every chunk the manifest names is present remotely: a killed push leaves no snapshot;
- nothing relies on conditional writes (Swift's S3 API has none): objects have content-derived or
  unique names, and gc and push exclude each other through lock objects with server-side times;
- only chunks the other side lacks travel, in packs: a push uploads packs of the chunks no remote
  index object lists, then their index objects; a pull reads the index objects, then fetches the
  entries it lacks by coalesced range reads of the packs; nothing lists one key per chunk (remotes of
  the one-object-per-chunk layout, version 1, are read chunk by chunk: FORMAT.md, "Remote versions");
- every index object is validated as a local index file, and every range answer must be exactly the
  bytes asked, before any of it is used;
- every chunk fetched is verified against its id before it enters the local store (a raw-addressed
  one decoded and its raw bytes hashed); one that does not match is refetched once, then reported as
  damage; a remote manifest is validated by
  Manifest.loads like a local one; a pulled snapshot is committed through the local store's writer;
- remote gc deletes only chunks no remote manifest names, never while a fresh push or pull lock
  exists, and a push whose lock was removed as stale re-checks every chunk before it commits;
- credentials come from the environment or a 0600 file; they are never in an argument, a message or
  a remote's config.
Nothing here knows CRIU or runsc: a snapshot is a manifest and chunks.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import stat
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

from storage.base.progress import Progress
from storage.format.chunkfile import HEADER_SIZE, ChunkError, ChunkHeader, check_received, max_stored_len
from storage.fs.directio import AlignedBuffer, BufferPool
from storage.base.errors import DamageError, GpusnapError, UnavailableError
from storage.fs.directio import align_up
from storage.base.limits import DEFAULT_JOBS, MAX_MANIFEST, MAX_RECORD
from storage.format.manifest import ChunkRef, Manifest, ManifestError
from storage.base.names import validate_snapshot_name
from storage.format.packs import INDEX_MAX, PACK_NAME, IndexDamage, Loc, PackIndex, coalesce, decode_index, encode_index
from storage.repo.store import Problem, SnapshotStore, StoreError, VerifyReport
from storage.format.storedir import REMOTES, path_in

REMOTE_FORMAT = "gpusnap-remote"
REMOTE_VERSION = 2              # packs and index objects; 1: one object per chunk (read, FORMAT.md)
READ_VERSIONS = (1, 2)
# a remote pack is closed before an entry would take it past this (env: a test hook, to make packs of one entry)
REMOTE_PACK_TARGET = int(os.environ.get("GPUSNAP_REMOTE_PACK_TARGET", 64 << 20))
# the most bytes one range read of a pack asks for, unless one entry is larger (env: a test hook)
RANGE_MAX = int(os.environ.get("GPUSNAP_REMOTE_RANGE_MAX", 16 << 20))
MULTIPART_THRESHOLD = 64 << 20  # objects larger than this go up in parts
PART_SIZE = 16 << 20            # S3 wants parts of at least 5 MiB, at most 10000 of them
LOCK_REFRESH_S = float(os.environ.get("GPUSNAP_REMOTE_LOCK_REFRESH_S", 60.0))  # env: a test hook
LOCK_STALE_S = float(os.environ.get("GPUSNAP_REMOTE_LOCK_STALE_S", 30 * 60))
_ID_RE = re.compile(r"[0-9a-f]{64}")
# the layout under a remote's prefix (FORMAT.md, "Remote stores"): this module owns it
MARKER_KEY = "gpusnap-remote.json"
PACKS, INDEX, CHUNKS, SNAPSHOTS, LOCKS = "packs", "index", "chunks", "snapshots", "locks"
_REMOTE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "403",
               "Forbidden", "AuthorizationHeaderMalformed"}


class RemoteError(GpusnapError):
    """A remote operation that cannot be done; the message says what to do about it."""


class RemoteUnreachableError(RemoteError, UnavailableError):
    """The object store did not answer (down, refused, timed out) after the retries."""


class RemoteDamageError(RemoteError, DamageError):
    """A remote manifest or chunk that is not what it claims to be."""


# ---- configuration and credentials ----------------------------------------------------------------
@dataclass(frozen=True)
class RemoteConfig:
    """One configured remote: `s3://BUCKET/PREFIX` at ENDPOINT. Holds no secret."""
    name: str
    bucket: str
    prefix: str
    endpoint: str
    region: str = "us-east-1"
    credentials_file: str | None = None

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "endpoint": self.endpoint, "region": self.region,
                "credentials_file": self.credentials_file}

    @classmethod
    def from_json(cls, v: Any) -> "RemoteConfig":
        if not isinstance(v, dict):
            raise RemoteError("remote config is not a JSON object")
        try:
            bucket, prefix = parse_url(v["url"])
            cf = v.get("credentials_file")
            if cf is not None and not isinstance(cf, str):
                raise TypeError("credentials_file")
            return cls(validate_remote_name(v["name"]), bucket, prefix, _endpoint(v["endpoint"]),
                       str(v.get("region") or "us-east-1"), cf)
        except (KeyError, TypeError) as e:
            raise RemoteError(f"remote config is malformed ({e})") from None


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str = field(repr=False)


def validate_remote_name(name: str) -> str:
    if not isinstance(name, str) or not _REMOTE_NAME_RE.fullmatch(name):
        raise RemoteError(f"remote name {name!r} is invalid: letters, digits, _ . -, at most 64")
    return name


def parse_url(url: str) -> tuple[str, str]:
    """'s3://BUCKET/PREFIX' -> (BUCKET, PREFIX without slashes at either end)."""
    m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?", url or "")
    if not m:
        raise RemoteError(f"{url!r} is not s3://BUCKET/PREFIX (bucket: 3-63 lowercase letters, digits, . -)")
    prefix = (m.group(2) or "").strip("/")
    if any(p in ("", ".", "..") for p in prefix.split("/")) and prefix:
        raise RemoteError(f"{url!r}: the prefix has an empty, '.' or '..' component")
    return m.group(1), prefix


def _endpoint(url: str) -> str:
    if not isinstance(url, str) or not re.fullmatch(r"https?://[^\s/@]+(/[^\s@]*)?", url):
        raise RemoteError(f"endpoint {url!r} is not an http(s):// URL (without credentials in it)")
    return url.rstrip("/")


def _remotes_dir(store: SnapshotStore) -> str:
    return path_in(store.path, REMOTES)


def add_remote(store: SnapshotStore, cfg: RemoteConfig) -> None:
    """Record CFG in STORE/remotes/NAME.json (0600), replacing an older entry of that name."""
    d = _remotes_dir(store)
    os.makedirs(d, mode=0o700, exist_ok=True)
    tmp = os.path.join(store.tmp_dir, f"remote.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(cfg.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(d, cfg.name + ".json"))


def remove_remote(store: SnapshotStore, name: str) -> None:
    """Remove remote NAME's configuration (STORE/remotes/NAME.json); nothing on the remote is touched."""
    path = os.path.join(_remotes_dir(store), validate_remote_name(name) + ".json")
    try:
        os.unlink(path)
    except FileNotFoundError:
        raise RemoteError(f"no remote named {name!r} (`gpusnap remote list` lists them)") from None
    fd = os.open(_remotes_dir(store), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remote_exists(store: SnapshotStore, name: str) -> bool:
    return os.path.lexists(os.path.join(_remotes_dir(store), validate_remote_name(name) + ".json"))


def list_remotes(store: SnapshotStore) -> list[RemoteConfig]:
    try:
        names = sorted(f[:-5] for f in os.listdir(_remotes_dir(store)) if f.endswith(".json"))
    except FileNotFoundError:
        return []
    return [load_remote(store, n) for n in names]


def load_remote(store: SnapshotStore, name: str | None) -> RemoteConfig:
    """The remote NAME, or the only one configured when NAME is None."""
    if name is None:
        try:
            names = sorted(f[:-5] for f in os.listdir(_remotes_dir(store)) if f.endswith(".json"))
        except FileNotFoundError:
            names = []
        if len(names) != 1:
            raise RemoteError("name the remote: " + (f"this store has {', '.join(names)}" if names else
                              "none is configured (`gpusnap remote add NAME s3://BUCKET/PREFIX --endpoint URL`)"))
        name = names[0]
    path = os.path.join(_remotes_dir(store), validate_remote_name(name) + ".json")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RemoteError(f"no remote named {name!r} (`gpusnap remote add` it first)") from None
    with os.fdopen(fd, "rb") as f:
        try:
            return RemoteConfig.from_json(json.load(f))
        except ValueError as e:
            raise RemoteError(f"remote {name!r}: unreadable config ({e})") from None


def load_credentials(cfg: RemoteConfig, env: dict[str, str] | None = None) -> Credentials:
    """From GPUSNAP_S3_ACCESS_KEY_ID/GPUSNAP_S3_SECRET_ACCESS_KEY (or the AWS_ names), else from the
    remote's credentials file, which must be a regular file of ours that nobody else can read."""
    environ: Mapping[str, str] = os.environ if env is None else env
    for a, s in (("GPUSNAP_S3_ACCESS_KEY_ID", "GPUSNAP_S3_SECRET_ACCESS_KEY"),
                 ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")):
        if environ.get(a) and environ.get(s):
            return Credentials(environ[a], environ[s])
    if cfg.credentials_file is None:
        raise RemoteError(f"remote {cfg.name!r}: no credentials (set GPUSNAP_S3_ACCESS_KEY_ID and "
                          "GPUSNAP_S3_SECRET_ACCESS_KEY, or `remote add --credentials-file`)")
    return read_credentials_file(cfg.credentials_file)


def read_credentials_file(path: str) -> Credentials:
    """`access_key_id = ...` and `secret_access_key = ...` lines; the file must be mode 0600 or stricter."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise RemoteError(f"credentials file {path}: {e.strerror}") from None
    with os.fdopen(fd, "r") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise RemoteError(f"credentials file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise RemoteError(f"credentials file {path} is readable by others (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}); `chmod 600` it")
        if st.st_uid != os.geteuid():
            raise RemoteError(f"credentials file {path} belongs to another user")
        values: dict[str, str] = {}
        for line in f:
            k, sep, v = line.partition("=")
            if sep and not line.lstrip().startswith("#"):
                values[k.strip()] = v.strip()
    if not values.get("access_key_id") or not values.get("secret_access_key"):
        raise RemoteError(f"credentials file {path} needs access_key_id = ... and secret_access_key = ...")
    return Credentials(values["access_key_id"], values["secret_access_key"])


# ---- the S3 client -------------------------------------------------------------------------------
class ObjectStore:
    """The few S3 calls the remote tier makes, through boto3, with errors turned into one line.

    Retries with exponential backoff on 5xx, throttling and timeouts are botocore's "standard" mode
    (GPUSNAP_S3_MAX_ATTEMPTS, default 5). Counts the payload bytes sent and received.
    """

    def __init__(self, cfg: RemoteConfig, creds: Credentials, pool: int = 16) -> None:
        import boto3
        from botocore.config import Config
        self.cfg = cfg
        self.bucket = cfg.bucket
        attempts = int(os.environ.get("GPUSNAP_S3_MAX_ATTEMPTS", "5"))
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=cfg.endpoint, region_name=cfg.region,
            aws_access_key_id=creds.access_key, aws_secret_access_key=creds.secret_key,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"},
                          retries={"mode": "standard", "max_attempts": attempts},
                          connect_timeout=5, read_timeout=120, max_pool_connections=pool,
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.requests = 0

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.bytes_sent += sent
            self.bytes_received += received
            self.requests += 1

    @contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """botocore's exceptions as a RemoteError with one line saying what failed and why."""
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            yield
        except ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _AUTH_CODES or status == 403:
                raise RemoteError(f"remote {self.cfg.name!r}: the object store refused the credentials "
                                  f"while {doing} ({code or status})") from None
            if code == "NoSuchBucket":
                raise RemoteError(f"remote {self.cfg.name!r}: bucket {self.bucket!r} does not exist at "
                                  f"{self.cfg.endpoint}") from None
            if status is not None and status >= 500:
                raise RemoteUnreachableError(f"remote {self.cfg.name!r}: the object store failed while {doing} "
                                             f"(HTTP {status} {code}) after retries") from None
            raise RemoteError(f"remote {self.cfg.name!r}: {doing} failed: {code or status} "
                              f"{err.get('Message', '')}".rstrip()) from None
        except BotoCoreError as e:
            raise RemoteUnreachableError(f"remote {self.cfg.name!r}: cannot reach the object store at "
                                         f"{self.cfg.endpoint} while {doing} ({type(e).__name__})") from None

    def is_missing(self, e: Exception) -> bool:
        from botocore.exceptions import ClientError
        return isinstance(e, ClientError) and (
            e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound")
            or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404)

    def ensure_bucket(self) -> None:
        from botocore.exceptions import ClientError
        with self.errors(f"checking bucket {self.bucket!r}"):
            try:
                self.client.head_bucket(Bucket=self.bucket)
                return
            except ClientError as e:
                if not self.is_missing(e):
                    raise
            self.client.create_bucket(Bucket=self.bucket)

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """One object; multipart above MULTIPART_THRESHOLD (an aborted upload leaves nothing visible)."""
        n = len(data)
        with self.errors(f"writing {key}"):
            if n <= MULTIPART_THRESHOLD:
                self.client.put_object(Bucket=self.bucket, Key=key,
                                       Body=data if isinstance(data, (bytes, bytearray)) else bytes(data))
                self._count(sent=n)
                return
            up = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
            try:
                parts = []
                for i, off in enumerate(range(0, n, PART_SIZE), 1):
                    piece = bytes(data[off:off + PART_SIZE])
                    r = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=up, PartNumber=i, Body=piece)
                    self._count(sent=len(piece))
                    parts.append({"PartNumber": i, "ETag": r["ETag"]})
                self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=up,
                                                      MultipartUpload={"Parts": parts})
            except BaseException:
                try:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=up)
                except Exception:
                    pass
                raise

    def _get_object(self, key: str) -> dict[str, Any] | None:
        """The answer to a GET of object KEY (its body not yet read), or None when there is no such
        object; called inside self.errors."""
        from botocore.exceptions import ClientError
        try:
            r: dict[str, Any] = self.client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as e:
            if self.is_missing(e):
                return None
            raise
        return r

    def get_into(self, key: str, buf: memoryview) -> int | None:
        """Object KEY's bytes into BUF; its length, or None when there is no such object."""
        with self.errors(f"reading {key}"):
            r = self._get_object(key)
            if r is None:
                return None
            got = self._read_capped(key, r, buf)
            self._count(received=got)
            return got

    def get_range_into(self, key: str, offset: int, length: int, buf: memoryview) -> int | None:
        """LENGTH bytes of object KEY from OFFSET (one HTTP range read) into BUF; LENGTH, or None when
        there is no such object. An answer of any other length (a short pack, a server that ignores the
        range, a body that ends early or goes on) is RemoteDamageError, raised before more than LENGTH
        bytes are read."""
        from botocore.exceptions import ClientError
        assert 0 < length <= len(buf)
        with self.errors(f"reading {key}"):
            try:
                r = self.client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={offset}-{offset + length - 1}")
            except ClientError as e:
                if self.is_missing(e):
                    return None
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                    raise RemoteDamageError(f"remote {self.cfg.name!r}: {key} is shorter than its index says "
                                            f"(no bytes at {offset})") from None
                raise
            claimed = r.get("ContentLength")
            if claimed is not None and claimed != length:
                r["Body"].close()
                raise RemoteDamageError(f"remote {self.cfg.name!r}: {key} answered {claimed} bytes for the "
                                        f"{length} asked at {offset} (shorter than its index says, or the "
                                        "range ignored)")
            cr = r.get("ContentRange")
            if isinstance(cr, str) and not cr.startswith(f"bytes {offset}-{offset + length - 1}/"):
                r["Body"].close()
                raise RemoteDamageError(f"remote {self.cfg.name!r}: {key} answered the range {cr!r}, "
                                        f"not bytes {offset}-{offset + length - 1}")
            got = self._read_capped(key, r, buf[:length])
            self._count(received=got)
            if got != length:
                raise RemoteDamageError(f"remote {self.cfg.name!r}: {key} answered {got} of the {length} bytes "
                                        f"asked at {offset} (shorter than its index says)")
            return got

    def _pieces(self, key: str, r: dict[str, Any], cap: int) -> Iterator[bytes]:
        """The body of response R in pieces, never more than CAP bytes in all: a claimed length
        (Content-Length) over CAP, a body that goes on past CAP (endless, or longer than it claimed) or
        one that ends before its claimed length is damage, raised before anything past CAP is read."""
        from urllib3.exceptions import HTTPError
        body = r["Body"]
        try:
            claimed = r.get("ContentLength")
            if claimed is not None and (not isinstance(claimed, int) or claimed > cap):
                raise RemoteDamageError(f"remote {self.cfg.name!r}: {key} claims {claimed} bytes, more than it "
                                        f"can hold ({cap}); not read")
            raw = getattr(body, "_raw_stream", None)  # below botocore, whose length check reads to the end
            reader = raw if raw is not None else body
            got = 0
            while True:
                try:
                    piece = reader.read(min(1 << 20, cap - got + 1))
                except (HTTPError, OSError, ValueError) as e:
                    raise RemoteUnreachableError(f"remote {self.cfg.name!r}: reading {key} failed after {got} bytes "
                                                 f"({type(e).__name__})") from None
                if not piece:
                    break
                got += len(piece)
                if got > cap:
                    raise RemoteDamageError(f"remote {self.cfg.name!r}: {key} goes on past {cap} bytes, more than "
                                            "it can hold; not read")
                yield piece
            if claimed is not None and got != claimed:
                raise RemoteDamageError(f"remote {self.cfg.name!r}: {key} ended after {got} of the {claimed} "
                                        "bytes it claimed")
        finally:
            body.close()

    def _read_capped(self, key: str, r: dict[str, Any], buf: memoryview) -> int:
        got = 0
        for piece in self._pieces(key, r, len(buf)):
            buf[got:got + len(piece)] = piece
            got += len(piece)
        return got

    def get(self, key: str, limit: int) -> bytes | None:
        """Object KEY's bytes (at most LIMIT: storage/base/limits.py), or None when there is no such object."""
        with self.errors(f"reading {key}"):
            r = self._get_object(key)
            if r is None:
                return None
            data = b"".join(self._pieces(key, r, limit))
            self._count(received=len(data))
            return data

    def head(self, key: str) -> int | None:
        from botocore.exceptions import ClientError
        with self.errors(f"checking {key}"):
            try:
                size = self.client.head_object(Bucket=self.bucket, Key=key).get("ContentLength")
                if not isinstance(size, int) or size < 0:
                    raise RemoteDamageError(f"remote {self.cfg.name!r}: {key}: the object store gave no length")
                return size
            except ClientError as e:
                if self.is_missing(e):
                    return None
                raise

    def list(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """(key, size, last-modified epoch seconds, by the server's clock) under PREFIX."""
        with self.errors(f"listing {prefix}"):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                self._count()
                for o in page.get("Contents", []):
                    if not isinstance(o.get("Key"), str) or not isinstance(o.get("Size"), int) \
                            or not hasattr(o.get("LastModified"), "timestamp"):
                        raise RemoteDamageError(f"remote {self.cfg.name!r}: a listing of {prefix} names an object "
                                                "without a key, size or time")
                    yield o["Key"], o["Size"], o["LastModified"].timestamp()

    def delete(self, key: str) -> None:
        with self.errors(f"deleting {key}"):
            self.client.delete_object(Bucket=self.bucket, Key=key)
            self._count()

    def server_time(self) -> float:
        """The object store's clock (from a Date header), so lock ages never mix two machines' clocks."""
        from email.utils import parsedate_to_datetime
        with self.errors("reading the server's time"):
            r = self.client.head_bucket(Bucket=self.bucket)
        return parsedate_to_datetime(r["ResponseMetadata"]["HTTPHeaders"]["date"]).timestamp()


# ---- reports -------------------------------------------------------------------------------------
@dataclass
class TransferReport:
    snapshot: str
    remote: str
    direction: str
    chunks_total: int = 0       # distinct chunks the manifest names
    chunks_sent: int = 0        # chunks that travelled
    bytes_total: int = 0        # stored bytes of all distinct chunks
    bytes_sent: int = 0         # payload bytes that travelled (chunk objects and the manifest)
    refetched: int = 0
    packs_sent: int = 0         # pack objects a push uploaded (each with its index object)
    ranges: int = 0             # range reads of packs a pull made (each one request)
    rechecked_after_gc: bool = False
    already_there: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RemoteGcReport:
    chunks_removed: int = 0     # chunks no manifest names any more, deleted (pack entries and chunk objects)
    packs_removed: int = 0
    bytes_freed: int = 0
    stale_locks_removed: int = 0


# ---- the remote ----------------------------------------------------------------------------------
def pause_for_tests(done: int, before: int | None = None) -> None:
    """GPUSNAP_TEST_PAUSE_TRANSFER=N:PATH: once the N-th chunk has moved (a pack or a range moves
    several: the count went from BEFORE to DONE past N), create PATH and wait until it is removed (lets
    tests kill -9 or stop the object store at a known point of a real transfer)."""
    spec = os.environ.get("GPUSNAP_TEST_PAUSE_TRANSFER")
    if not spec:
        return
    n, _, path = spec.partition(":")
    if not (done - 1 if before is None else before) < int(n) <= done:
        return
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    while os.path.exists(path):
        time.sleep(0.05)


def _run_bounded(fn: Callable[[Any], None], items: Iterable[Any], jobs: int) -> None:
    """FN over ITEMS on JOBS threads with at most 2*JOBS queued (back-pressure); the first error stops
    the submission and is raised once the running calls end."""
    with ThreadPoolExecutor(jobs) as ex:
        pending: set[Future[None]] = set()
        try:
            for item in items:
                if len(pending) >= 2 * jobs:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        f.result()
                pending.add(ex.submit(fn, item))
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in done:
                f.result()
        except BaseException:
            for f in pending:
                f.cancel()
            raise


class Remote:
    """A gpusnap remote: `PREFIX/` in a bucket laid out as FORMAT.md, "Remote stores", says."""

    def __init__(self, cfg: RemoteConfig, creds: Credentials, jobs: int = DEFAULT_JOBS) -> None:
        self.cfg = cfg
        self.jobs = max(1, jobs)
        self.s3 = ObjectStore(cfg, creds, pool=2 * self.jobs + 2)
        self.version = REMOTE_VERSION  # what check() found

    @classmethod
    def open(cls, store: SnapshotStore, name: str | None, jobs: int = DEFAULT_JOBS) -> "Remote":
        cfg = load_remote(store, name)
        return cls(cfg, load_credentials(cfg), jobs)

    # ---- keys ----
    def key(self, *parts: str) -> str:
        return "/".join(p for p in (self.cfg.prefix, *parts) if p)

    def chunk_key(self, cid: str) -> str:
        """A version 1 chunk object (read, never written now)."""
        return self.key(CHUNKS, cid[:2], cid)

    def pack_key(self, pack: str) -> str:
        return self.key(PACKS, pack)

    def index_key(self, pack: str) -> str:
        return self.key(INDEX, pack)

    def manifest_key(self, name: str) -> str:
        return self.key(SNAPSHOTS, validate_snapshot_name(name) + ".json")

    # ---- setup ----
    def init(self) -> None:
        """Create the bucket if missing and mark PREFIX as a gpusnap remote (checks one already there)."""
        self.s3.ensure_bucket()
        marker = self.s3.get(self.key(MARKER_KEY), MAX_RECORD)
        if marker is None:
            self.s3.put(self.key(MARKER_KEY),
                        json.dumps({"format": REMOTE_FORMAT, "version": REMOTE_VERSION}).encode())
        else:
            self._check_marker(marker)

    def check(self) -> None:
        marker = self.s3.get(self.key(MARKER_KEY), MAX_RECORD)
        if marker is None:
            raise RemoteError(f"remote {self.cfg.name!r}: {self.cfg.url} is not a gpusnap remote "
                              "(`gpusnap remote add` creates it)")
        self._check_marker(marker)

    def _check_marker(self, data: bytes) -> None:
        try:
            info = json.loads(data)
        except (ValueError, RecursionError):
            info = None
        if not isinstance(info, dict) or info.get("format") != REMOTE_FORMAT or info.get("version") not in READ_VERSIONS:
            raise RemoteError(f"remote {self.cfg.name!r}: {self.cfg.url} holds something other than a "
                              f"{REMOTE_FORMAT} v{REMOTE_VERSION}")
        self.version = int(info["version"])

    def upgrade(self) -> None:
        """Mark a version 1 remote version 2 before its first pack (FORMAT.md, "Remote versions")."""
        if self.version < REMOTE_VERSION:
            self.s3.put(self.key(MARKER_KEY), json.dumps({"format": REMOTE_FORMAT, "version": REMOTE_VERSION}).encode())
            self.version = REMOTE_VERSION

    # ---- the index objects ----
    def read_index(self) -> PackIndex:
        """Every index object of the remote (one listing of index/, one GET each, JOBS at a time),
        each validated as a local index file; one that fails is recorded in .damage, its entries unused."""
        base = self.key(INDEX) + "/"
        names = [k[len(base):] for k, _, _ in self.s3.list(base) if PACK_NAME.fullmatch(k[len(base):])]
        got: dict[str, tuple[int, list[tuple[str, int, int]]] | str] = {}
        lock = threading.Lock()

        def one(name: str) -> None:
            data = self.s3.get(self.index_key(name), INDEX_MAX)
            if data is None:
                return  # deleted since the listing (a gc): its pack goes too
            try:
                res: tuple[int, list[tuple[str, int, int]]] | str = decode_index(name, data)
            except IndexDamage as e:
                res = f"remote {self.cfg.name!r}: {e}"
            with lock:
                got[name] = res
        _run_bounded(one, names, self.jobs)
        idx = PackIndex()
        for name in sorted(got):
            res = got[name]
            if isinstance(res, str):
                idx.damage[name] = res
            else:
                idx.add(name, res[0], res[1])
        return idx

    def pack_sizes(self) -> dict[str, int]:
        """Every pack object present, by name, with its size (one listing of packs/: one key per pack)."""
        base = self.key(PACKS) + "/"
        return {k[len(base):]: size for k, size, _ in self.s3.list(base) if PACK_NAME.fullmatch(k[len(base):])}

    # ---- snapshots ----
    def names(self) -> list[str]:
        base = self.key(SNAPSHOTS) + "/"
        out = []
        for k, _, _ in self.s3.list(base):
            rest = k[len(base):]
            if rest.endswith(".json") and "/" not in rest:
                try:
                    out.append(validate_snapshot_name(rest[:-5]))
                except GpusnapError:
                    continue  # not ours: never becomes a name we use
        return sorted(out)

    def manifest_bytes(self, name: str) -> bytes | None:
        return self.s3.get(self.manifest_key(name), MAX_MANIFEST)

    def load(self, name: str) -> Manifest:
        data = self.manifest_bytes(name)
        if data is None:
            raise RemoteError(f"remote {self.cfg.name!r} has no snapshot named {name!r}")
        return self._parse(name, data)

    def _parse(self, name: str, data: bytes) -> Manifest:
        try:
            m = Manifest.loads(data, where=f"remote {self.cfg.name!r} snapshot {name!r}")
        except ManifestError as e:
            raise RemoteDamageError(str(e)) from None
        if m.name != name:
            raise RemoteDamageError(f"remote snapshot {name!r}: manifest says its name is {m.name!r}")
        return m

    def chunk_sizes(self) -> dict[str, int]:
        """Every chunk object present remotely, by id, with its size (one listing)."""
        base = self.key(CHUNKS) + "/"
        out: dict[str, int] = {}
        for k, size, _ in self.s3.list(base):
            cid = k.rsplit("/", 1)[-1]
            if _ID_RE.fullmatch(cid) and k == self.chunk_key(cid):
                out[cid] = size
        return out

    def remove(self, name: str) -> None:
        if self.s3.head(self.manifest_key(name)) is None:
            raise RemoteError(f"remote {self.cfg.name!r} has no snapshot named {name!r}")
        self.s3.delete(self.manifest_key(name))

    # ---- locks ----
    def _locks(self) -> list[tuple[str, str, float]]:
        """(key, kind, last-modified) of every lock object."""
        base = self.key(LOCKS) + "/"
        out = []
        for k, _, t in self.s3.list(base):
            kind = k[len(base):].split("-", 1)[0]
            out.append((k, kind, t))
        return out

    @contextmanager
    def lock(self, kind: str) -> Iterator["_Lock"]:
        """A lock object for the duration: `push` and `pull` are shared with each other, `gc` is exclusive.

        Created first, then the others are listed (so of two racing sides at least one sees the
        other and backs off); refreshed every LOCK_REFRESH_S; a lock not refreshed for LOCK_STALE_S
        (by the server's clock) that then stays unrefreshed while we watch it for two refresh periods
        (by our own monotonic clock) is stale and ignored.
        """
        lk = _Lock(self, kind)
        lk.write()
        try:
            conflict = self._conflicting_lock(lk)
            if conflict is not None:
                raise RemoteError(f"remote {self.cfg.name!r} is locked by a running {conflict}; "
                                  "try again when it ends")
            lk.start_refresh()
            yield lk
        finally:
            lk.release()

    def _conflicting_lock(self, lk: "_Lock") -> str | None:
        """The first live lock that excludes LK (its kind plus its object name), or None."""
        now = self.s3.server_time()
        excluding = [(key, other, t) for key, other, t in self._locks()
                     if key != lk.key and (lk.kind == "gc" or other == "gc")]
        dead = self._confirmed_stale({key: t for key, _, t in excluding if _stale(now, t)})
        for key, other, _ in excluding:
            if key not in dead:
                return f"{other} ({key.rsplit('/', 1)[-1]})"
        return None

    def _confirmed_stale(self, looks_stale: dict[str, float]) -> set[str]:
        """Of the locks in LOOKS_STALE (key -> last-modified), old by the server's clock, those that are
        not refreshed while we watch them for two refresh periods by our own monotonic clock: a server
        whose clock jumps (or whose Date disagrees with its object times) cannot make a live lock, which
        its holder rewrites every LOCK_REFRESH_S, look dead."""
        if not looks_stale or LOCK_STALE_S <= 0:
            return set(looks_stale)
        watching = dict(looks_stale)
        deadline = time.monotonic() + 2 * LOCK_REFRESH_S + 1
        while watching and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, max(0.5, LOCK_REFRESH_S / 4)))
            now = {key: t for key, _, t in self._locks()}
            for key in [k for k in watching if now.get(k) != watching[k]]:
                del watching[key]   # rewritten (alive) or removed (released): not stale
        return set(watching)

    def _reacquire(self, lk: "_Lock", timeout: float = 600.0) -> None:
        """LK again after gc removed it as stale: rewritten, then wait for a running gc to end."""
        lk.write()
        deadline = time.monotonic() + timeout
        while (conflict := self._conflicting_lock(lk)) is not None:
            if time.monotonic() > deadline:
                raise RemoteError(f"remote {self.cfg.name!r}: waited {timeout:.0f} s for {conflict} to end; "
                                  "nothing was committed")
            time.sleep(1.0)

    # ---- push ----
    def push(self, store: SnapshotStore, name: str, *, replace: bool = False, progress: Progress | None = None) -> TransferReport:
        t0 = time.perf_counter()
        rep = TransferReport(name, self.cfg.name, "push")
        with store.shared():
            m = store.load(name)
            data = m.dumps_bounded("pushed")  # what the remote's readers load (MAX_MANIFEST)
            refs = distinct_refs(m)
            rep.chunks_total = len(refs)
            rep.bytes_total = sum(HEADER_SIZE + r.stored_len for r in refs)
            self.check()
            with self.lock("push") as lk:
                old = self.manifest_bytes(name)
                same = old is not None and self._parse(name, old).dumps() == data
                if old is not None and not same and not replace:
                    raise RemoteError(f"remote {self.cfg.name!r} already has a different snapshot "
                                      f"named {name!r} (use --replace to overwrite it)")
                have = self._present()
                # no sound index lists them in a pack that is all there (never pushed, a lost or damaged
                # index, a lost or truncated pack): sent, in new packs, also under a manifest already
                # there, which is how such damage is repaired
                todo = [r for r in refs if _stored_id(r) not in have]
                if same and not todo:
                    rep.already_there = True
                    rep.seconds = time.perf_counter() - t0
                    return rep
                if todo:
                    self.upgrade()
                self._upload(store, todo, rep, progress)
                if lk.lost():
                    # gc took our lock for stale and may have deleted packs we uploaded or found present
                    rep.rechecked_after_gc = True
                    self._reacquire(lk)
                    have = self._present()
                    self._upload(store, [r for r in refs if _stored_id(r) not in have], rep, progress)
                self.s3.put(self.manifest_key(name), data)  # last: the snapshot is visible from here on
                rep.bytes_sent += len(data)
        rep.seconds = time.perf_counter() - t0
        return rep

    def _present(self) -> set[str]:
        """The chunk ids a sound index lists in a pack object as long as that index says (one listing
        of index/ and one of packs/, one key per pack each)."""
        index, sizes = self.read_index(), self.pack_sizes()
        return {cid for pack, ents in index.entries.items() if sizes.get(pack, -1) >= index.packs[pack]
                for cid, _, _ in ents}

    def _upload(self, store: SnapshotStore, refs: list[ChunkRef], rep: TransferReport, progress: Progress | None) -> None:
        """REFS read from STORE (stored check) into packs of at most REMOTE_PACK_TARGET, each uploaded,
        then its index object; JOBS packs at a time, each built in memory by one thread."""
        if not refs:
            return
        if progress is not None:
            progress.start(sum(HEADER_SIZE + r.stored_len for r in refs))
        groups: list[list[ChunkRef]] = [[]]
        size = 0
        for r in refs:  # manifest order: a pull of this snapshot reads each pack front to back
            n = HEADER_SIZE + align_up(max_stored_len(r.codec, r.raw_len, r.stored_len))
            if groups[-1] and size + n > REMOTE_PACK_TARGET:
                groups.append([])
                size = 0
            groups[-1].append(r)
            size += n
        lock = threading.Lock()
        with BufferPool(min(self.jobs, len(groups)), _buffer_size(refs)) as pool:
            def send(group: list[ChunkRef]) -> None:
                pack = bytearray()
                ents: list[tuple[str, int, int]] = []
                with pool.borrowed() as buf:
                    for ref in group:
                        try:
                            # the stored check: a damaged local chunk never travels (a pull checks in full);
                            # a delta entry travels whole (full-checked, no base on the remote: FORMAT.md)
                            header, payload = store.expanded(ref.id or "", *store.read_stored(ref, buf))
                        except ChunkError as e:
                            raise StoreError(f"local snapshot damaged, nothing pushed: {e}") from None
                        n = HEADER_SIZE + align_up(header.stored_len)
                        if pack and len(pack) + n > REMOTE_PACK_TARGET:
                            self._send_pack(pack, ents, rep, progress, lock)
                            pack, ents = bytearray(), []
                        ents.append((_stored_id(ref), len(pack), n))
                        pack += header.pack().ljust(HEADER_SIZE, b"\0")
                        pack += payload
                        pack += bytes(n - HEADER_SIZE - header.stored_len)
                if ents:
                    self._send_pack(pack, ents, rep, progress, lock)
            _run_bounded(send, groups, self.jobs)

    def _send_pack(self, pack: bytearray, ents: list[tuple[str, int, int]], rep: TransferReport,
                   progress: Progress | None, lock: threading.Lock) -> None:
        """Upload PACK, then its index object (a pack without its index is garbage for gc)."""
        name = secrets.token_hex(16)
        index = encode_index(name, len(pack), ents)
        self.s3.put(self.pack_key(name), pack)
        self.s3.put(self.index_key(name), index)
        with lock:
            before = rep.chunks_sent
            rep.chunks_sent += len(ents)
            rep.packs_sent += 1
            rep.bytes_sent += len(pack) + len(index)
            done = rep.chunks_sent
        if progress is not None:
            progress.advance(len(pack))
        pause_for_tests(done, before)

    # ---- verify / gc ----
    def verify(self, names: list[str] | None = None, read_data: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Every named snapshot's manifest valid and every chunk present: an entry of a sound index whose
        pack object is there and as long as its index says (or, not in any index, a version 1 chunk
        object of a possible size: one HEAD each); with READ_DATA every chunk also fetched (coalesced
        range reads) and checked in full."""
        report = VerifyReport()
        self.check()
        manifests = []
        for n in (names if names is not None else self.names()):
            report.snapshots.append(n)
            try:
                manifests.append(self.load(n))
            except RemoteError as e:
                report.problems.append(Problem(n, None, None, str(e)))
        index = self.read_index()
        report.problems += [Problem("(remote)", None, None, why + " (the chunks it lists read as missing)")
                            for why in index.damage.values()]
        sizes = self.pack_sizes()
        bad: dict[str, str] = {}
        refs = {_stored_id(r): r for m in manifests for r in distinct_refs(m)}
        at: dict[str, Loc] = {}
        legacy: list[ChunkRef] = []
        for cid, r in refs.items():
            locs = [loc for loc in index.find(cid) if _entry_fits(r, loc)]
            if locs:
                whole = usable(index, sizes, r)
                if whole:
                    at[cid] = whole[0]
                    continue
                loc = locs[0]
                have = sizes.get(loc.pack)
                bad[cid] = (f"its pack {loc.pack[:12]}… is missing on the remote" if have is None else
                            f"its pack {loc.pack[:12]}… is {have} bytes on the remote, not {index.packs[loc.pack]}")
                continue
            size = self.s3.head(self.chunk_key(cid))
            if size is None:
                bad[cid] = "missing on the remote"
            elif not _size_fits(r, size):
                bad[cid] = f"is {size} bytes on the remote, not {HEADER_SIZE + r.stored_len}"
            else:
                legacy.append(r)
        if read_data:
            todo = [refs[c] for c in at] + legacy
            if progress is not None:
                progress.start(sum(HEADER_SIZE + r.stored_len for r in todo))
            lock = threading.Lock()

            def done(ref: ChunkRef, why: str | None) -> None:
                with lock:
                    if why is not None:
                        bad[_stored_id(ref)] = why
                    report.chunks_checked += 1
                    report.bytes_checked += HEADER_SIZE + ref.stored_len
                if progress is not None:
                    progress.advance(HEADER_SIZE + ref.stored_len)
            runs = coalesce(sorted(((i, at[c]) for i, c in enumerate(at)), key=lambda x: (x[1].pack, x[1].offset)),
                            most=RANGE_MAX)
            ids = list(at)
            size = max([_buffer_size(legacy)] + [run[-1][1].offset + run[-1][1].length - run[0][1].offset
                                                 for run in runs])
            with BufferPool(self.jobs, size) as pool:
                def check_run(run: list[tuple[int, Loc]]) -> None:
                    with pool.borrowed() as buf:
                        for cid, why, _, _ in self.fetch_run([(refs[ids[i]], loc) for i, loc in run], buf):
                            done(refs[cid], why)

                def check_one(ref: ChunkRef) -> None:
                    with pool.borrowed() as buf:
                        done(ref, check_fetched(ref, buf, self.s3.get_into(self.chunk_key(_stored_id(ref)), buf.view))[0])
                _run_bounded(check_run, runs, self.jobs)
                _run_bounded(check_one, legacy, self.jobs)
        else:
            report.chunks_checked = len(refs)
        for m in manifests:
            for s in m.streams:
                for i, c in enumerate(s.chunks):
                    if c.id in bad:
                        report.problems.append(Problem(m.name, s.name, i, f"chunk {c.id[:16]}… {bad[c.id]}"))
        return report

    def fetch_run(self, run: list[tuple[ChunkRef, Loc]], buf: AlignedBuffer) -> list[tuple[str, str | None, ChunkHeader | None, memoryview]]:
        """The entries RUN (adjacent entries of one pack, in offset order) fetched with one range read
        into BUF and each checked as a chunk file received: (id, why it is not that chunk or None, its
        header, its entry's bytes in BUF). A range answer of the wrong length fails every entry."""
        first, last = run[0][1], run[-1][1]
        length = last.offset + last.length - first.offset
        try:
            n = self.s3.get_range_into(self.pack_key(first.pack), first.offset, length, buf.view)
            why_all = None if n is not None else f"its pack {first.pack[:12]}… is missing on the remote"
        except RemoteDamageError as e:
            why_all = str(e)
        out: list[tuple[str, str | None, ChunkHeader | None, memoryview]] = []
        for ref, loc in run:
            view = buf.view[loc.offset - first.offset:loc.offset - first.offset + loc.length]
            if why_all is not None:
                out.append((_stored_id(ref), why_all, None, view))
            else:
                why, header = check_entry(ref, view)
                out.append((_stored_id(ref), why, header, view))
        return out

    def gc(self) -> RemoteGcReport:
        """Delete the packs and version 1 chunk objects no remote manifest names, holding the exclusive gc lock."""
        report = RemoteGcReport()
        self.check()
        with self.lock("gc") as lk:
            now = self.s3.server_time()
            for key in self._confirmed_stale({key: t for key, _, t in self._locks() if key != lk.key and _stale(now, t)}):
                self.s3.delete(key)  # a push that wakes up finds its lock gone and re-checks
                report.stale_locks_removed += 1
            live: set[str] = set()
            for n in self.names():
                try:
                    live |= self.load(n).chunk_ids()
                except RemoteError as e:
                    raise RemoteError(f"remote gc stopped, nothing deleted: {e}; `gpusnap remote forget {n}` "
                                      "it first if it cannot be repaired") from None
            index = self.read_index()
            sizes = self.pack_sizes()
            lock = threading.Lock()
            # packs without an index (a killed push's; no push runs now) and packs with nothing live
            dead_packs: list[tuple[str, int, list[str]]] = [(p, size, []) for p, size in sizes.items() if p not in index.packs and p not in index.damage]
            dead_packs += [(p, sizes.get(p, 0), [c for c, _, _ in ents]) for p, ents in index.entries.items()
                           if not any(c in live for c, _, _ in ents)]

            def drop_pack(item: tuple[str, int, list[str]]) -> None:
                pack, size, ids = item
                if ids:
                    self.s3.delete(self.index_key(pack))  # the index first: a listed index means its pack is there
                self.s3.delete(self.pack_key(pack))
                with lock:
                    report.packs_removed += 1
                    report.chunks_removed += len(ids)
                    report.bytes_freed += size
            _run_bounded(drop_pack, dead_packs, self.jobs)
            in_packs = {c for p, ents in index.entries.items() for c, _, _ in ents if any(x in live for x, _, _ in ents)}
            dead = [(cid, size) for cid, size in self.chunk_sizes().items() if cid not in live or cid in in_packs]

            def drop(item: tuple[str, int]) -> None:
                self.s3.delete(self.chunk_key(item[0]))
                with lock:
                    report.chunks_removed += item[0] not in live
                    report.bytes_freed += item[1]
            _run_bounded(drop, dead, self.jobs)
        return report


def _stale(now: float, modified: float) -> bool:
    """Whether a lock last written at MODIFIED is stale at NOW (both the server's clock). A limit of 0
    (the test hook GPUSNAP_REMOTE_LOCK_STALE_S) takes every lock for stale: a refresh can land between
    the server-time read and the listing, within the same second."""
    return LOCK_STALE_S <= 0 or now - modified > LOCK_STALE_S


class _Lock:
    """One lock object `locks/KIND-HOST-PID-RANDOM.json`, rewritten by a thread to keep it fresh."""

    def __init__(self, remote: Remote, kind: str) -> None:
        self.remote = remote
        self.kind = kind
        host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64]
        self.key = remote.key(LOCKS, f"{kind}-{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}.json")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self) -> None:
        body = {"kind": self.kind, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        self.remote.s3.put(self.key, json.dumps(body).encode())

    def lost(self) -> bool:
        return self.remote.s3.head(self.key) is None

    def start_refresh(self) -> None:
        def run() -> None:
            while not self._stop.wait(LOCK_REFRESH_S):
                try:
                    self.write()
                except GpusnapError:
                    pass  # the next refresh tries again; lost() catches a lock gc removed
        self._thread = threading.Thread(target=run, name="gpusnap-remote-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.remote.s3.delete(self.key)
        except GpusnapError:
            pass  # a lock left behind goes stale by itself


def _stored_id(r: ChunkRef) -> str:
    """The id of a stored (not zero) chunk, as distinct_refs returns them."""
    if r.id is None:
        raise RemoteError("internal: a zero chunk where a stored one was expected")
    return r.id


def distinct_refs(m: Manifest, smallest_streams_first: bool = False) -> list[ChunkRef]:
    """M's stored chunks, each once, in stream order (smallest streams first if asked)."""
    streams = sorted(m.streams, key=lambda s: s.size) if smallest_streams_first else m.streams
    seen: set[str] = set()
    out = []
    for s in streams:
        for c in s.chunks:
            if c.id is not None and c.id not in seen:
                seen.add(c.id)
                out.append(c)
    return out


def check_fetched(ref: ChunkRef, buf: AlignedBuffer, n: int | None) -> tuple[str | None, ChunkHeader | None]:
    """(why the N bytes fetched into BUF are not chunk REF, None) or (None, their header) when they are
    (chunkfile.check_received: a GSNPCHK2 object is decoded and its raw bytes hashed)."""
    if n is None:
        return "is missing on the remote", None
    return _check_image(ref, buf.view[:n])


def check_entry(ref: ChunkRef, entry: memoryview) -> tuple[str | None, ChunkHeader | None]:
    """As check_fetched, for ENTRY, the bytes of a pack entry (a chunk file and its zero padding): its
    header's stored length must fit in it, then the chunk file is checked."""
    assert ref.id is not None
    try:
        header = ChunkHeader.unpack(entry[:64], ref.id)
    except Exception:  # noqa: BLE001 - whatever a hostile entry makes the parser raise
        return "has a malformed header", None
    n = HEADER_SIZE + header.stored_len
    if n > len(entry):
        return f"its entry is {len(entry)} bytes, its header says {n}", None
    return _check_image(ref, entry[:n])


def _check_image(ref: ChunkRef, image: memoryview) -> tuple[str | None, ChunkHeader | None]:
    assert ref.id is not None
    try:
        return None, check_received(ref.id, ref.codec, ref.raw_len, ref.stored_len, image)
    except ChunkError as e:
        return e.what, None
    except Exception:  # noqa: BLE001 - whatever a hostile object makes the parser or decoder raise
        return "has a malformed header or payload", None


def usable(index: PackIndex, sizes: dict[str, int], ref: ChunkRef) -> list[Loc]:
    """The entries of REF that INDEX lists in a pack object (SIZES: a listing of packs/) at least as
    long as its index says, and that can be REF at all (_entry_fits): the ones a reader tries."""
    return [loc for loc in index.find(_stored_id(ref)) if _entry_fits(ref, loc)
            and sizes.get(loc.pack, -1) >= index.packs[loc.pack]]


def _entry_fits(ref: ChunkRef, loc: Loc) -> bool:
    """Whether an index entry LOC can be chunk REF at all (so that a hostile index cannot make a reader
    allocate more than the snapshot's chunk needs)."""
    return HEADER_SIZE < loc.length <= HEADER_SIZE + align_up(max_stored_len(ref.codec, ref.raw_len, ref.stored_len))


def _size_fits(ref: ChunkRef, size: int | None) -> bool:
    """Whether an object of SIZE bytes can be chunk REF without reading it: exactly its file for a GPU
    codec; for raw/zstd, also any other encoding of the same raw bytes (a GSNPCHK2 chunk pushed from
    another host: FORMAT.md, "Trust")."""
    if size is None:
        return False
    if size == HEADER_SIZE + ref.stored_len:
        return True
    return HEADER_SIZE < size <= HEADER_SIZE + max_stored_len(ref.codec, ref.raw_len, ref.stored_len)


def _buffer_size(refs: list[ChunkRef]) -> int:
    """A buffer that holds any object that may be one of REFS (and detects a larger one)."""
    return max((HEADER_SIZE + max_stored_len(r.codec, r.raw_len, r.stored_len) for r in refs),
               default=HEADER_SIZE) + HEADER_SIZE

