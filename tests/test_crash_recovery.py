"""gpusnap killed (SIGKILL) or stopped (SIGTERM) at every stage of a dump or checkpoint, with real CRIU
and real runsc: the workload runs on with its state intact, or the snapshot is committed and restores
it; nothing is left in staging, the store's tmp/ or /dev/shm. The stages are reached exactly through
the test hook GPUSNAP_TEST_PAUSE=STAGE:FILE (gpusnap writes FILE and waits until it is removed); the
stage inside runsc's checkpoint through a runsc wrapper that waits after the real checkpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, REPO, Cli, pythonpath
from support.entries import chunk_ids
from test_criu import Tree, healthy
from test_runsc import U, env, lines, start_counter, wait_lines  # noqa: F401 - env is a fixture

pytestmark = pytest.mark.root
STAGES = ["before-dump", "dumping", "ingest", "before-commit", "after-commit"]
SIGNALS = [signal.SIGKILL, signal.SIGTERM]


@pytest.fixture(scope="module", autouse=True)
def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU and runsc need root")


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
    left = [n.name for n in (store / "journal").iterdir() if n.name != "recover.lock"]
    assert left == [], f"journal records left behind: {left}"


def expect_exit(sig: int, stage: str, r: subprocess.CompletedProcess[str]) -> None:
    if sig == signal.SIGKILL:
        assert r.returncode == -signal.SIGKILL
    elif stage == "after-commit":  # a signal after the commit only hurries the end: the dump succeeded
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 128 + signal.SIGTERM and "SIGTERM" in r.stderr, (r.returncode, r.stderr)


def wait_dead(tree: Tree, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while tree.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not tree.alive()


@pytest.mark.parametrize("sig", SIGNALS, ids=["kill9", "term"])
@pytest.mark.parametrize("stage", STAGES)
def test_criu_dump_interrupted(stage: str, sig: int, tmp_path: Path) -> None:
    store = tmp_path / "store"
    cli = Cli(store)
    tree = Tree(mb=16, detached=True)
    try:
        c0 = tree.report()["counter"]
        p = Paused(store, ["criu", "dump", str(tree.pid), "snap"], stage, tmp_path)
        staging = p.record["staging"]
        assert p.record["kind"] == "criu-dump" and {x["pid"] for x in p.record["procs"]} == {tree.pid, tree.child}
        r = p.stop(sig)
        expect_exit(sig, stage, r)
        if sig == signal.SIGKILL:
            assert cli.run("criu", "dump", str(tree.pid), "other", check=False).returncode == 5, \
                "a state-changing command must refuse while an interrupted operation waits"
            rec = cli.json("recover")
            assert rec["ok"] and len(rec["operations"]) == 1, rec
            assert rec["operations"][0]["stage"] != "started" or stage == "before-dump"
        else:
            assert cli.json("recover")["operations"] == [], "gpusnap undid it itself"
        assert_nothing_left(store, staging)
        if stage == "after-commit":
            wait_dead(tree)  # killed only now that the snapshot is committed
            assert cli.json("store", "verify", "snap")["ok"]
            cli.json("criu", "restore", "snap")
        else:
            assert cli.json("store", "ls") == []
        after = tree.report()
        assert healthy(after) and after["pid"] == tree.pid, after
        assert after["counter"] >= c0, "the counter continues from its value"
    finally:
        tree.kill()


RUNSC_WRAPPER = """\
#!/bin/sh
# runsc as usual, except that `checkpoint` waits after the real checkpoint until {pause} is removed
for a in "$@"; do
  if [ "$a" = checkpoint ]; then
    {real} "$@"; rc=$?
    echo $$ > {pause}.tmp && mv {pause}.tmp {pause}
    while [ -e {pause} ]; do sleep 0.05; done
    exit $rc
  fi
