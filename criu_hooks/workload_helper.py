"""Sleep and wake for any PyTorch server: the prepare/resume protocol of gpusnap's workload hooks.

This file is standalone: it imports nothing from gpusnap (the standard library, and torch when the
server uses it), so copy it next to your server and import it from there. It gives any PyTorch server
vLLM's sleep level-1 semantics: on prepare, new requests wait, the ones in flight finish, the tensors the
server said it can re-create (a KV pool, scratch buffers) are dropped and the CUDA caching allocator
is emptied, so a snapshot holds only what matters (the weights); on resume the dropped tensors come
back as zeros of the same shape, dtype and device, and requests flow again.

    import workload_helper
    gate = workload_helper.Gate()
    gate.discardable("kv_pool", lambda: server.kv_pool, lambda t: setattr(server, "kv_pool", t))
    host, port = gate.serve(port=8321)          # POST /prepare, POST /resume on 127.0.0.1:8321

    @gate.guarded                               # or: with gate.request(): ... / async with gate.arequest(): ...
    def handle(request): ...

    gpusnap criu dump PID NAME --prepare http://127.0.0.1:8321/prepare --resume http://127.0.0.1:8321/resume

Endpoints (loopback only): POST /prepare (alias /sleep), POST /resume (alias /wake_up), GET /state.
Each answers 200 with a JSON summary (/prepare: bytes released per tensor), 503 if requests in flight
did not finish within the drain deadline (the gate is open again then: nothing was released).
Both are idempotent: a second prepare, or a resume without a prepare, changes nothing. A request a web
page could have made (an Origin or Sec-Fetch-Site header, a Host that is not a loopback address, as
DNS rebinding sends) is refused with 403; the endpoint has no other authentication: any local process
can reach it.

Guarantees: a discardable tensor is dropped only when no request is in flight and none can start; a
request that arrives while prepared waits (up to admit_timeout_s, then RuntimeError) and never runs
on a dropped tensor; prepare and resume never run at once.
"""
from __future__ import annotations

import asyncio
import functools
import gc
import inspect
import ipaddress
import json
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class DrainTimeout(RuntimeError):
    """Requests in flight did not finish by the drain deadline: nothing was released."""


@dataclass
class _Discardable:
    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]
    shape: tuple[int, ...] | None = None   # recorded when dropped
    dtype: Any = None
    device: Any = None


