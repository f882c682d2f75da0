"""`gpusnap-criu-hook`: the CRIU action script that checkpoints and restores the GPU state of the CUDA
processes in a tree CRIU dumps (runc, Podman, containerd, plain `criu`), safe when CRIU runs an action
twice, when a dump fails, and with --leave-running.

Guarantees kept here (GPU freeze/thaw itself is sandbox/gpu/state.py's):
- every action is idempotent: a second pre-dump finds the processes CHECKPOINTED and leaves them; a
  second post-dump, network-unlock or post-resume finds nothing left to do;
- a dump that fails after pre-dump, or one with --leave-running, gives the GPU processes back at
  network-unlock (the action CRIU runs in both cases), with no environment variable needed; the
  network-unlock of a restore (CRIU runs one before the processes resume) changes nothing: only the
  CRIU run that froze the processes thaws them at network-unlock (a record per run, under the state
  directory, keyed by CRIU's pid and start time);
- gpusnap's own CRIU runs (marked with GPUSNAP_OWN_CRIU_CALL) are left to gpusnap: the hook does nothing;
- where CRIU's own cuda plugin is installed it handles the GPUs: the hook steps aside and says so;
- one log line per action, to stderr (CRIU's log) and to the log file;
- no action blocks: each runs under a deadline (GPUSNAP_HOOK_TIMEOUT, default 180 s). At the deadline
  the action is interrupted (a pre-dump undoes what it froze on the way out), one FAILED line is logged
  and the hook exits with the status that lets CRIU go on safely (EXIT_ON_FAILURE); if Python cannot
  even run that (a driver call stuck in C), a watchdog thread ends the process GRACE_S later. Signals
  CRIU left blocked are unblocked first, files are opened non-blocking (a FIFO planted at the log or
  record path fails at once), and the process ends with os._exit (no wait for leftover threads).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import signal
import stat
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

HELP = """\
gpusnap-criu-hook is a CRIU action script: CRIU runs it at every stage of a dump or restore, with
CRTOOLS_SCRIPT_ACTION, CRTOOLS_INIT_PID and CRTOOLS_IMAGE_DIR set. It checkpoints the GPU state of the
CUDA processes in the tree so that CRIU can dump them, and brings it back afterwards:

  pre-dump        lock and checkpoint every CUDA process of the tree (all or nothing; on a failure
                  they keep running and CRIU aborts the dump); already checkpointed ones are left
  network-unlock  after a failed dump or a --leave-running one: restore and unlock the processes
                  this dump checkpointed (on a restore: nothing)
  post-resume     after a restore: restore and unlock the tree's CUDA processes
  other actions   nothing
Every action may run twice (CRIU 4.1.1 does that when runc passes its config): the second is harmless.
By default the driver keeps the GPU memory in each process's host memory, which CRIU then dumps.

Install it with `gpusnap hook install` (it writes `action-script PATH` into the CRIU configuration
file your runtime reads). It does nothing when CRIU's own cuda plugin (cuda_plugin.so in CRIU's plugin
directory) is installed, and nothing inside gpusnap's own CRIU runs.

