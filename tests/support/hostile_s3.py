"""A small S3 server on 127.0.0.1 that speaks enough of the protocol for gpusnap's client (boto3,
path-style, SigV4 ignored: any credentials pass) and misbehaves on request: for the keys a test names,
an endless body, a 2^40 Content-Length, no Content-Length at all, or a clock far off.

Run as `python hostile_s3.py PORTFILE BEHAVIOURS.json`: it listens on a free port, writes the port to
PORTFILE, and re-reads BEHAVIOURS.json on every request, a JSON object mapping a key suffix to one of
  "endless"   200, no Content-Length, then bytes until the client hangs up;
  "huge"      200, Content-Length 2^40, a megabyte, then the connection closed;
  "nolength"  the stored object (or the range asked), with no Content-Length (connection closed at its end);
  "rangelong" a range read answered with 4096 bytes more than asked (Content-Length saying so);
  "rangeshort" a range read answered with 4096 bytes fewer than asked (Content-Length saying so);
  "norange"   a range read answered with the whole object (200, as a server that ignores Range);
  "silent"    a GET (or HEAD) read and never answered (a server that hangs: the client's timeouts and
              deadline are all that end it);
A suffix starting with "~" matches every key that contains the rest (e.g. "~/packs/").
Range reads (`Range: bytes=A-B`) are otherwise answered as S3 does (206, Content-Range).
plus the keys "clock_offset_s": seconds added to every Date and LastModified the server reports (a
clock far off), and "date_offset_s": seconds added to the Date header alone (a Date that disagrees
with the object times, as behind a proxy with another clock), and "list_forever": a substring; every
ListObjectsV2 of a prefix containing it answers IsTruncated with 1000 new keys (a listing that never ends).
Objects are kept in memory (PUT, GET, HEAD, DELETE, ListObjectsV2, multipart uploads).
"""
from __future__ import annotations

import email.utils
import hashlib
import json
import sys
import threading
import time
import urllib.parse
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from xml.sax.saxutils import escape

_objects: dict[str, tuple[bytes, float]] = {}   # "bucket/key" -> (bytes, last modified, true clock)
_uploads: dict[str, dict[int, bytes]] = {}
_lock = threading.Lock()
_behaviours_path = ""