class Gate:
    """Admits requests while open; prepare() closes it, drains, and releases what was registered."""

    def __init__(self, drain_timeout_s: float = 30.0, admit_timeout_s: float = 600.0) -> None:
        self.drain_timeout_s, self.admit_timeout_s = drain_timeout_s, admit_timeout_s
        self._cv = threading.Condition()
        self._open = True
        self._in_flight = 0
        self._prepared = False
        self._steps = threading.Lock()      # one prepare or resume at a time
        self._items: dict[str, _Discardable] = {}
        self._server: ThreadingHTTPServer | None = None

    # -- what the server registers ------------------------------------------------------------------
    def discardable(self, name: str, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        """A tensor the server can do without while prepared: GET() returns it (or None), SET(t) puts
        T in its place (None on prepare; zeros of the same shape, dtype and device on resume)."""
        with self._steps:
            if name in self._items:
                raise ValueError(f"discardable {name!r} is registered already")
            self._items[name] = _Discardable(name, get, set)

    # -- the request path ---------------------------------------------------------------------------
    def _admit(self) -> bool:
        with self._cv:
            if not self._open:
                return False
            self._in_flight += 1
            return True

    def _done(self) -> None:
        with self._cv:
            self._in_flight -= 1
            self._cv.notify_all()

    @contextmanager
    def request(self) -> Iterator[None]:
        """One request's work (blocking): waits while prepared."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._open, timeout=self.admit_timeout_s):
                raise RuntimeError("the server stayed prepared (asleep) too long: request not admitted")
            self._in_flight += 1
        try:
            yield
        finally:
            self._done()

    @asynccontextmanager
    async def arequest(self) -> AsyncIterator[None]:
        """One request's work in an asyncio server: waits (without blocking the loop) while prepared."""
        deadline = time.monotonic() + self.admit_timeout_s
        while not self._admit():
            if time.monotonic() > deadline:
                raise RuntimeError("the server stayed prepared (asleep) too long: request not admitted")
            await asyncio.sleep(0.005)
        try:
            yield
        finally:
            self._done()

    def guarded(self, fn: F) -> F:
        """FN (a function or a coroutine function) run as one request."""
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def awrapped(*a: Any, **k: Any) -> Any:
                async with self.arequest():
                    return await fn(*a, **k)
            return awrapped  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapped(*a: Any, **k: Any) -> Any:
            with self.request():
                return fn(*a, **k)
        return wrapped  # type: ignore[return-value]

    # -- the protocol -------------------------------------------------------------------------------
    @property
    def prepared(self) -> bool:
        return self._prepared

    def state(self) -> dict[str, Any]:
        with self._cv:
            return {"state": "prepared" if self._prepared else "running", "in_flight": self._in_flight,
                    "discardable": sorted(self._items)}

    def prepare(self) -> dict[str, Any]:
        """Close the gate, wait for requests in flight (DrainTimeout after drain_timeout_s: the gate
        opens again), drop every discardable tensor, empty the CUDA caching allocator."""
        with self._steps:
            if self._prepared:
                return {"state": "prepared", "released_bytes": 0, "already": True}
            t0 = time.monotonic()
            with self._cv:
                self._open = False
                if not self._cv.wait_for(lambda: self._in_flight == 0, timeout=self.drain_timeout_s):
                    self._open = True
                    self._cv.notify_all()
                    raise DrainTimeout(f"{self._in_flight} request(s) still in flight after {self.drain_timeout_s:g} s")
            released: dict[str, int] = {}
            for d in self._items.values():
                t = d.get()
                if t is None:
                    continue
                d.shape, d.dtype, d.device = tuple(t.shape), t.dtype, t.device
                released[d.name] = int(t.numel()) * int(t.element_size())
                d.set(None)
                del t
            gc.collect()
            _empty_cuda_cache()
            self._prepared = True
            return {"state": "prepared", "released_bytes": sum(released.values()), "released": released,
                    "seconds": round(time.monotonic() - t0, 3)}

    def resume(self) -> dict[str, Any]:
        """Re-create each dropped tensor as zeros of its shape, dtype and device; open the gate."""
        with self._steps:
            if not self._prepared:
                return {"state": "running", "recreated_bytes": 0, "already": True}
            t0 = time.monotonic()
            import torch
            made = 0
            for d in self._items.values():
                if d.shape is None:
                    continue
                t = torch.zeros(d.shape, dtype=d.dtype, device=d.device)
                made += int(t.numel()) * int(t.element_size())
                d.set(t)
                d.shape = d.dtype = d.device = None
            self._prepared = False
            with self._cv:
                self._open = True
                self._cv.notify_all()
            return {"state": "running", "recreated_bytes": made, "seconds": round(time.monotonic() - t0, 3)}

    # -- the endpoint -------------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Serve POST /prepare and /resume (and /sleep, /wake_up, GET /state) on HOST:PORT, a loopback
        address, from a daemon thread; the address bound (PORT 0: any free port)."""
        if host not in LOOPBACK:
            raise ValueError(f"the helper listens on a loopback address only, not {host!r}")
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                pass

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _refused(self) -> bool:
                """A request a web page could have made (a browser on this host visiting a hostile
                site: an Origin header, or a Host that is not a loopback name, as DNS rebinding sends):
                403. gpusnap, curl and other tools send neither."""
                host = (self.headers.get("Host") or "").strip().lower()
                name = host[1:host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
                if self.headers.get("Origin") is None and self.headers.get("Sec-Fetch-Site") is None \
                        and (name == "localhost" or _loopback_ip(name)):
                    return False
                self._answer(403, {"error": "refused: the helper answers tools on this host, not web pages "
                                            "(an Origin header, or a Host that is not a loopback address)"})
                return True

            def do_GET(self) -> None:
                if self._refused():
                    return
                if self.path.split("?")[0] == "/state":
                    self._answer(200, gate.state())
                else:
                    self._answer(404, {"error": "not found"})

            def do_POST(self) -> None:
                if self._refused():
                    return
                try:
                    n = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    n = -1
                if not 0 <= n <= 1 << 16:  # a negative length read to the end of the stream: held the thread
                    self._answer(400, {"error": "bad Content-Length"})
                    return
                if n:
                    self.rfile.read(n)
                step = {"/prepare": gate.prepare, "/sleep": gate.prepare,
                        "/resume": gate.resume, "/wake_up": gate.resume}.get(self.path.split("?")[0])
                if step is None:
                    self._answer(404, {"error": "not found"})
                    return
                try:
                    self._answer(200, step())
                except DrainTimeout as e:
                    self._answer(503, {"error": str(e)})
                except Exception as e:  # noqa: BLE001 - told to gpusnap, which fails the step
                    self._answer(500, {"error": f"{type(e).__name__}: {e}"})

        family_host = host if host != "localhost" else "127.0.0.1"
        server_cls = ThreadingHTTPServer
        if ":" in family_host:
            import socket

            class V6(ThreadingHTTPServer):
                address_family = socket.AF_INET6
            server_cls = V6
        self._server = server_cls((family_host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="workload-helper", daemon=True).start()
        addr = self._server.server_address
        return str(addr[0]), int(addr[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _empty_cuda_cache() -> None:
    """torch.cuda.synchronize() and empty_cache(), only where this process uses CUDA already."""
    import sys
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
