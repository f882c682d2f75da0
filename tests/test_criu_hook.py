"""`gpusnap-criu-hook` run by the real CRIU 4.1.1 against a real process tree in its own network
namespace (as a container's), its "GPU processes" those of the driver stand-in, whose state lives in a
file both the hook (CRIU's child) and the test read. Every action is given twice, as CRIU 4.1.1 runs
them when runc passes its config; failed and --leave-running dumps end with every process RUNNING."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import REPO
from support.criu import criu_path
from support.driver_standin import SharedStandIn
from sandbox.gpu.driver import Features, GpuInfo, ProcessState as S

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_criu")]

HOST_FEATS = Features(bindings="stand-in", driver_version="stand-in", checkpoint_api=True, custom_storage=False,
                      gpus=[GpuInfo(0, "Stand-in GPU", "GPU-00000000-0000-0000-0000-000000000000", 1 << 30, (9, 0), None, False)])
TREE = ("import os,sys,time\n"
        "pid=os.fork()\n"
        "if pid==0:\n    time.sleep(600)\n    os._exit(0)\n"
        "open(sys.argv[1]+'.tmp','w').write('%d %d'%(os.getpid(),pid)); os.rename(sys.argv[1]+'.tmp',sys.argv[1])\n"
        "time.sleep(600)\n")


class NetnsTree:
    """A parent and a child in their own network namespace (CRIU runs network-lock/unlock only then)."""

    def __init__(self, tmp: Path, netns: bool = True) -> None:
        ready = tmp / "ready"
        self.proc = subprocess.Popen([*(["unshare", "-n"] if netns else []), sys.executable, "-c", TREE, str(ready)], cwd="/",
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + 20
        while not ready.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "the tree did not start"
            time.sleep(0.02)
        self.pid, self.child = map(int, ready.read_text().split())

    @property
    def pids(self) -> list[int]:
        return [self.pid, self.child]

    def alive(self) -> bool:
        return all(_running(p) for p in self.pids)

    def reap(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        for p in self.pids:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.reap()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[NetnsTree]:
    t = NetnsTree(tmp_path)
    yield t
    t.kill()


@pytest.fixture
def hook(tmp_path: Path) -> dict:
    """The hook as CRIU runs it, its driver the shared stand-in named by $STANDIN; log and records here."""
    w = tmp_path / "gpusnap-criu-hook"
    w.write_text(f"#!{sys.executable}\nimport os, sys\nsys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]\n"
                 "from support.driver_standin import SharedStandIn\nfrom criu_hooks.action_script import main\n"
                 "main(driver=SharedStandIn(os.environ['STANDIN']))\n")
    w.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("GPUSNAP_OWN_CRIU_CALL", "CRIU_CONFIG_FILE")}
    env.update(GPUSNAP_HOOK_LOG=str(tmp_path / "log" / "criu-hook.log"), GPUSNAP_HOOK_STATE=str(tmp_path / "state"),
               STANDIN=str(tmp_path / "standin"))
    return {"script": str(w), "env": env, "log": tmp_path / "log" / "criu-hook.log", "standin": str(tmp_path / "standin")}


def criu(*args: str, env: dict, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([criu_path(), *args, "--no-default-config", "-v4"], env=env, capture_output=True, text=True,
                       timeout=120)
    if check:
        assert p.returncode == 0, p.stderr[-2000:]
    return p


def log_lines(hook: dict) -> list[tuple[str, str]]:
    """(action, what it did) per line of the hook's log."""
    if not hook["log"].exists():
        return []
    out = []
    for line in hook["log"].read_text().splitlines():
        action, msg = line.split(" ", 2)[2].split(": ", 1)
        out.append((action, msg))
    return out


def standin_for(hook: dict, tree: NetnsTree) -> tuple[SharedStandIn, dict[int, bytes]]:
    mem = {p: os.urandom(4096) + bytes([p % 251]) * 1000 for p in tree.pids}
    return SharedStandIn.create(hook["standin"], mem), mem


def calls(d: SharedStandIn, call: str) -> list[int]:
    return sorted(p for p, c in d.load().calls if c == call)


