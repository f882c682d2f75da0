"""The memory tier's resident process: `gpusnap pool serve` holds a pinned pool (storage/tiers/memory.py)
and the GPU engine, and swaps CUDA processes' GPU memory out into the pool and back on request.

Why a resident process: the pool must outlive the processes it swaps (model swapping: put one model's
GPU state aside, run another, bring the first back), and pinned memory is slow to get (16 GiB: 2.9 s
registered with huge pages, 11.8 s with cuMemHostAlloc, measured on the H200), so it is taken once.

It needs the driver's custom-storage API (the driver maps a process's GPU memory into this process,
the engine streams it into the pool); with a driver that only has the host copy, swap-out is refused
with the reason (`gpusnap gpu checkpoint` into a store works there).

Protocol: a Unix stream socket (0600, root by default at /run/gpusnap/pool.sock), one JSON object per
line each way: {"op": "swap_out", "pid": P, "name": N} | {"op": "swap_in", "name": N, "pid": P} |
{"op": "ls"} | {"op": "rm", "name": N} | {"op": "usage"} | {"op": "stop"}; the answer is
{"ok": true, ...} or {"ok": false, "error": "one line"}. Requests are served one at a time.
"""
from __future__ import annotations

import json
import os
import socket
import stat
import threading
import time
from typing import Any

from storage.api import GpusnapError

DEFAULT_SOCKET = "/run/gpusnap/pool.sock"
IDLE_S = 60.0


class PoolDaemonError(GpusnapError):
    """The pool daemon cannot be reached, refused a request, or cannot start."""


