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
import sys
import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from storage.api import EXIT_UNAVAILABLE, GpusnapError
from storage.api import own_dir

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


_VERSIONS: dict[tuple[str, int, int, int], tuple[int, int, int] | None] = {}


def criu_version(binary: str) -> tuple[int, int, int] | None:
    """BINARY's CRIU version (`criu --version`), asked once per process for each file (path, inode,
    mtime, size: a binary replaced meanwhile is asked again); None where it is not a CRIU."""
    try:
        st = os.stat(binary)
    except OSError:
        return None
    key = (binary, st.st_ino, st.st_mtime_ns, st.st_size)
    if key not in _VERSIONS:
        _VERSIONS[key] = _ask_version(binary)
    return _VERSIONS[key]


def _ask_version(binary: str) -> tuple[int, int, int] | None:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


Version = tuple[int, ...]


@dataclass(frozen=True)
class KnownFailure:
    """A CRIU release range that is known to fail on a kernel range: what fails, and the fix.
    Ranges are half-open: [kernel_from, kernel_below) and [criu_from, criu_below); None: no bound."""
    kernel_from: Version
    kernel_below: Version | None
    criu_from: Version
    criu_below: Version | None
    fails: str
    fix: str

    def applies(self, kernel: Version, criu: Version) -> bool:
        return (kernel >= self.kernel_from and (self.kernel_below is None or kernel < self.kernel_below)
                and criu >= self.criu_from and (self.criu_below is None or criu < self.criu_below))

    def describe(self, kernel: Version, criu: Version) -> str:
        return (f"CRIU {'.'.join(map(str, criu))} on kernel {'.'.join(map(str, kernel))}: {self.fails}; "
                f"fix: {self.fix}")


# The one table of kernel/CRIU combinations known to fail (docs/PLATFORM.md says the same in words).
KNOWN_FAILURES: tuple[KnownFailure, ...] = (
    KnownFailure((6, 16), None, (0,), (4, 2),
                 "no process with a TCP socket can be dumped (`sockets: Can't get 1:16 opt: Operation not "
                 "supported`: Linux 6.16 allows SO_PASSCRED/SO_PASSSEC on UNIX and netlink sockets only); "
                 "`criu check` still passes",
                 "CRIU 4.2 or later (scripts/setup/install-criu.sh builds 4.2.1 from Debian unstable's source)"),
    KnownFailure((0,), None, (0,), (4, 0),
                 "`criu check` fails on recent kernels (`vdso: Unexpected rt vDSO area bounds`, seen on 6.18)",
                 "CRIU 4.0 or later (scripts/setup/install-criu.sh)"),
)


def kernel_version(release: str | None = None) -> Version:
    """The running kernel's version (RELEASE as `uname -r` prints it), e.g. (6, 18, 0)."""
    nums = re.findall(r"\d+", (release or os.uname().release).split("-")[0])[:3]
    return tuple(int(x) for x in nums) or (0,)


def known_failures(criu: Version, kernel: Version | None = None) -> list[str]:
    """What KNOWN_FAILURES says CRIU version CRIU fails at on KERNEL (default: the running one), with the fix."""
    k = kernel_version() if kernel is None else kernel
    return [f.describe(k, criu) for f in KNOWN_FAILURES if f.applies(k, criu)]


@dataclass(frozen=True)
class CriuChoice:
    """Which CRIU binary gpusnap uses and why; `passed_over` names each candidate before it that was
    not usable, with the reason (e.g. Debian 12's own criu 3.17); `known_failures`: what the chosen
    one is known to fail at on this kernel (KNOWN_FAILURES), empty when nothing is known."""
    path: str | None
    why: str | None
    passed_over: tuple[str, ...] = ()
    version: Version | None = None
    known_failures: tuple[str, ...] = ()


def _candidates() -> list[tuple[str | None, str]]:
    return [(os.environ.get("GPUSNAP_CRIU"), "GPUSNAP_CRIU"), (shutil.which("criu"), "PATH"),
            (REPO_CRIU, "the project's build by scripts/setup.sh"), ("/usr/local/sbin/criu", "/usr/local/sbin")]