def test_twice_run_actions_and_leave_running_resume_every_process(tree: NetnsTree, hook: dict, tmp_path: Path) -> None:
    """Each action twice (CRIU 4.1.1 under runc): the second pre-dump and post-dump change nothing;
    --leave-running brings every process back at network-unlock, with no environment variable."""
    d, mem = standin_for(hook, tree)
    (tmp_path / "img").mkdir()
    criu("dump", "-t", str(tree.pid), "-D", str(tmp_path / "img"), "-R", "--action-script", hook["script"],
         "--action-script", hook["script"], env=hook["env"])
    assert tree.alive()
    now = d.load()
    assert all(now.get_state(p) == S.RUNNING and bytes(now.procs[p].gpu) == mem[p] for p in tree.pids)
    assert calls(d, "checkpoint") == sorted(tree.pids) and calls(d, "restore") == sorted(tree.pids)
    assert calls(d, "lock") == sorted(tree.pids) and calls(d, "unlock") == sorted(tree.pids)
    acts = log_lines(hook)
    assert [a for a, _ in acts] == ["pre-dump", "pre-dump", "network-lock", "network-lock", "post-dump", "post-dump",
                                    "network-unlock", "network-unlock"]
    assert acts[0][1].startswith("checkpointed 2 ") and "checkpointed 0 " in acts[1][1] and "already checkpointed 2" in acts[1][1]
    assert acts[6][1].startswith("dump failed or left running: restored 2") and acts[7][1].startswith("nothing this CRIU run froze")
    assert os.listdir(tmp_path / "state") == []  # the record of this dump is gone with it


def test_leave_running_in_the_host_network_namespace_with_the_variable(hook: dict, tmp_path: Path) -> None:
    """A tree in the host's network namespace gets no network-unlock from CRIU: GPUSNAP_LEAVE_RUNNING=1
    makes post-dump resume it (the second post-dump finds nothing to do)."""
    tree = NetnsTree(tmp_path, netns=False)
    try:
        d, mem = standin_for(hook, tree)
        (tmp_path / "img").mkdir()
        criu("dump", "-t", str(tree.pid), "-D", str(tmp_path / "img"), "-R", "--action-script", hook["script"],
             "--action-script", hook["script"], env={**hook["env"], "GPUSNAP_LEAVE_RUNNING": "1"})
        now = d.load()
        assert tree.alive() and all(now.get_state(p) == S.RUNNING and bytes(now.procs[p].gpu) == mem[p] for p in tree.pids)
        acts = dict_of(log_lines(hook))
        assert "network-unlock" not in acts
        assert acts["post-dump"][0].startswith("GPUSNAP_LEAVE_RUNNING: restored 2") and "restored 0" in acts["post-dump"][1]
    finally:
        tree.kill()


def test_failed_dump_resumes_every_process_at_network_unlock(tree: NetnsTree, hook: dict, tmp_path: Path) -> None:
    """A dump that fails after pre-dump (here a second action script refuses post-dump): CRIU runs
    network-unlock, the hook restores and unlocks every process; the tree runs on."""
    d, mem = standin_for(hook, tree)
    fail = tmp_path / "fail.sh"
    fail.write_text('#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] && exit 1\nexit 0\n')
    fail.chmod(0o755)
    (tmp_path / "img").mkdir()
    p = criu("dump", "-t", str(tree.pid), "-D", str(tmp_path / "img"), "--action-script", hook["script"],
             "--action-script", hook["script"], "--action-script", str(fail), env=hook["env"], check=False)
    assert p.returncode != 0
    time.sleep(0.2)
    assert tree.alive()
    now = d.load()
    assert all(now.get_state(p) == S.RUNNING and bytes(now.procs[p].gpu) == mem[p] for p in tree.pids)
    assert calls(d, "checkpoint") == sorted(tree.pids) and calls(d, "restore") == sorted(tree.pids)
    assert ("network-unlock", "dump failed or left running: restored 2, unlocked 0, already running 0 "
                              f"(pids {tree.pids})") in log_lines(hook)


