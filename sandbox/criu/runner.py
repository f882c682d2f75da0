"""Run CRIU 4.x: dump and restore process trees with argv lists, keep its log, explain its failures.

Guarantees kept here: CRIU runs in its own session (a Ctrl-C on gpusnap's terminal does not reach
it); a timeout or an exception while it runs ends its whole process group, so nothing it started is
left running; the log a failure points at exists and holds what CRIU printed too (where CRIU says
that it lacks the capabilities it needs).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Sequence

from storage.errors import GpusnapError

from sandbox.procgroup import run_group

REPO_CRIU = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".cache", "criu", "bin", "criu")
MIN_MAJOR = 4


class CriuError(GpusnapError):
    """CRIU is missing, too old, or a dump/restore failed (the message carries CRIU's own reason)."""

    def __init__(self, message: str, log_tail: list[str] | None = None, log_path: str | None = None,
                 what: str = "") -> None:
        super().__init__(message + (f" (log: {log_path})" if log_path else ""))
        self.reason = message
        self.log_tail = log_tail or []
        self.log_path = log_path
        self.what = what

    def with_log(self, path: str) -> "CriuError":
        """The same error pointing at a kept copy of the log."""
        return CriuError(self.reason, self.log_tail, path, self.what)


def criu_version(binary: str) -> tuple[int, int, int] | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def find_criu() -> str | None:
    """$GPUSNAP_CRIU, else the first CRIU >= 4 on PATH or in the project's cache (scripts/install-criu.sh)."""
    cands = [os.environ.get("GPUSNAP_CRIU"), shutil.which("criu"), REPO_CRIU, "/usr/local/sbin/criu"]
    for c in cands:
        if c and os.access(c, os.X_OK):
            v = criu_version(c)
            if v and v[0] >= MIN_MAJOR:
                return c
    return None


@dataclass(frozen=True)
class DumpOptions:
    leave_running: bool = False
    leave_stopped: bool = False   # the tree stays there, stopped, until the caller kills or resumes it
    shell_job: bool = False
    ext_unix_sk: bool = False
    file_locks: bool = False
    link_remap: bool = False
    tcp_established: bool = False
    action_script: str | None = None
    extra: tuple[str, ...] = ()

    def argv(self) -> list[str]:
        a = []
        for flag, on in (("--leave-running", self.leave_running), ("--leave-stopped", self.leave_stopped),
                         ("--shell-job", self.shell_job),
                         ("--ext-unix-sk", self.ext_unix_sk), ("--file-locks", self.file_locks),
                         ("--link-remap", self.link_remap), ("--tcp-established", self.tcp_established)):
            if on:
                a.append(flag)
        if self.action_script:
            a += ["--action-script", self.action_script]
        return a + list(self.extra)


@dataclass
class CriuRun:
    argv: list[str]
    log_path: str
    returncode: int
    log_tail: list[str] = field(default_factory=list)


# CRIU's own noise that says nothing about why it failed (printed as root, harmless)
_NOISE = ("RLIMIT_NOFILE",)
# lines that name the cause where CRIU's first Error line names only a consequence (e.g. the warning
# "Unable to interrupt task: 1 (Operation not permitted)" before "Error: Unable to detach from 1")
_CAUSES = ("Unable to interrupt task", "Unable to seize", "CAP_CHECKPOINT_RESTORE")


def explain(log_path: str, n: int = 6) -> list[str]:
    """The lines of a CRIU log that explain a failure: a line naming a known cause first, then its
    error lines in order (the first is the most specific), else the last lines."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [l.rstrip() for l in f]
    except OSError:
        return []
    causes = [l for l in lines if any(c in l for c in _CAUSES)]
    errs = [l for l in lines if ("Error" in l or "error" in l or "Can't" in l or "can't" in l)
            and not any(x in l for x in _NOISE) and l not in causes]
    return (causes + errs)[:n] if causes or errs else lines[-n:]


class Criu:
    """One CRIU binary; every call an argv list, every log kept in the images directory."""

    def __init__(self, binary: str | None = None) -> None:
        b = binary or find_criu()
        if not b:
            raise CriuError("CRIU >= 4.0 not found (run scripts/setup.sh, or set GPUSNAP_CRIU)")
        self.binary = b
        self.version = criu_version(b)

    def _run(self, argv: Sequence[str], log_path: str, what: str, timeout: float) -> CriuRun:
        full = [self.binary, *argv, "-v4", "-o", log_path]
        try:
            p = run_group(full, timeout)
        except subprocess.TimeoutExpired:
            raise CriuError(f"criu {what} did not finish within {timeout:g} s (stopped)") from None
        run = CriuRun(full, log_path, p.returncode)
        if p.returncode != 0:
            said = (p.stdout or "") + (p.stderr or "")
            if said.strip():  # what CRIU printed rather than logged (e.g. missing capabilities) goes in the log too
                with open(log_path, "a") as f:
                    f.write("--- printed by criu ---\n" + said)
            run.log_tail = explain(log_path) or said.strip().splitlines()[-6:]
            reason = _strip_prefix(run.log_tail[0]) if run.log_tail else f"exit {p.returncode}"
            if "CAP_CHECKPOINT_RESTORE" in reason:
                reason = "it needs root or the CAP_CHECKPOINT_RESTORE capability, and ran without both"
            raise CriuError(f"criu {what} failed: {reason}", run.log_tail, log_path, what)
        return run

    def dump(self, pid: int, images_dir: str, opts: DumpOptions = DumpOptions(), timeout: float = 3600) -> CriuRun:
        return self._run(["dump", "-t", str(pid), "-D", images_dir, *opts.argv()],
                         os.path.join(images_dir, "dump.log"), f"dump of pid {pid}", timeout)

    def restore(self, images_dir: str, *, detach: bool = True, shell_job: bool = False,
                action_script: str | None = None, pidfile: str | None = None, extra: Sequence[str] = (),
                timeout: float = 3600) -> CriuRun:
        argv = ["restore", "-D", images_dir]
        if detach:
            argv.append("-d")
        if shell_job:
            argv.append("--shell-job")
        if action_script:
            argv += ["--action-script", action_script]
        if pidfile:
            argv += ["--pidfile", pidfile]
        return self._run([*argv, *extra], os.path.join(images_dir, "restore.log"), "restore", timeout)

    def check(self) -> str:
        p = subprocess.run([self.binary, "check"], capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise CriuError(f"criu check failed: {(p.stderr or p.stdout).strip().splitlines()[-1:]}")
        return p.stdout.strip()


def _strip_prefix(line: str) -> str:
    # "(00.012345) Error (criu/cr-dump.c:1234): msg" -> "msg"
    return re.sub(r"^\(\s*[\d.]+\)\s*(?:\d+:\s*)?(?:(?:Error|Warn)\s*\([^)]*\):\s*)?", "", line).strip()
