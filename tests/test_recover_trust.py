"""`gpusnap recover` against forged journal records, and a restore killed during the split fill, through
the real CLI with real CRIU: recover signals only processes it can prove gpusnap started (a record
with a valid MAC under the journal's key, helpers recorded as they started, a committed snapshot that
names this very operation), and a tree a restore left stopped half-filled is killed, so that the
retried restore succeeds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import Cli
from support.criu import Tree, _state, healthy, pids_with
from support.crash import Paused, assert_nothing_left, wait_dead

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_root")]
SPLIT = {"GPUSNAP_CRIU_IMAGES": "stream", "GPUSNAP_CRIU_SPLIT_MIN": str(4 << 20),
         "GPUSNAP_CRIU_SPLIT_SHARED_MIN": str(4 << 20)}


def _start(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _victim(marker: str) -> subprocess.Popen[bytes]:
    """An unrelated process (not gpusnap's) whose command line contains MARKER."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", marker], start_new_session=True)


def _forge(store: Path, **fields: object) -> Path:
    """A journal record written by hand (no MAC: not gpusnap's), its owner a dead process."""
    (store / "journal").mkdir(mode=0o700, parents=True, exist_ok=True)
    rec: dict[str, object] = {"op": uuid.uuid4().hex, "kind": "criu-dump", "stage": "dumping", "owner": {"pid": 1, "start": 1},
           "snapshot": "forged", "staging": None, "procs": [], "cuda_pids": [], "gpu_path": None,
           "leave_running": False, "runsc": None, "started": time.time(), "helpers": []}
    rec.update(fields)
    path = store / "journal" / f"{rec['op']}.json"
    path.write_text(json.dumps(rec))
    return path


def _alive_and_running(p: subprocess.Popen[bytes]) -> bool:
    return p.poll() is None and _state(p.pid) in ("S", "R")


def test_a_forged_staging_path_kills_no_process_that_mentions_it(tmp_path: Path) -> None:
    """A record whose `staging` is an absolute path that an unrelated process's command line contains:
    recover signals nothing, says the record is not gpusnap's, and sets it aside (nothing blocks)."""
    store = tmp_path / "store"
    cli = Cli(store)
    cli.json("store", "init")
    marker = f"/tmp/gpusnap-op-{uuid.uuid4().hex}"
    victim = _victim(marker)
    try:
        forged = _forge(store, staging=marker)
        r = cli.run("recover", "--json", "--wait", "1", check=False)
        time.sleep(0.3)
        assert _alive_and_running(victim), "recover signalled a process it did not start"
        assert r.returncode != 0, "a forged record is reported as a failure"
        rep = json.loads(r.stdout)
        op = rep["operations"][0]
        assert not rep["ok"] and "not one gpusnap wrote" in op["error"] and op["actions"] == [], rep
        assert not forged.exists() and (store / "journal" / f"rejected-{forged.stem}.json").exists()
        assert cli.json("recover")["operations"] == [], "set aside: it blocks nothing any more"
    finally:
        victim.kill()
        victim.wait()


def test_a_forged_committed_dump_record_kills_nothing(tmp_path: Path) -> None:
    """A forged `criu-dump` record at stage `committed` naming a victim's pid and start time, for a
    snapshot whose manifest carries the matching meta.op (a real dump's): the victim lives on."""
    from storage.repo.store import SnapshotStore
    store = tmp_path / "store"
    cli = Cli(store)
    tree = Tree(mb=4, detached=True)
    victim = _victim("victim")
    try:
        cli.json("criu", "dump", "--leave-running", str(tree.pid), "snap")
        op = SnapshotStore(str(store)).load("snap").meta["op"]
        _forge(store, op=op, stage="committed", snapshot="snap",
               procs=[{"pid": victim.pid, "start": _start(victim.pid)}])
        r = cli.run("recover", "--json", check=False)
        time.sleep(0.3)
        assert _alive_and_running(victim), "recover killed a process a forged record named"
        rep = json.loads(r.stdout)
        assert r.returncode != 0 and "not one gpusnap wrote" in rep["operations"][0]["error"], rep
        assert healthy(tree.report()), "the dumped tree was left running (--leave-running)"
    finally:
        victim.kill()
        victim.wait()
        tree.kill()


def test_a_record_with_a_mac_of_another_journal_is_refused(tmp_path: Path) -> None:
    """A record copied from another store's journal (valid there, under that journal's key) names
    nothing here: MACs are per journal."""
    a, b = tmp_path / "a", tmp_path / "b"
    Cli(a).json("store", "init")
    Cli(b).json("store", "init")
    from sandbox.ops.journal import Journal, OpKind, OpRecord, Proc, Stage
    victim = _victim("victim")
    try:
        rec = OpRecord(uuid.uuid4().hex, OpKind.CRIU_DUMP, Stage.DUMPED, Proc(1, 1), "x",
                       procs=(Proc(victim.pid, _start(victim.pid)),))
        Journal(str(a)).write(rec)
        (b / "journal").mkdir(mode=0o700, exist_ok=True)
        os.rename(a / "journal" / f"{rec.op}.json", b / "journal" / f"{rec.op}.json")
        r = Cli(b).run("recover", "--json", check=False)
        time.sleep(0.3)
        assert _alive_and_running(victim), "a record signed for another journal was acted on"
        assert r.returncode != 0 and "not one gpusnap wrote" in json.loads(r.stdout)["operations"][0]["error"]
    finally:
        victim.kill()
        victim.wait()


def test_a_committed_dump_kills_only_what_its_own_manifest_names(tmp_path: Path) -> None:
    """Even a record with a valid MAC (here written with the journal's key) gets a kill only for pids
    that the committed manifest names and that carry this operation's commit MAC: a victim the record
    adds is left alone, and a record of another operation id gets no kill at all."""
    from sandbox.ops.journal import Journal, OpKind, OpRecord, Proc, Stage
    from storage.repo.store import SnapshotStore
    store = tmp_path / "store"
    cli = Cli(store)
    tree = Tree(mb=4, detached=True)
    victim = _victim("victim")
    try:
        cli.json("criu", "dump", "--leave-running", str(tree.pid), "snap")
        op = SnapshotStore(str(store)).load("snap").meta["op"]
        named = (Proc(victim.pid, _start(victim.pid)),)
        for rec_op in (uuid.uuid4().hex, op):  # another operation's id; then this snapshot's own
            Journal(str(store)).write(OpRecord(rec_op, OpKind.CRIU_DUMP, Stage.COMMITTED, Proc(1, 1), "snap",
                                               procs=named))
            rep = cli.json("recover")
            assert rep["ok"], rep
            time.sleep(0.3)
            assert _alive_and_running(victim), (rec_op == op, rep)
        assert healthy(tree.report())
    finally:
        victim.kill()
        victim.wait()
        tree.kill()


def _fill_workers() -> list[int]:
    """Pids of split-fill worker processes (sandbox/criu/fill_procs.py) on this machine."""
    return pids_with(b"sandbox.criu.fill_procs")


@pytest.mark.parametrize("procs", ["1", "2"], ids=["fill-in-process", "fill-in-2-workers"])
def test_restore_killed_during_the_split_fill_is_recovered_and_retried(tmp_path: Path, procs: str) -> None:
    """kill -9 of `gpusnap criu restore` while it writes the large runs into the tree CRIU restored
    stopped: the restored pids were journaled before the fill, so recover kills the half-filled tree
    (no process is left stopped), and the retried restore succeeds with the counter continuing. With
    the fill in worker processes, the workers die with gpusnap (none is left reading or writing)."""
    store = tmp_path / "store"
    cli = Cli(store)
    tree = Tree(mb=16, detached=True)
    env = {**SPLIT, "GPUSNAP_FILL_PROCS": procs}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        c0 = tree.report()["counter"]
        cli.json("criu", "dump", str(tree.pid), "r")
        wait_dead(tree)
        p = Paused(store, ["criu", "restore", "r"], "split-fill", tmp_path)
        staging = p.record["staging"]
        assert p.record["stage"] == "filling" and {x["pid"] for x in p.record["procs"]} == {tree.pid, tree.child}
        if procs != "1":
            assert _fill_workers(), "the fill's workers were started"
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait()
        p.file.unlink()
        deadline = time.monotonic() + 10
        while _fill_workers():
            assert time.monotonic() < deadline, f"fill workers outlived gpusnap: {_fill_workers()}"
            time.sleep(0.05)
        assert _state(tree.pid) == "T", "CRIU left the tree stopped for the fill"
        assert cli.run("criu", "restore", "r", check=False).returncode == 5
        rec = cli.json("recover")
        assert rec["ok"] and any("half-filled" in a for a in rec["operations"][0]["actions"]), rec
        for pid in (tree.pid, tree.child):
            assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z", (pid, _state(pid))
        assert_nothing_left(store, staging)
        r = cli.json("criu", "restore", "r")
        assert r["restored_pid"] == tree.pid
        after = tree.report()
        assert healthy(after) and after["counter"] >= c0, after
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        tree.kill()
