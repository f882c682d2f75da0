"""Start, swap out and swap in one server: blocking calls (the daemon runs them in a worker thread, one
at a time) over gpusnap's own journaled operations, so that a kill -9 of the daemon at any point leaves
the server running or in a committed snapshot, and `gpusnap recover` finishes what was in flight:

- mode criu: out = `criu dump` into snapshot swap.NAME (CRIU leaves the tree stopped, the snapshot
  commits, only then the tree is killed: sandbox.criu.snapshot); in = `criu restore` of it;
- mode gpu: out = `gpu checkpoint` (the process stays, CHECKPOINTED, its GPU memory in the store);
  in = `gpu restore` into the same process.

Each returns its stages' seconds for the daemon's one log line per swap. A model's prepare/resume
hooks run as `--prepare`/`--resume` do on the commands (sandbox.ops.prepared): prepare before the tree
is seized or its GPU locked, resume after a failed swap-out and after every swap-in, each journaled
first so that `gpusnap recover` finishes a step a killed daemon left.
"""
from __future__ import annotations

import os
import stat
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from storage.api import GpusnapError
from storage.api import SnapshotStore

from sandbox.host.processes import Proc, process_tree
from sandbox.ops.prepared import HookReport, prepared, resumed, tree_of
from sandbox.swap.config import Mode, Model, workload_hooks


class SwapError(GpusnapError):
    """A start or swap of one server that failed (the message says which and why)."""


@dataclass
class Step:
    """What one step did: its stages' seconds, and the process the server is now."""

    what: str
    seconds: dict[str, float] = field(default_factory=dict)
    proc: Proc | None = None

    def line(self) -> str:
        total = sum(v for k, v in self.seconds.items() if k == "total") or sum(self.seconds.values())
        parts = ", ".join(f"{k} {v:.3f}" for k, v in self.seconds.items() if k != "total")
        return f"{self.what} {total:.3f} s ({parts})"


_children: dict[int, subprocess.Popen[bytes]] = {}


