"""Workload hooks (--prepare, --resume, --hook-timeout) through the real CLI and real CRIU: a prepare step
that fails, times out or is killed leaves no snapshot and the workload resumed; the resume step runs after
a dump CRIU refused, after --leave-running, and (as the snapshot recorded it) after a plain restore;
`recover` runs it for a workload a SIGKILLed gpusnap left prepared; a resume record planted in the store
is never run; URLs off the loopback are refused before anything happens."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, REPO, Cli, pythonpath
from support.crafted import rewrite_manifest
from support.crash import wait_dead
from support.criu import Tree, healthy
from support.journal import paused as _paused, records
from support.servers import HttpConn, python_workload

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_root")]


def step(log: Path, word: str, fail: str = "") -> str:
    """A command step that appends WORD, the step and the snapshot (from its environment) to LOG, then FAIL."""
    return f"/bin/sh -c 'echo {word} $GPUSNAP_HOOK_STEP $GPUSNAP_SNAPSHOT $GPUSNAP_PID >> {log}{fail}'"


def proc_state(pid: int) -> str:
    """PID's state letter, "gone" if there is none (a killed process init has not reaped yet is "Z")."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def one_line(r: subprocess.CompletedProcess[str]) -> str:
    got = r.stderr.strip().splitlines()
    assert len(got) == 1, r.stderr
    return got[0]


@pytest.mark.parametrize("how", ["fails", "times-out", "killed"])
def test_prepare_that_fails_leaves_no_snapshot_and_the_workload_resumed(how: str, tmp_path: Path) -> None:
    store, log, pidfile = tmp_path / "store", tmp_path / "log", tmp_path / "prepare.pid"
    cli = Cli(store)
    prepare = {"fails": step(log, "p", "; exit 3"),
               "times-out": f"/bin/sh -c 'echo $$ > {pidfile}; echo p >> {log}; exec sleep 60'",
               "killed": f"/bin/sh -c 'echo p >> {log}; kill -9 $$'"}[how]
    tree = Tree(mb=4, detached=True)
    try:
        c0 = tree.report()["counter"]
        t0 = time.monotonic()
        r = cli.run("criu", "dump", str(tree.pid), "snap", "--prepare", prepare, "--resume", step(log, "r"),
                    "--hook-timeout", "2", check=False)
        assert r.returncode == 1, (r.returncode, r.stderr)
        line = one_line(r)
        assert line.startswith("gpusnap: the prepare step") and "no snapshot was taken; the workload was resumed" in line
        assert {"fails": "exited 3", "times-out": "did not finish within 2 s", "killed": "killed by signal 9"}[how] in line
        if how == "times-out":
            assert time.monotonic() - t0 < 30, "the deadline was not kept"
            sleeper = int(pidfile.read_text())
            assert not os.path.exists(f"/proc/{sleeper}"), "the timed-out step's process group was not killed"
        assert lines(log)[0].split()[0] == "p"
        assert lines(log)[-1] == f"r resume snap {tree.pid}", "the workload was not told to resume"
        assert cli.json("store", "ls") == [] and records(store) == []
        after = tree.report()
        assert healthy(after) and after["counter"] >= c0 and tree.running()
    finally:
        tree.close()


def test_resume_runs_after_a_dump_that_criu_refused(tmp_path: Path) -> None:
    """An established TCP connection without --tcp-established: CRIU refuses the dump, for real."""
    store, log = tmp_path / "store", tmp_path / "log"
    cli = Cli(store)
    w = python_workload("tcp_server.py", "127.0.0.1")
    c = None
    try:
        c = HttpConn("127.0.0.1", w.info["ports"]["127.0.0.1"])
        assert c.request()[0] == 200
        r = cli.run("criu", "dump", str(w.pid), "srv", "--prepare", step(log, "p"), "--resume", step(log, "r"),
                    check=False)
        assert r.returncode != 0
        assert "Connected TCP socket, consider using --tcp-established" in one_line(r)
        assert lines(log) == [f"p prepare srv {w.pid}", f"r resume srv {w.pid}"]
        assert c.request()[0] == 200, "the server runs on after the failed dump"
        assert cli.json("store", "ls") == [] and records(store) == []
    finally:
        if c is not None:
            c.close()
        w.close()


