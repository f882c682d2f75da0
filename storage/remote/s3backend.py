"""The `s3://BUCKET/PREFIX` backend: any S3-compatible object store (AWS S3, Ceph RGW, MinIO, Swift's
s3api), through boto3, path-style, SigV4.

botocore retries nothing here (Retrying, around every backend, does, within the command's deadline);
a request waits at most GPUSNAP_S3_READ_TIMEOUT_S (default 30 s, never more than the deadline) for
the next byte, and a body is read in pieces with the deadline checked between them, so a silent or
trickling server fails the command by its deadline. Credentials: GPUSNAP_S3_ACCESS_KEY_ID and
GPUSNAP_S3_SECRET_ACCESS_KEY (or the AWS_ names), else the remote's 0600 credentials file.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Any, Iterator

from storage.remote.backend import (READ_TIMEOUT_S, BackendDamage, BackendError, BackendSpec, BackendStats, StreamedGets,
                                    BackendUnavailable, Deadline, ObjectInfo, Page, Sink, _env_float)
from storage.remote.credentials import Credentials, load_credentials

MULTIPART_THRESHOLD = 64 << 20  # objects larger than this go up in parts
PART_SIZE = 16 << 20            # S3 wants parts of at least 5 MiB, at most 10000 of them
_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "403",
               "Forbidden", "AuthorizationHeaderMalformed"}


def parse_s3_url(url: str) -> tuple[str, str]:
    """'s3://BUCKET/PREFIX' -> (BUCKET, PREFIX without slashes at either end)."""
    m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?", url or "")
    if not m:
        raise BackendError(f"{url!r} is not s3://BUCKET/PREFIX (bucket: 3-63 lowercase letters, digits, . -)")
    prefix = (m.group(2) or "").strip("/")
    if any(p in ("", ".", "..") for p in prefix.split("/")) and prefix:
        raise BackendError(f"{url!r}: the prefix has an empty, '.' or '..' component")
    return m.group(1), prefix


def check_url(url: str) -> str:
    bucket, prefix = parse_s3_url(url)
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


def open_s3(spec: BackendSpec, deadline: Deadline) -> "S3Backend":
    if spec.endpoint is None:
        raise BackendError(f"remote {spec.name!r}: an s3:// remote needs --endpoint URL")
    return S3Backend(spec, load_credentials(spec.name, spec.credentials_file), deadline)


class S3Backend(StreamedGets):
    """The Backend protocol over boto3; errors turned into one line each."""

    def __init__(self, spec: BackendSpec, creds: Credentials, deadline: Deadline) -> None:
        import boto3
        from botocore.config import Config
        self.who = f"remote {spec.name!r}"
        self.url = check_url(spec.url)
        self.endpoint = spec.endpoint
        self.bucket, self.prefix = parse_s3_url(spec.url)
        self.deadline = deadline
        self.stats = BackendStats()
        read_timeout = max(1.0, min(_env_float("GPUSNAP_S3_READ_TIMEOUT_S", READ_TIMEOUT_S), deadline.seconds))
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=spec.endpoint, region_name=spec.region,
            aws_access_key_id=creds.access_key, aws_secret_access_key=creds.secret_key,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"},
                          retries={"mode": "standard", "max_attempts": 1},
                          connect_timeout=min(5.0, read_timeout), read_timeout=read_timeout,
                          max_pool_connections=spec.pool,
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _dl(self, deadline: Deadline | None, doing: str) -> Deadline:
        dl = deadline or self.deadline
        dl.check(doing, self.who)
        return dl

    @contextmanager
    def errors(self, doing: str) -> Iterator[None]:
        """botocore's exceptions as a BackendError with one line saying what failed and why."""
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            yield
        except ClientError as e:
            err = e.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _AUTH_CODES or status == 403:
                raise BackendError(f"{self.who}: the object store refused the credentials "
                                   f"while {doing} ({code or status})") from None
            if code == "NoSuchBucket":
                raise BackendError(f"{self.who}: bucket {self.bucket!r} does not exist at {self.endpoint}") from None
            if status is not None and (status >= 500 or status in (408, 429)):
                raise BackendUnavailable(f"{self.who}: the object store failed while {doing} "
                                         f"(HTTP {status} {code}) after retries") from None
            raise BackendError(f"{self.who}: {doing} failed: {code or status} "
                               f"{err.get('Message', '')}".rstrip()) from None
        except BotoCoreError as e:
            raise BackendUnavailable(f"{self.who}: cannot reach the object store at {self.endpoint} while "
                                     f"{doing} ({type(e).__name__})") from None

    def _is_missing(self, e: Exception) -> bool:
        from botocore.exceptions import ClientError
        return isinstance(e, ClientError) and (
            e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound")
            or e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404)

    # ---- the protocol ----
    def ensure(self, deadline: Deadline | None = None) -> None:
        from botocore.exceptions import ClientError
        self._dl(deadline, "checking the bucket")
        with self.errors(f"checking bucket {self.bucket!r}"):
            try:
                self.client.head_bucket(Bucket=self.bucket)
                return
            except ClientError as e:
                if not self._is_missing(e):
                    raise
            self.client.create_bucket(Bucket=self.bucket)

    def put(self, key: str, data: bytes | bytearray | memoryview, deadline: Deadline | None = None) -> None:
        """One object; multipart above MULTIPART_THRESHOLD (an aborted upload leaves nothing visible)."""
        dl = self._dl(deadline, f"writing {key}")
        n, k = len(data), self._key(key)
        with self.errors(f"writing {key}"):
            if n <= MULTIPART_THRESHOLD:
                self.client.put_object(Bucket=self.bucket, Key=k,
                                       Body=data if isinstance(data, (bytes, bytearray)) else bytes(data))
                self.stats.count(sent=n)
                return
            up = self.client.create_multipart_upload(Bucket=self.bucket, Key=k)["UploadId"]
            try:
                parts = []
                for i, off in enumerate(range(0, n, PART_SIZE), 1):
                    dl.check(f"writing {key}", self.who)
                    piece = bytes(data[off:off + PART_SIZE])
                    r = self.client.upload_part(Bucket=self.bucket, Key=k, UploadId=up, PartNumber=i, Body=piece)
                    self.stats.count(sent=len(piece))
                    parts.append({"PartNumber": i, "ETag": r["ETag"]})
                self.client.complete_multipart_upload(Bucket=self.bucket, Key=k, UploadId=up,
                                                      MultipartUpload={"Parts": parts})
            except BaseException:
                try:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=k, UploadId=up)
                except Exception:
                    pass
                raise

    def _get_object(self, key: str, **kw: Any) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError
        try:
            r: dict[str, Any] = self.client.get_object(Bucket=self.bucket, Key=self._key(key), **kw)
        except ClientError as e:
            if self._is_missing(e):
                return None
            raise
        return r

    def _pieces(self, key: str, r: dict[str, Any], cap: int, dl: Deadline) -> Iterator[bytes]:
        """The body of response R in pieces, never more than CAP bytes in all: a claimed length over CAP,
        a body that goes on past CAP or ends before its claimed length is damage, raised before anything
        past CAP is read; the deadline is checked between pieces."""
        from urllib3.exceptions import HTTPError
        body = r["Body"]
        try:
            claimed = r.get("ContentLength")
            if claimed is not None and (not isinstance(claimed, int) or claimed > cap):
                raise BackendDamage(f"{self.who}: {key} claims {claimed} bytes, more than it can hold ({cap}); "
                                    "not read")
            raw = getattr(body, "_raw_stream", None)  # below botocore, whose length check reads to the end
            reader = raw if raw is not None else body
            got = 0
            while True:
                dl.check(f"reading {key}", self.who)
                try:
                    piece = reader.read(min(1 << 20, cap - got + 1))
                except (HTTPError, OSError, ValueError) as e:
                    raise BackendUnavailable(f"{self.who}: reading {key} failed after {got} bytes "
                                             f"({type(e).__name__})") from None
                if not piece:
                    break
                got += len(piece)
                if got > cap:
                    raise BackendDamage(f"{self.who}: {key} goes on past {cap} bytes, more than it can hold; not read")
                yield piece
            if claimed is not None and got != claimed:
                raise BackendDamage(f"{self.who}: {key} ended after {got} of the {claimed} bytes it claimed")
        finally:
            body.close()

    def get_stream(self, key: str, limit: int, sink: Sink, deadline: Deadline | None = None) -> bool:
        dl = self._dl(deadline, f"reading {key}")
        with self.errors(f"reading {key}"):
            r = self._get_object(key)
            if r is None:
                return False
            got = 0
            for piece in self._pieces(key, r, limit, dl):
                got += len(piece)
                sink(piece)
            self.stats.count(received=got)
            return True

    def get_range_into(self, key: str, offset: int, length: int, buf: memoryview,
                       deadline: Deadline | None = None) -> int | None:
        from botocore.exceptions import ClientError
        assert 0 < length <= len(buf)
        dl = self._dl(deadline, f"reading {key}")
        with self.errors(f"reading {key}"):
            try:
                r = self._get_object(key, Range=f"bytes={offset}-{offset + length - 1}")
            except ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 416:
                    raise BackendDamage(f"{self.who}: {key} is shorter than its index says "
                                        f"(no bytes at {offset})") from None
                raise
            if r is None:
                return None
            claimed = r.get("ContentLength")
            if claimed is not None and claimed != length:
                r["Body"].close()
                raise BackendDamage(f"{self.who}: {key} answered {claimed} bytes for the {length} asked at "
                                    f"{offset} (shorter than its index says, or the range ignored)")
            cr = r.get("ContentRange")
            if isinstance(cr, str) and not cr.startswith(f"bytes {offset}-{offset + length - 1}/"):
                r["Body"].close()
                raise BackendDamage(f"{self.who}: {key} answered the range {cr!r}, not bytes "
                                    f"{offset}-{offset + length - 1}")
            got = 0
            for piece in self._pieces(key, r, length, dl):
                buf[got:got + len(piece)] = piece
                got += len(piece)
            self.stats.count(received=got)
            if got != length:
                raise BackendDamage(f"{self.who}: {key} answered {got} of the {length} bytes asked at {offset} "
                                    "(shorter than its index says)")
            return got

    def stat(self, key: str, deadline: Deadline | None = None) -> ObjectInfo | None:
        from botocore.exceptions import ClientError
        self._dl(deadline, f"checking {key}")
        with self.errors(f"checking {key}"):
            try:
                r = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            except ClientError as e:
                if self._is_missing(e):
                    return None
                raise
            self.stats.count()
            size, t = r.get("ContentLength"), r.get("LastModified")
            if not isinstance(size, int) or size < 0:
                raise BackendDamage(f"{self.who}: {key}: the object store gave no length")
            return ObjectInfo(key, size, t.timestamp() if hasattr(t, "timestamp") else 0.0)

    def list_page(self, prefix: str, token: str | None, deadline: Deadline | None = None) -> Page:
        self._dl(deadline, f"listing {prefix}")
        base = self._key("")
        kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self._key(prefix), "MaxKeys": 1000}
        if token is not None:
            kw["ContinuationToken"] = token
        with self.errors(f"listing {prefix}"):
            page = self.client.list_objects_v2(**kw)
        self.stats.count()
        items = []
        contents = page.get("Contents", [])
        if not isinstance(contents, list) or len(contents) > 1000:
            raise BackendDamage(f"{self.who}: a listing of {prefix} is not a page of at most 1000 keys")
        for o in contents:
            if not isinstance(o.get("Key"), str) or not isinstance(o.get("Size"), int) \
                    or not hasattr(o.get("LastModified"), "timestamp") or not o["Key"].startswith(base):
                raise BackendDamage(f"{self.who}: a listing of {prefix} names an object without a key, size or time")
            items.append(ObjectInfo(o["Key"][len(base):], o["Size"], o["LastModified"].timestamp()))
        nxt = page.get("NextContinuationToken") if page.get("IsTruncated") else None
        if nxt is not None and not isinstance(nxt, str):
            raise BackendDamage(f"{self.who}: a listing of {prefix} gave no continuation token")
        return Page(items, nxt)

    def delete(self, key: str, deadline: Deadline | None = None) -> None:
        self._dl(deadline, f"deleting {key}")
        with self.errors(f"deleting {key}"):
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
            self.stats.count()

    def now(self, deadline: Deadline | None = None) -> float:
        """The object store's clock (from a Date header), so lock ages never mix two machines' clocks."""
        from email.utils import parsedate_to_datetime
        self._dl(deadline, "reading the server's time")
        with self.errors("reading the server's time"):
            r = self.client.head_bucket(Bucket=self.bucket)
        try:
            return parsedate_to_datetime(r["ResponseMetadata"]["HTTPHeaders"]["date"]).timestamp()
        except (KeyError, TypeError, ValueError):
            raise BackendDamage(f"{self.who}: the object store's answer has no valid Date") from None

    def close(self) -> None:
        self.client.close()