def start(model: Model, run_dir: str) -> Step:
    """MODEL's command, in its own session, output appended to RUN_DIR/NAME.log (never a shell)."""
    t = time.monotonic()
    log = os.open(os.path.join(run_dir, f"{model.name}.log"),
                  os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
    if not stat.S_ISREG(os.fstat(log).st_mode):
        os.close(log)
        raise SwapError(f"{model.name}: {run_dir}/{model.name}.log is not a regular file")
    try:
        p = subprocess.Popen(list(model.command), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             cwd=model.cwd, env={**os.environ, **dict(model.env)}, start_new_session=True)
    except OSError as e:
        raise SwapError(f"{model.name}: cannot start {model.command[0]!r}: {e.strerror or e}") from None
    finally:
        os.close(log)
    _children[p.pid] = p
    proc = Proc.of(p.pid)
    if proc is None:
        raise SwapError(f"{model.name}: its command exited at once (see {run_dir}/{model.name}.log)")
    return Step("start", {"spawn": time.monotonic() - t}, proc)


def reap(pid: int) -> int | None:
    """PID's exit status if it is a child of ours that ended (reaped now), else None."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if got == 0:
        return None
    _children.pop(pid, None)
    return status


def _tcp_states(pids: list[int]) -> list[str]:
    """The states (hex, /proc/net/tcp) of the TCP sockets the processes PIDS hold, LISTEN ones left out."""
    inodes = set()
    for p in pids:
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                try:
                    t = os.readlink(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if t.startswith("socket:["):
                    inodes.add(t[8:-1])
        except OSError:
            continue
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pids[0]}/net/{table}") as f:
                next(f)
                for ln in f:
                    cols = ln.split()
                    if len(cols) > 9 and cols[9] in inodes and cols[3] != "0A":
                        out.append(cols[3])
        except (OSError, StopIteration, IndexError):
            continue
    return out


def wait_quiet(proc: Proc, timeout: float = 5.0) -> None:
    """Until the server holds no TCP connection (the proxy closed its own; the server's side closes
    after it): CRIU dumps a listening socket, not a connection."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            pids = process_tree(proc.pid)
        except Exception:  # noqa: BLE001 - gone: the dump says so
            return
        if not _tcp_states(pids):
            return
        time.sleep(0.01)


def swap_out(store: SnapshotStore, model: Model, proc: Proc) -> Step:
    """MODEL's server (PROC) out into its snapshot, by its mode."""
    t = time.monotonic()
    if model.mode == Mode.CRIU:
        from sandbox.criu.runner import DumpOptions
        from sandbox.criu.snapshot import criu_dump
        wait_quiet(proc)
        quiet = time.monotonic() - t
        wh = workload_hooks(model)
        with prepared(store.path, wh, model.snapshot, proc.pid, resume_after=False, report=HookReport()):
            r = criu_dump(store, proc.pid, model.snapshot, replace=True, options=DumpOptions(skip_in_flight=True),
                          resume=wh.resume)
        for p in r.pids:   # the dumped tree was killed once the snapshot committed: free its pids
            deadline = time.monotonic() + 5
            while reap(p) is None and Proc.of(p) is not None and time.monotonic() < deadline:
                time.sleep(0.005)
        return Step(f"out {model.name} (criu dump)", {"quiet": quiet, **r.seconds,
                                                      "total": time.monotonic() - t}, None)
    from sandbox.gpu.snapshot import gpu_checkpoint
    wh = workload_hooks(model)
    with prepared(store.path, wh, model.snapshot, proc.pid, resume_after=False, report=HookReport()):
        g = gpu_checkpoint(store, proc.pid, model.snapshot, replace=True, resume=wh.resume)
    return Step(f"out {model.name} (gpu checkpoint)", {**g.seconds, "total": time.monotonic() - t}, proc)


def swap_in(store: SnapshotStore, model: Model, proc: Proc | None) -> Step:
    """MODEL's server back from its snapshot: criu restores the process, gpu gives PROC its memory back."""
    t = time.monotonic()
    if model.mode == Mode.CRIU:
        from sandbox.criu.snapshot import criu_restore
        r = criu_restore(store, model.snapshot)
        new = Proc.of(r.restored_pid) if r.restored_pid else None
        if new is None:
            raise SwapError(f"{model.name}: restored, but its process {r.restored_pid} is gone")
        _resume(store, model, new.pid, r.seconds)
        return Step(f"in {model.name} (criu restore)", {**r.seconds, "total": time.monotonic() - t}, new)
    if proc is None:
        raise SwapError(f"{model.name}: no process to give its GPU memory back to")
    from sandbox.gpu.snapshot import gpu_restore
    g = gpu_restore(store, model.snapshot, proc.pid)
    _resume(store, model, proc.pid, g.seconds)
    return Step(f"in {model.name} (gpu restore)", {**g.seconds, "total": time.monotonic() - t}, proc)


def _resume(store: SnapshotStore, model: Model, pid: int, seconds: dict[str, float]) -> None:
    """MODEL's resume step for its restored tree (PID), journaled first (the config's own step: the
    operator's, not one read back from the snapshot)."""
    wh = workload_hooks(model)
    if wh.resume is None:
        return
    t = time.monotonic()
    resumed(store.path, wh.resume, wh.timeout_s, model.snapshot, pid, tree_of(pid), HookReport())
    seconds["resume"] = time.monotonic() - t


def gpu_bytes(proc: Proc) -> int | None:
    """GPU memory the server's tree holds now, through NVML (None where NVML cannot say)."""
    from sandbox.gpu import nvml
    try:
        pids = process_tree(proc.pid)
    except Exception:  # noqa: BLE001
        return None
    got = nvml.process_memory(pids)
    return None if got is None else sum(sum(per.values()) for per in got.values())


def gpu_total() -> int | None:
    """The memory of every GPU here together (NVML); None without NVML."""
    from sandbox.gpu import nvml
    m = nvml.memory()
    return sum(t for t, _ in m.values()) if m else None


def stop(proc: Proc, grace: float = 5.0) -> None:
    """End a server the daemon started or restored (SIGTERM, then SIGKILL), and reap it."""
    import signal
    try:
        tree = process_tree(proc.pid)
    except Exception:  # noqa: BLE001
        tree = [proc.pid]
    procs = [p for p in (Proc.of(x) for x in tree) if p is not None]
    procs = [p for p in procs if p.pid != proc.pid] + ([proc] if proc.alive() else [])
    for p in procs:
        p.signal(signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(p.alive() for p in procs):
        reap(proc.pid)
        time.sleep(0.02)
    for p in procs:
        p.signal(signal.SIGKILL)
    end = time.monotonic() + 2
    while time.monotonic() < end and reap(proc.pid) is None and proc.alive():
        time.sleep(0.01)
