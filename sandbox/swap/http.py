"""HTTP/1.1 message framing over asyncio streams, for passing messages through unchanged.

Only what framing needs is read from a message: its start line, and the headers Content-Length,
Transfer-Encoding and Connection. Bodies are copied as the bytes that came (a chunked body chunk by
chunk with its own size lines and trailers, so that server-sent events go out as each arrives).
Sizes are bounded: a head over MAX_HEAD bytes, a chunk-size line over MAX_LINE, are refused.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

MAX_HEAD = 64 << 10
MAX_LINE = 8 << 10
COPY = 64 << 10


class HttpError(Exception):
    """A message that cannot be framed (the connection is answered 400 or closed)."""


@dataclass(frozen=True)
class Head:
    """A request or response head: its bytes as they came, and what framing needs."""

    raw: bytes
    start: tuple[str, str, str]          # (method, target, version) or (version, status, reason)
    headers: tuple[tuple[str, str], ...]  # (lower-case name, value)

    def get(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def tokens(self, name: str) -> set[str]:
        return {t.strip().lower() for k, v in self.headers if k == name for t in v.split(",")}

    @property
    def chunked(self) -> bool:
        return "chunked" in self.tokens("transfer-encoding")

    def length(self) -> int | None:
        v = self.get("content-length")
        if v is None:
            return None
        if not v.strip().isdigit():
            raise HttpError(f"bad Content-Length {v!r}")
        return int(v)

    def keep_alive(self, version: str) -> bool:
        conn = self.tokens("connection")
        return "keep-alive" in conn if version == "HTTP/1.0" else "close" not in conn


async def read_head(r: asyncio.StreamReader) -> Head | None:
    """The next head on R; None at a clean end of stream before any byte of one."""
    try:
        raw = await r.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise HttpError("the stream ended inside a message head") from None
    except asyncio.LimitOverrunError:
        raise HttpError(f"a message head over {MAX_HEAD} bytes") from None
    lines = raw[:-4].split(b"\r\n")
    while lines and not lines[0]:   # tolerated empty lines before a request (RFC 9112 2.2)
        lines.pop(0)
    if not lines:
        raise HttpError("an empty message head")
    start = lines[0].decode("latin-1").split(" ", 2)
    if len(start) < 2:
        raise HttpError(f"a bad start line {lines[0][:80]!r}")
    headers = []
    for ln in lines[1:]:
        k, sep, v = ln.decode("latin-1").partition(":")
        if not sep or not k or k != k.strip():
            raise HttpError(f"a bad header line {ln[:80]!r}")
        headers.append((k.lower(), v.strip()))
    return Head(raw, (start[0], start[1], start[2] if len(start) > 2 else ""), tuple(headers))


async def copy_exact(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        b = await r.read(min(n, COPY))
        if not b:
            raise HttpError("the stream ended inside a body")
        w.write(b)
        await w.drain()
        n -= len(b)


async def copy_until_eof(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while b := await r.read(COPY):
        w.write(b)
        await w.drain()


async def _line(r: asyncio.StreamReader) -> bytes:
    try:
        ln = await r.readuntil(b"\n")
    except asyncio.IncompleteReadError:
        raise HttpError("the stream ended inside a chunked body") from None
    except asyncio.LimitOverrunError:
        raise HttpError("a chunk-size line too long") from None
    if len(ln) > MAX_LINE:
        raise HttpError("a chunk-size line too long")
    return ln


async def copy_chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """A chunked body, its size lines, chunks and trailers byte for byte; each chunk sent as it comes."""
    while True:
        ln = await _line(r)
        try:
            size = int(ln.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise HttpError(f"a bad chunk-size line {ln[:40]!r}") from None
        w.write(ln)
        if size == 0:
            while True:   # trailers up to the empty line
                t = await _line(r)
                w.write(t)
                if t in (b"\r\n", b"\n"):
                    await w.drain()
                    return
        await copy_exact(r, w, size)
        crlf = await _line(r)
        if crlf.strip():
            raise HttpError("a chunk not followed by CRLF")
        w.write(crlf)
        await w.drain()


async def copy_body(r: asyncio.StreamReader, w: asyncio.StreamWriter, head: Head) -> None:
    """A request's body as its head frames it (none when neither header is there)."""
    if head.chunked:
        await copy_chunked(r, w)
    else:
        await copy_exact(r, w, head.length() or 0)


def response_has_body(method: str, status: int) -> bool:
    return not (method == "HEAD" or 100 <= status < 200 or status in (204, 304))


def simple_response(status: int, reason: str, body: str, *, close: bool = True,
                    content_type: str = "text/plain; charset=utf-8") -> bytes:
    data = body.encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
            + ("Connection: close\r\n" if close else "") + "\r\n").encode() + data
