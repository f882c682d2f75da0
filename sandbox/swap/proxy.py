"""Requests in, routed to their server's port on 127.0.0.1, answers back: a stream both ways.

Routing: a model's own listen address serves that model alone; the shared one routes by the path
prefix /NAME/... (the prefix is taken off the request line: the server sees /...) or else by the
top-level "model" field of a JSON body (read whole only up to Config.max_route_body bytes; those bytes
are then sent on as they came). /metrics on the shared address (and on the metrics address) is the
daemon's own. Nothing else of a request or an answer is looked at beyond its framing (sandbox.swap.http):
keep-alive, chunked bodies and server-sent events pass through unchanged. Each request gets its own
connection to its server, closed when its answer ends, so that a server with no request in flight holds
no connection from gpusnap when it is swapped out.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Protocol

from sandbox.swap import http
from sandbox.swap.config import Config
from sandbox.swap.http import Head, HttpError, simple_response
from sandbox.swap.registry import Server, Unavailable

IDLE_S = 300.0   # a keep-alive connection with no new request for this long is closed


class Daemon(Protocol):
    """What the proxy asks of the daemon (sandbox.swap.daemon.Daemon)."""

    cfg: Config
    names: frozenset[str]
    servers: dict[str, Server]

    async def acquire(self, name: str, arrived: float) -> None: ...
    def release(self, name: str) -> None: ...
    async def refused(self, name: str, arrived: float) -> bool: ...
    def metrics(self) -> str: ...


class Proxy:
    def __init__(self, daemon: Daemon, *, model: str | None = None, metrics_only: bool = False) -> None:
        self.d, self.model, self.metrics_only = daemon, model, metrics_only

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await asyncio.wait_for(http.read_head(r), IDLE_S)
                except asyncio.TimeoutError:
                    break
                if head is None or not await self.one(head, r, w):
                    break
        except HttpError as e:
            await _answer(w, 400, "Bad Request", f"gpusnap swap: {e}\n")
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            w.close()

    async def one(self, head: Head, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bool:
        """Serve one request; whether the client connection stays open for the next."""
        method, target, version = head.start
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            await _answer(w, 505, "HTTP Version Not Supported", "gpusnap swap speaks HTTP/1.x\n")
            return False
        if self.metrics_only or (self.model is None and target.split("?")[0] == "/metrics"):
            await _discard_body(r, head)
            body = self.d.metrics()
            w.write(simple_response(200, "OK", body, close=not head.keep_alive(version),
                                    content_type="text/plain; version=0.0.4; charset=utf-8"))
            await w.drain()
            return head.keep_alive(version)
        arrived = time.monotonic()
        name, raw, sent_body = self.model, head.raw, b""
        body_done = False
        if name is None:
            name, raw = self._by_prefix(head)
        if name is None:
            name, sent_body = await self._by_json(head, r)
            body_done = True
            if name is None:
                await _answer(w, 404, "Not Found", "gpusnap swap: no model to route this request to: use /NAME/... "
                              f"or a JSON body with \"model\" (models: {', '.join(self.d.names)})\n")
                return False
        try:
            await self.d.acquire(name, arrived)
        except Unavailable as e:
            await _answer(w, 503, "Service Unavailable", f"gpusnap swap: {e}\n")
            return False
        try:
            return await self._forward(name, head, raw, sent_body, body_done, r, w, arrived)
        finally:
            self.d.release(name)

    def _by_prefix(self, head: Head) -> tuple[str | None, bytes]:
        method, target, version = head.start
        if not target.startswith("/"):
            return None, head.raw
        first, sep, rest = target[1:].partition("/")
        first, q, query = first.partition("?")
        if first not in self.d.names:
            return None, head.raw
        new = "/" + rest if sep else "/"
        if q:
            new += "?" + query
        raw = head.raw.lstrip(b"\r\n")
        return first, f"{method} {new} {version}".encode("latin-1") + raw[raw.index(b"\r\n"):]

    async def _by_json(self, head: Head, r: asyncio.StreamReader) -> tuple[str | None, bytes]:
        """The JSON body's "model" (read whole, up to the bound), and the body's bytes as they came."""
        limit = self.d.cfg.max_route_body
        if head.chunked:
            raw, data = await _read_chunked(r, limit)
        else:
            n = head.length() or 0
            if n > limit:
                raise HttpError(f"a body of {n} bytes is over the {limit} read to find its \"model\": route by "
                                "/NAME/... or by a model's own port")
            raw = data = await r.readexactly(n)
        try:
            doc = json.loads(data) if data else None
        except (ValueError, RecursionError):
            doc = None
        name = doc.get("model") if isinstance(doc, dict) else None
        return (name if isinstance(name, str) and name in self.d.names else None), raw

    async def _forward(self, name: str, head: Head, raw: bytes, sent_body: bytes, body_done: bool,
                       r: asyncio.StreamReader, w: asyncio.StreamWriter, arrived: float) -> bool:
        port = self.d.servers[name].model.port
        while True:
            try:
                br, bw = await asyncio.open_connection("127.0.0.1", port, limit=http.MAX_HEAD)
                break
            except ConnectionRefusedError:
                # its process may have died: the daemon checks, restarts it, and the request waits again
                if not await self.d.refused(name, arrived):
                    await _answer(w, 502, "Bad Gateway", f"gpusnap swap: the server of {name} refuses connections\n")
                    return False
        upload: asyncio.Task[None] | None = None
        keep = head.keep_alive(head.start[2])
        answered = False
        try:
            bw.write(raw + sent_body)
            await bw.drain()
            if not body_done and (head.chunked or head.length()):
                upload = asyncio.create_task(http.copy_body(r, bw, head))
            while True:
                rh = await http.read_head(br)
                if rh is None:
                    raise HttpError(f"the server of {name} closed the connection without an answer")
                w.write(rh.raw)
                answered = True
                try:
                    status = int(rh.start[1])
                except ValueError:
                    raise HttpError(f"the server of {name} answered a bad status line") from None
                if status == 101:   # a protocol switch (WebSocket): bytes both ways until either side ends
                    await w.drain()
                    await _tunnel(r, w, br, bw)
                    return False
                if 100 <= status < 200:
                    await w.drain()
                    continue
                break
            if not http.response_has_body(head.start[0], status):
                await w.drain()
            elif rh.chunked:
                await http.copy_chunked(br, w)
            elif (n := rh.length()) is not None:
                await http.copy_exact(br, w, n)
            else:
                await http.copy_until_eof(br, w)
                keep = False
            keep = keep and rh.keep_alive(rh.start[0])
            if upload is not None:
                if not upload.done():   # answered before the body was all sent: the rest cannot be told apart
                    upload.cancel()
                    keep = False
                else:
                    upload.result()
            return keep
        except (HttpError, ConnectionError, asyncio.IncompleteReadError) as e:
            if answered:
                return False   # the answer broke off: the client sees its connection end
            await _answer(w, 502, "Bad Gateway", f"gpusnap swap: {name}: {e or type(e).__name__}\n")
            return False
        finally:
            if upload is not None and not upload.done():
                upload.cancel()
            bw.close()


async def _read_chunked(r: asyncio.StreamReader, limit: int) -> tuple[bytes, bytes]:
    """A whole chunked body up to LIMIT bytes: (its bytes as they came, the data)."""
    raw, data = bytearray(), bytearray()
    while True:
        ln = await r.readuntil(b"\n")
        raw += ln
        try:
            size = int(ln.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise HttpError("a bad chunk-size line") from None
        if size == 0:
            while True:
                t = await r.readuntil(b"\n")
                raw += t
                if t in (b"\r\n", b"\n"):
                    return bytes(raw), bytes(data)
        if len(raw) + size > limit:
            raise HttpError(f"a chunked body over the {limit} bytes read to find its \"model\": route by /NAME/... "
                            "or by a model's own port")
        chunk = await r.readexactly(size + 2)
        raw += chunk
        data += chunk[:-2]


async def _discard_body(r: asyncio.StreamReader, head: Head) -> None:
    if head.chunked:
        await _read_chunked(r, 1 << 20)
    elif n := head.length():
        if n > 1 << 20:
            raise HttpError("a request body too large for /metrics")
        await r.readexactly(n)


async def _tunnel(r: asyncio.StreamReader, w: asyncio.StreamWriter, br: asyncio.StreamReader,
                  bw: asyncio.StreamWriter) -> None:
    async def pipe(a: asyncio.StreamReader, b: asyncio.StreamWriter) -> None:
        try:
            await http.copy_until_eof(a, b)
        finally:
            b.close()
    await asyncio.gather(pipe(r, bw), pipe(br, w), return_exceptions=True)


async def _answer(w: asyncio.StreamWriter, status: int, reason: str, body: str) -> None:
    try:
        w.write(simple_response(status, reason, body))
        await w.drain()
    except ConnectionError:
        pass
