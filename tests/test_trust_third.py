"""Trust, third pass (issue 58 rows N1, N2, N3, N6, N8), each through the real CLI (and real CRIU for N1
and N2): journal records that are replayed, copied with their store, signed with a key that travelled
with the store, or carry no MAC are set aside and act on nothing; a restore whose fill finished is
never undone by killing it; FIFOs planted at the key or a record block no command; gc deletes only
what a get made, and only entries of the get's user."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from conftest import Cli
from support.criu import Tree, _state, healthy, require_criu
from support.crash import Paused, wait_dead

pytestmark = pytest.mark.root
SPLIT = {"GPUSNAP_CRIU_IMAGES": "stream", "GPUSNAP_CRIU_SPLIT_MIN": str(4 << 20),
         "GPUSNAP_CRIU_SPLIT_SHARED_MIN": str(4 << 20)}


@pytest.fixture(autouse=True)
def split_env(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    for k, v in SPLIT.items():
        monkeypatch.setenv(k, v)


def _start(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _running(pid: int) -> bool:
    return _state(pid) in ("S", "R", "D")


def _victim() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)


def _paused_restore(store: Path, tmp: Path, stage: str) -> tuple[Tree, Paused, Path]:
    """A tree dumped into STORE (killed), then `criu restore` of it paused at STAGE; its journal record's path."""
    require_criu()
    cli = Cli(store)
    tree = Tree(mb=16, detached=True)
    cli.json("criu", "dump", str(tree.pid), "r")
    wait_dead(tree)
    p = Paused(store, ["criu", "restore", "r"], stage, tmp)
    return tree, p, store / "journal" / f"{p.record['op']}.json"


# ---- N1: a genuine record replayed after its restore finished kills nothing --------------------

def test_n1_a_filling_record_put_back_after_the_restore_is_set_aside(tmp_path: Path) -> None:
    """A store writer renames the genuine `filling` record out of journal/ during the split fill and puts
    it back after the restore finished (then, again, a copy of it): recover sets it aside and the
    restored, running tree lives on. (Before: recover SIGKILLed it as "the half-filled restored tree".)"""
    store = tmp_path / "store"
    cli = Cli(store)
    tree, p, rec = _paused_restore(store, tmp_path, "split-fill")
    try:
        assert p.record["stage"] == "filling"
        held = tmp_path / "held.json"
        os.rename(rec, held)             # the writer takes the genuine record away
        saved = held.read_bytes()
        p.file.unlink()                  # the restore goes on, and finishes
        out, err = p.proc.communicate(timeout=180)
        assert p.proc.returncode == 0, err
        assert healthy(tree.report()), "the restore finished, the tree runs"
        for attempt in ("renamed back", "copied back"):
            if attempt == "renamed back":
                os.rename(held, rec)
            else:
                rec.write_bytes(saved)
            r = cli.run("recover", "--json", check=False)
            time.sleep(0.3)
            rep = json.loads(r.stdout)
            assert r.returncode != 0 and len(rep["operations"]) == 1, (attempt, rep)
            op = rep["operations"][0]
            assert "not the current record" in op["error"] and op["actions"] == [], (attempt, op)
            assert _running(tree.pid) and _running(tree.child), (attempt, _state(tree.pid))
            assert not rec.exists(), "set aside"
            assert cli.json("recover")["operations"] == [], "nothing is left to block other commands"
        assert healthy(tree.report()), "the running, fully restored tree was never signalled"
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
        tree.kill()


def test_n1_gpusnap_killed_after_the_fill_finished_leaves_the_running_tree_alone(tmp_path: Path) -> None:
    """gpusnap SIGKILLed after the split fill finished and the tree continued, but before its record
    left `filling`: the record is genuine and current, yet its undo checks what it would undo (the
    fill's own marker, the tree's /proc state): the whole, running tree is never signalled."""
    store = tmp_path / "store"
    cli = Cli(store)
    tree, p, rec = _paused_restore(store, tmp_path, "fill-done")
    try:
        assert json.loads(rec.read_text())["stage"] == "filling"
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait()
        p.file.unlink()
        rep = cli.json("recover")
        time.sleep(0.3)
        assert rep["ok"], rep
        assert any("split fill had finished" in a for a in rep["operations"][0]["actions"]), rep
        assert _running(tree.pid) and _running(tree.child)
        assert healthy(tree.report())
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
        tree.kill()


