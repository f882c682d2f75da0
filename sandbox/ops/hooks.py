"""Workload hooks: the prepare and resume steps a workload is told to take around a snapshot.

A step (`--prepare STEP`, `--resume STEP`) is either an argv command line or an `http://` URL on this
host that gpusnap POSTs to (vLLM's `/sleep?level=1` and `/wake_up` as they are; the PyTorch helper's
`/prepare` and `/resume`, criu_hooks/workload_helper.py). This module parses steps and runs them; when
they run around a dump, checkpoint or restore, and what the journal records meanwhile, is
sandbox.ops.prepared's.

Guarantees kept here:
- a URL names a loopback host (127.0.0.0/8, ::1, localhost) and the http scheme, checked when the step
  is parsed (the command line, a journal record, a snapshot's record): nothing else is ever contacted
  (`localhost` is connected to as 127.0.0.1, else ::1, never looked up);
- a command runs without a shell, from /, with a clean environment (PATH, LANG and the GPUSNAP_HOOK_*
  variables only), stdin /dev/null, every signal's default action, in its own session
  (sandbox.host.procgroup: recorded by the journal's operation as it starts); at its deadline (or a
  signal to gpusnap) its whole process group is killed, and with it what the step left in sessions of
  its own (gpusnap adopts them as a child subreaper while the step runs). What it prints goes to an
  unlinked temporary file kept under about OUTPUT_KEEP bytes (_Output), of which only the tail is
  read, quoted with its control characters made '?' (_quoted);
- a URL gets one POST with an empty body; the answer is read up to RESPONSE_LIMIT bytes; connect,
  send and the whole answer stop at the step's deadline (the socket is shut down then); a 2xx
  status is success, anything else a failure;
- every failure is one HookError naming the step and why (exit 1);
- a snapshot's recorded resume step is trusted only with a valid MAC under the host key over the
  step, the snapshot's name and the operation that committed it (sandbox.ops.trust): a step a store
  writer planted, or copied from another snapshot, is never run.
"""
from __future__ import annotations

import enum
import fcntl
import http.client
import ipaddress
import os
import re
import shlex
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any, Mapping

from storage.api import EXIT_USAGE, GpusnapError

from sandbox.host import procgroup
from sandbox.ops.trust import JournalKey

DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 3600.0
RESPONSE_LIMIT = 64 << 10     # bytes of a URL step's answer read (the rest is not)
OUTPUT_TAIL = 400             # characters of a command's output an error quotes
OUTPUT_KEEP = 1 << 20         # bytes of a command's output kept on disk at most (about) before it is emptied
OUTPUT_POLL_S = 0.02          # how often it is looked at
SPEC_LIMIT = 4096             # characters of a step as given
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


class HookError(GpusnapError):
    """A prepare or resume step failed, timed out, or cannot be trusted (exit 1)."""


class HookSpecError(HookError):
    """A step as given is not one gpusnap runs (a non-loopback URL, an empty command): a usage error."""

    exit_code = EXIT_USAGE


class Step(str, enum.Enum):
    PREPARE = "prepare"
    RESUME = "resume"


@dataclass(frozen=True)
class Hook:
    """One step: ARGV to run, or URL to POST to (exactly one is set); SPEC as the user wrote it."""

    spec: str
    argv: tuple[str, ...] = ()
    url: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "Hook":
        if not isinstance(spec, str) or not spec.strip():
            raise HookSpecError("a hook step is empty: give a command line or an http:// URL on this host")
        if len(spec) > SPEC_LIMIT or "\0" in spec:
            raise HookSpecError(f"a hook step is longer than {SPEC_LIMIT} characters or holds a NUL byte")
        if _SCHEME.match(spec.strip()):
            return cls(spec, url=_loopback_url(spec.strip()))
        try:
            argv = tuple(shlex.split(spec))
        except ValueError as e:
            raise HookSpecError(f"hook step {spec!r}: {e}") from None
        if not argv:
            raise HookSpecError(f"hook step {spec!r} names no command")
        return cls(spec, argv=argv)

    def describe(self) -> str:
        return f"POST {self.url}" if self.url else f"`{self.spec}`"