done
exec {real} "$@"
"""


def _counting(out: Path) -> list[int]:
    ls = lines(out)
    nums = [int(l[0]) for l in ls]
    assert nums == list(range(nums[0], nums[0] + len(nums))), "the counter must continue without a gap or a restart"
    assert len({l[1] for l in ls}) == 1, "in-memory data changed"
    return nums


@pytest.mark.parametrize("sig", SIGNALS, ids=["kill9", "term"])
@pytest.mark.parametrize("stage", STAGES)
def test_runsc_checkpoint_interrupted(stage: str, sig: int, tmp_path: Path, env: dict, cli: Cli, store_dir: Path) -> None:
    import shutil
    cid = U(f"k{STAGES.index(stage)}{sig}")
    bundle, out = start_counter(cli, env, cid)
    wrapper_dir = None
    if stage == "dumping":
        wrapper_dir = tmp_path / "bin"
        wrapper_dir.mkdir()
        w = wrapper_dir / "runsc"
        w.write_text(RUNSC_WRAPPER.format(real=shutil.which("runsc"), pause=tmp_path / "pause-dumping"))
        w.chmod(0o755)
    p = Paused(store_dir, ["runsc", "checkpoint", cid, "snap", *env["args"], "--runsc-arg=--network=none"], stage,
               tmp_path, str(wrapper_dir) if wrapper_dir else None)
    staging = p.record["staging"]
    r = p.stop(sig)
    expect_exit(sig, stage, r)
    if sig == signal.SIGKILL:
        rec = cli.json("recover")
        assert rec["ok"] and len(rec["operations"]) == 1, rec
    else:
        assert cli.json("recover")["operations"] == []
    assert_nothing_left(store_dir, staging)
    if stage == "after-commit":  # committed: the sandbox stays stopped, as asked, and the snapshot restores it
        before = lines(out)
        time.sleep(0.5)
        assert lines(out) == before
        out2 = tmp_path / "restored.out"
        cid2 = U(f"r{STAGES.index(stage)}{sig}")
        cli.json("runsc", "restore", "snap", cid2, "--bundle", str(bundle), "--output", str(out2))
        env["made"].append((cid2, env["args"]))
        after = wait_lines(out2, 3)
        assert int(after[0][0]) == int(before[-1][0]) + 1 and after[0][1] == before[-1][1]
    else:
        assert cli.json("store", "ls") == []
        n = len(lines(out))
        wait_lines(out, n + 3)  # running again (restarted from the staged checkpoint where it had stopped)
        _counting(out)


def _processes_mentioning(text: str) -> list[str]:
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


def test_hanging_runsc_is_timed_out_and_leaves_nothing(tmp_path: Path, env: dict) -> None:
    """A runsc whose `run` starts the sandbox for real and then hangs: after the timeout the command's
    group, the container and its sandbox and gofer processes (re-parented to init) are all gone."""
    import shutil
    from sandbox.runsc.runner import Runsc, RunscError
    root = env["args"][0].split("=", 2)[2]
    wrapper = tmp_path / "runsc"
    wrapper.write_text(f"#!/bin/sh\n{shutil.which('runsc')} \"$@\"\n"  # `run` hangs after starting the sandbox
                       'case " $* " in *" run "*) while :; do sleep 1; done;; esac\n')
    wrapper.chmod(0o755)
    cid = U("hang")
    bundle = tmp_path / "bundle"
    env["build"](str(bundle), [sys.executable, "-c", "import time; time.sleep(600)"])
    r = Runsc([f"--root={root}", "--platform=ptrace", "--network=none"], binary=str(wrapper), timeout=8)
    with open(tmp_path / "out", "ab") as f, pytest.raises(RunscError, match="did not finish within 8 s"):
        r.run(cid, str(bundle), stdout=f, stderr=f)
    assert _processes_mentioning(str(wrapper)) == [], "the hung runsc command's group must be gone"
    assert _processes_mentioning(root) == [], "runsc-sandbox and runsc-gofer must be gone"
    assert Runsc([f"--root={root}"]).state(cid) is None, "the container must be deleted"
    assert [n for n in os.listdir(root) if cid in n] == [], "no state or lock file of the container may be left"


def test_thp_put_back_after_kill(tmp_path: Path) -> None:
    """thp() records the value before switching; a kill -9 inside the block leaves the record, and
    `gpusnap recover` puts the value back and removes it (a file stands in for the sysfs setting)."""
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    rundir = tmp_path / "run"
    ready = tmp_path / "ready"
    prog = textwrap.dedent(f"""
        import os, time
        from sandbox.host.hugepages import thp
        with thp("always", path={str(setting)!r}, record_dir={str(rundir)!r}):
            open({str(ready)!r}, "w").close()
            time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", prog], env={**os.environ, "PYTHONPATH": pythonpath()})
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.02)
    assert setting.read_text() == "always"
    assert len(list(rundir.iterdir())) == 1
    p.kill()
    p.wait()
    cli = Cli(tmp_path / "store")
    cli.run("store", "init")  # makes the store
    rep = json.loads(cli.run("recover", "--json", env={"GPUSNAP_RUN_DIR": str(rundir)}).stdout)
    assert rep["thp_put_back"] == [{"path": str(setting), "value": "madvise"}]
    assert setting.read_text() == "madvise" and list(rundir.iterdir()) == []