Environment:
  GPUSNAP_GPU_SNAPSHOT=NAME  where the driver has custom storage: stream the GPU memory into snapshot
                             NAME of GPUSNAP_STORE (or the default store) instead; CRIU's image then
                             holds no GPU bytes
  GPUSNAP_LOCK_TIMEOUT=S     how long a process may take to finish its CUDA calls before the lock
                             fails (default 10 s)
  GPUSNAP_HOOK_TIMEOUT=S     the most one action may take (default 180 s); at the deadline it logs
                             FAILED and exits (pre-dump/post-dump: 1, so CRIU aborts the dump and
                             the processes keep running; network-unlock/post-resume: CRIU goes on)
  GPUSNAP_HOOK_LOG=FILE      the log (default /var/log/gpusnap/criu-hook.log; stderr goes to CRIU's log)
  GPUSNAP_HOOK_STATE=DIR     the per-dump records (default /run/gpusnap/criu-hook); both paths are
                             reached without a link, through parents others cannot write in
  GPUSNAP_LEAVE_RUNNING=1    also resume at post-dump (for trees in the host's network namespace,
                             where CRIU runs no network-unlock)
  CRIU_LIBS_DIR              CRIU's plugin directory, as CRIU reads it (default /usr/lib/criu)

By hand: `gpusnap-criu-hook resume PID` restores and unlocks every CUDA process in PID's tree (after
a dump CRIU aborted without running network-unlock).
"""

DEFAULT_LOG = "/var/log/gpusnap/criu-hook.log"
DEFAULT_STATE = "/run/gpusnap/criu-hook"
HANDLED = ("pre-dump", "post-dump", "network-unlock", "post-resume")
DEFAULT_TIMEOUT_S = 180.0
GRACE_S = 20.0   # after the deadline: how long the interrupted action may take to undo, then _exit

# The exit status of an action that failed or ran out of time, chosen so that CRIU goes on safely:
# - before the dump's commit (pre-dump, network-lock, post-dump) non-zero makes CRIU abort the dump,
#   and the tree keeps running (a pre-dump undoes its own freeze on the way out);
# - CRIU ignores the status of network-unlock, pre-resume and post-resume (the restore goes on; the
#   log line says how to bring the GPU processes back);
# - on the restore side CRIU kills the restored tree when pre-restore, setup-namespaces,
#   post-setup-namespaces or post-restore fail; the hook does nothing there, so it never fails them.
EXIT_ON_FAILURE = {"pre-dump": 1, "network-lock": 1, "post-dump": 1, "network-unlock": 1, "pre-resume": 1,
                   "post-resume": 1, "resume": 1}


def exit_on_failure(action: str) -> int:
    return EXIT_ON_FAILURE.get(action, 0)


class HookError(Exception):
    """A hook step that failed; the message says what state the processes are in and what to do."""


class HookTimeout(BaseException):
    """The action ran past GPUSNAP_HOOK_TIMEOUT: raised in the action by the deadline's alarm. A
    BaseException, as KeyboardInterrupt is, so that no `except Exception` on the way (process
    discovery skips pids that way) swallows it and works on past the deadline."""


def hook_timeout() -> float:
    try:
        t = float(os.environ.get("GPUSNAP_HOOK_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return t if 0 < t <= 24 * 3600 else DEFAULT_TIMEOUT_S


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Run the block under a deadline: HookTimeout is raised in it after SECONDS; if the block cannot
    even be interrupted (stuck in C with the GIL), a watchdog thread ends the process SECONDS + GRACE_S
    after the start (exit 1, a traceback on stderr).

    Why: the hang seen under Podman (the second network-unlock started, then nothing for 593 s until
    Podman gave up, and a `criu restore --rpc` that SIGTERM did not end) is a hook that never returns
    while CRIU waits for it. CRIU restores with every signal but SIGCHLD blocked, and versions of CRIU
    whose action-script child does not clear that mask (see criu PR #827, "Action scripts should be
    invoked with normal signal behavior") hand it to the script across exec: the hook then cannot be
    ended by SIGTERM, and an alarm armed without unblocking would never fire. While the hook runs,
    the restored tasks wait in CRIU's restorer (still named `criu restore --rpc`, all signals
    blocked) on the futex of the next restore stage, which is the futex wait that was seen. So the
    mask is cleared here first, SIGTERM/SIGALRM get their default/handler back, and nothing the hook
    does may wait without this deadline."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(s) == signal.SIG_IGN:
            signal.signal(s, signal.SIG_DFL)

    def on_alarm(signum: int, frame: Any) -> None:
        raise HookTimeout(f"did not finish in {seconds:g} s (GPUSNAP_HOOK_TIMEOUT)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    faulthandler.dump_traceback_later(seconds + GRACE_S, exit=True, file=sys.stderr)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        faulthandler.cancel_dump_traceback_later()


# ------------------------------------------------------------------------------ files, safely
def _safe_dir(path: str) -> int:
    """An fd of directory PATH (the log's or the records'), made 0700 where missing, its parents too;
    reached from / without following a link anywhere, each parent root's or ours and writable by no
    one else (unless sticky, as /tmp), PATH our own: OSError otherwise (storage.fs.owndir)."""
    from storage.api import own_dir
    try:
        return own_dir(os.path.abspath(path))
    except OSError as e:
        raise OSError(f"{path}: {e.strerror or e}") from None


def _open_in(dir_path: str, name: str, flags: int) -> int:
    dfd = _safe_dir(dir_path)
    try:   # O_NONBLOCK: a FIFO planted here fails (ENXIO) or is refused below instead of blocking the hook
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600, dir_fd=dfd)
    finally:
        os.close(dfd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{dir_path}/{name} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def log(action: str, msg: str) -> None:
    """One line to stderr (it lands in CRIU's log) and to the hook's log file (best effort)."""
    line = f"gpusnap-criu-hook: {action}: {msg}"
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("GPUSNAP_HOOK_LOG") or DEFAULT_LOG
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        fd = _open_in(os.path.dirname(path), os.path.basename(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, f"{stamp} criu={_criu_pid()} {line.split(': ', 1)[1]}\n".encode())
        finally:
            os.close(fd)
    except OSError as e:
        print(f"gpusnap-criu-hook: cannot write the log {path}: {e}", file=sys.stderr)


# ---------------------------------------------------------------------------- who is calling
def _criu_pid() -> int:
    """The CRIU process running this action (CRTOOLS_IMAGE_DIR is /proc/CRIUPID/fd/N)."""
    m = re.fullmatch(r"/proc/(\d+)/fd/\d+", os.environ.get("CRTOOLS_IMAGE_DIR", ""))
    return int(m.group(1)) if m else os.getppid()


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _criu_argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _libdir(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a in ("-L", "--libdir") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--libdir="):
            return a.split("=", 1)[1]
    return None


# ------------------------------------------------------------------ what this dump froze
class DumpRecord:
    """What the CRIU run that is dumping froze, so that its network-unlock (and only its) thaws it."""

    def __init__(self, criu_pid: int) -> None:
        self.dir = os.environ.get("GPUSNAP_HOOK_STATE") or DEFAULT_STATE
        self.name = f"dump-{criu_pid}-{_start_time(criu_pid)}.json"

    def write(self, data: dict[str, Any]) -> None:
        fd = _open_in(self.dir, self.name + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        dfd = _safe_dir(self.dir)
        try:
            os.rename(self.name + ".tmp", self.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)

    def read(self) -> dict[str, Any] | None:
        try:
            fd = _open_in(self.dir, self.name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        with os.fdopen(fd) as f:
            data = json.load(f)
        if not isinstance(data, dict) or not all(type(p) is int for p in data.get("pids", [])):
            raise HookError(f"{self.dir}/{self.name} is damaged; remove it")
        return data

    def remove(self) -> None:
        dfd = _safe_dir(self.dir)
        try:
            os.unlink(self.name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)

    def remove_stale(self) -> None:
        """Records of CRIU runs that are gone (a killing dump ends with no network-unlock)."""
        dfd = _safe_dir(self.dir)
        try:
            for n in os.listdir(dfd):
                m = re.fullmatch(r"dump-(\d+)-(\d+|None)\.json(\.tmp)?", n)
                if m and _start_time(int(m.group(1))) != m.group(2):
                    os.unlink(n, dir_fd=dfd)
        finally:
            os.close(dfd)


# -------------------------------------------------------------------------------- the actions
def _cuda_pids(root: int, driver: Any) -> list[int]:
    from sandbox.gpu.processes import cuda_processes, uses_gpu
    from sandbox.host.processes import process_tree
    if driver is None and not os.path.exists("/dev/nvidiactl") and not any(uses_gpu(p) for p in process_tree(root)):
        return []
    return cuda_processes(root, driver or _real_driver())


def _real_driver() -> Any:
    from sandbox.gpu.driver import CudaDriver
    return CudaDriver()


def _custom_target() -> tuple[str, str] | None:
    name = os.environ.get("GPUSNAP_GPU_SNAPSHOT")
    if not name:
        return None
    from storage.api import default_store_path
    return os.environ.get("GPUSNAP_STORE") or default_store_path(), name


def _thaw(drv: Any, pids: list[int], path: str, target: tuple[str, str] | None, device: Any) -> Any:
    from sandbox.gpu import state
    plan = state.plan(recorded=path, streams=target is not None)
    if target is None or not plan.streams:
        return state.thaw(drv, pids, plan.backend())
    from sandbox.gpu.regions import EngineRegions
    from storage.api import GpuEngine
    from storage.api import SnapshotStore
    store = SnapshotStore(target[0], create=False)
    m = store.load(target[1])
    with GpuEngine(0 if device is None else device) as eng:
        return state.thaw(drv, pids, plan.backend(EngineRegions.of(eng, store, m)))


def _freeze(drv: Any, pids: list[int], features: Any, device: Any) -> tuple[Any, str, tuple[str, str] | None]:
    """Checkpoint PIDS (idempotent): custom storage into GPUSNAP_GPU_SNAPSHOT where asked and offered."""
    from sandbox.gpu import state
    from sandbox.gpu.driver import ProcessState
    limits = state.Limits(lock_timeout_s=float(os.environ.get("GPUSNAP_LOCK_TIMEOUT", "10")))
    target = _custom_target()
    if target is not None:
        from sandbox.gpu.driver import probe
        features = features or probe(drv)
    running = [p for p in pids if drv.get_state(p) == ProcessState.RUNNING]
    # nothing to stream (no target, or nothing running): never replace the snapshot with an empty one
    plan = state.plan(features=features if target is not None else None, streams=target is not None and bool(running))
    if target is None or not plan.streams:
        return state.checkpoint(drv, pids, plan.backend(), limits), plan.path.value, None
    from sandbox.gpu.regions import EngineRegions
    from storage.api import GpuEngine
    from storage.api import SnapshotStore
    store = SnapshotStore(target[0])
    from sandbox.ops.gpu_path import GpuPath
    from sandbox.ops.snapshot_meta import GpuMeta
    # `path` too: the key gpusnap-criu-hook releases before the unified `gpu_path` read
    meta = GpuMeta(GpuPath.CUSTOM_STORAGE, min(pids), tuple(pids), extra={"path": GpuPath.CUSTOM_STORAGE.value}).to_json()
    from sandbox.host.dumpwrites import dump_packs_direct
    with store.writer(target[1], replace=True, meta=meta, direct_packs=dump_packs_direct()) as w, \
            GpuEngine(0 if device is None else device) as eng:
        with state.freeze(drv, pids, plan.backend(EngineRegions.into(eng, w)), limits) as rep:
            w.commit()
    return rep, "custom-storage", target


def run(action: str, init_pid: int | None, *, driver: Any = None, features: Any = None, device: Any = None,
        pids: list[int] | None = None) -> str:
    """One CRIU action; returns what it did (one line). driver/features/device/pids: stand-ins for tests
    (default: the real driver, probed, and GPU 0). Raises HookError saying what to do."""
    if os.environ.get("GPUSNAP_OWN_CRIU_CALL"):
        return "gpusnap's own CRIU run: gpusnap handles the GPU state itself"
    if action not in HANDLED:
        return "nothing to do"
    from sandbox.criu.runner import cuda_plugin
    criu_pid = _criu_pid()
    plugin = cuda_plugin(_libdir(_criu_argv(criu_pid)))
    if plugin is not None:
        return (f"CRIU's cuda plugin ({plugin}) handles the GPU processes: gpusnap-criu-hook steps aside "
                "(uninstall one of the two: `gpusnap hook uninstall`, or remove the plugin)")
    if init_pid is None:
        raise HookError("CRTOOLS_INIT_PID is not set (run by CRIU as an action script? see --help)")
    record = DumpRecord(criu_pid)
    if action == "network-unlock":
        data = record.read()
        if data is None:
            return "nothing this CRIU run froze (a restore, or no GPU process): nothing to do"
        target = (data["store"], data["snapshot"]) if data.get("snapshot") else None
        rep = _thaw(driver or _real_driver(), list(data["pids"]), data.get("path", "host-staged"), target, device)
        record.remove()
        return f"dump failed or left running: restored {len(rep.restored)}, unlocked {len(rep.unlocked)}, " \
               f"already running {len(rep.running)} (pids {list(data['pids'])})"
    found = _cuda_pids(init_pid, driver) if pids is None else pids
    if not found:
        return "no CUDA process in the tree: nothing to do"
    drv = driver or _real_driver()
    if action == "pre-dump":
        record.remove_stale()
        rep, path, target = _freeze(drv, found, features, device)
        if rep.frozen:  # only what this dump froze is thawed at its network-unlock
            record.write({"pids": found, "path": path, "store": target[0] if target else None,
                          "snapshot": target[1] if target else None})
        return f"checkpointed {len(rep.frozen)} CUDA process(es) via {path}, already checkpointed " \
               f"{len(rep.already)} (pids {found})"
    if action == "post-dump":
        if os.environ.get("GPUSNAP_LEAVE_RUNNING") != "1":
            return "nothing to do (the dump kills them next; a failed or --leave-running one resumes them at network-unlock)"
        data = record.read() or {"pids": found}
        target = (data["store"], data["snapshot"]) if data.get("snapshot") else None
        rep = _thaw(drv, found, data.get("path", "host-staged"), target, device)
        record.remove()
        return f"GPUSNAP_LEAVE_RUNNING: restored {len(rep.restored)}, already running {len(rep.running)}"
    # post-resume: the restored tree; custom storage: from the snapshot the dump streamed into
    from sandbox.gpu.driver import ProcessState
    target = _custom_target()
    waiting = [p for p in found if drv.get_state(p) == ProcessState.CHECKPOINTED]
    path = "custom-storage" if target is not None and waiting and _in_snapshot(target, waiting) else "host-staged"
    rep = _thaw(drv, found, path, target, device)
    return f"restored {len(rep.restored)} CUDA process(es) via {path}, unlocked {len(rep.unlocked)}, " \
           f"already running {len(rep.running)}"


def _in_snapshot(target: tuple[str, str], pids: list[int]) -> bool:
    """Whether snapshot TARGET holds custom-storage GPU memory for PIDS."""
    from storage.api import SnapshotStore
    try:
        m = SnapshotStore(target[0], create=False).load(target[1])
    except Exception:  # noqa: BLE001 - no such store or snapshot: the driver's host copy
        return False
    from sandbox.ops.gpu_path import GpuPath
    from sandbox.ops.snapshot_meta import GpuMeta
    try:
        meta = GpuMeta.of(m)  # validated: a snapshot's metadata is hostile until then
    except Exception:  # noqa: BLE001 - not a GPU snapshot, or not a sound one: the driver's host copy
        return False
    return meta.gpu_path == GpuPath.CUSTOM_STORAGE and set(pids) <= set(meta.pids)


def _what_to_do(action: str) -> str:
    return {"pre-dump": "the GPU processes were left running and unlocked; CRIU aborts this dump",
            "post-resume": "the GPU processes stay CHECKPOINTED; retry with `gpusnap-criu-hook resume PID`",
            "network-unlock": "run `gpusnap-criu-hook resume PID` to bring the GPU processes back",
            "post-dump": "run `gpusnap-criu-hook resume PID` to bring the GPU processes back"}.get(action, "")


def main(argv: list[str] | None = None, *, driver: Any = None) -> None:
    """The entry point; DRIVER: a stand-in for tests (default: the real driver). Always ends the
    process (os._exit: leftover threads of an interrupted action are not waited for)."""
    ap = argparse.ArgumentParser(prog="gpusnap-criu-hook", description=HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", nargs="?", choices=["resume"], help="resume PID: by hand, see above")
    ap.add_argument("pid", nargs="?", type=int)
    a = ap.parse_args(argv)
    if a.command == "resume":
        if a.pid is None:
            ap.error("resume needs the PID of the tree")
        action, init = "resume", a.pid
    else:
        action = os.environ.get("CRTOOLS_SCRIPT_ACTION", "")
        if not action:
            ap.error("CRTOOLS_SCRIPT_ACTION is not set: CRIU runs this as an action script (see --help)")
        pid_s = os.environ.get("CRTOOLS_INIT_PID", "")
        init = int(pid_s) if pid_s.isdigit() else None
    code = 0
    try:
        with deadline(hook_timeout()):
            if action == "resume":
                from sandbox.gpu.state import resume
                drv = driver or _real_driver()
                r = resume(drv, _cuda_pids(init, drv))
                msg = f"restored {r.restored}, unlocked {r.unlocked}, already running {r.running}"
            else:
                msg = run(action, init, driver=driver)
    except BaseException as e:  # noqa: BLE001 - one line for CRIU's log, the status that lets CRIU go on
        if isinstance(e, SystemExit):
            raise
        first = (str(e).splitlines() or [type(e).__name__])[0]
        msg = f"FAILED: {first}" + (f"; {_what_to_do(action)}" if _what_to_do(action) else "")
        code = exit_on_failure(action)
    try:
        with deadline(10):
            log(action, msg)
    except BaseException:  # noqa: BLE001 - the log is best effort; the exit status is what CRIU needs
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
