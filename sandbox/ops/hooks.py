"""Workload hooks: the prepare and resume steps a workload is told to take around a snapshot.

A step (`--prepare STEP`, `--resume STEP`) is either an argv command line or an `http://` URL on this
host that gpusnap POSTs to (vLLM's `/sleep?level=1` and `/wake_up` as they are; the PyTorch helper's
`/prepare` and `/resume`, criu_hooks/workload_helper.py). This module parses steps and runs them; when
they run around a dump, checkpoint or restore, and what the journal records meanwhile, is
sandbox.ops.prepared's.

Guarantees kept here:
- a URL names a loopback host (127.0.0.0/8, ::1, localhost) and the http scheme, checked when the step
  is parsed (the command line, a journal record, a snapshot's record): nothing else is ever contacted;
- a command runs without a shell, from /, with a clean environment (PATH, LANG and the GPUSNAP_HOOK_*
  variables only), stdin /dev/null, in its own session (sandbox.host.procgroup: recorded by the
  journal's operation as it starts); at its deadline its whole process group is killed. What it
  prints goes to an unlinked temporary file, of which only the tail is read;
- a URL gets one POST with an empty body; the answer is read up to RESPONSE_LIMIT bytes; connect,
  send and every read stop at the step's deadline; a 2xx status is success, anything else a failure;
- every failure is one HookError naming the step and why (exit 1);
- a snapshot's recorded resume step is trusted only with a valid MAC under the host key over the
  step, the snapshot's name and the operation that committed it (sandbox.ops.trust): a step a store
  writer planted, or copied from another snapshot, is never run.
"""
from __future__ import annotations

import enum
import http.client
import ipaddress
import os
import re
import shlex
import subprocess
import tempfile
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
    u = urllib.parse.urlsplit(spec)
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
    with tempfile.TemporaryFile() as out:
        try:
            p = procgroup.run_group(hook.argv, timeout_s, stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/")
        except subprocess.TimeoutExpired:
            raise HookError(f"the {step.value} step {hook.describe()} did not finish within {timeout_s:g} s "
                            "(--hook-timeout); its process group was killed") from None
        except OSError as e:
            raise HookError(f"the {step.value} step {hook.describe()} cannot run: {e.strerror or e}") from None
        if p.returncode == 0:
            return "exit 0"
        out.seek(max(0, os.fstat(out.fileno()).st_size - OUTPUT_TAIL))
        tail = " ".join(out.read().decode(errors="replace").split())
    how = f"was killed by signal {-p.returncode}" if p.returncode < 0 else f"exited {p.returncode}"
    raise HookError(f"the {step.value} step {hook.describe()} {how}" + (f": {tail}" if tail else ""))


def _post(hook: Hook, step: Step, timeout_s: float) -> str:
    assert hook.url is not None
    u = urllib.parse.urlsplit(hook.url)
    deadline = time.monotonic() + timeout_s
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    conn = http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=timeout_s)
    try:
        conn.request("POST", path, body=b"", headers={"Content-Length": "0", "User-Agent": "gpusnap-hook"})
        _set_deadline(conn, deadline)
        resp = conn.getresponse()
        body = b""
        while len(body) < RESPONSE_LIMIT:
            _set_deadline(conn, deadline)
            part = resp.read1(RESPONSE_LIMIT - len(body)) if hasattr(resp, "read1") else resp.read(RESPONSE_LIMIT)
            if not part:
                break
            body += part
    except TimeoutError:
        raise HookError(f"the {step.value} step {hook.describe()} got no complete answer within {timeout_s:g} s "
                        "(--hook-timeout)") from None
    except (OSError, http.client.HTTPException) as e:
        raise HookError(f"the {step.value} step {hook.describe()} failed: "
                        f"{getattr(e, 'strerror', None) or e or type(e).__name__}") from None
    finally:
        conn.close()
    text = " ".join(body[:OUTPUT_TAIL].decode(errors="replace").split())
    if not 200 <= resp.status < 300:
        raise HookError(f"the {step.value} step {hook.describe()} answered HTTP {resp.status}"
                        + (f": {text}" if text else ""))
    return f"HTTP {resp.status}" + (f": {text}" if text else "")


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


def recorded(key: JournalKey, snapshot: str, meta: Mapping[str, Any]) -> Hook | None:
    """The resume step SNAPSHOT's META records (None if it records none); HookError if it is not one
    this store's gpusnap recorded for this snapshot: it is then never run."""
    rec = meta.get(RECORD_KEY)
    if rec is None:
        return None
    hook, op = (rec.get("hook"), meta.get("op")) if isinstance(rec, dict) else (None, None)
    if not (isinstance(hook, str) and isinstance(op, str)
            and key.check("snapshot-resume", _signed(snapshot, op, hook), rec.get("mac"))):
        raise HookError(f"snapshot {snapshot!r} records a resume step that gpusnap cannot verify (no valid MAC "
                        "under this store's journal key: it may have been planted by whoever can write the store); "
                        "nothing was restored: pass --resume STEP to name the step yourself, or --no-resume")
    try:
        return Hook.parse(hook)
    except HookSpecError as e:
        raise HookError(f"snapshot {snapshot!r} records a resume step gpusnap will not run: {e}") from None