# ---- N2: a store copied elsewhere carries records, never the power to act on them -----------------

def test_n2_a_copied_store_sets_every_record_aside_and_the_original_still_recovers(tmp_path: Path) -> None:
    """A restore killed during the split fill leaves a genuine `filling` record naming the stopped tree.
    The store copied to another directory: recover there sets the record aside and signals nothing;
    recover of the original store still kills its half-filled tree, as it must."""
    a, b = tmp_path / "a", tmp_path / "b"
    tree, p, rec = _paused_restore(a, tmp_path, "split-fill")
    try:
        os.kill(p.proc.pid, signal.SIGKILL)
        p.proc.wait()
        p.file.unlink()
        assert _state(tree.pid) == "T"
        shutil.copytree(a, b, symlinks=True)
        r = Cli(b).run("recover", "--json", check=False)
        time.sleep(0.3)
        op = json.loads(r.stdout)["operations"][0]
        assert r.returncode != 0 and "another store directory" in op["error"] and op["actions"] == [], op
        assert _state(tree.pid) == "T" and _state(tree.child) == "T", "the copy's record signalled nothing"
        rep = Cli(a).json("recover")
        assert rep["ok"] and any("half-filled" in x for x in rep["operations"][0]["actions"]), rep
        wait_dead(tree)
    finally:
        tree.kill()


