"""The `gpusnap swap serve` daemon: one asyncio event loop that proxies requests, keeps each server's
state (sandbox.swap.registry), and one swapper task that brings servers in, one at a time, in the order
they were first asked for; the blocking swaps run in a worker thread (sandbox.swap.swapper), so that
requests to resident servers go on meanwhile.

A request for a server that is not resident waits in its server's queue (in arrival order) while the
swapper makes room (sandbox.swap.policy: least recently used, idle, unpinned servers, no more than
needed) and brings it in; past its deadline (request_timeout) it is answered 503 with the reason. A
server whose process dies is restarted (criu mode: from its last snapshot when it has one; else its
command), and the log says so. Every swap goes through a journaled gpusnap operation; the daemon also
keeps where each server is in RUN_DIR/state.json, so that a daemon started again after a kill adopts
the servers still running and the snapshots still holding the others (after `gpusnap recover`).
"""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import deque
from typing import Any, Callable

from storage.api import SnapshotStore

from sandbox.ops import journal
from sandbox.swap import control, registry, swapper
from sandbox.swap.config import Config, Mode
from sandbox.swap.policy import plan
from sandbox.swap.proxy import Proxy
from sandbox.swap.registry import Server, State, Unavailable

MONITOR_S = 0.2
HEALTH_EVERY_S = 0.05


def stderr_log(line: str) -> None:
    print(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} gpusnap swap: {line}", file=sys.stderr, flush=True)