def test_thp_record_removed_after_a_normal_block(tmp_path: Path) -> None:
    from sandbox.host.hugepages import put_back, thp
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    with thp("always", path=str(setting), record_dir=str(tmp_path / "run")):
        assert setting.read_text() == "always"
        assert put_back(str(tmp_path / "run")) == [], "a live owner's record is not touched"
    assert setting.read_text() == "madvise" and list((tmp_path / "run").iterdir()) == []


GPU_DUMP = """
import sys
sys.path.insert(0, {tests!r})
from support.driver_standin import SharedStandIn
from sandbox.criu.snapshot import criu_dump
from sandbox.gpu.driver import Features
from storage.store import SnapshotStore
criu_dump(SnapshotStore({store!r}), {pid}, "g", gpu_driver=SharedStandIn({state!r}),
          features=Features(checkpoint_api=True, custom_storage=False))
"""


@pytest.mark.parametrize("stage", ["before-dump", "ingest", "before-commit"])
def test_gpu_dump_killed_then_recovered(stage: str, tmp_path: Path) -> None:
    """The driver-stand-in variant: the tree's two processes are CUDA processes (a file-backed stand-in,
    host-staged path); gpusnap is killed -9 with them CHECKPOINTED (and the tree stopped by CRIU):
    recovery resumes the tree and restores and unlocks their GPU memory, byte-exact."""
    import random
    from support.driver_standin import SharedStandIn
    from sandbox.gpu.driver import ProcessState
    from sandbox.ops.recover import recover
    from storage.store import SnapshotStore
    tree = Tree(mb=16, detached=True)
    try:
        state = str(tmp_path / "driver.pkl")
        before = {pid: random.Random(pid).randbytes(64 << 10) for pid in (tree.pid, tree.child)}
        SharedStandIn.create(state, before)
        store = tmp_path / "store"
        pause = tmp_path / "pause"
        prog = GPU_DUMP.format(tests=str(REPO / "tests"), store=str(store), pid=tree.pid, state=state)
        env = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_TEST_PAUSE": f"{stage}:{pause}",
               "GPUSNAP_RUN_DIR": str(tmp_path / "run")}
        p = subprocess.Popen([sys.executable, "-c", prog], env=env, start_new_session=True)
        deadline = time.monotonic() + 120
        while not pause.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the dump did not reach the pause"
            time.sleep(0.02)
        assert {SharedStandIn(state).get_state(x) for x in before} == {ProcessState.CHECKPOINTED}
        staging = json.loads(next((store / "journal").glob("*.json")).read_text())["staging"]
        p.kill()
        p.wait()
        pause.unlink()
        rep = recover(SnapshotStore(str(store), create=False), gpu_driver=lambda: SharedStandIn(state),
                      thp_record_dir=str(tmp_path / "run"))
        assert rep.ok, rep.as_dict()
        d = SharedStandIn(state)
        assert all(d.get_state(x) == ProcessState.RUNNING for x in before)
        assert {x: bytes(d.procs[x].gpu) for x in before} == before
        assert_nothing_left(store, staging)
        assert healthy(tree.report())
    finally:
        tree.kill()


def test_criu_without_privilege_says_so_and_keeps_its_log(tmp_path: Path) -> None:
    """CRIU run without root or CAP_CHECKPOINT_RESTORE (setpriv to nobody) exits before writing its log:
    the error says what is missing, the tree runs on, and the log it points at exists and holds CRIU's words."""
    import re
    import shutil
    from sandbox.criu.runner import Criu, CriuError, find_criu
    from sandbox.criu.snapshot import criu_dump
    from storage.store import SnapshotStore
    if not shutil.which("setpriv"):
        pytest.skip("setpriv (util-linux) is needed to drop privileges")
    wrapper = tmp_path / "criu"
    wrapper.write_text(f"#!/bin/sh\nexec setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all "
                       f"{find_criu()} \"$@\"\n")
    wrapper.chmod(0o755)
    tree = Tree(mb=4, detached=True)
    try:
        with pytest.raises(CriuError) as ei:
            criu_dump(SnapshotStore(str(tmp_path / "store")), tree.pid, "np", criu=Criu(str(wrapper)))
        msg = str(ei.value)
        assert "needs root or the CAP_CHECKPOINT_RESTORE capability" in msg, msg
        log = re.search(r"\(log: (\S+)\)$", msg).group(1)
        assert os.path.exists(log) and "CAP_CHECKPOINT_RESTORE" in Path(log).read_text()
        assert healthy(tree.report())
    finally:
        tree.kill()