def test_killing_dump_then_restore_with_twice_run_post_resume(tree: NetnsTree, hook: dict, tmp_path: Path) -> None:
    """A plain dump kills the tree with its GPU processes CHECKPOINTED; the restore's own network-unlock
    (before the processes resume) leaves them, post-resume restores them once, its second run nothing."""
    d, mem = standin_for(hook, tree)
    img = tmp_path / "img"
    img.mkdir()
    criu("dump", "-t", str(tree.pid), "-D", str(img), "--action-script", hook["script"], "--action-script",
         hook["script"], env=hook["env"])
    tree.reap()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{p}") for p in tree.pids):  # until the killed tree is reaped
        assert time.monotonic() < deadline, "the killed tree was not reaped"
        time.sleep(0.05)
    assert all(d.get_state(p) == S.CHECKPOINTED for p in tree.pids)
    dumped = len(log_lines(hook))
    criu("restore", "-D", str(img), "-d", "--action-script", hook["script"], "--action-script", hook["script"],
         env=hook["env"])
    try:
        assert tree.alive()
        now = d.load()
        assert all(now.get_state(p) == S.RUNNING and bytes(now.procs[p].gpu) == mem[p] for p in tree.pids)
        assert calls(d, "restore") == sorted(tree.pids) and calls(d, "unlock") == sorted(tree.pids)
        acts = dict_of(log_lines(hook)[dumped:])
        assert all(m.startswith("nothing this CRIU run froze") for m in acts["network-unlock"])
        assert acts["post-resume"][0].startswith("restored 2 ") and acts["post-resume"][1].startswith("restored 0 ")
    finally:
        tree.kill()