class PoolServer:
    """The resident pool and engine behind a socket; a context manager (serve_forever in the caller's thread)."""

    def __init__(self, socket_path: str, capacity: int, *, driver: Any = None, features: Any = None,
                 device: Any = None) -> None:
        from storage.api import GpuEngine
        from storage.api import PinnedPool
        from sandbox.gpu.driver import CudaDriver, probe
        self.driver = driver or CudaDriver()
        self.features = features or probe(self.driver)
        self.engine = GpuEngine(0 if device is None else device)
        try:
            t0 = time.perf_counter()
            self.pool = PinnedPool(self.engine.dev.pool_memory(capacity))
            self.pool_seconds = time.perf_counter() - t0
        except BaseException:
            self.engine.close()
            raise
        self.meta: dict[str, dict[str, Any]] = {}
        self.path = socket_path
        self._stop = threading.Event()
        try:
            self.sock = self._listen(socket_path)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _listen(path: str) -> socket.socket:
        """A listening socket at PATH, made only where nothing is, or where a stale socket of ours is
        (a socket owned by this user that nobody answers on: left by a daemon that died). Anything
        else at PATH (a regular file, a link, a live daemon's socket) is left alone and refused."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
                what = "a socket of another user" if stat.S_ISSOCK(st.st_mode) else "not a socket"
                raise PoolDaemonError(f"{path} exists and is {what}; not replacing it (give another --socket)")
            if _alive(path):
                raise PoolDaemonError(f"a pool daemon already serves {path}")
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                raise PoolDaemonError(f"{path} changed while it was checked; not replacing it")
            os.unlink(path)  # left by a daemon that died
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            sock.bind(path)
        except OSError as e:
            sock.close()
            raise PoolDaemonError(f"cannot listen on {path}: {e.strerror}") from None
        finally:
            os.umask(old)
        sock.listen(8)
        return sock

    def __enter__(self) -> "PoolServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        sock = getattr(self, "sock", None)
        if sock is not None:
            sock.close()
            del self.sock
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.close()
            del self.pool
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
            del self.engine

    # -- serving -------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            with conn:
                conn.settimeout(IDLE_S)  # a client that sends nothing does not hold the daemon
                f = conn.makefile("rwb")
                try:
                    for line in f:
                        f.write((json.dumps(self.handle(line)) + "\n").encode())
                        f.flush()
                        if self._stop.is_set():
                            break
                except OSError:
                    pass  # the client went away or idled out; the next one is served

    def handle(self, line: bytes) -> dict[str, Any]:
        try:
            req = json.loads(line)
            op = req.get("op")
            fn = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
            if fn is None:
                raise PoolDaemonError(f"unknown request {op!r}")
            return {"ok": True, **fn(req)}
        except Exception as e:  # noqa: BLE001 - every failure is one line for the client
            return {"ok": False, "error": (str(e).splitlines() or [type(e).__name__])[0]}

    # -- operations ------------------------------------------------------------------------------
    def op_usage(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"usage": self.pool.usage(), "path": self.features.path, "pool_seconds": round(self.pool_seconds, 3)}

    def op_ls(self, req: dict[str, Any]) -> dict[str, Any]:
        return {"snapshots": [{"name": n, **self.meta.get(n, {})} for n in self.pool.names()]}

    def op_rm(self, req: dict[str, Any]) -> dict[str, Any]:
        name = str(req["name"])
        if self.meta.get(name, {}).get("swapped_out"):
            raise PoolDaemonError(f"{name!r} holds the GPU memory of processes still swapped out "
                                  f"({self.meta[name]['pids']}); swap them in first")
        self.pool.remove(name)
        self.meta.pop(name, None)
        return {}

    def op_stop(self, req: dict[str, Any]) -> dict[str, Any]:
        self._stop.set()
        return {}

    def op_swap_out(self, req: dict[str, Any]) -> dict[str, Any]:
        from sandbox.gpu.regions import EngineRegions
        from sandbox.gpu.snapshot import cuda_pids_of
        from sandbox.gpu.state import freeze, plan
        gp = plan(features=self.features) if self.features.checkpoint_api or self.features.custom_storage else None
        if gp is None or not gp.streams:
            raise PoolDaemonError("the memory tier needs the driver's custom-storage API (CUDA 13.4, driver R615+); "
                                  f"this driver offers {self.features.path}: use `gpusnap gpu checkpoint` into a store")
        pid, name = int(req["pid"]), str(req["name"])
        pids = cuda_pids_of(pid, self.driver)
        t0 = time.perf_counter()
        with self.pool.writer(name) as w:
            with freeze(self.driver, pids, gp.backend(EngineRegions.into(self.engine, w))) as rep:
                w.commit()
        self.meta[name] = {"pids": pids, "root_pid": pid, "swapped_out": True,
                           "raw_bytes": w.stats.raw_bytes, "stored_bytes": w.stats.bytes_new + w.stats.bytes_dedup}
        return {"name": name, "pids": pids, "seconds": {**rep.seconds, "total": time.perf_counter() - t0},
                "raw_bytes": w.stats.raw_bytes, "new_bytes": w.stats.bytes_new}

    def op_swap_in(self, req: dict[str, Any]) -> dict[str, Any]:
        from sandbox.gpu.regions import EngineRegions
        from sandbox.gpu.state import GpuPath, plan, thaw
        name = str(req["name"])
        m = self.pool.load(name)
        info = self.meta.get(name)
        if not info or not info.get("swapped_out"):
            raise PoolDaemonError(f"{name!r} is not swapped out")
        if int(req["pid"]) not in (info["root_pid"], *info["pids"]):
            raise PoolDaemonError(f"{name!r} was taken of pid {info['root_pid']}, not {req['pid']}")
        gp = plan(recorded=GpuPath.CUSTOM_STORAGE)  # what the memory tier holds
        rep = thaw(self.driver, info["pids"], gp.backend(EngineRegions.of(self.engine, self.pool, m)))
        info["swapped_out"] = False
        return {"name": name, "pids": info["pids"], "seconds": rep.seconds}


def _alive(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def request(socket_path: str, req: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    """One request to the pool daemon; raises PoolDaemonError with its one-line reason on failure."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(socket_path)
    except OSError as e:
        s.close()
        raise PoolDaemonError(f"no pool daemon at {socket_path} ({e.strerror}); start one with `gpusnap pool serve`") from None
    with s:
        f = s.makefile("rwb")
        f.write((json.dumps(req) + "\n").encode())
        f.flush()
        line = f.readline()
    if not line:
        raise PoolDaemonError(f"the pool daemon at {socket_path} closed the connection")
    ans = json.loads(line)
    if not ans.get("ok"):
        raise PoolDaemonError(f"pool: {ans.get('error')}")
    return ans