def _legacy_record(store: Path, **fields: object) -> tuple[Path, bytes]:
    """What an older gpusnap left: STORE/journal/key and a record MACed with it (no boot, no store id)."""
    j = store / "journal"
    j.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = os.urandom(32)
    fd = os.open(j / "key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, key)
    os.close(fd)
    d: dict[str, object] = {"op": uuid.uuid4().hex, "kind": "criu-restore", "stage": "filling",
                            "owner": {"pid": 4194301, "start": 1}, "snapshot": "s", "staging": None, "procs": [],
                            "cuda_pids": [], "gpu_path": None, "leave_running": False, "runsc": None,
                            "started": time.time(), "helpers": []}
    d.update(fields)
    data = json.dumps(["journal-record", d], sort_keys=True, separators=(",", ":")).encode()
    d["mac"] = hmac.new(key, data, hashlib.sha256).hexdigest()
    path = j / f"{d['op']}.json"
    body = json.dumps(d, sort_keys=True).encode()
    path.write_bytes(body)
    return path, body


def test_n2_a_record_under_a_key_that_travelled_with_the_store_kills_nothing(tmp_path: Path) -> None:
    """A store from elsewhere holds journal/key and a `filling` record MACed with it naming a local
    process by pid and start time: recover sets it aside, the process lives, and the message names
    the explicit migration (--trust-old-key)."""
    store = tmp_path / "store"
    Cli(store).json("store", "init")
    victim = _victim()
    try:
        rec, _ = _legacy_record(store, procs=[{"pid": victim.pid, "start": _start(victim.pid)}])
        r = Cli(store).run("recover", "--json", check=False)
        time.sleep(0.3)
        op = json.loads(r.stdout)["operations"][0]
        assert r.returncode != 0 and "--trust-old-key" in op["error"] and op["actions"] == [], op
        assert victim.poll() is None and _running(victim.pid), "recover killed an unrelated process"
        assert not rec.exists()
    finally:
        victim.kill()
        victim.wait()


def test_old_key_records_are_honoured_once_with_trust_old_key(tmp_path: Path) -> None:
    """Migration: a `criu-dump` record an older gpusnap left at stage `dumping` (the tree it names stopped)
    is set aside by a plain recover; put back, `recover --trust-old-key` acts on it (resumes the tree)."""
    store = tmp_path / "store"
    cli = Cli(store)
    cli.json("store", "init")
    victim = _victim()
    try:
        os.kill(victim.pid, signal.SIGSTOP)
        rec, body = _legacy_record(store, kind="criu-dump", stage="dumping",
                                   procs=[{"pid": victim.pid, "start": _start(victim.pid)}])
        assert cli.run("recover", "--json", check=False).returncode != 0
        time.sleep(0.2)
        assert _state(victim.pid) == "T", "a plain recover acts on no record under the old key"
        rec.write_bytes(body)
        rep = cli.json("recover", "--trust-old-key")
        assert rep["ok"] and any("resumed" in a for a in rep["operations"][0]["actions"]), rep
        time.sleep(0.2)
        assert _running(victim.pid)
        assert cli.json("recover")["operations"] == []
    finally:
        victim.kill()
        victim.wait()


# ---- N3: FIFOs at the key or a record block nothing ----------------------------------------------

def _fifo(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.mkfifo(path, 0o600)


def test_n3_fifos_at_the_key_and_a_record_block_no_command(tmp_path: Path) -> None:
    """FIFOs at STORE/journal/key (where older versions kept the key), at a record's path, and at the host
    key itself: recover, store gc, store put and criu dump each end (under a timeout), none blocks."""
    require_criu()
    store = tmp_path / "store"
    cli = Cli(store)
    cli.json("store", "init")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(os.urandom(4096))
    _fifo(store / "journal" / "key")
    _fifo(store / "journal" / f"{uuid.uuid4().hex}.json")
    tree = Tree(mb=4, detached=True)
    try:
        # recover exits 1: it reports the records it set aside; the others go on past them
        for rc, args in ((1, ["recover"]), (0, ["store", "gc"]), (0, ["store", "put", "p", str(tmp_path / "src")]),
                         (0, ["criu", "dump", "--leave-running", str(tree.pid), "d"])):
            _fifo(store / "journal" / f"{uuid.uuid4().hex}.json")  # a fresh one each time (each is set aside)
            r = cli.run(*args, check=False, timeout=60)  # TimeoutExpired: it blocked
            assert r.returncode == rc and "set aside" in r.stdout + r.stderr, (args, r.returncode, r.stdout, r.stderr)
        # the host key a FIFO: every command that needs it fails at once, in one line
        host = tmp_path / "host"
        host.mkdir(mode=0o700)
        _fifo(host / "key")
        env = {"GPUSNAP_HOST_DIR": str(host)}
        from sandbox.ops.journal import Journal
        op = uuid.uuid4().hex  # a record whose MAC must be checked: the key is read
        (store / "journal" / f"{op}.json").write_text(json.dumps({
            "op": op, "kind": "criu-dump", "stage": "dumping", "owner": {"pid": 4194301, "start": 1}, "snapshot": "x",
            "boot": "b", "store": Journal(str(store)).store_id, "mac": "0" * 64}))
        for args in (["recover"], ["criu", "dump", "--leave-running", str(tree.pid), "d2"]):
            r = cli.run(*args, check=False, timeout=60, env=env)
            assert r.returncode != 0 and "host key" in r.stderr and "regular file" in r.stderr, (args, r.stderr)
        assert healthy(tree.report())
    finally:
        tree.kill()


# ---- N6: gc deletes only what a get made, and only entries of the get's user -------------------

NOBODY = 65534


def _as_nobody(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, user=NOBODY, group=NOBODY)


def test_n6_a_tree_a_store_writer_dressed_as_a_get_keeps_another_users_file() -> None:
    """`nobody` (who can write the store) renames its own directory, holding another user's subdirectory,
    to a get's hidden tree name, writes the marker itself and plants tmp/get.* with its own uid and that
    nonce: root's gc deletes nothing of the other user's (before: it deleted the file nobody could not)."""
    from storage.fs.owner import boot_tag
    base = Path(tempfile.mkdtemp(prefix="gpusnap-n6-"))  # /tmp: a path nobody can reach
    try:
        os.chmod(base, 0o755)
        store = base / "store"
        cli = Cli(store)
        cli.json("store", "init")
        os.chmod(store, 0o755)
        os.chmod(store / "tmp", 0o777)  # a store nobody can write
        shared = base / "shared"
        shared.mkdir()
        os.chmod(shared, 0o777)
        mine = shared / "mine"
        _as_nobody(f"import os; os.mkdir({str(mine)!r}, 0o777)")
        victim = mine / "victim"
        victim.mkdir(mode=0o755)
        os.chown(victim, 1234, 1234)
        (victim / "precious").write_text("the other user's")
        os.chown(victim / "precious", 1234, 1234)
        pid = 4194301
        nonce = "ab" * 16
        dest = shared / "dest"
        staging = shared / f".dest.gpusnap-{pid}"
        rec = store / "tmp" / f"get.{pid}-1-{boot_tag()}.1.2"
        _as_nobody(f"import os, json; os.rename({str(mine)!r}, {str(staging)!r}); "
                   f"open(os.path.join({str(staging)!r}, '.gpusnap-get.{nonce}'), 'w').write({nonce!r}); "
                   f"open({str(rec)!r}, 'w').write(json.dumps({{'pid': {pid}, 'start': 1, 'boot': {boot_tag()!r}, "
                   f"'uid': {NOBODY}, 'dest': {str(dest)!r}, 'nonce': {nonce!r}}}))")
        gc = json.loads(cli.run("store", "gc", "--json", check=False).stdout)
        assert (staging / "victim" / "precious").read_text() == "the other user's", gc
        assert gc["gets_cleaned"] == 0 and any("not an entry of uid" in d for d in gc["damage"]), gc
        # a root get's marker is keyed with the host key: the nonce alone (all a store writer knows) is no marker
        from storage.fs.getmark import carries_marker, marker_name
        root_tree = shared / "roots"
        root_tree.mkdir(mode=0o700)
        (root_tree / marker_name(nonce)).write_text(nonce)
        fd = os.open(root_tree, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert not carries_marker(fd, nonce, 0)
        finally:
            os.close(fd)
    finally:
        shutil.rmtree(base)


# ---- N8: a record without a MAC blocks nothing -------------------------------------------------

def test_n8_a_record_without_a_mac_blocks_no_command(tmp_path: Path) -> None:
    store = tmp_path / "store"
    cli = Cli(store)
    cli.json("store", "init")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(os.urandom(4096))
    rec: dict[str, object] = {"op": uuid.uuid4().hex, "kind": "criu-dump", "stage": "dumping", "owner": {"pid": 4194301, "start": 1},
           "snapshot": "x", "staging": None, "procs": [], "cuda_pids": [], "gpu_path": None,
           "leave_running": False, "runsc": None, "started": time.time(), "helpers": []}
    path = store / "journal" / f"{rec['op']}.json"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_text(json.dumps(rec))
    r = cli.run("store", "put", "p", str(tmp_path / "src"), check=False)
    assert r.returncode == 0, r.stderr
    assert "set aside" in r.stderr and not path.exists(), r.stderr
    assert (store / "journal" / f"rejected-{rec['op']}.json").exists()
    path.write_text(json.dumps(rec))
    assert cli.run("store", "gc", check=False).returncode == 0
    path.write_text(json.dumps(rec))
    require_criu()
    tree = Tree(mb=4, detached=True)
    try:
        cli.json("criu", "dump", "--leave-running", str(tree.pid), "d")
        assert healthy(tree.report())
    finally:
        tree.kill()


# ---- gc reports what it really freed -------------------------------------------------------------

def test_gc_reports_the_bytes_a_pack_held_not_what_its_index_claims(tmp_path: Path) -> None:
    """An 8 KiB pack whose index says the pack is 1 GiB long: gc removes it and reports 8 KiB freed (before:
    "1.07 GB freed", the index's claim)."""
    from storage.format.packs import encode_index
    store = tmp_path / "store"
    cli = Cli(store)
    cli.json("store", "init")
    pack = uuid.uuid4().hex
    (store / "packs").mkdir(exist_ok=True)
    (store / "index").mkdir(exist_ok=True)
    (store / "packs" / pack).write_bytes(os.urandom(8192))
    (store / "index" / pack).write_bytes(encode_index(pack, 1 << 30, [(os.urandom(32).hex(), 0, 8192)]))
    gc = cli.json("store", "gc")
    assert gc["packs_removed"] == 1 and not (store / "packs" / pack).exists(), gc
    assert gc["bytes_freed"] == 8192, gc


# ---- a power loss: records of an earlier boot are recovered, and signal nothing -------------------

def test_a_record_of_an_earlier_boot_is_cleaned_up_and_signals_nothing(tmp_path: Path) -> None:
    """After a power loss /run is empty but the host key is not: a genuine `filling` record of the earlier
    boot is recovered (its staging removed, the record cleared, ok), and the process of this boot whose
    pid and start time it happens to name is somebody else's: never signalled."""
    from dataclasses import replace
    from sandbox.ops.journal import Journal, OpKind, OpRecord, Proc, Stage, boot_id
    store = tmp_path / "store"
    cli = Cli(store)
    cli.json("store", "init")
    victim = _victim()
    try:
        j = Journal(str(store))
        op = uuid.uuid4().hex
        staging = tmp_path / f"gpusnap-op-{op}"
        staging.mkdir(mode=0o700)
        (staging / "images").mkdir()
        rec = OpRecord(op, OpKind.CRIU_RESTORE, Stage.FILLING, Proc(4194301, 1), "r", staging=str(staging),
                       procs=(Proc(victim.pid, _start(victim.pid)),), boot=str(uuid.uuid4()), store=j.store_id)
        assert rec.boot != boot_id()
        j.write(rec)
        from sandbox.ops import opstate
        opstate.remove(op)  # what the reboot did to /run
        rep = cli.json("recover")
        time.sleep(0.3)
        assert rep["ok"], rep
        acts = rep["operations"][0]["actions"]
        assert any("before this boot" in a for a in acts) and not any("killed" in a for a in acts), acts
        assert victim.poll() is None and _running(victim.pid)
        assert not staging.exists() and not (store / "journal" / f"{op}.json").exists()
        # the same record replayed later (kept by a store writer) does no more: nothing left to remove
        j.write(replace(rec, staging=None))
        opstate.remove(op)
        assert cli.json("recover")["ok"] and victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_recover_forgets_the_state_of_an_operation_whose_record_is_gone(tmp_path: Path) -> None:
    """gpusnap killed between removing its record and its host-local state (or the record taken away):
    recover forgets that state, so that the record put back later is never taken for current."""
    from sandbox.ops import opstate
    from sandbox.ops.journal import Journal, OpKind, OpRecord, Proc, Stage
    store = tmp_path / "store"
    cli = Cli(store)
    cli.json("store", "init")
    j = Journal(str(store))
    op = uuid.uuid4().hex
    j.write(OpRecord(op, OpKind.CRIU_DUMP, Stage.DUMPING, Proc(4194301, 1), "x"))
    kept = (store / "journal" / f"{op}.json").read_bytes()
    (store / "journal" / f"{op}.json").unlink()
    assert opstate.load(op) is not None
    assert cli.json("recover")["operations"] == []
    assert opstate.load(op) is None, "the orphan state was forgotten"
    (store / "journal" / f"{op}.json").write_bytes(kept)
    r = cli.run("recover", "--json", check=False)
    assert r.returncode != 0 and "not the current record" in json.loads(r.stdout)["operations"][0]["error"]
