"""The warm tier (storage/tiers/warm.py, storage/repo/warmread.py): `store warm`/`cool`, `store ls`, the
budget and LRU eviction, restores reading from it (bit-exact, a damaged copy read past), a killed
`store warm` leaving the store whole, and its bytes closed to anyone who could not read the store."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import GPUSNAP, REPO, Cli, pythonpath
from support.criu import Tree, healthy, require_criu

pytestmark = pytest.mark.root
MB = 1 << 20


@pytest.fixture
def warm_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = tmp_path / "warm"
    monkeypatch.setenv("GPUSNAP_WARM_DIR", str(d))
    monkeypatch.setenv("GPUSNAP_WARM_MOUNT", "0")
    monkeypatch.delenv("GPUSNAP_WARM_BUDGET", raising=False)
    yield d


def put(cli: Cli, tmp: Path, name: str, mb: int, seed: int) -> Path:
    src = tmp / f"src-{name}"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(mb * MB))
    cli.json("store", "put", name, str(src))
    return src


def warm_packs(d: Path) -> set[str]:
    return {p.name for p in d.glob("*/packs/*")}


def test_warm_ls_cool_and_lru_within_budget(cli: Cli, tmp_path: Path, warm_env: Path) -> None:
    for i, n in enumerate("abc"):
        put(cli, tmp_path, n, 6, i)
    r = cli.json("store", "warm", "--budget", "13M", "a")[0]
    assert r["copied"] >= 6 * MB and r["evicted"] == [] and r["budget"] == 13 * MB
    time.sleep(0.02)
    cli.json("store", "warm", "b")
    assert {x["name"]: x["warm"] for x in cli.json("store", "ls")} == {"a": True, "b": True, "c": False}
    time.sleep(0.02)
    r = cli.json("store", "warm", "c")[0]  # the budget (remembered) holds two: a, least recently used, goes
    assert r["evicted"] == ["a"] and r["used"] <= 13 * MB
    assert {x["name"] for x in cli.json("store", "ls") if x["warm"]} == {"b", "c"}
    assert len(warm_packs(warm_env)) == 2, "a's pack copy is removed, not just forgotten"
    assert "WARM" in cli.run("store", "ls").stdout
    # bigger than the whole budget: refused, one line, nothing evicted
    big = put(cli, tmp_path, "big", 14, 9)
    assert big.exists()
    p = cli.run("store", "warm", "big", check=False)
    assert p.returncode != 0 and "budget" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert {x["name"] for x in cli.json("store", "ls") if x["warm"]} == {"b", "c"}
    assert cli.json("store", "cool", "b") == {"cooled": ["b"]}
    assert {x["name"] for x in cli.json("store", "ls") if x["warm"]} == {"c"}
    status = cli.json("store", "warm")
    assert set(status["snapshots"]) == {"c"} and status["used"] == status["snapshots"]["c"]["bytes"]
    assert cli.json("store", "cool", "--all") == {"cooled": ["c"]} and warm_packs(warm_env) == set()


def test_restore_from_warm_equals_restore_from_disk(cli: Cli, tmp_path: Path, warm_env: Path) -> None:
    require_criu()
    tree = Tree(mb=48)
    try:
        rep = cli.json("criu", "dump", "--keep-warm", str(tree.pid), "t")
        assert rep["warm"]["held"] > 48 * MB, rep["warm"]
        tree.reap()
        tree.gone()
        r = cli.json("criu", "restore", "t")
        assert r["warm"]["in_use"] and r["warm"]["bytes_read"] > 40 * MB, r["warm"]
        warm_rep = tree.report()
        assert healthy(warm_rep), warm_rep
        tree.kill()
        # a damaged warm copy is a cache miss, never wrong bytes: flip bytes in every copy, restore again
        for p in warm_env.glob("*/packs/*"):
            with open(p, "r+b") as f:
                f.seek(8192)
                f.write(b"\xff" * 4096)
        r = cli.json("criu", "restore", "t")
        assert healthy(tree.report())
        tree.kill()
        cli.json("store", "cool", "t")
        r = cli.json("criu", "restore", "t")
        assert r["warm"]["bytes_read"] == 0
        disk_rep = tree.report()
        assert healthy(disk_rep)
        for k in ("memory_ok", "child_memory_ok", "pipe_ok", "thread_ok", "file_offset", "pid"):
            assert warm_rep[k] == disk_rep[k], k
        assert cli.json("store", "verify")["ok"]
    finally:
        tree.close()


def test_killed_warm_leaves_the_store_whole(cli: Cli, tmp_path: Path, warm_env: Path) -> None:
    src = put(cli, tmp_path, "k", 8, 3)
    flag = tmp_path / "paused"
    env = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_WARM_PAUSE": f"copied:{flag}"}
    p = subprocess.Popen([*GPUSNAP, "--store", str(cli.store), "store", "warm", "k"], cwd=REPO, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not flag.exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
    leftovers = list(warm_env.glob("*/packs/.tmp.*"))
    assert leftovers, "the kill came with a copy not yet renamed"
    assert not any(x["warm"] for x in cli.json("store", "ls")), "not warm until every pack is whole"
    assert cli.json("store", "verify")["ok"]
    cli.json("store", "warm", "k")  # the next change removes what the killed one left
    assert not list(warm_env.glob("*/packs/.tmp.*")) and [x["warm"] for x in cli.json("store", "ls")] == [True]
    out = tmp_path / "got"
    cli.json("store", "get", "k", str(out))
    assert (out / "src-k/data.bin").read_bytes() == (src / "data.bin").read_bytes()


def test_other_users_cannot_read_warm_bytes(cli: Cli, tmp_path: Path, warm_env: Path) -> None:
    put(cli, tmp_path, "secret", 2, 5)
    cli.json("store", "warm", "secret")
    os.chmod(tmp_path, 0o755)  # the way to the tier is open: the tier itself must not be
    packs = list(warm_env.glob("*/packs/*"))
    assert packs and (warm_env.stat().st_mode & 0o777) == 0o700
    probe = ("import os,sys\nos.setgid(65534); os.setuid(65534)\nok=[]\nfor p in sys.argv[1:]:\n"
             " try:\n  open(p,'rb').read(1); ok.append(p)\n except PermissionError: pass\nprint(len(ok))")
    out = subprocess.run([sys.executable, "-c", probe, *map(str, packs), str(warm_env / "state.json")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "0", out
    # a tier directory someone else could read is never used, nor filled
    os.chmod(warm_env, 0o755)
    p = cli.run("store", "warm", "secret", check=False)
    assert p.returncode != 0 and "private" in p.stderr, p.stderr
    os.chmod(warm_env, 0o700)


def test_root_tier_is_a_huge_page_tmpfs(cli: Cli, tmp_path: Path, warm_env: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_WARM_MOUNT", "1")
    put(cli, tmp_path, "m", 2, 7)
    try:
        r = cli.json("store", "warm", "m")[0]
        thp = os.path.exists("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        assert r["memory"] == ("tmpfs huge=always" if thp else "tmpfs"), r
    finally:
        subprocess.run(["umount", str(warm_env)], check=False)
