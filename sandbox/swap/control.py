"""The daemon's control socket (root-only), what `gpusnap swap status` reads from it, and the same
figures in Prometheus text format for /metrics.

The socket is a unix stream socket created 0600 in a 0700 directory, and each peer's credentials are
checked (SO_PEERCRED: uid 0 or the daemon's own); a request is one JSON line of at most 4 KiB
({"op": "status"}), the answer one JSON line.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import struct
from typing import Any, Awaitable, Callable

from storage.api import GpusnapError, UnavailableError

MAX_REQUEST = 4096
MAX_ANSWER = 16 << 20


class ControlError(GpusnapError):
    """The control socket cannot be reached or answered wrongly."""


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def prepare_dir(path: str) -> None:
    """The socket's directory: made 0700 if missing; refused if it is a link or others may write it."""
    d = os.path.dirname(path)
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise UnavailableError(f"{d}: the control socket's directory must be a directory owned by uid "
                               f"{os.geteuid()} that no one else can write")


async def serve(path: str, handle: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> asyncio.AbstractServer:
    """Listen on PATH (a stale socket there is replaced; anything else there is refused)."""
    prepare_dir(path)
    try:
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise UnavailableError(f"{path}: exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(path)
            raise UnavailableError(f"{path}: another `gpusnap swap serve` answers there")
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(path)
        finally:
            probe.close()
    except FileNotFoundError:
        pass
    me = os.geteuid()

    async def one(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            sock = w.get_extra_info("socket")
            if peer_uid(sock) not in (0, me):
                w.write(b'{"error": "the control socket is root-only"}\n')
                return
            line = await asyncio.wait_for(r.readline(), 10)
            if len(line) > MAX_REQUEST:
                w.write(b'{"error": "request too long"}\n')
                return
            try:
                req = json.loads(line)
                if not isinstance(req, dict):
                    raise ValueError
            except ValueError:
                w.write(b'{"error": "not a JSON object"}\n')
                return
            w.write(json.dumps(await handle(req)).encode() + b"\n")
        except (OSError, asyncio.TimeoutError, ValueError):
            pass
        finally:
            try:
                await w.drain()
                w.close()
            except OSError:
                pass
    old = os.umask(0o177)   # the socket is created 0600: no window where others may connect
    try:
        server = await asyncio.start_unix_server(one, path, limit=MAX_REQUEST * 2)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return server


def ask(path: str, req: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
    """REQ to the daemon at PATH; its answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    s.settimeout(timeout)
    try:
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(f"no `gpusnap swap serve` answers at {path} (is it running? --socket names "
                               "another control socket)") from None
        except PermissionError:
            raise ControlError(f"{path}: permission denied: the control socket is root-only") from None
        s.sendall(json.dumps(req).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            b = s.recv(1 << 16)
            if not b:
                break
            buf += b
            if len(buf) > MAX_ANSWER:
                raise ControlError(f"{path}: the answer is over {MAX_ANSWER} bytes")
    except socket.timeout:
        raise ControlError(f"{path}: no answer within {timeout:g} s") from None
    finally:
        s.close()
    try:
        d = json.loads(buf)
    except ValueError:
        raise ControlError(f"{path}: not a gpusnap swap daemon's answer") from None
    if not isinstance(d, dict):
        raise ControlError(f"{path}: not a gpusnap swap daemon's answer")
    if "error" in d:
        raise ControlError(f"{path}: {d['error']}")
    return d


def _h(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def render(st: dict[str, Any]) -> str:
    """`swap status` as text: one line per server, then the daemon's figures."""
    budget = st.get("budget_bytes")
    lines = [f"{'MODEL':<16} {'MODE':<5} {'STATE':<13} {'PID':>7} {'GPU MEM':>10} {'FLIGHT':>6} {'QUEUE':>5} "
             f"{'REQS':>6} {'OUT':>4} {'IN':>4} {'IN p50':>7}  NOTE"]
    for s in st["servers"]:
        p50 = s["swap_in"]["p50"]
        note = ("pinned " if s["pinned"] else "") + (s["error"] or "")
        lines.append(f"{s['name']:<16} {s['mode']:<5} {s['state']:<13} {s['pid'] or '-':>7} {_h(s['gpu_bytes']):>10} "
                     f"{s['in_flight']:>6} {s['queued']:>5} {s['requests']:>6} {s['swap_out']['count']:>4} "
                     f"{s['swap_in']['count']:>4} {(f'{p50:.2f}s' if p50 is not None else '-'):>7}  {note}".rstrip())
    lines.append(f"resident {st['resident']}" + (f"/{st['max_resident']}" if st.get("max_resident") else "")
                 + f", GPU memory {_h(st['gpu_bytes'])}" + (f" of a {_h(budget)} budget" if budget else "")
                 + f", swaps {st['swaps']}, queue {st['queue']}, up {st['uptime_s']:.0f} s")
    return "\n".join(lines)


def metrics(st: dict[str, Any]) -> str:
    """The status figures in Prometheus text exposition format (0.0.4)."""
    out: list[str] = []

    def fam(name: str, kind: str, help_: str, rows: list[tuple[str, Any]]) -> None:
        out.append(f"# HELP gpusnap_swap_{name} {help_}")
        out.append(f"# TYPE gpusnap_swap_{name} {kind}")
        for labels, v in rows:
            if v is not None:
                out.append(f"gpusnap_swap_{name}{labels} {v}")
    srv = st["servers"]
    lab = [(s, '{model="%s"}' % s["name"]) for s in srv]
    states = ["stopped", "starting", "resident", "swapping-out", "swapped-out", "swapping-in", "failed"]
    fam("state", "gauge", "1 for the state each server is in.",
        [('{model="%s",state="%s"}' % (s["name"], x), int(s["state"] == x)) for s in srv for x in states])
    fam("gpu_memory_bytes", "gauge", "GPU memory each server holds (measured through NVML).",
        [(lb, s["gpu_bytes"] if s["state"] == "resident" else 0) for s, lb in lab])
    fam("in_flight", "gauge", "Requests being forwarded.", [(lb, s["in_flight"]) for s, lb in lab])
    fam("queued", "gauge", "Requests waiting for their server.", [(lb, s["queued"]) for s, lb in lab])
    fam("requests_total", "counter", "Requests routed to each server.", [(lb, s["requests"]) for s, lb in lab])
    fam("rejected_total", "counter", "Requests answered 503 (deadline or failure).", [(lb, s["rejected"]) for s, lb in lab])
    fam("restarts_total", "counter", "Servers restarted after their process died.", [(lb, s["restarts"]) for s, lb in lab])
    for kind in ("swap_out", "swap_in", "start"):
        fam(f"{kind}_total", "counter", f"Completed {kind.replace('_', ' ')}s.", [(lb, s[kind]["count"]) for s, lb in lab])
        fam(f"{kind}_seconds_total", "counter", f"Seconds spent in {kind.replace('_', ' ')}s.",
            [(lb, s[kind]["seconds_total"]) for s, lb in lab])
        fam(f"{kind}_seconds", "gauge", f"p50 and p99 of the last {kind.replace('_', ' ')}s.",
            [('{model="%s",quantile="%s"}' % (s["name"], q), s[kind][k]) for s in srv for q, k in (("0.5", "p50"), ("0.99", "p99"))])
    fam("budget_bytes", "gauge", "The GPU memory budget.", [("", st.get("budget_bytes"))])
    fam("resident", "gauge", "Servers resident now.", [("", st["resident"])])
    return "\n".join(out) + "\n"