def test_leave_running_resumes_and_a_plain_restore_runs_the_recorded_resume(tmp_path: Path) -> None:
    store, log = tmp_path / "store", tmp_path / "log"
    cli = Cli(store)
    tree = Tree(mb=4, detached=True)
    try:
        d = cli.json("criu", "dump", "--leave-running", str(tree.pid), "live",
                     "--prepare", step(log, "p"), "--resume", step(log, "r"))
        assert [h["step"] for h in d["hooks"]] == ["prepare", "resume"]
        assert lines(log) == [f"p prepare live {tree.pid}", f"r resume live {tree.pid}"]
        assert healthy(tree.report())
        # a dump that ends the workload runs no resume step: the snapshot records it for the restore
        cli.json("criu", "dump", str(tree.pid), "gone", "--prepare", step(log, "p2"), "--resume", step(log, "r2"))
        wait_dead(tree)
        assert lines(log)[2:] == [f"p2 prepare gone {tree.pid}"]
        r = cli.json("criu", "restore", "gone")
        assert r["restored_pid"] == tree.pid and [h["step"] for h in r["hooks"]] == ["resume"]
        assert lines(log)[3:] == [f"r2 resume gone {tree.pid}"]
        assert healthy(tree.report()) and records(store) == []
        # --no-resume: none runs; --resume: that one instead of the recorded one
        tree.kill()
        wait_dead(tree)
        assert "hooks" not in cli.json("criu", "restore", "gone", "--no-resume")
        assert lines(log)[4:] == []
        tree.kill()
        wait_dead(tree)
        cli.json("criu", "restore", "gone", "--resume", step(log, "mine"))
        assert lines(log)[4:] == [f"mine resume gone {tree.pid}"]
    finally:
        tree.close()


@pytest.mark.parametrize("plant", ["bad-mac", "no-mac", "copied-from-another-snapshot"])
def test_a_planted_resume_record_is_refused(plant: str, tmp_path: Path) -> None:
    store, log = tmp_path / "store", tmp_path / "log"
    cli = Cli(store)
    tree = Tree(mb=4, detached=True)
    try:
        cli.json("criu", "dump", "--leave-running", str(tree.pid), "other", "--resume", step(log, "theirs"))
        cli.json("criu", "dump", str(tree.pid), "snap")
        wait_dead(tree)
        other = json.loads((store / "snapshots" / "other.json").read_text())["meta"]["resume"]
        evil = step(log, "planted")

        def change(body: dict) -> None:
            body["meta"]["resume"] = {"bad-mac": {"hook": evil, "mac": "0" * 64}, "no-mac": {"hook": evil},
                                      "copied-from-another-snapshot": other}[plant]
            if plant == "copied-from-another-snapshot":  # and the op it was signed for
                body["meta"]["op"] = json.loads((store / "snapshots" / "other.json").read_text())["meta"]["op"]
        rewrite_manifest(store / "snapshots" / "snap.json", change)
        before = lines(log)
        r = cli.run("criu", "restore", "snap", check=False)
        assert r.returncode == 1
        line = one_line(r)
        assert "records a resume step that gpusnap cannot verify" in line and "--resume" in line, line
        assert not tree.alive(), "nothing may be restored when the record is refused"
        assert lines(log) == before, "a planted step ran"
        # the user names the step (or none): the restore goes ahead
        cli.json("criu", "restore", "snap", "--resume", step(log, "mine"))
        assert lines(log) == [*before, f"mine resume snap {tree.pid}"] and healthy(tree.report())
    finally:
        tree.close()


@pytest.mark.parametrize("stage,leave", [("after-prepare", False), ("before-dump", False),
                                         ("before-commit", False), ("before-resume", True)])
def test_recover_resumes_a_workload_left_prepared_by_a_killed_gpusnap(stage: str, leave: bool, tmp_path: Path) -> None:
    """SIGKILL after the prepare step: before the dump, as it starts, with the tree stopped by CRIU (its
    undo resumes the tree first, then the resume step runs), after a --leave-running dump committed but
    before the resume step: `recover` tells the workload to resume, last."""
    store, log = tmp_path / "store", tmp_path / "log"
    cli = Cli(store)
    tree = Tree(mb=4, detached=True)
    try:
        c0 = tree.report()["counter"]
        args = ["criu", "dump", *(["--leave-running"] if leave else []), str(tree.pid), "snap",
                "--prepare", step(log, "p"), "--resume", step(log, "r")]
        p = _paused(store, args, stage, tmp_path)
        kinds = sorted(json.loads((store / "journal" / n).read_text())["kind"] for n in records(store))
        assert kinds == (["workload-prepared"] if stage in ("after-prepare", "before-resume")
                         else ["criu-dump", "workload-prepared"])
        if stage == "before-commit":
            assert set(tree.states().values()) == {"T"}, "CRIU left the tree stopped for the commit"
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        (tmp_path / f"pause-{stage}").unlink()
        assert lines(log) == [f"p prepare snap {tree.pid}"]
        assert cli.run("criu", "dump", str(tree.pid), "x", check=False).returncode == 5
        rec = cli.json("recover")
        assert rec["ok"], rec
        assert [o["kind"] for o in rec["operations"]][-1] == "workload-prepared", "the resume step runs last"
        assert any("ran the resume step" in a for a in rec["operations"][-1]["actions"]), rec
        assert lines(log) == [f"p prepare snap {tree.pid}", f"r resume snap {tree.pid}"]
        assert records(store) == []
        after = tree.report()
        assert healthy(after) and after["counter"] >= c0
        assert [s["name"] for s in cli.json("store", "ls")] == (["snap"] if leave else [])
    finally:
        tree.close()


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000/sleep?level=1", "http://0.0.0.0:8000/sleep",
                                 "http://example.invalid/prepare", "https://127.0.0.1/prepare",
                                 "http://user:pw@127.0.0.1:8000/sleep", "ftp://127.0.0.1/x",
                                 "http://[::ffff:10.0.0.1]:80/x"])