def dict_of(acts: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for a, m in acts:
        out.setdefault(a, []).append(m)
    return out


def test_gpusnap_criu_dump_never_runs_a_configured_hook(tree: NetnsTree, hook: dict, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook configured where CRIU reads configuration (a private $HOME/.criu/default.conf, read
    like /etc/criu/default.conf, and CRIU_CONFIG_FILE, read even with --no-default-config): a plain
    `criu dump` runs it, `gpusnap criu dump` does not: it checkpoints the GPU once, itself."""
    from sandbox.criu.snapshot import criu_dump
    from storage.repo.store import SnapshotStore
    home = tmp_path / "home"
    (home / ".criu").mkdir(parents=True)
    (home / ".criu" / "default.conf").write_text(f"action-script {hook['script']}\n")
    (tmp_path / "extra.conf").write_text(f"action-script {hook['script']}\n")
    for k, v in hook["env"].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HOME", str(home))
    control = SharedStandIn.create(str(tmp_path / "control"), {p: b"x" * 100 for p in tree.pids})
    (tmp_path / "img").mkdir()
    p = subprocess.run([criu_path(), "dump", "-t", str(tree.pid), "-D", str(tmp_path / "img"), "-R"],
                       env={**os.environ, "STANDIN": control.path}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert calls(control, "checkpoint") == sorted(tree.pids), "the configured hook runs in a plain criu dump"
    hook["log"].unlink()
    monkeypatch.setenv("CRIU_CONFIG_FILE", str(tmp_path / "extra.conf"))
    d, mem = standin_for(hook, tree)
    st = SnapshotStore(str(tmp_path / "store"))
    rep = criu_dump(st, tree.pid, "c", leave_running=True, gpu_driver=d, features=HOST_FEATS)
    assert sorted(rep.cuda_pids) == sorted(tree.pids)
    assert calls(d, "checkpoint") == sorted(tree.pids) and calls(d, "restore") == sorted(tree.pids)
    assert not hook["log"].exists(), hook["log"].read_text()
    now = d.load()
    assert all(now.get_state(p) == S.RUNNING and bytes(now.procs[p].gpu) == mem[p] for p in tree.pids)
    assert tree.alive()


def test_hook_steps_aside_for_criu_cuda_plugin(tmp_path: Path, child: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda_plugin.so in CRIU's plugin directory ($CRIU_LIBS_DIR here, as CRIU reads it): the hook
    touches nothing and says why; doctor says the plugin handles GPUs in CRIU dumps."""
    from criu_hooks.action_script import run
    from support.driver_standin import StandInDriver
    from sandbox import doctor
    libs = tmp_path / "criu-libs"
    libs.mkdir()
    monkeypatch.setenv("GPUSNAP_HOOK_STATE", str(tmp_path / "state"))
    monkeypatch.delenv("GPUSNAP_OWN_CRIU_CALL", raising=False)
    monkeypatch.setenv("CRIU_LIBS_DIR", str(libs))
    d = StandInDriver()
    d.add(child, b"gpu" * 100)
    assert "gpusnap-criu-hook" in doctor.gpu_handler()
    (libs / "cuda_plugin.so").write_bytes(b"\x7fELF")
    assert "steps aside" in run("pre-dump", child, driver=d, pids=[child])
    assert d.calls == [] and d.get_state(child) == S.RUNNING
    assert doctor.gpu_handler().startswith(f"CRIU's cuda plugin ({libs}/cuda_plugin.so)")


def test_hook_help_and_errors(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "GPUSNAP_HOOK_LOG": str(tmp_path / "hook.log")}
    env.pop("CRTOOLS_SCRIPT_ACTION", None)
    h = subprocess.run([sys.executable, "-m", "criu_hooks.action_script", "--help"], env=env, capture_output=True,
                       text=True)
    assert h.returncode == 0
    for must in ("CRIU action script", "pre-dump", "network-unlock", "post-resume", "gpusnap hook install",
                 "GPUSNAP_GPU_SNAPSHOT", "GPUSNAP_HOOK_LOG", "cuda plugin", "twice"):
        assert must in h.stdout.replace("\n", " "), must
    p = subprocess.run([sys.executable, "-m", "criu_hooks.action_script"], env=env, capture_output=True, text=True)
    assert p.returncode == 2 and "CRTOOLS_SCRIPT_ACTION is not set" in p.stderr
    # a failing pre-dump: one line saying what state the processes are in, exit 1 (CRIU aborts)
    env.update(CRTOOLS_SCRIPT_ACTION="pre-dump", CRTOOLS_INIT_PID="999999999", GPUSNAP_HOOK_STATE=str(tmp_path / "s"))
    f = subprocess.run([sys.executable, "-m", "criu_hooks.action_script"], env=env, capture_output=True, text=True)
    assert f.returncode == 1 and len(f.stderr.splitlines()) == 1, f.stderr
    assert "FAILED: no process with pid 999999999; the GPU processes were left running" in f.stderr
    # gpusnap's own CRIU runs: nothing
    env["GPUSNAP_OWN_CRIU_CALL"] = "1"
    o = subprocess.run([sys.executable, "-m", "criu_hooks.action_script"], env=env, capture_output=True, text=True)
    assert o.returncode == 0 and "gpusnap's own CRIU run" in o.stderr


def test_hook_log_is_private_and_never_follows_a_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from criu_hooks.action_script import log
    monkeypatch.setenv("GPUSNAP_HOOK_LOG", str(tmp_path / "logs" / "criu-hook.log"))
    log("pre-dump", "one")
    log("pre-dump", "two")
    assert (tmp_path / "logs").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "logs" / "criu-hook.log").stat().st_mode & 0o777 == 0o600
    assert [l.split(" ", 2)[2] for l in (tmp_path / "logs" / "criu-hook.log").read_text().splitlines()] == [
        "pre-dump: one", "pre-dump: two"]
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (tmp_path / "logs2").mkdir(mode=0o700)
    (tmp_path / "logs2" / "criu-hook.log").symlink_to(victim)
    monkeypatch.setenv("GPUSNAP_HOOK_LOG", str(tmp_path / "logs2" / "criu-hook.log"))
    log("pre-dump", "three")
    os.symlink(tmp_path / "logs", tmp_path / "logs3")
    monkeypatch.setenv("GPUSNAP_HOOK_LOG", str(tmp_path / "logs3" / "criu-hook.log"))
    log("pre-dump", "four")
    assert victim.read_text() == "keep\n"
    assert "four" not in (tmp_path / "logs" / "criu-hook.log").read_text()


def test_hook_log_and_records_are_reached_without_a_link_in_any_parent(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook's log and per-dump records (paths a setting names; the hook runs as root) are reached
    from / without following a link in any component, and no parent may be writable by others unless
    sticky: a linked parent or one another user could fill is refused, nothing written through it;
    missing parents are made 0700."""
    from criu_hooks.action_script import DumpRecord, log
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    os.symlink(elsewhere, tmp_path / "linked")
    monkeypatch.setenv("GPUSNAP_HOOK_LOG", str(tmp_path / "linked" / "logs" / "criu-hook.log"))
    log("pre-dump", "through a linked parent")
    assert list(elsewhere.iterdir()) == [], "nothing made or written through the link"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # others may write here, not sticky: they could swap what we make in it
    monkeypatch.setenv("GPUSNAP_HOOK_LOG", str(shared / "logs" / "criu-hook.log"))
    log("pre-dump", "in a directory others may write")
    assert not (shared / "logs" / "criu-hook.log").exists()
    monkeypatch.setenv("GPUSNAP_HOOK_STATE", str(tmp_path / "linked" / "state"))
    with pytest.raises(OSError, match="state"):
        DumpRecord(os.getpid()).write({"pids": []})
    assert list(elsewhere.iterdir()) == []
    monkeypatch.setenv("GPUSNAP_HOOK_LOG", str(tmp_path / "new" / "deep" / "criu-hook.log"))
    log("pre-dump", "fine")
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700 and (tmp_path / "new" / "deep").stat().st_mode & 0o777 == 0o700
    assert "fine" in (tmp_path / "new" / "deep" / "criu-hook.log").read_text()


def test_custom_storage_hook_double_pre_dump_keeps_the_snapshot(tmp_path: Path, child: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Custom storage into GPUSNAP_GPU_SNAPSHOT: a second pre-dump (the processes already
    CHECKPOINTED) does not replace the snapshot with an empty one; post-resume twice brings the memory
    back once."""
    from criu_hooks.action_script import run
    from support.driver_standin import StandInDriver
    from storage.gpu.device import HostDevice
    from storage.repo.store import SnapshotStore
    from support.custom_storage import FEATS, gpu_bytes
    d = StandInDriver()
    d.add(child, gpu_bytes(8, 2))
    before = bytes(d.procs[child].gpu)
    for k, v in (("GPUSNAP_STORE", str(tmp_path / "store")), ("GPUSNAP_GPU_SNAPSHOT", "hook-gpu"),
                 ("GPUSNAP_HOOK_STATE", str(tmp_path / "state")), ("CRIU_LIBS_DIR", str(tmp_path / "none"))):
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GPUSNAP_OWN_CRIU_CALL", raising=False)
    kw: dict[str, Any] = dict(driver=d, features=FEATS, device=HostDevice(), pids=[child])
    assert run("pre-dump", child, **kw).startswith("checkpointed 1 CUDA process(es) via custom-storage")
    assert run("pre-dump", child, **kw).startswith("checkpointed 0 ")
    st = SnapshotStore(str(tmp_path / "store"))
    assert [s.name for s in st.load("hook-gpu").streams] == [f"gpu/{child}/0"]
    assert d.get_state(child) == S.CHECKPOINTED and len(d.procs[child].gpu) == 0
    assert run("post-resume", child, **kw).startswith("restored 1 CUDA process(es) via custom-storage")
    assert run("post-resume", child, **kw).startswith("restored 0 ")
    assert d.get_state(child) == S.RUNNING and bytes(d.procs[child].gpu) == before
    assert json.loads(json.dumps(st.load("hook-gpu").meta))["path"] == "custom-storage"


# --- no action blocks ------------------------------------------------------------------------------

STALL = """\
import os, signal, sys, time
sys.path[:0] = [{repo!r}]
from criu_hooks import action_script
action_script.GRACE_S = {grace}

class Stall:
    '''A driver whose every call hangs: in Python (interruptible), or with SIGALRM blocked (as a call
    stuck in C: only the watchdog can end it).'''
    def __getattr__(self, name):
        def call(*a, **k):
            if {in_c}:
                signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
            time.sleep(3600)
        return call

action_script.main(driver=Stall())
"""


def _blocked_like_criu() -> None:
    """As an action script of a CRIU whose child keeps CRIU's restore mask: every signal but SIGCHLD
    blocked, and SIGTERM ignored for good measure."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGCHLD, signal.SIGKILL, signal.SIGSTOP})
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _run_stalled(tmp_path: Path, action: str, *, in_c: bool = False, grace: float = 20,
                 extra: dict | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp_path / "stalled-hook.py"
    script.write_text(STALL.format(repo=str(REPO), grace=grace, in_c=in_c))
    sleeper = subprocess.Popen(["sleep", "60"])
    env = {k: v for k, v in os.environ.items() if k not in ("GPUSNAP_OWN_CRIU_CALL", "CRIU_CONFIG_FILE")}
    env.update(CRTOOLS_SCRIPT_ACTION=action, CRTOOLS_INIT_PID=str(sleeper.pid), GPUSNAP_HOOK_TIMEOUT="1",
               GPUSNAP_HOOK_LOG=str(tmp_path / "log" / "hook.log"), GPUSNAP_HOOK_STATE=str(tmp_path / "state"),
               **(extra or {}))
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60,
                           preexec_fn=_blocked_like_criu)
    finally:
        sleeper.kill()
        sleeper.wait()
    return p, time.monotonic() - t0


@pytest.mark.parametrize("action,code", [("pre-dump", 1), ("post-resume", 1)])
def test_a_stalled_action_ends_at_its_deadline_with_one_line(tmp_path: Path, action: str, code: int) -> None:
    """A driver call that never returns, in a hook started with CRIU's restore signal mask (SIGTERM
    and SIGALRM blocked): the action ends at GPUSNAP_HOOK_TIMEOUT with one FAILED line and the status
    that lets CRIU go on (pre-dump: 1, CRIU aborts the dump; post-resume: CRIU ignores it)."""
    p, took = _run_stalled(tmp_path, action)
    assert p.returncode == code, p.stderr
    assert took < 15, f"the hook took {took:.1f} s past a 1 s deadline"
    line, = p.stderr.strip().splitlines()
    assert f"{action}: FAILED: did not finish in 1 s (GPUSNAP_HOOK_TIMEOUT)" in line, line
    assert "FAILED: did not finish" in (tmp_path / "log" / "hook.log").read_text()


def test_an_action_stuck_in_c_is_ended_by_the_watchdog(tmp_path: Path) -> None:
    """A call that Python cannot interrupt (SIGALRM blocked, as a driver call stuck in C): the
    watchdog thread ends the process GRACE_S after the deadline."""
    p, took = _run_stalled(tmp_path, "pre-dump", in_c=True, grace=2)
    assert p.returncode == 1 and took < 15, (p.returncode, took)
    assert "Timeout" in p.stderr and "Stall" not in p.stdout


def test_a_fifo_at_the_log_or_record_path_does_not_block(tmp_path: Path) -> None:
    """Files the hook opens are opened non-blocking: a FIFO planted where the record or the log is
    fails at once instead of waiting for a writer/reader."""
    from criu_hooks.action_script import DumpRecord
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (tmp_path / "log").mkdir(mode=0o700)
    os.mkfifo(tmp_path / "log" / "hook.log", 0o600)
    env_state = {"GPUSNAP_HOOK_STATE": str(state)}
    script = tmp_path / "unlock.py"
    script.write_text(f"import sys; sys.path[:0] = [{str(REPO)!r}]\n"
                      "from criu_hooks.action_script import main; main()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("GPUSNAP_OWN_CRIU_CALL", "CRTOOLS_IMAGE_DIR")}
    env.update(CRTOOLS_SCRIPT_ACTION="network-unlock", CRTOOLS_INIT_PID="1", GPUSNAP_HOOK_TIMEOUT="30",
               GPUSNAP_HOOK_LOG=str(tmp_path / "log" / "hook.log"), **env_state)
    # without CRTOOLS_IMAGE_DIR the CRIU run is the hook's parent: this test's process
    os.mkfifo(state / DumpRecord(os.getpid()).name, 0o600)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 20
    err = p.stderr
    assert p.returncode == 1 and "is not a regular file" in err, err
    assert "cannot write the log" in err
