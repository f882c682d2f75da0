"""Run CRIU 4.x: dump and restore process trees with argv lists, keep its log, explain its failures.

gpusnap's own CRIU calls never read a CRIU configuration file (`--no-default-config`, and
CRIU_CONFIG_FILE, which CRIU reads even then, is dropped from its environment), so an `action-script`
installed there for runc or Podman does not run on top of gpusnap's own GPU handling; OWN_CALL_ENV is
set in CRIU's environment too, and the action script steps aside when it sees it.

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
from typing import Mapping, Sequence

from storage.errors import EXIT_UNAVAILABLE, GpusnapError

from sandbox.host.procgroup import run_group

REPO_CRIU = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), ".cache", "criu", "bin", "criu")
MIN_MAJOR = 4
OWN_CALL_ENV = "GPUSNAP_OWN_CRIU_CALL"   # set in the environment of gpusnap's own CRIU runs
PLUGIN_DIR = "/usr/lib/criu"            # CRIU's default plugin directory (--libdir, CRIU_LIBS_DIR override it)
CUDA_PLUGIN = "cuda_plugin.so"


def cuda_plugin(libdir: str | None = None, env: dict[str, str] | None = None) -> str | None:
    """The path of CRIU's own cuda plugin where CRIU would load it (LIBDIR as `--libdir`, else
    $CRIU_LIBS_DIR, else /usr/lib/criu, as CRIU looks), or None."""
    environ: Mapping[str, str] = os.environ if env is None else env
    d = libdir or environ.get("CRIU_LIBS_DIR") or PLUGIN_DIR
    p = os.path.join(d, CUDA_PLUGIN)
    return p if os.path.isfile(p) else None


def own_call_env() -> dict[str, str]:
    """The environment for gpusnap's own CRIU runs: no CRIU_CONFIG_FILE, the marker set."""
    env = {k: v for k, v in os.environ.items() if k != "CRIU_CONFIG_FILE"}
    env[OWN_CALL_ENV] = "1"
    return env


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


class CriuMissing(CriuError):
    """No usable CRIU >= 4 on this machine (exit 4: the environment, not the request)."""

    exit_code = EXIT_UNAVAILABLE


def criu_version(binary: str) -> tuple[int, int, int] | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


@dataclass(frozen=True)
class CriuChoice:
    """Which CRIU binary gpusnap uses and why; `passed_over` names each candidate before it that was
    not usable, with the reason (e.g. Debian 12's own criu 3.17)."""
    path: str | None
    why: str | None
    passed_over: tuple[str, ...] = ()


def _candidates() -> list[tuple[str | None, str]]:
    return [(os.environ.get("GPUSNAP_CRIU"), "GPUSNAP_CRIU"), (shutil.which("criu"), "PATH"),
            (REPO_CRIU, "the project's build by scripts/setup.sh"), ("/usr/local/sbin/criu", "/usr/local/sbin")]


def locate_criu() -> CriuChoice:
    """The first usable CRIU >= 4 of: $GPUSNAP_CRIU, `criu` on PATH, the project's own build in
    .cache/criu (scripts/setup/install-criu.sh), /usr/local/sbin/criu."""
    passed: list[str] = []
    for path, why in _candidates():
        if not path:
            continue
        if not os.access(path, os.X_OK):
            if why == "GPUSNAP_CRIU" or os.path.lexists(path):
                passed.append(f"{path} ({why}): not an executable file")
            continue
        v = criu_version(path)
        if v and v[0] >= MIN_MAJOR:
            return CriuChoice(path, why, tuple(passed))
        passed.append(f"{path} ({why}): " + (f"version {'.'.join(map(str, v))}, need {MIN_MAJOR}.0 or later"
                                             if v else "does not report a CRIU version"))
    return CriuChoice(None, None, tuple(passed))


def find_criu() -> str | None:
    """The path locate_criu() chooses, or None."""
    return locate_criu().path


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


# CRIU's own noise that says nothing about why it failed (printed when run as root, and harmless)
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
            raise CriuMissing("CRIU >= 4.0 not found (run scripts/setup.sh, or set GPUSNAP_CRIU; "
                              "`gpusnap doctor` lists what was tried)")
        self.binary = b
        self.version = criu_version(b)

    def _run(self, argv: Sequence[str], log_path: str, what: str, timeout: float) -> CriuRun:
        full = [self.binary, *argv, "--no-default-config", "-v4", "-o", log_path]
        try:
            p = run_group(full, timeout, env=own_call_env())
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