def locate_criu(kernel: Version | None = None) -> CriuChoice:
    """The CRIU >= 4 to use: $GPUSNAP_CRIU when it is one (the user's choice, even one known to fail
    here: `doctor` warns), else the first of `criu` on PATH, the project's own build in .cache/criu
    (scripts/setup/install-criu.sh) and /usr/local/sbin/criu that is not known to fail on this KERNEL
    (default: the running one), else the first usable one of those, with what it fails at."""
    passed: list[str] = []
    usable: list[tuple[str, str, Version, list[str]]] = []
    for path, why in _candidates():
        if not path:
            continue
        if not os.access(path, os.X_OK):
            if why == "GPUSNAP_CRIU" or os.path.lexists(path):
                passed.append(f"{path} ({why}): not an executable file")
            continue
        v = criu_version(path)
        if not v or v[0] < MIN_MAJOR:
            passed.append(f"{path} ({why}): " + (f"version {'.'.join(map(str, v))}, need {MIN_MAJOR}.0 or later"
                                                 if v else "does not report a CRIU version"))
            continue
        fails = known_failures(v, kernel)
        if why == "GPUSNAP_CRIU" or not fails:
            return CriuChoice(path, why, tuple(passed), v, tuple(fails))
        if all(u[0] != path for u in usable):
            usable.append((path, why, v, fails))
        passed.append(f"{path} ({why}): {fails[0]}")
    if usable:
        first, first_why, first_v, first_fails = usable[0]
        return CriuChoice(first, first_why, tuple(p for p in passed if not p.startswith(f"{first} ({first_why})")),
                          first_v, tuple(first_fails))
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
    skip_in_flight: bool = False  # connections not yet accepted are dropped (their clients retry)
    action_script: str | None = None
    extra: tuple[str, ...] = ()
    # each checked before it gets here (sandbox.criu.criu_options, sandbox.criu.netlock)
    network_lock: str | None = None       # iptables, nftables or skip (None: CRIU's default, iptables)
    ghost_limit: int | None = None        # bytes of a deleted file's contents CRIU keeps in the images
    no_ghost_fiemap: bool = False
    force_irmap: bool = False
    irmap_scan_paths: tuple[str, ...] = ()
    root: str | None = None
    external: tuple[str, ...] = ()
    manage_cgroups: str | None = None     # none, props, soft, full, strict or ignore
    tcp_close: bool = False               # established connections neither dumped nor locked

    def argv(self) -> list[str]:
        a = []
        for flag, on in (("--leave-running", self.leave_running), ("--leave-stopped", self.leave_stopped),
                         ("--shell-job", self.shell_job),
                         ("--ext-unix-sk", self.ext_unix_sk), ("--file-locks", self.file_locks),
                         ("--link-remap", self.link_remap), ("--tcp-established", self.tcp_established),
                         ("--skip-in-flight", self.skip_in_flight)):
            if on:
                a.append(flag)
        if self.action_script:
            a += ["--action-script", self.action_script]
        if self.network_lock:
            a += ["--network-lock", self.network_lock]
        if self.ghost_limit is not None:
            a += ["--ghost-limit", str(self.ghost_limit)]
        a += ["--no-ghost-fiemap"] if self.no_ghost_fiemap else []
        a += ["--force-irmap"] if self.force_irmap else []
        for d in self.irmap_scan_paths:
            a += ["--irmap-scan-path", d]
        if self.root:
            a += ["--root", self.root]
        for e in self.external:
            a += ["--external", e]
        if self.manage_cgroups:
            a += [f"--manage-cgroups={self.manage_cgroups}"]
        a += ["--tcp-close"] if self.tcp_close else []
        return a + list(self.extra)


@dataclass
class CriuRun:
    argv: list[str]
    log_path: str
    returncode: int
    log_tail: list[str] = field(default_factory=list)


# CRIU's own lines that say nothing about why it failed: printed when run as root, or where /run is no
# tmpfs (CRIU 4.1 prints that one as a warning with "Can't" in it), and harmless
_NOISE = ("RLIMIT_NOFILE", "kdat cache")
# lines that name the cause where CRIU's first Error line names only a consequence (e.g. the warning
# "Unable to interrupt task: 1 (Operation not permitted)" before "Error: Unable to detach from 1")
_CAUSES = ("Unable to interrupt task", "Unable to seize", "CAP_CHECKPOINT_RESTORE")
# CRIU's summaries of a failure it has already named: "Dump files (pid: 7) failed with -1", "Dumping FAILED."
_CONSEQUENCE = re.compile(r"(?:Dumping|Restoring|Pre-dumping) FAILED|failed with -?\d+\s*$|Unable to detach from")
_ERROR = re.compile(r"^\(\s*[\d.]+\)\s*(?:\d+:\s*)?Error\s*\(")
_PRINTED = "--- printed by criu ---"