def _loopback_url(spec: str) -> str:
    try:
        u = urllib.parse.urlsplit(spec)
    except ValueError as e:  # "Invalid IPv6 URL": a bracket left open, or text after it
        raise HookSpecError(f"hook URL {spec!r}: {e}") from None
    if u.scheme != "http":
        raise HookSpecError(f"hook URL {spec!r}: only http:// on this host is supported")
    if u.username is not None or u.password is not None:
        raise HookSpecError(f"hook URL {spec!r}: credentials in the URL are not supported")
    host = u.hostname or ""
    try:
        loop = host == "localhost" or ipaddress.ip_address(host).is_loopback
        u.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        loop = False
    if not loop:
        raise HookSpecError(f"hook URL {spec!r}: its host must be a loopback address (127.0.0.0/8, [::1], "
                            "localhost); gpusnap contacts no other host")
    return spec


@dataclass(frozen=True)
class HookRun:
    """What one step did: its spec, seconds taken, and a short detail (an exit status or an HTTP answer)."""

    step: Step
    spec: str
    seconds: float
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step.value, "spec": self.spec, "seconds": round(self.seconds, 3), "detail": self.detail}


def run(hook: Hook, step: Step, timeout_s: float, *, snapshot: str = "", pid: int | None = None) -> HookRun:
    """Run HOOK as STEP within TIMEOUT_S seconds; HookError if it fails or times out."""
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise HookSpecError(f"--hook-timeout must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds")
    t0 = time.monotonic()
    detail = (_post(hook, step, timeout_s) if hook.url else _command(hook, step, timeout_s, snapshot, pid))
    return HookRun(step, hook.spec, time.monotonic() - t0, detail)


def _command(hook: Hook, step: Step, timeout_s: float, snapshot: str, pid: int | None) -> str:
    env = {"PATH": CLEAN_PATH, "LANG": "C.UTF-8", "GPUSNAP_HOOK_STEP": step.value, "GPUSNAP_SNAPSHOT": snapshot}
    if pid is not None:
        env["GPUSNAP_PID"] = str(pid)
    # a step that left its process group (setsid, a daemonizing tool) is ended with it: it comes to
    # gpusnap (a child subreaper while the step runs) when its parent dies, and is swept then
    with _Output() as out, procgroup.adopting_escapees() as sweep:
        try:
            p = procgroup.run_group(hook.argv, timeout_s, stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/",
                                    preexec_fn=_default_signals)
        except subprocess.TimeoutExpired:
            sweep()
            raise HookError(f"the {step.value} step {hook.describe()} did not finish within {timeout_s:g} s "
                            "(--hook-timeout); its process group was killed") from None
        except OSError as e:
            raise HookError(f"the {step.value} step {hook.describe()} cannot run: {e.strerror or e}") from None
        except BaseException:  # a signal: the group was ended, and so is what left it
            sweep()
            raise
        if p.returncode == 0:
            return "exit 0"
        tail = _quoted(out.tail())
    how = f"was killed by signal {-p.returncode}" if p.returncode < 0 else f"exited {p.returncode}"
    raise HookError(f"the {step.value} step {hook.describe()} {how}" + (f": {tail}" if tail else ""))


