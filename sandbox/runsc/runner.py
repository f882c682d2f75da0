"""Run gVisor's runsc: run, exec, checkpoint, restore, delete, state, list; argv lists, logs kept.

runsc's global flags (platform, network, root, ...) go before the subcommand and are recorded by the
caller so that restore uses the same ones. What the installed runsc supports is read from its own
--help output, never assumed (Debian's 20221219 build has no nvproxy, no --compression, no --direct).

Guarantees kept here: every runsc command runs in its own process group with a timeout; a timeout,
an error or an exception (a signal turned into one) while `run` or `restore` creates a sandbox ends
the group, force-deletes the container and kills the sandbox and gofer processes of that container
(they leave runsc's group with setsid and are found by container id and root), so nothing is left
running or holding a lock.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from sandbox.host.procgroup import run_group
from sandbox.runsc import records
from sandbox.runsc.records import Kind


from storage.api import EXIT_UNAVAILABLE, GpusnapError

DEFAULT_ROOT = "/var/run/runsc"


class RunscError(GpusnapError):
    """runsc is missing, or one of its commands failed (the message carries runsc's own reason)."""


class NoSuchContainer(RunscError):
    """runsc knows no container of exactly that id under the root it was given."""


class RunscMissing(RunscError):
    """No runsc on this machine (exit 4: the environment, not the request)."""

    exit_code = EXIT_UNAVAILABLE


@dataclass(frozen=True)
class RunscFeatures:
    version: str | None
    platforms: tuple[str, ...]
    nvproxy: bool
    checkpoint_flags: tuple[str, ...] = field(default_factory=tuple)
    global_flags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def save_restore_exec(self) -> bool:
        """Newer runsc runs a command inside the container around save and restore
        (`checkpoint --save-restore-exec-argv`): its own hook for cuda-checkpoint."""
        return "save-restore-exec-argv" in self.checkpoint_flags

    def gpu_args(self, *, driver_version: str | None = None, capabilities: Sequence[str] = ("compute", "utility"),
                 ) -> list[str]:
        """The global flags a GPU sandbox needs with this runsc (nvproxy), or RunscError saying why none can run."""
        if not self.nvproxy:
            raise RunscError(f"this runsc ({self.version or 'unknown version'}) has no nvproxy, so it cannot run GPU "
                             "sandboxes; install a gVisor release with nvproxy (2023 or later)")
        args = ["--nvproxy=true"]
        if driver_version:
            if "nvproxy-driver-version" not in self.global_flags:
                raise RunscError(f"this runsc ({self.version}) cannot pin the NVIDIA driver ABI (--nvproxy-driver-version)")
            args.append(f"--nvproxy-driver-version={driver_version}")
        if capabilities and "nvproxy-allowed-driver-capabilities" in self.global_flags:
            args.append(f"--nvproxy-allowed-driver-capabilities={','.join(capabilities)}")
        return args

    @property
    def can_leave_running(self) -> bool:
        return "leave-running" in self.checkpoint_flags

    @property
    def can_store_uncompressed(self) -> bool:
        """Newer runsc: `checkpoint -compression=none`, so that the store can dedup the image."""
        return "compression" in self.checkpoint_flags


def _flags(help_text: str) -> tuple[str, ...]:
    return tuple(sorted(set(re.findall(r"^\s+-{1,2}([a-z0-9][a-z0-9-]*)", help_text, re.M))))


def parse_features(version_text: str, global_help: str, checkpoint_help: str) -> RunscFeatures:
    """Features from runsc's own words (pure: tested against captured help texts)."""
    m = re.search(r"runsc version\s+(\S+)", version_text)
    plats = re.search(r"-platform string\s*\n\s*specifies which platform to use: ([^\n]*)", global_help)
    platforms: tuple[str, ...] = ()
    if plats:
        text = re.sub(r"\(default[^)]*\)", "", plats.group(1))
        platforms = tuple(w for w in (p.strip(" .") for p in text.split(",")) if re.fullmatch(r"[a-z0-9]+", w))
    gflags = _flags(global_help)
    return RunscFeatures(m.group(1) if m else None, platforms, "nvproxy" in gflags, _flags(checkpoint_help), gflags)


class Runsc:
    """One runsc binary with fixed global flags."""

    def __init__(self, global_args: Sequence[str] = (), binary: str | None = None,
                 log_dir: str | None = None, timeout: float = 600) -> None:
        b = binary or shutil.which("runsc")
        if not b:
            raise RunscMissing("runsc not found (run scripts/setup.sh, or install gVisor)")
        self.binary = b
        self.global_args = list(global_args)
        self.log_dir = log_dir
        self.timeout = timeout

    @property
    def root(self) -> str:
        """runsc's state directory these global flags select (--root), where container ids live."""
        root = DEFAULT_ROOT
        for a, nxt in zip(self.global_args, [*self.global_args[1:], ""]):
            if a.lstrip("-") == "root" and a.startswith("-"):
                root = nxt
            elif a.startswith(("--root=", "-root=")):
                root = a.split("=", 1)[1]
        return root

    def argv(self, *args: str) -> list[str]:
        return [self.binary, *self.global_args, *args]

    def _run(self, what: str, *args: str, timeout: float | None = None, stdout: Any = None, stderr: Any = None,
             preexec: Callable[[], None] | None = None, creates: str | None = None,
             finish: bool = False) -> subprocess.CompletedProcess[str]:
        """One runsc command as its own process group. CREATES: the container id the command brings
        into being (run, restore), cleaned away whole if the command times out, fails or is interrupted."""
        timeout = self.timeout if timeout is None else timeout
        try:
            p = run_group(self.argv(*args), timeout, stdout=subprocess.PIPE if stdout is None else stdout,
                          stderr=subprocess.PIPE if stderr is None else stderr, preexec_fn=preexec, finish=finish)
        except subprocess.TimeoutExpired:
            if creates:
                self.clean_up(creates, _bundle_of(args))
            raise RunscError(f"runsc {what} did not finish within {timeout:g} s (stopped, nothing left running)") from None
        except BaseException:
            if creates:
                self.clean_up(creates, _bundle_of(args))
            raise
        if p.returncode != 0 and creates and (self.state(creates) or {}).get("status") != "running":
            self.clean_up(creates, _bundle_of(args))
        if p.returncode != 0:
            err = (p.stderr or "").strip().splitlines() if isinstance(p.stderr, str) else []
            self._keep_log(what, p)
            raise RunscError(f"runsc {what} failed: {_reason(err) or f'exit {p.returncode}'}")
        return p

    def _keep_log(self, what: str, p: subprocess.CompletedProcess[str]) -> None:
        if self.log_dir and isinstance(p.stderr, str):
            os.makedirs(self.log_dir, mode=0o700, exist_ok=True)
            with open(os.path.join(self.log_dir, f"runsc-{what.split()[0]}.log"), "a") as f:
                f.write(" ".join(self.argv()) + "\n" + p.stderr + "\n")

    def features(self) -> RunscFeatures:
        v = subprocess.run([self.binary, "--version"], capture_output=True, text=True).stdout
        g = subprocess.run([self.binary, "flags"], capture_output=True, text=True)  # the global flags
        c = subprocess.run([self.binary, "checkpoint", "--help"], capture_output=True, text=True)
        return parse_features(v, g.stdout + g.stderr, c.stdout + c.stderr)

    def run(self, cid: str, bundle: str, *, stdout: Any, stderr: Any, preexec: Callable[[], None] | None = None) -> None:
        self._run(f"run {cid}", "run", "-detach", "-bundle", bundle, cid, stdout=stdout, stderr=stderr, preexec=preexec,
                  creates=cid)

    def exec(self, cid: str, argv: Sequence[str], timeout: float = 60, env: dict[str, str] | None = None) -> str:
        envs = [a for k, v in (env or {}).items() for a in ("-env", f"{k}={v}")]
        return self._run(f"exec {cid}", "exec", *envs, cid, *argv, timeout=timeout).stdout

    def exec_piped(self, cid: str, argv: Sequence[str], env: dict[str, str] | None = None,
                   stderr: Any = None) -> subprocess.Popen[bytes]:
        """`runsc exec` of ARGV in CID with its stdin and stdout as binary pipes to the caller."""
        envs = [a for k, v in (env or {}).items() for a in ("-env", f"{k}={v}")]
        return subprocess.Popen(self.argv("exec", *envs, cid, *argv), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr)

    def checkpoint(self, cid: str, image_path: str, *, leave_running: bool = False,
                   uncompressed: bool = False) -> None:
        args = ["checkpoint", "-image-path", image_path]
        if leave_running:
            args.append("-leave-running")
        if uncompressed:
            args.append("-compression=none")
        self._run(f"checkpoint {cid}", *args, cid, finish=True)  # never cut in half: the sandbox stops at its end

    def restore(self, cid: str, bundle: str, image_path: str, *, stdout: Any, stderr: Any,
                preexec: Callable[[], None] | None = None) -> None:
        self._run(f"restore {cid}", "restore", "-image-path", image_path, "-bundle", bundle, "-detach", cid,
                  stdout=stdout, stderr=stderr, preexec=preexec, creates=cid)

    def delete(self, cid: str, force: bool = True) -> None:
        self._run(f"delete {cid}", "delete", *(["-force"] if force else []), cid)

    def state(self, cid: str) -> dict[str, Any] | None:
        """The state of exactly CID, or None when runsc has none (or cannot tell which one is meant)."""
        try:
            return self.lookup(cid)
        except RunscError:
            return None

    def lookup(self, cid: str) -> dict[str, Any]:
        """The state of exactly CID. runsc also answers for an id prefix: a container whose id is not
        CID is refused (NoSuchContainer), as is none; any other failure is RunscError with runsc's own
        reason (e.g. `id "app" is ambiguous`)."""
        where = f"under runsc root {self.root}"
        try:
            p = run_group(self.argv("state", cid), 60)
        except subprocess.TimeoutExpired:
            raise RunscError(f"runsc state {cid} did not answer within 60 s") from None
        if p.returncode != 0:
            reason = _reason(p.stderr.strip().splitlines())
            if "does not exist" in reason or not reason:
                raise NoSuchContainer(f"no container {cid!r} {where}")
            raise RunscError(f"container {cid!r} {where}: {re.sub(r'^loading container[^:]*: ', '', reason)}")
        try:
            st = json.loads(p.stdout)
        except ValueError:
            raise RunscError(f"runsc state {cid}: unreadable answer {p.stdout[:100]!r}") from None
        if st.get("id") != cid:
            raise NoSuchContainer(f"no container {cid!r} {where} (runsc would take {st.get('id')!r}, whose id "
                                  "starts with it; give the full id)")
        return st

    def sandbox_processes(self, cid: str, bundle: str | None = None) -> list[int]:
        """runsc's own processes serving container CID (or started with BUNDLE) under this root
        (runsc-sandbox, runsc-gofer, a hung runsc command), found by their command lines: they may
        have left runsc's process group."""
        root = self.root
        out = []
        for n in os.listdir("/proc"):
            if not n.isdigit() or int(n) == os.getpid():
                continue
            try:
                with open(f"/proc/{n}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
            except OSError:
                continue
            if (os.path.basename(argv[0]).startswith("runsc")
                    and (cid in argv or (bundle is not None and os.path.basename(argv[0]) == "runsc-gofer"
                                         and (bundle in argv or f"--bundle={bundle}" in argv)))
                    and (root in argv or f"--root={root}" in argv or f"-root={root}" in argv
                         or (root == "/var/run/runsc" and not any("root" in a for a in argv)))):
                out.append(int(n))
        return out

    def clean_up(self, cid: str, bundle: str | None = None) -> list[int]:
        """Container CID gone whole: `runsc delete -force`, then any of its processes still there
        killed (SIGKILL) and waited for. Returns the pids that had to be killed."""
        try:
            run_group(self.argv("delete", "-force", cid), 60)
        except subprocess.TimeoutExpired:
            pass
        left = self.sandbox_processes(cid, bundle)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while self.sandbox_processes(cid, bundle) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:  # a sandbox killed before delete could see it: its state is still recorded
            try:
                run_group(self.argv("delete", "-force", cid), 60)
            except subprocess.TimeoutExpired:
                pass
        return left

    def list(self) -> list[str]:
        p = self._run("list", "list", "-quiet")
        return [l for l in p.stdout.split() if l]


def _bundle_of(args: Sequence[str]) -> str | None:
    for a, b in zip(args, [*args[1:], None]):
        if a in ("-bundle", "--bundle"):
            return b
    return None


def _reason(lines: list[str]) -> str:
    """runsc's most telling stderr line, without its log prefix."""
    pick = [l for l in lines if "error" in l.lower() or "fail" in l.lower() or "not supported" in l.lower()]
    line = (pick or lines or [""])[-1]
    return re.sub(r"^[A-Z]\d{4} [\d:.]+\s+\d+\s+\S+\]\s*", "", line).strip()


def restart(r: Runsc, cid: str, bundle: str, images: str) -> None:
    """Run CID again, under the same id, from the checkpoint images just taken (its network namespace
    is the bundle's, which the checkpoint left in place)."""
    output = (records.read(r.root, cid, Kind.RUN) or {}).get("output") or os.devnull
    r.delete(cid)
    with open(output, "ab") as out:
        r.restore(cid, bundle, images, stdout=out, stderr=out)