def test_criu_error_names_the_cause_not_its_consequence(tmp_path: Path) -> None:
    """CRIU's log when it may not seize a task: the warning that says why comes before the first Error line
    (lines as CRIU 4.1.1 wrote them for `dump -t 1` here)."""
    from sandbox.criu.runner import _strip_prefix, explain
    log = tmp_path / "dump.log"
    log.write_text("(00.108052) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: Operation not permitted\n"
                   "(00.108771) Warn  (compel/src/lib/infect.c:133): Unable to interrupt task: 1 (Operation not permitted)\n"
                   "(00.108796) Error (compel/src/lib/infect.c:418): Unable to detach from 1: No such process\n"
                   "(00.108804) Error (criu/cr-dump.c:2111): Dumping FAILED.\n")
    assert _strip_prefix(explain(str(log))[0]) == "Unable to interrupt task: 1 (Operation not permitted)"


@pytest.mark.parametrize("stage", ["before-restore", "after-restore"])
def test_criu_restore_killed(stage: str, tmp_path: Path) -> None:
    """kill -9 of `criu restore` before CRIU runs (nothing started; the snapshot restores afterwards)
    or after it (the restored tree runs on); recover removes the materialized images either way."""
    store = tmp_path / "store"
    cli = Cli(store)
    tree = Tree(mb=8, detached=True)
    try:
        cli.json("criu", "dump", str(tree.pid), "r")
        wait_dead(tree)
        p = Paused(store, ["criu", "restore", "r"], stage, tmp_path)
        staging = p.record["staging"]
        assert p.stop(signal.SIGKILL).returncode == -signal.SIGKILL
        assert cli.run("criu", "restore", "r", check=False).returncode == 5
        rec = cli.json("recover")
        assert rec["ok"] and rec["operations"][0]["kind"] == "criu-restore", rec
        assert_nothing_left(store, staging)
        if stage == "before-restore":
            assert not tree.alive(), "no process may have started"
            cli.json("criu", "restore", "r")
        assert healthy(tree.report())
    finally:
        tree.kill()


@pytest.mark.parametrize("stage", ["before-restore", "after-restore"])
def test_runsc_restore_killed(stage: str, tmp_path: Path, env: dict, cli: Cli, store_dir: Path) -> None:
    """kill -9 of `runsc restore` before runsc runs (no sandbox; a new restore works) or after it (the
    restored sandbox runs on, counting from the checkpoint); recover removes the materialized images."""
    cid = U(f"rk{stage[0]}")
    bundle, out = start_counter(cli, env, cid)
    cli.json("runsc", "checkpoint", cid, "s", *env["args"], "--runsc-arg=--network=none")
    last = int(lines(out)[-1][0])
    cid2 = U(f"rr{stage[0]}")
    out2 = tmp_path / "restored.out"
    env["made"].append((cid2, env["args"]))
    p = Paused(store_dir, ["runsc", "restore", "s", cid2, "--bundle", str(bundle), "--output", str(out2)], stage, tmp_path)
    staging = p.record["staging"]
    assert p.stop(signal.SIGKILL).returncode == -signal.SIGKILL
    rec = cli.json("recover")
    assert rec["ok"] and rec["operations"][0]["kind"] == "runsc-restore", rec
    assert_nothing_left(store_dir, staging)
    if stage == "before-restore":
        assert not out2.exists() or lines(out2) == [], "no sandbox may have started"
        cli.json("runsc", "restore", "s", cid2, "--bundle", str(bundle), "--output", str(out2))
    after = wait_lines(out2, 3)
    assert int(after[0][0]) == last + 1


def test_recover_leaves_a_live_operation_alone(tmp_path: Path) -> None:
    """`gpusnap recover` while a dump is in flight (its gpusnap alive, paused before the commit): nothing
    is touched; the dump then completes normally."""
    store = tmp_path / "store"
    cli = Cli(store)
    tree = Tree(mb=8, detached=True)
    try:
        p = Paused(store, ["criu", "dump", "--leave-running", str(tree.pid), "live"], "before-commit", tmp_path)
        assert cli.json("recover")["operations"] == []
        assert len(list((store / "journal").glob("*.json"))) == 1
        p.file.unlink()
        out, err = p.proc.communicate(timeout=120)
        assert p.proc.returncode == 0, err
        assert cli.json("store", "verify", "live")["ok"] and healthy(tree.report())
    finally:
        tree.kill()