class _Output:
    """A command step's stdout and stderr: an unlinked temporary file, opened O_APPEND (the step's
    descriptor too), that a thread empties whenever it holds more than OUTPUT_KEEP bytes, keeping its
    last OUTPUT_TAIL: a step that prints without end costs at most about that much disk, not what it
    wrote (a step relaying a workload's endless answer filled /tmp). A process the step leaves
    running may go on writing to it after gpusnap is gone, as to any file it was given."""

    def __init__(self) -> None:
        self.file = tempfile.TemporaryFile()
        fd = self.file.fileno()
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
        self._carried = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trim_until_stopped, name="hook-output", daemon=True)

    def __enter__(self) -> "_Output":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.file.close()

    def fileno(self) -> int:
        return self.file.fileno()

    def _trim_until_stopped(self) -> None:
        while not self._stop.wait(OUTPUT_POLL_S):
            self._trim()

    def _trim(self) -> None:
        fd = self.file.fileno()
        size = os.fstat(fd).st_size
        if size > OUTPUT_KEEP:
            self._carried = os.pread(fd, OUTPUT_TAIL, size - OUTPUT_TAIL)
            os.ftruncate(fd, 0)  # the step's next write lands at 0 (O_APPEND)

    def tail(self) -> bytes:
        """The last OUTPUT_TAIL bytes the step wrote (about: what was written while a trim ran is lost)."""
        self._stop.set()
        self._thread.join()
        fd = self.file.fileno()
        size = os.fstat(fd).st_size
        last = os.pread(fd, OUTPUT_TAIL, max(0, size - OUTPUT_TAIL))
        return (self._carried + last)[-OUTPUT_TAIL:] if size < OUTPUT_TAIL else last


def _quoted(data: bytes) -> str:
    """DATA (what a step printed or answered: the workload's words) as one line fit to quote on the
    operator's terminal: runs of white space made one space, every other control character (an escape
    sequence's ESC, C1's CSI) a '?'."""
    text = " ".join(data.decode(errors="replace").split())
    return "".join(c if c.isprintable() else "?" for c in text)


def _default_signals() -> None:
    """In the step's process before exec: every signal's default action and none blocked. An ignored
    signal stays ignored across exec, and gpusnap ignores SIGTERM/SIGHUP/SIGINT while it undoes what a
    signal stopped (sandbox.host.interrupts): the resume step it runs then, and whatever that starts,
    could otherwise not be stopped by them."""
    for s in signal.valid_signals():
        if s not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(s, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _post(hook: Hook, step: Step, timeout_s: float) -> str:
    assert hook.url is not None
    u = urllib.parse.urlsplit(hook.url)
    deadline = time.monotonic() + timeout_s
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    conn = http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=timeout_s)
    if u.hostname == "localhost":  # the name is checked, not the resolver: connect to loopback ourselves
        try:
            conn.sock = _connect_localhost(u.port or 80, timeout_s)
        except OSError as e:
            raise HookError(f"the {step.value} step {hook.describe()} failed: {e.strerror or e}") from None
    # a socket timeout bounds each read, not the answer: an endpoint that trickles a byte at a time (or
    # sends `100 Continue` for ever) would hold gpusnap without end. At the deadline the socket is shut
    # down, which ends any read in progress; `cut` tells that from the endpoint closing.
    cut = threading.Event()
    watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _cut, args=(conn, cut))
    watchdog.daemon = True
    watchdog.start()
    late = HookError(f"the {step.value} step {hook.describe()} got no complete answer within {timeout_s:g} s "
                     "(--hook-timeout)")
    try:
        conn.request("POST", path, body=b"", headers={"Content-Length": "0", "User-Agent": "gpusnap-hook"})
        _set_deadline(conn, deadline)
        resp = conn.getresponse()
        body = b""
        while len(body) < RESPONSE_LIMIT:
            _set_deadline(conn, deadline)
            part = resp.read1(RESPONSE_LIMIT - len(body))
            if not part:
                break
            body += part
        if cut.is_set():
            raise late
    except TimeoutError:
        raise late from None
    except (OSError, http.client.HTTPException) as e:
        if cut.is_set():
            raise late from None
        why = _quoted(str(getattr(e, "strerror", None) or e).encode()) or type(e).__name__  # BadStatusLine: its words
        raise HookError(f"the {step.value} step {hook.describe()} failed: {why}") from None
    finally:
        watchdog.cancel()
        conn.close()
    text = _quoted(body[:OUTPUT_TAIL])
    if not 200 <= resp.status < 300:
        raise HookError(f"the {step.value} step {hook.describe()} answered HTTP {resp.status}"
                        + (f": {text}" if text else ""))
    return f"HTTP {resp.status}" + (f": {text}" if text else "")


