"""Crash-test support: a gpusnap command held at a stage by the pause hook (GPUSNAP_TEST_PAUSE=STAGE:FILE:
gpusnap writes FILE and waits until it is removed), the stages and signals the crash tests walk, and
the checks that nothing is left behind (staging, the store's tmp/, journal records)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import GPUSNAP, REPO, pythonpath
from support.criu import Tree

STAGES = ["before-dump", "dumping", "ingest", "before-commit", "after-commit"]
SIGNALS = [signal.SIGKILL, signal.SIGTERM]


class Paused:
    """A gpusnap command started with the pause hook at STAGE, waiting there."""

    def __init__(self, store: Path, args: list[str], stage: str, tmp: Path, path_prefix: str | None = None) -> None:
        self.store = store
        self.file = tmp / f"pause-{stage}"
        env = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_TEST_PAUSE": f"{stage}:{self.file}"}
        if path_prefix:
            env["PATH"] = f"{path_prefix}:{env['PATH']}"
        self.proc = subprocess.Popen([*GPUSNAP, "--store", str(store), *args, "--json"], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                                     start_new_session=True)
        deadline = time.monotonic() + 120
        while not self.file.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"gpusnap ended before {stage}: {self.proc.communicate()}")
            assert time.monotonic() < deadline, f"gpusnap never reached {stage}"
            time.sleep(0.02)
        recs = [json.loads(p.read_text()) for p in (store / "journal").glob("*.json")]
        assert len(recs) == 1, recs
        self.record = recs[0]

    def stop(self, sig: int) -> subprocess.CompletedProcess[str]:
        """Send SIG, then release whatever still waits at the pause (CRIU's action script, the runsc
        wrapper, or gpusnap's own undo path waiting for them); gpusnap's exit."""
        os.kill(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait()
        time.sleep(0.2)
        self.file.unlink()
        out, err = self.proc.communicate(timeout=180)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)


def assert_nothing_left(store: Path, staging: str) -> None:
    assert not os.path.exists(staging), f"staging {staging} left behind"
    assert list((store / "tmp").iterdir()) == [], "temporary store files left behind"
    left = [n.name for n in (store / "journal").iterdir() if n.name not in ("recover.lock", "key")]
    assert left == [], f"journal records left behind: {left}"


def expect_exit(sig: int, stage: str, r: subprocess.CompletedProcess[str]) -> None:
    if sig == signal.SIGKILL:
        assert r.returncode == -signal.SIGKILL
    elif stage == "after-commit":  # a signal after the commit only hurries the end: the dump succeeded
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 128 + signal.SIGTERM and "SIGTERM" in r.stderr, (r.returncode, r.stderr)


def wait_dead(tree: Tree, timeout: float = 60) -> None:
    """Until the whole tree is gone and its pids are free again: a zombie still holds its pid, and
    init reaps the detached tree's only when it gets to it (seconds on a loaded machine), while CRIU
    restores every process with its own pid."""
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{p}") for p in (tree.pid, tree.child)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tree.alive(), "the tree still runs"
    held = [p for p in (tree.pid, tree.child) if os.path.exists(f"/proc/{p}")]
    assert not held, f"pids {held} of the dead tree were not reaped in {timeout:g} s"


def processes_mentioning(text: str) -> list[str]:
    """Command lines (other than ours) that contain TEXT: what a test checks is gone."""
    found = []
    for n in os.listdir("/proc"):
        if n.isdigit() and int(n) != os.getpid():
            try:
                cmd = Path(f"/proc/{n}/cmdline").read_bytes()
            except OSError:
                continue
            if text.encode() in cmd:
                found.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
    return found


def sleeping_pair() -> tuple[subprocess.Popen[bytes], list[int]]:
    """A parent (in its own session) with one child, both sleeping, for tests whose stand-in driver
    plays their GPU: the parent's Popen and the two pids, parent first."""
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                             "subprocess.Popen(['sleep', '600']); time.sleep(600)"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not (kids := Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return proc, [proc.pid, int(kids[0])]