def test_a_reused_pid_is_never_signalled() -> None:
    """Processes are named by pid and start time: a record's pid now held by another process is left alone."""
    from sandbox.ops.journal import Proc
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = Proc.of(p.pid)
        assert me is not None and me.alive()
        assert not Proc(p.pid, me.start + 1).signal(signal.SIGKILL)
        time.sleep(0.2)
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT], ids=["hup", "int"])
def test_criu_dump_hup_and_int_run_the_same_undo(sig: int, tmp_path: Path) -> None:
    """SIGHUP (terminal closed) and SIGINT (Ctrl-C) with CRIU's images complete and the tree stopped:
    gpusnap undoes the dump itself, as for SIGTERM."""
    store = tmp_path / "store"
    cli = Cli(store)
    tree = Tree(mb=8, detached=True)
    try:
        p = Paused(store, ["criu", "dump", str(tree.pid), "s"], "ingest", tmp_path)
        r = p.stop(sig)
        assert r.returncode == 128 + sig and signal.Signals(sig).name in r.stderr, (r.returncode, r.stderr)
        assert_nothing_left(store, p.record["staging"])
        assert cli.json("store", "ls") == [] and healthy(tree.report())
    finally:
        tree.kill()


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["before-dump", "ingest"])
def test_real_gpu_dump_killed_then_recovered(stage: str, tmp_path: Path) -> None:
    """On a GPU machine: a real CUDA process (scripts/workloads/gpu_workload.py) is locked and checkpointed by the
    driver, gpusnap is killed -9 (before CRIU, or with CRIU done and the process stopped); `gpusnap
    recover` resumes it and restores and unlocks its GPU memory, verified by the process itself."""
    from scripts.workloads.workload_control import Workload
    store = tmp_path / "store"
    cli = Cli(store)
    with Workload(float(os.environ.get("GPUSNAP_TEST_GB", "1")), seed=5, detached=True) as w:
        p = Paused(store, ["criu", "dump", str(w.pid), "g"], stage, tmp_path)
        assert p.record["cuda_pids"] == [w.pid] and p.record["stage"] == ("gpu-frozen" if stage == "before-dump" else "dumped")
        assert p.stop(signal.SIGKILL).returncode == -signal.SIGKILL
        rec = cli.json("recover")
        assert rec["ok"], rec
        assert any("GPU state resumed" in a for a in rec["operations"][0]["actions"]), rec
        assert_nothing_left(store, p.record["staging"])
        assert w.verify(), "the GPU memory must be intact after recovery"
        assert cli.json("store", "ls") == []


def test_recover_ends_a_helper_that_does_not_finish(tmp_path: Path) -> None:
    """gpusnap killed -9 while CRIU is inside the dump (held at post-dump by the test hook, which is
    never released): `recover --wait 2` kills CRIU's process group, resumes the tree, removes staging."""
    store = tmp_path / "store"
    cli = Cli(store)
    tree = Tree(mb=8, detached=True)
    try:
        p = Paused(store, ["criu", "dump", str(tree.pid), "h"], "dumping", tmp_path)
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait()
        rec = cli.json("recover", "--wait", "2")
        assert rec["ok"] and any("killed helper" in a for a in rec["operations"][0]["actions"]), rec
        assert _processes_mentioning(p.record["staging"]) == []
        assert_nothing_left(store, p.record["staging"])
        assert healthy(tree.report())
    finally:
        tree.kill()


# ---- `gpusnap gpu checkpoint` through custom storage, killed: recovery from the journal's chunk references

GPU_CHECKPOINT_CLI = """
import functools, sys
sys.path.insert(0, {tests!r})
from support.driver_standin import SharedStandIn
from cli import gpu_cmd, main
from sandbox.gpu.driver import Features
from storage.device import HostDevice
# the real `gpusnap gpu checkpoint` command, with the driver stand-in (custom storage offered) and the
# engine on host memory in place of the CUDA driver and GPU 0
gpu_cmd.gpu_checkpoint = functools.partial(gpu_cmd.gpu_checkpoint, driver=SharedStandIn({state!r}),
                                           features=Features(checkpoint_api=True, custom_storage={custom}),
                                           device=HostDevice())
main(["--store", {store!r}, "gpu", "checkpoint", "{pid}", "g", "--json"], prog_name="gpusnap")
"""


