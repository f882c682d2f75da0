"""CRIU integration against the real CRIU 4.x (scripts/setup.sh installs it): dump into the store,
restore from it, state verified from inside the restored processes; failures leave the tree running."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import REPO, Cli, chunk_files, small_tmpfs
from support.criu import Tree, healthy

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_criu")]


@pytest.fixture
def tree():
    t = Tree()
    yield t
    t.close()


def test_dump_restore_through_the_store(cli: Cli, tree: Tree, store_dir: Path) -> None:
    assert healthy(tree.report())
    rep = cli.json("criu", "dump", str(tree.pid), "t1")
    assert set(rep["pids"]) == {tree.pid, tree.child} and rep["cuda_pids"] == []
    tree.reap()
    assert not tree.alive(), "the tree must be gone after a dump without --leave-running"
    assert cli.json("store", "verify", "t1")["ok"]
    info = cli.json("store", "inspect", "t1")
    assert info["meta"]["kind"] == "criu" and any(s["name"].startswith("images/pages-") for s in info["streams"])
    assert info["meta"]["ingested_while_dumping"], "the page images are read while CRIU writes them"
    r = cli.json("criu", "restore", "t1")
    assert r["restored_pid"] == tree.pid
    after = tree.report()
    assert healthy(after), after
    assert after["pid"] == tree.pid


def test_leave_running_and_second_dump_dedups(cli: Cli) -> None:
    tree = Tree(mb=96)  # known data dominates; the interpreter's own heap churns between dumps
    try:
        _leave_running_and_dedup(cli, tree)
    finally:
        tree.close()


def _leave_running_and_dedup(cli: Cli, tree: Tree) -> None:
    first = cli.json("criu", "dump", "--leave-running", str(tree.pid), "a")
    assert tree.alive() and healthy(tree.report())
    second = cli.json("criu", "dump", "--leave-running", str(tree.pid), "b")
    assert tree.alive()
    assert second["new_bytes"] <= 0.15 * first["new_bytes"], (first, second)
    assert second["dedup_bytes"] > 0
    tree.kill()
    cli.json("criu", "restore", "b")
    assert healthy(tree.report())


def test_dump_criu_refuses_leaves_tree_running(cli: Cli, store_dir: Path) -> None:
    """An established TCP connection without --tcp-established: CRIU refuses; nothing changes."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    d = Path(tempfile.mkdtemp(prefix="gpusnap-criu-tcp-"))
    prog = ("import socket,time,os,sys;s=socket.create_connection(('127.0.0.1',%d));"
            "open(sys.argv[1]+'/ready','w').write(str(os.getpid()));time.sleep(600)" % port)
    p = subprocess.Popen([sys.executable, "-c", prog, str(d)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    conn, _ = srv.accept()
    try:
        while not (d / "ready").exists():
            time.sleep(0.02)
        r = cli.run("criu", "dump", str(p.pid), "tcp", check=False)
        assert r.returncode == 1 and "criu dump" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
        assert "TCP" in r.stderr or "tcp" in r.stderr
        assert p.poll() is None, "the process must still run"
        assert cli.json("store", "ls") == []
        assert not list((store_dir / "tmp").iterdir())
    finally:
        p.kill()
        p.wait()
        conn.close()
        srv.close()
        shutil.rmtree(d, ignore_errors=True)


def test_store_full_during_the_dump_brings_the_tree_back(tmp_path: Path) -> None:
    """The store (a 12 MiB tmpfs) fills up while CRIU is still dumping 64 MiB of random memory: no
    snapshot, one-line error, and the tree CRIU had killed is restored from staging and still healthy."""
    with small_tmpfs(tmp_path / "small", "12m") as mnt:
        _store_full_during_dump(mnt)


def _store_full_during_dump(mnt: Path) -> None:
    tree = Tree(mb=64, detached=True)
    try:
        small = Cli(mnt / "store")
        r = small.run("criu", "dump", str(tree.pid), "full", check=False)
        assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "space" in r.stderr.lower() or "full" in r.stderr.lower(), r.stderr
        assert tree.alive() and healthy(tree.report()), r.stderr
        assert small.json("store", "ls") == []
    finally:
        tree.close()


@pytest.mark.parametrize("damage", ["flip", "missing"])
def test_damaged_snapshot_refused_before_any_process_starts(cli: Cli, tree: Tree, store_dir: Path, damage: str) -> None:
    cli.json("criu", "dump", str(tree.pid), "d")
    tree.reap()
    victim = max(chunk_files(store_dir), key=lambda p: p.stat().st_size)
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[4096 + 100] ^= 0xFF
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    r = cli.run("criu", "restore", "d", check=False)
    assert r.returncode == 3 and "damaged" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not tree.alive(), "no process may start from a damaged snapshot"


def test_restore_refuses_when_pids_are_taken(cli: Cli, tree: Tree) -> None:
    cli.json("criu", "dump", "--leave-running", str(tree.pid), "busy")
    r = cli.run("criu", "restore", "busy", check=False)
    assert r.returncode == 1 and "in use" in r.stderr
    assert healthy(tree.report())


def test_criu_logs_kept_where_asked_and_never_through_a_link(cli: Cli, tree: Tree, tmp_path: Path) -> None:
    """GPUSNAP_CRIU_LOGS: a copy of each CRIU run's log (the images directory's goes away with it); a
    link in its place is not followed, and the dump goes on without the copy."""
    logs = tmp_path / "logs"
    env = {"GPUSNAP_CRIU_LOGS": str(logs)}
    json.loads(cli.run("criu", "dump", "--leave-running", str(tree.pid), "l1", "--json", env=env).stdout)
    kept = sorted(p.name for p in logs.iterdir())
    assert len(kept) == 1 and kept[0].startswith(f"dump-of-pid-{tree.pid}-"), kept
    assert "Dumping finished successfully" in (logs / kept[0]).read_text(errors="replace")
    assert (logs.stat().st_mode & 0o777) == 0o700 and ((logs / kept[0]).stat().st_mode & 0o777) == 0o600
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = tmp_path / "link"
    link.symlink_to(elsewhere)
    for through in (str(link), str(link) + "/", str(link / "sub")):  # the link itself, followed by a slash, a parent
        p = cli.run("criu", "dump", "--leave-running", str(tree.pid), "l2", "--json",
                    env={"GPUSNAP_CRIU_LOGS": through})
        assert json.loads(p.stdout)["pids"] and "CRIU's log not kept" in p.stderr, (through, p.stderr)
        assert list(elsewhere.iterdir()) == [], through
        cli.run("store", "rm", "l2")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # anyone may write in it: not where a log of the tree goes
    p = cli.run("criu", "dump", "--leave-running", str(tree.pid), "l3", "--json", env={"GPUSNAP_CRIU_LOGS": str(shared)})
    assert json.loads(p.stdout)["pids"] and "others may write in it" in p.stderr, p.stderr
    assert list(shared.iterdir()) == []
    assert healthy(tree.report())


def test_dump_of_missing_pid_and_bad_name(cli: Cli) -> None:
    r = cli.run("criu", "dump", "4194000", "x", check=False)
    assert r.returncode == 1 and "no process with pid 4194000" in r.stderr
    r = cli.run("criu", "dump", str(os.getpid()), "../x", check=False)
    assert r.returncode == 2 and "path separator" in r.stderr  # a bad argument


@pytest.mark.parametrize("action", ["network-lock", "network-unlock", "setup-namespaces", "post-setup-namespaces",
                                    "pre-restore", "post-restore", "pre-resume", "orphan-pts-master", "query-ext-files"])
def test_hook_ignores_actions_it_does_not_handle(action: str, tmp_path: Path) -> None:
    log = tmp_path / "log" / "criu-hook.log"
    env = dict(os.environ, CRTOOLS_SCRIPT_ACTION=action, CRTOOLS_INIT_PID=str(os.getpid()), CRTOOLS_IMAGE_DIR="/nonexistent",
               PYTHONPATH=str(REPO), GPUSNAP_HOOK_LOG=str(log), GPUSNAP_HOOK_STATE=str(tmp_path / "state"))
    env.pop("GPUSNAP_OWN_CRIU_CALL", None)
    p = subprocess.run([sys.executable, "-m", "criu_hooks.action_script"], env=env, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout == "", p.stderr
    assert p.stderr.startswith(f"gpusnap-criu-hook: {action}: nothing") and len(p.stderr.splitlines()) == 1
    assert len(log.read_text().splitlines()) == 1


def test_hook_as_criu_action_script_on_a_cpu_tree(tree: Tree, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CRIU runs the hook at every stage of a real dump; with no CUDA process it does nothing, and the dump succeeds."""
    from sandbox.criu.runner import Criu, DumpOptions
    monkeypatch.setenv("GPUSNAP_HOOK_LOG", str(tmp_path / "hook.log"))
    hook = tmp_path / "hook.sh"
    hook.write_text(f"#!/bin/sh\necho \"$CRTOOLS_SCRIPT_ACTION $CRTOOLS_INIT_PID\" >> {tmp_path}/actions\n"
                    f"PYTHONPATH={REPO} exec {sys.executable} -m criu_hooks.action_script\n")
    hook.chmod(0o755)
    images = tmp_path / "img"
    images.mkdir()
    Criu().dump(tree.pid, str(images), DumpOptions(leave_running=True, action_script=str(hook)))
    actions = (tmp_path / "actions").read_text().split("\n")
    assert any(a.startswith("pre-dump") for a in actions) and any(a.startswith("post-dump") for a in actions)
    assert healthy(tree.report())