def _behaviours() -> dict[str, Any]:
    try:
        with open(_behaviours_path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _offset() -> float:
    return float(_behaviours().get("clock_offset_s", 0))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def date_time_string(self, timestamp: float | None = None) -> str:
        extra = float(_behaviours().get("date_offset_s", 0)) if timestamp is None else 0.0  # the Date header
        return email.utils.formatdate((timestamp or time.time()) + _offset() + extra, usegmt=True)

    # ---- helpers ----
    def _split(self) -> tuple[str, str, dict[str, list[str]]]:
        u = urllib.parse.urlsplit(self.path)
        parts = urllib.parse.unquote(u.path).lstrip("/").split("/", 1)
        return parts[0], parts[1] if len(parts) > 1 else "", urllib.parse.parse_qs(u.query, keep_blank_values=True)

    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length", "0"))
        return self.rfile.read(n) if n else b""

    def _reply(self, code: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _missing(self) -> None:
        self._reply(404, b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>NoSuchKey</Code>"
                         b"<Message>no such key</Message></Error>", {"Content-Type": "application/xml"})

    def _behaviour(self, key: str) -> str | None:
        for suffix, what in _behaviours().items():
            if suffix in ("clock_offset_s", "date_offset_s", "list_forever"):
                continue
            if key.endswith(suffix) or (suffix.startswith("~") and suffix[1:] in key):
                return str(what)
        return None

    # ---- verbs ----
    def _hang(self) -> None:
        time.sleep(3600)  # a daemon thread: the server's exit ends it

    def do_HEAD(self) -> None:
        bucket, key, _ = self._split()
        if key and self._behaviour(key) == "silent":
            self._hang()
        if not key:
            self._reply(200)
            return
        with _lock:
            obj = _objects.get(f"{bucket}/{key}")
        if obj is None:
            self._reply(404)
            return
        if self._behaviour(key) == "nolength":
            self.send_response(200)
            self.send_header("ETag", '"x"')
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(obj[0])))  # the object's length, no body follows
        self.send_header("ETag", f'"{hashlib.md5(obj[0]).hexdigest()}"')
        self.send_header("Last-Modified", self.date_time_string(obj[1]))
        self.end_headers()

    def do_GET(self) -> None:
        bucket, key, q = self._split()
        if not key:
            self._list(bucket, q)
            return
        what = self._behaviour(key)
        if what == "silent":
            self._hang()
        if what == "endless":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            block = b"[" * 65536
            try:
                while True:
                    self.wfile.write(block)
            except OSError:
                return
        if what == "huge":
            self.send_response(200)
            self.send_header("Content-Length", str(1 << 40))
            self.send_header("Connection", "close")
            self.end_headers()
            try:
                self.wfile.write(b"\0" * (1 << 20))
            except OSError:
                pass
            self.close_connection = True
            return
        with _lock:
            obj = _objects.get(f"{bucket}/{key}")
        if obj is None:
            self._missing()
            return
        rng = self.headers.get("Range")
        if what == "nolength":
            body, code = obj[0], 200
            if rng:
                a_s, _, b_s = rng.removeprefix("bytes=").partition("-")
                body, code = obj[0][int(a_s):int(b_s) + 1], 206
            self.send_response(code)
            if rng:
                self.send_header("Content-Range", f"bytes {a_s}-{int(a_s) + len(body) - 1}/{len(obj[0])}")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True
            return
        if rng and what != "norange":
            a_s, _, b_s = rng.removeprefix("bytes=").partition("-")
            a, b = int(a_s), min(int(b_s), len(obj[0]) - 1)
            if a >= len(obj[0]):
                self._reply(416, b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InvalidRange</Code>"
                                 b"<Message>range not satisfiable</Message></Error>", {"Content-Type": "application/xml"})
                return
            body = obj[0][a:b + 1]
            if what == "rangelong":
                body += b"\0" * 4096
            elif what == "rangeshort":
                body = body[:-4096]
            self._reply(206, body, {"ETag": f'"{hashlib.md5(obj[0]).hexdigest()}"',
                                    "Content-Range": f"bytes {a}-{a + len(body) - 1}/{len(obj[0])}",
                                    "Last-Modified": self.date_time_string(obj[1])})
            return
        self._reply(200, obj[0], {"ETag": f'"{hashlib.md5(obj[0]).hexdigest()}"',
                                  "Last-Modified": self.date_time_string(obj[1])})

    def _list(self, bucket: str, q: dict[str, list[str]]) -> None:
        prefix = q.get("prefix", [""])[0]
        forever = _behaviours().get("list_forever")
        if isinstance(forever, str) and forever in prefix:
            page = int(q.get("continuation-token", ["0"])[0] or 0)
            t = datetime.fromtimestamp(time.time(), timezone.utc).strftime('%Y-%m-%dT%H:%M:%S.000Z')
            rows = "".join(f"<Contents><Key>{escape(prefix)}{page:012d}{i:04d}{'0' * 16}</Key><LastModified>{t}"
                           f"</LastModified><ETag>\"x\"</ETag><Size>1</Size><StorageClass>STANDARD</StorageClass>"
                           "</Contents>" for i in range(1000))
            xml = (f"<?xml version='1.0' encoding='UTF-8'?><ListBucketResult xmlns='http://s3.amazonaws.com/doc/2006-03-01/'>"
                   f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>1000</KeyCount>"
                   f"<MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>"
                   f"<NextContinuationToken>{page + 1}</NextContinuationToken>{rows}</ListBucketResult>")
            self._reply(200, xml.encode(), {"Content-Type": "application/xml"})
            return
        with _lock:
            items = sorted((k.split("/", 1)[1], v) for k, v in _objects.items()
                           if k.startswith(bucket + "/") and k.split("/", 1)[1].startswith(prefix))
        rows = "".join(
            f"<Contents><Key>{escape(k)}</Key><LastModified>"
            f"{datetime.fromtimestamp(t + _offset(), timezone.utc).strftime('%Y-%m-%dT%H:%M:%S.000Z')}"
            f"</LastModified><ETag>\"x\"</ETag><Size>{len(d)}</Size><StorageClass>STANDARD</StorageClass></Contents>"
            for k, (d, t) in items)
        xml = (f"<?xml version='1.0' encoding='UTF-8'?><ListBucketResult xmlns='http://s3.amazonaws.com/doc/2006-03-01/'>"
               f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(items)}</KeyCount>"
               f"<MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>{rows}</ListBucketResult>")
        self._reply(200, xml.encode(), {"Content-Type": "application/xml"})

    def do_PUT(self) -> None:
        bucket, key, q = self._split()
        data = self._body()
        if not key:
            self._reply(200)
            return
        if "uploadId" in q:
            with _lock:
                _uploads[q["uploadId"][0]][int(q["partNumber"][0])] = data
            self._reply(200, headers={"ETag": f'"{hashlib.md5(data).hexdigest()}"'})
            return
        with _lock:
            _objects[f"{bucket}/{key}"] = (data, time.time())
        self._reply(200, headers={"ETag": f'"{hashlib.md5(data).hexdigest()}"'})

    def do_POST(self) -> None:
        bucket, key, q = self._split()
        self._body()
        if "uploads" in q:
            up = hashlib.md5(f"{key}{time.time()}".encode()).hexdigest()
            with _lock:
                _uploads[up] = {}
            xml = (f"<?xml version='1.0' encoding='UTF-8'?><InitiateMultipartUploadResult><Bucket>{escape(bucket)}"
                   f"</Bucket><Key>{escape(key)}</Key><UploadId>{up}</UploadId></InitiateMultipartUploadResult>")
            self._reply(200, xml.encode(), {"Content-Type": "application/xml"})
            return
        if "uploadId" in q:
            with _lock:
                parts = _uploads.pop(q["uploadId"][0], {})
                _objects[f"{bucket}/{key}"] = (b"".join(parts[i] for i in sorted(parts)), time.time())
            xml = (f"<?xml version='1.0' encoding='UTF-8'?><CompleteMultipartUploadResult><Bucket>{escape(bucket)}"
                   f"</Bucket><Key>{escape(key)}</Key><ETag>\"x\"</ETag></CompleteMultipartUploadResult>")
            self._reply(200, xml.encode(), {"Content-Type": "application/xml"})
            return
        self._reply(400)

    def do_DELETE(self) -> None:
        bucket, key, q = self._split()
        with _lock:
            if "uploadId" in q:
                _uploads.pop(q["uploadId"][0], None)
            else:
                _objects.pop(f"{bucket}/{key}", None)
        self._reply(204)


def main() -> None:
    global _behaviours_path
    portfile, _behaviours_path = sys.argv[1], sys.argv[2]
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    with open(portfile + ".tmp", "w") as f:
        f.write(str(srv.server_address[1]))
    import os
    os.rename(portfile + ".tmp", portfile)
    srv.serve_forever()


if __name__ == "__main__":
    main()