def test_a_hook_url_off_the_loopback_is_refused_before_anything(url: str, tmp_path: Path) -> None:
    store = tmp_path / "store"
    tree = Tree(mb=4, detached=True)
    try:
        for args in (["criu", "dump", str(tree.pid), "s", "--prepare", url],
                     ["criu", "dump", str(tree.pid), "s", "--resume", url],
                     ["gpu", "checkpoint", str(tree.pid), "s", "--prepare", url]):
            r = Cli(store).run(*args, check=False)
            assert r.returncode == 2, (args, r.returncode, r.stderr)
            line = one_line(r)
            assert "hook URL" in line and ("loopback" in line or "only http://" in line or "credentials" in line), line
        assert not store.exists(), "nothing may be made for a refused step"
        assert tree.running()
    finally:
        tree.close()


def test_sigterm_during_the_prepare_step_resumes_the_workload(tmp_path: Path) -> None:
    store, log, pidfile = tmp_path / "store", tmp_path / "log", tmp_path / "prepare.pid"
    tree = Tree(mb=4, detached=True)
    try:
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        prepare = f"/bin/sh -c 'echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; exec sleep 60'"
        p = subprocess.Popen([*GPUSNAP, "--store", str(store), "criu", "dump", str(tree.pid), "snap", "--prepare",
                              prepare, "--resume", step(log, "r")], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + 60
        while not pidfile.exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 128 + signal.SIGTERM and "SIGTERM" in err, (p.returncode, err)
        assert not os.path.exists(f"/proc/{int(pidfile.read_text())}"), "the step's process group was not killed"
        assert lines(log) == [f"r resume snap {tree.pid}"], "the workload was not told to resume"
        assert records(store) == [] and Cli(store).json("store", "ls") == []
        assert healthy(tree.report())
    finally:
        tree.close()


# -- gpu checkpoint / restore: the same steps around the GPU flow (the driver's stand-in; CI has no GPU) ----
@pytest.mark.parametrize("fail", [False, True])
def test_gpu_checkpoint_prepares_records_the_resume_and_gpu_restore_runs_it(fail: bool, tmp_path: Path,
                                                                           child: int) -> None:
    """Prepare before the GPU is locked; no resume while the processes stay checkpointed (the snapshot
    records it); `gpu restore` runs the recorded step once they run. A checkpoint the driver fails:
    the processes run on with their memory and the resume step ran."""
    from support.driver_standin import StandInDriver
    from support.custom_storage import FEATS, gpu_bytes
    from typing import cast
    from sandbox.gpu.driver import CudaDriver, ProcessState  # the stand-in, cast: FEATS given, probe() never runs
    from sandbox.gpu.snapshot import gpu_checkpoint, gpu_restore
    from sandbox.ops.hooks import HookError, WorkloadHooks
    from sandbox.ops.prepared import HookReport, prepared, restore_resume, resumed, tree_of
    from storage.gpu.device import HostDevice
    from storage.repo.store import SnapshotStore

    log = tmp_path / "log"
    d = StandInDriver()
    d.add(child, gpu_bytes(5, 2))
    before = bytes(d.procs[child].gpu)
    seen: list[str] = []
    real_lock = d.lock

    def lock(pid: int, timeout_ms: int = 0) -> None:  # what the workload was told when its GPU got locked
        seen.append(log.read_text() if log.exists() else "")
        real_lock(pid, timeout_ms)
    d.lock = lock  # type: ignore[method-assign]
    if fail:
        d.fail[(child, "lock")] = "CUDA_ERROR_NOT_SUPPORTED"
    st = SnapshotStore(str(tmp_path / "store"))
    wh = WorkloadHooks.parse(step(log, "p"), step(log, "r"), 10)
    ran = HookReport()
    try:
        with prepared(st.path, wh, "g", child, resume_after=False, report=ran):
            gpu_checkpoint(st, child, "g", driver=cast(CudaDriver, d), features=FEATS, device=HostDevice(), thp_mode=None,
                           pids=[child], resume=wh.resume)
    except Exception as e:  # noqa: BLE001
        assert fail and "CUDA_ERROR_NOT_SUPPORTED" in str(e), e
        assert d.get_state(child) == ProcessState.RUNNING and bytes(d.procs[child].gpu) == before
        assert lines(log) == [f"p prepare g {child}", f"r resume g {child}"] and st.names() == []
        return
    assert not fail
    assert seen == [f"p prepare g {child}\n"], "the prepare step must run before the GPU is locked"
    assert d.get_state(child) == ProcessState.CHECKPOINTED and lines(log) == [f"p prepare g {child}"]
    step_ = restore_resume(st, "g", WorkloadHooks(), no_resume=False)
    assert step_ is not None and step_.spec == wh.resume.spec  # type: ignore[union-attr]
    gpu_restore(st, "g", child, driver=cast(CudaDriver, d), features=FEATS, device=HostDevice(), thp_mode=None)
    resumed(st.path, step_, 10, "g", child, tree_of(child), ran)
    assert d.get_state(child) == ProcessState.RUNNING and bytes(d.procs[child].gpu) == before
    assert lines(log) == [f"p prepare g {child}", f"r resume g {child}"] and records(tmp_path / "store") == []
    # the same record under another store's key is not trusted
    other = SnapshotStore(str(tmp_path / "other"))
    with pytest.raises(HookError, match="cannot verify"):
        from sandbox.ops import hooks, journal
        hooks.recorded(journal.Journal(other.path).key, "g", st.load("g").meta)


def test_recover_never_runs_the_resume_step_of_a_planted_journal_record(tmp_path: Path) -> None:
    """A `workload-prepared` record written by whoever can write the store (no MAC, or one from another
    key): recover runs nothing it names, sets it aside, and says so."""
    import uuid
    store, log = tmp_path / "store", tmp_path / "log"
    cli = Cli(store)
    tree = Tree(mb=4, detached=True)
    try:
        cli.run("store", "init")
        journal = store / "journal"
        journal.mkdir(mode=0o700, exist_ok=True)
        start = int(Path(f"/proc/{tree.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        for mac in (None, "0" * 64):
            op = uuid.uuid4().hex
            rec = {"op": op, "kind": "workload-prepared", "stage": "started",
                   "owner": {"pid": os.getpid(), "start": 1},  # no such owner: an interrupted operation
                   "snapshot": "s", "procs": [{"pid": tree.pid, "start": start}],
                   "resume": {"hook": step(log, "planted"), "timeout_s": 5.0}, **({"mac": mac} if mac else {})}
            (journal / f"{op}.json").write_text(json.dumps(rec))
            r = cli.run("recover", "--json", check=False)
            assert r.returncode != 0
            out = json.loads(r.stdout)
            assert not out["ok"] and "not one gpusnap wrote" in out["operations"][0]["error"], out
            assert not log.exists(), "a planted resume step ran"
            assert (journal / f"rejected-{op}.json").exists() and records(store) == []
        assert tree.running()
    finally:
        tree.close()


def test_recover_ends_a_prepare_step_left_running_by_a_killed_gpusnap(tmp_path: Path) -> None:
    """gpusnap SIGKILLed while its prepare step runs: the step (its own session) outlives it; recover
    kills its process group once the step's deadline has passed, then runs the resume step."""
    store, log, pidfile = tmp_path / "store", tmp_path / "log", tmp_path / "prepare.pid"
    cli = Cli(store)
    tree = Tree(mb=4, detached=True)
    try:
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        prepare = f"/bin/sh -c 'echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; exec sleep 300'"
        p = subprocess.Popen([*GPUSNAP, "--store", str(store), "criu", "dump", str(tree.pid), "snap", "--prepare",
                              prepare, "--resume", step(log, "r"), "--hook-timeout", "3"], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                             start_new_session=True)
        deadline = time.monotonic() + 60
        # the step started and gpusnap recorded it (the step may write its pid before the record is written)
        while not (pidfile.exists() and any(json.loads((store / "journal" / n).read_text()).get("helpers")
                                            for n in records(store))):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        sleeper = int(pidfile.read_text())
        assert os.path.exists(f"/proc/{sleeper}"), "the step runs on without gpusnap"
        t0 = time.monotonic()
        rec = cli.json("recover")
        assert time.monotonic() - t0 < 60, "recover waited past the step's deadline"
        assert rec["ok"], rec
        acts = rec["operations"][0]["actions"]
        assert any("killed helper" in a for a in acts) and any("ran the resume step" in a for a in acts), acts
        assert proc_state(sleeper) in ("gone", "Z"), "the step's process group was not killed"
        assert lines(log) == [f"r resume snap {tree.pid}"] and records(store) == []
        assert healthy(tree.report())
    finally:
        tree.close()