class GpuWorkload:
    """Two real processes (a parent and its child) the file-backed driver stand-in holds as CUDA
    processes with known GPU memory."""

    def __init__(self, tmp: Path) -> None:
        import random
        from support.driver_standin import SharedStandIn
        self.proc = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                                      "subprocess.Popen(['sleep', '600']); time.sleep(600)"], start_new_session=True)
        deadline = time.monotonic() + 10
        while not (kids := Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        self.pids = [self.proc.pid, int(kids[0])]
        self.state = str(tmp / "driver.pkl")
        # a random part (stored as a chunk file) and a zero part per process
        self.before = {p: random.Random(p).randbytes(3 << 20) + bytes(1 << 20) for p in self.pids}
        SharedStandIn.create(self.state, self.before)

    def driver(self):  # noqa: ANN201 - tests' SharedStandIn
        from support.driver_standin import SharedStandIn
        return SharedStandIn(self.state)

    def states(self) -> dict[int, str]:
        d = self.driver().load()
        return {p: d.procs[p].state.name for p in self.pids}

    def memory(self) -> dict[int, bytes]:
        d = self.driver().load()
        return {p: bytes(d.procs[p].gpu) for p in self.pids}

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _chunk_files(store: Path) -> set[str]:
    """The chunks stored durably (indexed pack entries, chunk files), and the packs not yet indexed."""
    index = {p.name for p in (store / "index").iterdir()} if (store / "index").is_dir() else set()
    unindexed = {p.name for p in (store / "packs").iterdir() if p.name not in index} if (store / "packs").is_dir() else set()
    return chunk_ids(store) | unindexed


def _logged_chunks(store: Path) -> set[str]:
    """The chunk ids the one reference log in the journal names."""
    (log,) = (store / "journal").glob("*.refs")
    return {json.loads(line.split(" ", 1)[1])["ref"][0] for line in log.read_text().splitlines()
            if '"k":"chunk"' in line} - {None}


def _gpu_checkpoint_paused(store: Path, w: GpuWorkload, stage: str, tmp: Path,
                           custom: bool = True) -> tuple[subprocess.Popen, Path]:
    pause = tmp / f"pause-{stage}"
    prog = GPU_CHECKPOINT_CLI.format(tests=str(REPO / "tests"), store=str(store), pid=w.pids[0], state=w.state,
                                     custom=custom)
    # a THP switch (host-staged path) is recorded where _recover puts it back
    env = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_TEST_PAUSE": f"{stage}:{pause}",
           "GPUSNAP_RUN_DIR": str(tmp / "run")}
    p = subprocess.Popen([sys.executable, "-c", prog], env=env, cwd=REPO, start_new_session=True, text=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not pause.exists():
        if p.poll() is not None:
            raise AssertionError(f"gpusnap ended before {stage}: {p.communicate()}")
        assert time.monotonic() < deadline, f"gpusnap never reached {stage}"
        time.sleep(0.02)
    return p, pause


def _recover(store: Path, w: GpuWorkload):  # noqa: ANN202 - sandbox.ops.recover.RecoverReport
    from sandbox.ops.recover import recover
    from storage.device import HostDevice
    from storage.store import SnapshotStore
    return recover(SnapshotStore(str(store), create=False), gpu_driver=w.driver, gpu_device=HostDevice,
                   thp_record_dir=str(store.parent / "run"))


def _gc(store: Path):  # noqa: ANN202 - storage.gc.GcReport
    from storage.gc import collect
    from storage.store import SnapshotStore
    return collect(SnapshotStore(str(store), create=False))


@pytest.mark.parametrize("sig", SIGNALS, ids=["kill9", "term"])
@pytest.mark.parametrize("stage", ["gpu-stream", "before-commit"])
def test_custom_storage_gpu_checkpoint_interrupted(stage: str, sig: int, tmp_path: Path) -> None:
    """`gpusnap gpu checkpoint` on the custom-storage path, stopped (a) after the driver checkpointed the
    first process and its memory was streamed, the second not yet (gpu-stream), (b) with every GPU
    stream written, before the commit. kill -9: the journal's reference log names the chunks, gc
    between the kill and recover keeps them, and `recover` feeds them back through the custom-storage
    restore; SIGTERM: gpusnap gives the memory back itself. Either way both processes are RUNNING with
    their GPU memory byte-identical, nothing is left in tmp/ or journal/, and gc then reclaims the
    orphaned chunks."""
    store = tmp_path / "store"
    cli = Cli(store)
    w = GpuWorkload(tmp_path)
    try:
        p, pause = _gpu_checkpoint_paused(store, w, stage, tmp_path)
        rec = json.loads(next((store / "journal").glob("*.json")).read_text())
        assert rec["kind"] == "gpu-checkpoint" and rec["gpu_path"] == "custom-storage" and rec["stage"] == "gpu-frozen"
        assert rec["cuda_pids"] == w.pids
        want = ({w.pids[0]: "CHECKPOINTED", w.pids[1]: "LOCKED"} if stage == "gpu-stream"
                else {x: "CHECKPOINTED" for x in w.pids})
        assert w.states() == want, "the driver released the memory of every CHECKPOINTED process"
        os.kill(p.pid, sig)
        if sig == signal.SIGKILL:
            p.wait()
        time.sleep(0.2)
        pause.unlink()
        out, err = p.communicate(timeout=120)
        if sig == signal.SIGKILL:
            assert p.returncode == -signal.SIGKILL
            named = _logged_chunks(store)
            assert named and named <= _chunk_files(store), "the log names only durable chunk files"
            assert cli.run("store", "gc", check=False).returncode == 5, "gc refuses until recover has run"
            g = _gc(store)  # and gc itself keeps what the journal names, whoever calls it
            assert g.chunks_removed == 0 and named <= _chunk_files(store)
            assert cli.run("gpu", "restore", "g", str(w.pids[0]), check=False).returncode == 5
            rep = _recover(store, w)
            assert rep.ok, rep.as_dict()
            (op,) = rep.operations
            assert op.kind == "gpu-checkpoint" and any("restored through custom storage" in a for a in op.actions), op
        else:
            assert p.returncode == 128 + signal.SIGTERM and "SIGTERM" in err, (p.returncode, err)
            assert _recover(store, w).operations == [], "gpusnap undid it itself"
        assert w.states() == {x: "RUNNING" for x in w.pids}
        assert w.memory() == w.before, "GPU memory must come back byte-identical"
        assert list((store / "tmp").iterdir()) == []
        assert [n.name for n in (store / "journal").iterdir()] == ["recover.lock"]
        assert cli.json("store", "ls") == []
        left = _chunk_files(store)
        assert left, "the killed checkpoint's chunks are still there before gc"
        g = _gc(store)
        assert g.chunks_removed + g.packs_removed > 0 and _chunk_files(store) == set(), "gc reclaims the orphaned chunks"
    finally:
        w.close()


def test_host_staged_gpu_checkpoint_killed_before_commit(tmp_path: Path) -> None:
    """The same kill on the host-staged path (the driver's copy stays inside each process): recover
    restores and unlocks both through the driver, byte-identical; no reference log was kept."""
    store = tmp_path / "store"
    w = GpuWorkload(tmp_path)
    try:
        p, pause = _gpu_checkpoint_paused(store, w, "before-commit", tmp_path, custom=False)
        assert w.states() == {x: "CHECKPOINTED" for x in w.pids}
        p.kill()
        p.wait()
        pause.unlink()
        p.communicate()
        assert list((store / "journal").glob("*.refs")) == []
        rep = _recover(store, w)
        assert rep.ok and "GPU state resumed" in rep.operations[0].actions[0], rep.as_dict()
        assert w.states() == {x: "RUNNING" for x in w.pids} and w.memory() == w.before
        assert [n.name for n in (store / "journal").iterdir()] == ["recover.lock"]
        assert list((store / "tmp").iterdir()) == []
    finally:
        w.close()


def test_custom_storage_gpu_checkpoint_killed_mid_region_says_what_is_lost(tmp_path: Path) -> None:
    """kill -9 while the first process's region streams (the driver holds it CHECKPOINTING, its memory
    mapped into the dead gpusnap): recover unlocks the second process, says the first one's memory is
    lost and the state it stays in, clears the record, and gc then reclaims the partial chunks."""
    store = tmp_path / "store"
    w = GpuWorkload(tmp_path)
    try:
        p, pause = _gpu_checkpoint_paused(store, w, "gpu-chunk", tmp_path)
        assert w.states() == {w.pids[0]: "CHECKPOINTING", w.pids[1]: "LOCKED"}
        p.kill()
        p.wait()
        pause.unlink()
        p.communicate()
        rep = _recover(store, w)
        (op,) = rep.operations
        assert not rep.ok and op.error is None, op
        assert len(op.lost) == 1 and f"pid {w.pids[0]}" in op.lost[0] and "CHECKPOINTING" in op.lost[0], op.lost
        assert w.states() == {w.pids[0]: "CHECKPOINTING", w.pids[1]: "RUNNING"}
        assert w.memory()[w.pids[1]] == w.before[w.pids[1]]
        assert [n.name for n in (store / "journal").iterdir()] == ["recover.lock"]
        assert list((store / "tmp").iterdir()) == []
        assert _chunk_files(store), "the partial region's chunk was stored"
        _gc(store)
        assert _chunk_files(store) == set()
    finally:
        w.close()


def test_custom_storage_torn_reference_log_is_known_incomplete(tmp_path: Path) -> None:
    """A log whose tail was torn (the second process's last lines cut in the middle, as a crash of the
    disk could leave it): recover restores the first process from its complete list and says exactly
    which region of the second is incomplete; it stays CHECKPOINTED."""
    store = tmp_path / "store"
    w = GpuWorkload(tmp_path)
    try:
        p, pause = _gpu_checkpoint_paused(store, w, "before-commit", tmp_path)
        p.kill()
        p.wait()
        pause.unlink()
        p.communicate()
        log = next((store / "journal").glob("*.refs"))
        data = log.read_bytes()
        second = data.index(f'"stream":"gpu/{w.pids[1]}/0"'.encode())
        cut = data.index(b"\n", data.index(b'"k":"chunk"', second)) - 5   # inside the second region's chunk line
        log.write_bytes(data[:cut])
        rep = _recover(store, w)
        (op,) = rep.operations
        assert op.error is None and len(op.lost) == 1, op
        assert f"pid {w.pids[1]}" in op.lost[0] and f"gpu/{w.pids[1]}/0: 0 of 1 chunks recorded" in op.lost[0], op.lost
        assert "CHECKPOINTED" in op.lost[0]
        assert w.states() == {w.pids[0]: "RUNNING", w.pids[1]: "CHECKPOINTED"}
        assert w.memory()[w.pids[0]] == w.before[w.pids[0]]
        assert [n.name for n in (store / "journal").iterdir()] == ["recover.lock"]
    finally:
        w.close()


CUSTOM_DUMP = """
import sys
sys.path.insert(0, {tests!r})
from support.driver_standin import SharedStandIn
from sandbox.criu.snapshot import criu_dump
from sandbox.gpu.driver import Features
from storage.device import HostDevice
from storage.store import SnapshotStore
criu_dump(SnapshotStore({store!r}), {pid}, "g", gpu_driver=SharedStandIn({state!r}),
          features=Features(checkpoint_api=True, custom_storage=True), device=HostDevice())
"""


@pytest.mark.parametrize("stage", ["before-dump", "before-commit"])
def test_custom_storage_criu_dump_killed_then_recovered(stage: str, tmp_path: Path) -> None:
    """`criu dump` of a tree whose two processes are CUDA processes on the custom-storage path (the
    file-backed stand-in, the engine on host memory), killed -9 with their GPU memory streamed into the
    uncommitted snapshot and released by the driver (before CRIU, or with CRIU done and the tree
    stopped): recover resumes the tree and feeds the memory back from the journal's chunk references."""
    import random
    from support.driver_standin import SharedStandIn
    store = tmp_path / "store"
    tree = Tree(mb=16, detached=True)
    try:
        state = str(tmp_path / "driver.pkl")
        before = {pid: random.Random(pid).randbytes(2 << 20) for pid in (tree.pid, tree.child)}
        SharedStandIn.create(state, before)
        pause = tmp_path / "pause"
        prog = CUSTOM_DUMP.format(tests=str(REPO / "tests"), store=str(store), pid=tree.pid, state=state)
        env = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_TEST_PAUSE": f"{stage}:{pause}"}
        p = subprocess.Popen([sys.executable, "-c", prog], env=env, start_new_session=True)
        deadline = time.monotonic() + 120
        while not pause.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the dump did not reach the pause"
            time.sleep(0.02)
        d = SharedStandIn(state).load()
        assert {d.procs[x].state.name for x in before} == {"CHECKPOINTED"} and not any(d.procs[x].gpu for x in before)
        staging = json.loads(next((store / "journal").glob("*.json")).read_text())["staging"]
        p.kill()
        p.wait()
        pause.unlink()
        named = _logged_chunks(store)
        _gc(store)  # may take CRIU's page chunks (the tree itself is still there), never the GPU streams'
        assert named and named <= _chunk_files(store)
        from sandbox.ops.recover import recover
        from storage.device import HostDevice
        from storage.store import SnapshotStore
        rep = recover(SnapshotStore(str(store), create=False), gpu_driver=lambda: SharedStandIn(state),
                      gpu_device=HostDevice, thp_record_dir=str(tmp_path / "run"))
        assert rep.ok, rep.as_dict()
        assert any("restored through custom storage" in a for a in rep.operations[0].actions), rep.as_dict()
        d = SharedStandIn(state).load()
        assert {d.procs[x].state.name for x in before} == {"RUNNING"}
        assert {x: bytes(d.procs[x].gpu) for x in before} == before
        assert_nothing_left(store, staging)
        assert healthy(tree.report())
        _gc(store)
        assert _chunk_files(store) == set()
    finally:
        tree.kill()