class Daemon:
    def __init__(self, cfg: Config, store: SnapshotStore, log: Callable[[str], None] = stderr_log) -> None:
        self.cfg, self.store, self.log = cfg, store, log
        self.servers = {m.name: Server(m) for m in cfg.models}
        self.names = frozenset(self.servers)
        self.waiters: dict[str, deque[asyncio.Future[None]]] = {n: deque() for n in self.servers}
        self.demands: deque[str] = deque()
        self.restart: set[str] = set()
        self.budget: int | None = None
        self.swaps = 0
        self.busy: str | None = None
        self.started = time.monotonic()
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None

    # -- requests -------------------------------------------------------------------------------------

    async def acquire(self, name: str, arrived: float) -> None:
        """Until NAME is resident and counts this request in flight (Unavailable past the deadline)."""
        s = self.servers[name]
        if s.state == State.RESIDENT and not self.waiters[name]:
            self._take(s)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters[name].append(fut)
        s.queued += 1
        self._demand(name)
        left = arrived + self.cfg.request_timeout - time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(left, 0.001))
        except asyncio.TimeoutError:
            if fut.done() and fut.exception() is None:
                return   # released just as the deadline came: it is counted in flight
            fut.cancel()
            s.rejected += 1
            raise Unavailable(f"{name} was not ready within the request deadline of {self.cfg.request_timeout:g} s "
                              f"({self._why(name)})") from None
        except Unavailable:
            s.rejected += 1
            raise
        finally:
            s.queued -= 1
            try:
                self.waiters[name].remove(fut)
            except ValueError:
                pass

    def _take(self, s: Server) -> None:
        s.in_flight += 1
        s.requests += 1
        s.touch()

    def release(self, name: str) -> None:
        s = self.servers[name]
        s.in_flight -= 1
        s.touch()
        self._poke()

    async def refused(self, name: str, arrived: float) -> bool:
        """NAME's server refused a connection: if its process died it is restarted and the request waits
        for it again (True: try again); False when it runs and still refuses, or the deadline passed."""
        s = self.servers[name]
        if s.proc is not None and self._check(s):
            return False
        s.in_flight -= 1
        try:
            await self.acquire(name, arrived)
        except Unavailable:
            s.in_flight += 1   # the caller's release() takes it off again
            return False
        return True

    def _why(self, name: str) -> str:
        s = self.servers[name]
        why = f"it is {s.state.value}"
        if self.busy:
            why += f"; the swapper is {self.busy}"
        if s.error:
            why += f"; {s.error}"
        return why

    def _demand(self, name: str) -> None:
        if name not in self.demands:
            self.demands.append(name)
        self._poke()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _release(self, name: str) -> None:
        """NAME is resident: its waiting requests go, in the order they came."""
        s = self.servers[name]
        for fut in list(self.waiters[name]):
            if not fut.done():
                self._take(s)
                fut.set_result(None)

    def _fail(self, name: str, why: str) -> None:
        for fut in list(self.waiters[name]):
            if not fut.done():
                fut.set_exception(Unavailable(f"{name}: {why}"))

    # -- the swapper ----------------------------------------------------------------------------------

    async def _swapper(self) -> None:
        assert self._wake is not None
        while True:
            if not self.demands:
                self._wake.clear()
                await self._wake.wait()
                continue
            name = self.demands[0]
            s = self.servers[name]
            if s.state == State.RESIDENT or (not self.waiters[name] and name not in self.restart):
                self.demands.popleft()
                self._release(name)
                self.busy = None
                continue
            p = plan([x.slot() for x in self.servers.values()], name, budget=self.budget,
                     max_resident=self.cfg.max_resident)
            if p.wait is not None:
                self.busy = f"waiting: {p.wait}"
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            outs: list[swapper.Step] = []
            for v in p.victims:
                step = await self._swap_out(self.servers[v])
                if step is None:
                    break
                outs.append(step)
            else:
                self.demands.popleft()
                self.restart.discard(name)
                await self._bring_in(s, outs)
                self.busy = None
                continue
            if outs:
                self.log(f"swap: {'; '.join(x.line() for x in outs)}; then {name} waits (a swap-out failed)")

    async def _swap_out(self, s: Server) -> swapper.Step | None:
        assert s.proc is not None
        s.state = State.SWAPPING_OUT
        self.busy = f"swapping {s.name} out"
        measured = swapper.gpu_bytes(s.proc)
        if measured is not None:
            s.gpu_bytes = measured
        self._save()
        try:
            step = await asyncio.to_thread(swapper.swap_out, self.store, s.model, s.proc)
        except Exception as e:  # noqa: BLE001 - the operation's undo put it back: it runs on
            alive = s.proc.alive()
            s.state, s.error = (State.RESIDENT if alive else State.STOPPED), f"swap-out failed: {e}"
            if not alive:
                s.proc = None
            self.log(f"swap out {s.name} FAILED: {e}; it {'runs on' if alive else 'is gone'}")
            self._save()
            return None
        s.state, s.proc, s.snapshot, s.error = State.SWAPPED_OUT, step.proc, s.model.snapshot, None
        s.swap_outs.add(step.seconds["total"])
        self.swaps += 1
        self._save()
        return step

    async def _bring_in(self, s: Server, outs: list[swapper.Step]) -> None:
        """S started or swapped in, after OUTS made room: one log line says all of it."""
        t = time.monotonic()
        steps: list[swapper.Step] = []
        try:
            if s.state == State.SWAPPED_OUT or (s.state in (State.STOPPED, State.FAILED) and s.snapshot
                                                and s.model.mode == Mode.CRIU):
                was = s.state
                s.state = State.SWAPPING_IN
                self.busy = f"swapping {s.name} in"
                self._save()
                try:
                    step = await asyncio.to_thread(swapper.swap_in, self.store, s.model, s.proc)
                except Exception as e:  # noqa: BLE001
                    if was == State.SWAPPED_OUT and s.model.mode == Mode.GPU:
                        raise
                    # criu: the snapshot does not restore (damaged, pids taken): the command starts it afresh
                    self.log(f"{s.name}: its snapshot {s.snapshot!r} did not restore ({e}); starting it from "
                             "its command")
                    s.snapshot = None
                    step = await self._start(s)
                steps.append(step)
            else:
                step = await self._start(s)
                steps.append(step)
            s.proc = steps[-1].proc
            self._save()
            h = await self._healthy(s, t)
            steps.append(swapper.Step("health", {"health": h}))
        except Exception as e:  # noqa: BLE001 - the server failed: its requests get the reason
            s.state, s.error = State.FAILED, str(e).splitlines()[0] if str(e) else type(e).__name__
            if s.proc is not None and (s.model.mode == Mode.CRIU or (steps and steps[-1].what == "start")) \
                    and s.proc.alive():   # a gpu-mode process that failed its restore stays, restorable
                await asyncio.to_thread(swapper.stop, s.proc)
                s.proc = None
            self.log(f"swap: {''.join(x.line() + '; ' for x in outs)}{s.name} FAILED to come up: {s.error}")
            self._fail(s.name, s.error)
            self._save()
            return
        total = time.monotonic() - t
        (s.starts if steps[0].what == "start" else s.swap_ins).add(total)
        s.state, s.error = State.RESIDENT, None
        if steps[0].what != "start":
            self.swaps += 1
        measured = swapper.gpu_bytes(s.proc) if s.proc else None
        if measured is not None:
            s.gpu_bytes = measured
        self.log(f"swap: {'; '.join(x.line() for x in outs + steps)}; {s.name} resident after "
                 f"{total + sum(x.seconds.get('total', 0.0) for x in outs):.3f} s")
        self._save()
        self._release(s.name)

    async def _start(self, s: Server) -> swapper.Step:
        s.state = State.STARTING
        self.busy = f"starting {s.name}"
        return await asyncio.to_thread(swapper.start, s.model, self.cfg.run_dir)

    async def _healthy(self, s: Server, since: float) -> float:
        """Seconds until S's health path answers 2xx (SwapError if its process dies or start_timeout passes)."""
        t = time.monotonic()
        req = f"GET {s.model.health} HTTP/1.1\r\nHost: 127.0.0.1:{s.model.port}\r\nConnection: close\r\n\r\n".encode()
        while True:
            try:
                r, w = await asyncio.open_connection("127.0.0.1", s.model.port)
                try:
                    w.write(req)
                    await w.drain()
                    line = await asyncio.wait_for(r.readline(), 10)
                finally:
                    w.close()
                parts = line.split()
                if len(parts) >= 2 and parts[1][:1] == b"2":
                    return time.monotonic() - t
            except (OSError, asyncio.TimeoutError):
                pass
            if s.proc is None or not s.proc.alive():
                if s.proc is not None:
                    swapper.reap(s.proc.pid)
                raise swapper.SwapError(f"its server exited before {s.model.health} answered "
                                        f"(see {self.cfg.run_dir}/{s.name}.log)")
            if not self.waiters[s.name] and s.name not in self.restart:
                raise swapper.SwapError(f"given up: every request for it passed its deadline before {s.model.health} "
                                        "answered (the next request tries again)")
            if time.monotonic() - since > self.cfg.start_timeout:
                raise swapper.SwapError(f"{s.model.health} did not answer 2xx within start_timeout "
                                        f"{self.cfg.start_timeout:g} s")
            await asyncio.sleep(HEALTH_EVERY_S)

    # -- crashes --------------------------------------------------------------------------------------

    def _check(self, s: Server) -> bool:
        """Whether S's process lives; a dead one is logged and its server restarted (if it was resident)."""
        if s.proc is None:
            return False
        status = swapper.reap(s.proc.pid)
        if s.proc.alive():
            return True
        how = "" if status is None else (f" (signal {os.WTERMSIG(status)})" if os.WIFSIGNALED(status)
                                         else f" (exit status {os.WEXITSTATUS(status)})")
        was = s.state
        s.proc, s.state, s.restarts = None, State.STOPPED, s.restarts + 1
        s.error = f"its process died{how}"
        src = (f"its last snapshot {s.snapshot!r}" if s.model.mode == Mode.CRIU and s.snapshot else "its command")
        if was == State.RESIDENT:
            self.log(f"{s.name}: its server died{how}; restarting it from {src}")
            self.restart.add(s.name)
            self._demand(s.name)
        else:
            self.log(f"{s.name}: its server died{how} while {was.value}; the next request starts it from {src}")
        self._save()
        return False

    async def _monitor(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(MONITOR_S)
            n += 1
            for s in self.servers.values():
                if s.proc is not None and s.state in (State.RESIDENT, State.SWAPPED_OUT):
                    self._check(s)
                if n % 10 == 0 and s.state == State.RESIDENT and s.proc is not None:
                    measured = swapper.gpu_bytes(s.proc)
                    if measured is not None:
                        s.gpu_bytes = measured

    # -- status ---------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        servers = [s.as_dict() for s in self.servers.values()]
        resident = [s for s in self.servers.values() if s.state == State.RESIDENT]
        return {"pid": os.getpid(), "uptime_s": round(time.monotonic() - self.started, 3), "servers": servers,
                "resident": len(resident), "max_resident": self.cfg.max_resident, "budget_bytes": self.budget,
                "gpu_bytes": sum(s.gpu_bytes or 0 for s in resident), "swaps": self.swaps,
                "queue": sum(s.queued for s in self.servers.values()), "busy": self.busy,
                "demands": list(self.demands), "store": self.store.path}

    def metrics(self) -> str:
        return control.metrics(self.status())

    async def _control(self, req: dict[str, Any]) -> dict[str, Any]:
        if req.get("op") == "status":
            return self.status()
        if req.get("op") == "stop":
            assert self._stop is not None
            self.log("asked to stop (control socket)")
            self._stop.set()
            return {"stopping": True, "pid": os.getpid()}
        return {"error": f"unknown op {req.get('op')!r}"}

    def _save(self) -> None:
        try:
            registry.save(self.cfg.run_dir, list(self.servers.values()))
        except OSError as e:
            self.log(f"cannot write {self.cfg.run_dir}/{registry.STATE_FILE}: {e.strerror or e}")

    # -- life -----------------------------------------------------------------------------------------

    def adopt(self) -> None:
        """What a previous daemon left: servers still running (pid AND start time) and snapshots holding
        the others (criu mode). Everything else starts stopped."""
        prev = registry.load(self.cfg.run_dir)
        for s in self.servers.values():
            e = prev.get(s.name)
            if not e:
                continue
            proc, snap = e["proc"], e["snapshot"]
            if proc is not None and proc.alive():
                s.proc, s.snapshot = proc, snap
                s.state = State.RESIDENT
                if s.model.mode == Mode.GPU and _checkpointed(proc.pid):
                    s.state = State.SWAPPED_OUT
                self.log(f"{s.name}: adopted its running server (pid {proc.pid}, {s.state.value})")
            elif (s.model.mode == Mode.CRIU and (snap == s.model.snapshot or e["state"] == State.SWAPPING_OUT.value)
                  and self.store.exists(s.model.snapshot)):
                # a dump kills the tree only once its snapshot is committed: a dead server that was being
                # swapped out is in it
                s.snapshot, s.state = s.model.snapshot, State.SWAPPED_OUT
                self.log(f"{s.name}: adopted its snapshot {s.snapshot!r} (swapped out)")

    async def run(self, ready: Callable[[], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, self._stop.set)
        servers: list[asyncio.AbstractServer] = []
        tasks: list[asyncio.Task[None]] = []
        try:
            servers.append(await control.serve(self.cfg.control, self._control))
            listen = [(a, Proxy(self, model=m.name)) for m in self.cfg.models if (a := m.listen) is not None]
            if self.cfg.listen:
                listen.append((self.cfg.listen, Proxy(self)))
            if self.cfg.metrics:
                listen.append((self.cfg.metrics, Proxy(self, metrics_only=True)))
            for addr, px in listen:
                servers.append(await asyncio.start_server(px.handle, addr.host, addr.port, limit=64 << 10,
                                                          reuse_address=True))
            tasks = [asyncio.create_task(self._swapper()), asyncio.create_task(self._monitor())]
            for s in self.servers.values():
                if s.state == State.RESIDENT:
                    s.touch()
            self.log(f"serving {', '.join(self.names)} on " + ", ".join(str(a) for a, _ in listen)
                     + f"; control {self.cfg.control}" + (f"; budget {self.budget} bytes" if self.budget else "")
                     + (f"; max_resident {self.cfg.max_resident}" if self.cfg.max_resident else ""))
            if ready:
                ready()
            stop = asyncio.create_task(self._stop.wait())
            await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in tasks:
                if t.done() and t.exception():
                    raise t.exception()  # type: ignore[misc]
        finally:
            for srv in servers:
                srv.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._shutdown()

    async def _shutdown(self) -> None:
        """Stop: the swap in the worker thread finished (to_thread is not interrupted), then every server
        the daemon runs is ended; snapshots stay in the store."""
        for s in self.servers.values():
            if s.proc is not None and s.proc.alive():
                self.log(f"{s.name}: stopping its server (pid {s.proc.pid})")
                await asyncio.to_thread(swapper.stop, s.proc)
        for name in self.servers:
            self._fail(name, "gpusnap swap is stopping")
        try:
            os.unlink(os.path.join(self.cfg.run_dir, registry.STATE_FILE))
        except OSError:
            pass
        try:
            os.unlink(self.cfg.control)
        except OSError:
            pass
        self.log("stopped")


def _checkpointed(pid: int) -> bool:
    try:
        from sandbox.gpu.driver import CudaDriver, ProcessState
        return bool(CudaDriver().get_state(pid) == ProcessState.CHECKPOINTED)
    except Exception:  # noqa: BLE001 - no driver: not a CUDA process
        return False


def serve(cfg: Config, store: SnapshotStore, log: Callable[[str], None] = stderr_log) -> None:
    """Run the daemon until SIGTERM, SIGINT or SIGHUP (refused while an interrupted operation waits for
    `gpusnap recover`)."""
    journal.require_clean(store.path)
    d = Daemon(cfg, store, log)
    d.budget = cfg.budget.resolve(swapper.gpu_total() if cfg.budget.fraction is not None else None)
    control.prepare_dir(cfg.control)
    d.adopt()
    asyncio.run(d.run())
