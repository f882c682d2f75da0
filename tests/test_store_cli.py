"""The store through the real CLI on a real disk: round trips, dedup, codecs, names, reporting."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from support.entries import chunk_ids
from conftest import Cli, chunk_files, make_mixed_tree, pythonpath, tree_digest


def test_round_trip_is_exact(cli: Cli, tmp_path: Path) -> None:
    src = make_mixed_tree(tmp_path / "model")
    rep = cli.json("store", "put", "m1", str(src))
    assert rep["raw_bytes"] == sum(f.stat().st_size for f in src.rglob("*") if f.is_file() and not f.is_symlink())
    cli.run("store", "get", "m1", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out" / "model") == tree_digest(src)


def test_store_dir_is_private_and_on_real_disk(cli: Cli, store_dir: Path) -> None:
    cli.run("store", "init")
    assert stat.S_IMODE(store_dir.stat().st_mode) == 0o700
    fs = os.statvfs(store_dir)
    assert fs.f_blocks > 0
    with open("/proc/mounts") as f:
        mounts = [l.split() for l in f]
    best = max((m for m in mounts if str(store_dir).startswith(m[1].rstrip("/") + "/") or m[1] == "/"),
               key=lambda m: len(m[1]))
    assert best[2] not in ("tmpfs", "ramfs"), f"tests must run on a real disk, store is on {best[2]}"


def test_zeros_elided_random_raw_weights_compressed(cli: Cli, tmp_path: Path, store_dir: Path) -> None:
    src = make_mixed_tree(tmp_path / "model", mb=24)
    cli.run("store", "put", "m1", str(src))
    info = cli.json("store", "inspect", "m1")
    codecs = info["codecs"]
    assert codecs["zero"]["raw_bytes"] == 8 << 20 and codecs["zero"]["stored_bytes"] == 0
    assert codecs["raw"]["raw_bytes"] >= 8 << 20  # random data: compression does not pay
    z = codecs["shuffle2-zstd"]  # bf16 N(0, 0.02): the byte planes apart, the exponent plane compressed
    assert z["raw_bytes"] == 8 << 20 and z["stored_bytes"] < z["raw_bytes"] / 1.4
    on_disk = sum(p.stat().st_size for p in chunk_files(store_dir))
    assert on_disk < 0.75 * info["size"]


def test_second_put_after_5_percent_change_writes_only_changed_chunks(cli: Cli, tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    src = tmp_path / "w"
    src.mkdir()
    data = bytearray(rng.normal(0, 0.02, 16 << 20).astype(np.float16).tobytes())  # 32 MiB
    (src / "weights").write_bytes(data)
    first = cli.json("store", "put", "v1", str(src))
    start = len(data) // 2
    span = len(data) * 5 // 100
    data[start:start + span] = rng.bytes(span)
    (src / "weights").write_bytes(data)
    second = cli.json("store", "put", "v2", str(src))
    assert second["new_bytes"] <= 0.15 * first["new_bytes"], (first, second)
    assert second["bytes_dedup"] > 0.8 * first["new_bytes"]
    cli.run("store", "get", "v1", str(tmp_path / "o1"))
    cli.run("store", "get", "v2", str(tmp_path / "o2"))
    assert (tmp_path / "o2" / "w" / "weights").read_bytes() == bytes(data)
    assert (tmp_path / "o1" / "w" / "weights").read_bytes() != bytes(data)


@pytest.mark.parametrize("bad", ["../x", ".hidden", "", "a" * 300, "a/b", "-rf"])
def test_invalid_names_rejected(cli: Cli, tmp_path: Path, bad: str) -> None:
    cli.run("store", "init")
    f = tmp_path / "f"
    f.write_bytes(b"x")
    p = cli.run("store", "put", "--", bad, str(f), check=False)
    assert p.returncode == 2  # a bad argument
    assert p.stderr.startswith("gpusnap: ") and len(p.stderr.strip().splitlines()) == 1
    assert "name" in p.stderr
    assert cli.json("store", "ls") == []


def test_nul_in_name_rejected_by_the_library(store_dir: Path) -> None:
    from storage.base.names import InvalidNameError, validate_snapshot_name
    with pytest.raises(InvalidNameError, match="NUL"):
        validate_snapshot_name("a\x00b")


def test_missing_input_path(cli: Cli, tmp_path: Path) -> None:
    cli.run("store", "init")
    p = cli.run("store", "put", "x", str(tmp_path / "nope"), check=False)
    assert p.returncode == 1 and "no such file" in p.stderr and len(p.stderr.splitlines()) == 1
    assert cli.json("store", "ls") == []


def test_unreadable_input_path(tmp_path: Path) -> None:
    """A file the caller may not read is refused up front, in one line, nothing stored. Root reads
    everything, so the CLI runs as root without the two capabilities that bypass file permissions
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH): the kernel's real permission check, wherever the checkout
    sits (switching to another uid would need the checkout and its venv readable by that user, which a
    clone under a 0700 directory is not)."""
    import shutil
    import subprocess
    from conftest import GPUSNAP, REPO, pythonpath
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root (and setpriv) to run the CLI without the file-permission capabilities")
    secret = tmp_path / "secret"
    secret.write_bytes(b"x" * 100)
    secret.chmod(0o000)
    drop = "-dac_override,-dac_read_search"
    p = subprocess.run(["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", *GPUSNAP,
                        "--store", str(tmp_path / "store"), "store", "put", "x", str(secret)],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=pythonpath()), cwd=REPO)
    assert p.returncode == 1, p.stderr
    assert "permission denied" in p.stderr.lower() and len(p.stderr.splitlines()) == 1, p.stderr
    assert not list((tmp_path / "store" / "snapshots").glob("*"))


def test_existing_name_needs_replace(cli: Cli, tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.write_bytes(b"one")
    cli.run("store", "put", "n", str(a))
    a.write_bytes(b"two")
    p = cli.run("store", "put", "n", str(a), check=False)
    assert p.returncode == 1 and "already exists" in p.stderr
    cli.run("store", "put", "--replace", "n", str(a))
    cli.run("store", "get", "n", str(tmp_path / "o"))
    assert (tmp_path / "o" / "a").read_bytes() == b"two"


def test_get_into_existing_dest_refused(cli: Cli, tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.write_bytes(b"one")
    cli.run("store", "put", "n", str(a))
    (tmp_path / "taken").mkdir()
    p = cli.run("store", "get", "n", str(tmp_path / "taken"), check=False)
    assert p.returncode == 1 and "already exists" in p.stderr


def test_unknown_snapshot_and_not_a_store(cli: Cli, tmp_path: Path) -> None:
    cli.run("store", "init")
    for args in (["get", "ghost", str(tmp_path / "o")], ["inspect", "ghost"], ["rm", "ghost"], ["verify", "ghost"]):
        p = cli.run("store", *args, check=False)
        assert p.returncode == 1 and "no snapshot named 'ghost'" in p.stderr, (args, p.stderr)
    other = tmp_path / "notastore"
    other.mkdir()
    (other / "precious").write_text("keep me")
    p = Cli(other).run("store", "ls", check=False)
    assert p.returncode == 1 and "not a gpusnap store" in p.stderr
    assert (other / "precious").read_text() == "keep me"


def test_rm_then_gc_reclaims_only_unreferenced(cli: Cli, tmp_path: Path, store_dir: Path) -> None:
    rng = np.random.default_rng(3)
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(rng.bytes(6 << 20))
    b.write_bytes(rng.bytes(6 << 20))
    cli.run("store", "put", "sa", str(a))
    cli.run("store", "put", "sb", str(b))
    before = chunk_ids(store_dir)
    packs = chunk_files(store_dir)
    assert len(before) == 4 and len(packs) == 2  # one pack per put
    cli.run("store", "rm", "sa")
    gc = cli.json("store", "gc")
    assert gc["chunks_removed"] == 2 and len(chunk_ids(store_dir)) == 2 and gc["packs_removed"] == 1
    assert chunk_files(store_dir) == [p for p in packs if p.exists()] and len(chunk_files(store_dir)) == 1
    assert cli.json("store", "verify")["ok"]
    cli.run("store", "get", "sb", str(tmp_path / "o"))
    assert (tmp_path / "o" / "b").read_bytes() == b.read_bytes()


def test_quiet_when_not_a_terminal_and_json_everywhere(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(os.urandom(1 << 20))
    p = cli.run("store", "put", "q", str(f))
    assert p.stderr == "" and p.stdout.startswith("q: ")
    for args in (["ls"], ["inspect", "q"], ["verify"], ["gc"]):
        json.loads(cli.run("store", *args, "--json").stdout)


def test_help_explains(cli: Cli) -> None:
    out = cli.run("store", "--help").stdout
    for cmd in ("put", "get", "ls", "inspect", "verify", "rm", "gc"):
        assert cmd in out
    assert "GPUSNAP_STORE" in cli.run("--help").stdout


def test_page_chunker_round_trip(cli: Cli, tmp_path: Path) -> None:
    src = make_mixed_tree(tmp_path / "img", mb=12)
    cli.run("store", "put", "--chunker", "pages", "p", str(src))
    cli.run("store", "get", "p", str(tmp_path / "o"))
    assert tree_digest(tmp_path / "o" / "img") == tree_digest(src)


def test_cli_runs_without_pyroute2(tmp_path: Path, cli: Cli) -> None:
    """Only sandbox networks need pyroute2: without it the store and GPU commands work, and a runsc
    command that needs a network says what is missing in one line (the H200 image has no pyroute2)."""
    fake = tmp_path / "fake"
    (fake / "pyroute2").mkdir(parents=True)
    (fake / "pyroute2" / "__init__.py").write_text("raise ImportError('No module named pyroute2 (test)')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(fake), pythonpath()])}
    assert cli.run("store", "init", env=env).returncode == 0
    assert cli.run("store", "ls", env=env).returncode == 0
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text('{"ociVersion": "1.0.2", "process": {"args": ["true"]}, "root": {"path": "rootfs"}}')
    p = cli.run("runsc", "run", "gs-nopyroute2", "--bundle", str(bundle), check=False, env=env)
    assert p.returncode != 0
    assert "pyroute2" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_doctor_reports_what_is_here(cli: Cli) -> None:
    """doctor never fails; on this machine (no GPU) it says so and reports CRIU and runsc as found."""
    import shutil
    d = cli.json("doctor")
    assert d["gpu_path"] in ("none", "host-staged", "custom-storage")
    assert d["memory_tier"] == d["custom_storage"]
    assert d["dump_encoders"] == (0 if (os.cpu_count() or 1) < 8 else min(12, (os.cpu_count() or 1) - 4))
    if shutil.which("runsc"):
        assert d["runsc"] and d["runsc_features"]["platforms"]
    text = cli.run("doctor").stdout
    assert "GPU path" in text and "memory tier" in text and "dump encoders" in text
    assert json.loads(cli.run("doctor", "--json", env={"GPUSNAP_ENCODE_PROCS": "3"}).stdout)["dump_encoders"] == 3
    bad = cli.run("doctor", env={"GPUSNAP_ENCODE_PROCS": "lots"})  # doctor never fails: it says what is wrong
    assert "GPUSNAP_ENCODE_PROCS='lots': expected a number of processes" in bad.stdout