def _connect_localhost(port: int, timeout_s: float) -> socket.socket:
    """A connection to PORT on 127.0.0.1, else on ::1: what `localhost` names, whatever /etc/hosts or
    DNS would answer for it."""
    err: OSError = OSError("no loopback address answered")
    for addr in ("127.0.0.1", "::1"):
        try:
            return socket.create_connection((addr, port), timeout=timeout_s)
        except OSError as e:
            err = e
    raise err


def _cut(conn: http.client.HTTPConnection, cut: threading.Event) -> None:
    """The deadline of CONN's step: shut its socket down (a read in progress returns)."""
    cut.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _set_deadline(conn: http.client.HTTPConnection, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if conn.sock is not None:
        conn.sock.settimeout(left)


@dataclass(frozen=True)
class WorkloadHooks:
    """The steps one command was given: PREPARE, RESUME (either may be None), each within TIMEOUT_S."""

    prepare: Hook | None = None
    resume: Hook | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __bool__(self) -> bool:
        return self.prepare is not None or self.resume is not None

    @classmethod
    def parse(cls, prepare: str | None, resume: str | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> "WorkloadHooks":
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise HookSpecError(f"--hook-timeout must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds")
        return cls(Hook.parse(prepare) if prepare is not None else None,
                   Hook.parse(resume) if resume is not None else None, timeout_s)


# -- the resume step a snapshot records ----------------------------------------------------------------
RECORD_KEY = "resume"


def _signed(snapshot: str, op: str, hook: str) -> dict[str, str]:
    return {"hook": hook, "op": op, "snapshot": snapshot}


def snapshot_record(key: JournalKey, snapshot: str, op: str, hook: Hook) -> dict[str, str]:
    """What a dump or checkpoint committing SNAPSHOT as operation OP records as meta.resume."""
    return {"hook": hook.spec, "mac": key.mac("snapshot-resume", _signed(snapshot, op, hook.spec))}


def resume_meta(op: Any, snapshot: str, hook: Hook | None) -> dict[str, Any]:
    """The meta keys a dump or checkpoint (journal.Op OP) committing SNAPSHOT adds for HOOK ({} without)."""
    return {RECORD_KEY: snapshot_record(op.journal.key, snapshot, op.id, hook)} if hook is not None else {}


def recorded(key: JournalKey, snapshot: str, meta: Mapping[str, Any], restored: str | None = None) -> Hook | None:
    """The resume step SNAPSHOT's META records (None if it records none); HookError if it is not one
    this store's gpusnap recorded for this snapshot: it is then never run. RESTORED: what was restored
    already (a restore --from a remote checks the record only once the snapshot is here), for the error."""
    rec = meta.get(RECORD_KEY)
    if rec is None:
        return None
    hook, op = (rec.get("hook"), meta.get("op")) if isinstance(rec, dict) else (None, None)
    if not (isinstance(hook, str) and isinstance(op, str)
            and key.check("snapshot-resume", _signed(snapshot, op, hook), rec.get("mac"))):
        if restored is not None:
            raise HookError(f"{restored}, but the resume step it records cannot be verified (no valid MAC under "
                            "this store's journal key: another store's gpusnap recorded it, or someone planted it); "
                            "it was not run: tell the workload to resume yourself (name the step with --resume "
                            "STEP, or --no-resume, on a restore from a remote)")
        raise HookError(f"snapshot {snapshot!r} records a resume step that gpusnap cannot verify (no valid MAC "
                        "under this store's journal key: it may have been planted by whoever can write the store); "
                        "nothing was restored: pass --resume STEP to name the step yourself, or --no-resume")
    try:
        return Hook.parse(hook)
    except HookSpecError as e:
        raise HookError((f"{restored}, but " if restored is not None else "")
                        + f"snapshot {snapshot!r} records a resume step gpusnap will not run: {e}") from None