def cause_from_log(lines: Sequence[str], n: int = 6) -> list[str]:
    """The lines of a CRIU log that say why it failed, the cause first: CRIU's first Error line that
    is neither noise (the RLIMIT_NOFILE and kdat cache lines) nor a summary ("Dumping FAILED.",
    "... failed with -1", "Unable to detach"), else a warning naming a known cause (where CRIU's
    errors name only its consequence; the same warning is harmless when CRIU goes on, e.g. for a
    child exiting while it is seized), then the rest in order. Without Error lines: what CRIU printed (e.g. missing capabilities), else
    lines saying "Can't"/"fail", else the last lines. CRIU prints the most specific error first: the
    function that failed logs before each caller adds its own line."""
    lines = [l.rstrip("\n") for l in lines]
    printed = lines[lines.index(_PRINTED) + 1:] if _PRINTED in lines else []
    logged = lines[:lines.index(_PRINTED)] if _PRINTED in lines else lines
    quiet = [l for l in logged if not any(x in l for x in _NOISE)]
    causes = [l for l in quiet if any(c in l for c in _CAUSES)]
    errors = [l for l in quiet if _ERROR.match(l) and l not in causes]
    specific = [l for l in errors if not _CONSEQUENCE.search(l)]
    summaries = [l for l in errors if _CONSEQUENCE.search(l)]
    found = specific + causes + summaries
    if not found:
        found = [l for l in printed if l.strip()] or \
            [l for l in quiet if re.search(r"[Cc]an't|[Ff]ail|[Ee]rror", l)]
    return found[:n] if found else [l for l in lines if l.strip()][-n:]


def explain(log_path: str, n: int = 6) -> list[str]:
    """cause_from_log of the log at LOG_PATH ([] if it cannot be read)."""
    try:
        with open(log_path, errors="replace") as f:
            return cause_from_log(f.readlines(), n)
    except OSError:
        return []


LOGS_ENV = "GPUSNAP_CRIU_LOGS"
_LOG_WHAT = re.compile(r"[^A-Za-z0-9]+")


def keep_copy(log_path: str, what: str) -> None:
    """A copy of the CRIU log at LOG_PATH in the directory $GPUSNAP_CRIU_LOGS (created 0700; for looking
    at where CRIU's time went in a run that succeeded, whose log goes with its temporary images
    directory), named after WHAT, this process and the time; nothing when unset. Never fails the
    run, whatever goes wrong: a copy that cannot be made is said on stderr (if it can be). A log names
    the tree's paths and addresses, so the directory must be reached without a link, through
    directories of root or this user that no one else may write in (sticky ones aside), and be this
    user's own (storage.fs.owndir); each copy is a new file, 0600 (O_EXCL, O_NOFOLLOW)."""
    try:
        where = os.environ.get(LOGS_ENV, "").strip()
        if not where:
            return
        name = f"{_LOG_WHAT.sub('-', what).strip('-')[:60]}-{os.getpid()}-{time.time_ns()}.log"
        try:
            d = own_dir(os.path.abspath(where))
            try:
                with open(log_path, "rb") as src, \
                        os.fdopen(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                          0o600, dir_fd=d), "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            finally:
                os.close(d)
        except OSError as e:
            print(f"gpusnap: warning: CRIU's log not kept in {LOGS_ENV}={where!r}: {e.strerror or e}", file=sys.stderr)
    except Exception:  # noqa: BLE001 - stderr closed or a broken pipe: a log kept for measuring never fails a run
        pass


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
            keep_copy(log_path, what)
            raise CriuError(f"criu {what} did not finish within {timeout:g} s (stopped)") from None
        run = CriuRun(full, log_path, p.returncode)
        if p.returncode != 0:
            said = (p.stdout or "") + (p.stderr or "")
            if said.strip():  # what CRIU printed rather than logged (e.g. missing capabilities) goes in the log too
                with open(log_path, "a") as f:
                    f.write("--- printed by criu ---\n" + said)
        keep_copy(log_path, what)
        if p.returncode != 0:
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
