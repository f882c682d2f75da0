"""Trust, second pass (issue 26): forged gc records, hostile archives and imports, deep paths, a
SIGTERM'd get, big manifests for `ls`, hard links in `get --include`, a credentials file others can
read, put's scan racing a tight loop of swaps. Real files on the real disk, the real CLI."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import REPO, Cli, make_mixed_tree, pythonpath, tree_digest
from support.crafted import checksum, rewrite_manifest

DEAD_PID = 4194301


def _gpusnap(cli: Cli, *args: str, patch: str = "", timeout: float = 120) -> subprocess.Popen[str]:
    """The CLI as a child process, with PATCH (Python) run before it starts."""
    prog = f"import os, signal, sys, time\n{patch}\nfrom cli import main\nmain()\n"
    return subprocess.Popen([sys.executable, "-c", prog, "--store", str(cli.store), *args],
                            env={**os.environ, "PYTHONPATH": pythonpath()}, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _get_killed_at_commit(cli: Cli, name: str, dest: Path) -> None:
    p = _gpusnap(cli, "store", "get", name, str(dest), patch=(
        "from storage import filetree\n"
        "filetree.FileTreeSink.commit = lambda self: os.kill(os.getpid(), signal.SIGKILL)\n"))
    p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL


# ---- 2. gc deletes a get's staging tree only if the get's marker proves it is the get's ---------

def _forge_get_record(store: Path, dest: Path, pid: int = DEAD_PID, **extra: object) -> Path:
    from storage.owner import boot_tag
    rec = store / "tmp" / f"get.{pid}-1-{boot_tag()}.1.2"
    rec.write_text(json.dumps({"pid": pid, "start": 1, "boot": boot_tag(), "uid": os.geteuid(),
                               "dest": str(dest), "nonce": "0" * 32, **extra}))
    return rec


def test_forged_get_record_deletes_nothing_outside_the_store(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    cli.run("store", "init")
    elsewhere = tmp_path / "elsewhere"
    staging = elsewhere / f".x.gpusnap-{DEAD_PID}"
    (staging / "sub").mkdir(parents=True)
    (staging / "sub" / "precious").write_text("keep")
    rec = _forge_get_record(store_dir, elsewhere / "x")
    p = cli.run("store", "gc", "--json", check=False)
    gc = json.loads(p.stdout)
    assert p.returncode == 3 and gc["gets_cleaned"] == 0, gc
    assert any(".x.gpusnap-" in d and "no marker" in d for d in gc["damage"]), gc
    assert (staging / "sub" / "precious").read_text() == "keep"
    assert not rec.exists()   # the record is removed, reported
    # a record with no nonce at all (what earlier versions wrote, or a forger) touches nothing either
    rec = _forge_get_record(store_dir, elsewhere / "x", nonce=None)
    gc = json.loads(cli.run("store", "gc", "--json", check=False).stdout)
    assert gc["gets_cleaned"] == 0 and (staging / "sub" / "precious").exists() and not rec.exists()


def test_forged_get_record_naming_another_stores_get_deletes_nothing(cli: Cli, store_dir: Path,
                                                                     tmp_path: Path) -> None:
    other = Cli(tmp_path / "other")
    src = make_mixed_tree(tmp_path / "model", mb=2)
    other.run("store", "put", "snap", str(src))
    cli.run("store", "init")
    dest = tmp_path / "restored"
    _get_killed_at_commit(other, "snap", dest)
    partial = [x for x in tmp_path.iterdir() if x.name.startswith(".restored.gpusnap-")]
    assert len(partial) == 1
    pid = int(partial[0].name.rsplit("-", 1)[1])
    _forge_get_record(store_dir, dest, pid=pid)
    gc = json.loads(cli.run("store", "gc", "--json", check=False).stdout)
    assert gc["gets_cleaned"] == 0 and partial[0].exists(), gc
    # the store whose get it was removes it: its record's nonce matches the tree's marker
    gc = other.json("store", "gc")
    assert gc["gets_cleaned"] == 1 and gc["damage"] == [] and not partial[0].exists(), gc
