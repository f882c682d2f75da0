"""Trust boundaries of snapshot metadata and the pool socket: a snapshot (maybe from another node,
its checksum recomputed) cannot add runsc flags, name host interfaces or public subnets, or make
`store rm` remove another snapshot; each kind's record validates and round-trips; `pool serve`
never replaces what is not a stale socket of its own."""
from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from conftest import Cli
from support.crafted import rewrite_manifest

from sandbox.host.netns import NetConfig, NetnsError
from sandbox.ops.snapshot_meta import (CriuMeta, FilesMeta, GpuMeta, GpuPath, RunscFlagError, SnapshotKindError,
                                   SnapshotMetaError, check_runsc_args, parse_meta)
from storage.format.manifest import Manifest


def _m(meta: dict, name: str = "s") -> Manifest:
    return Manifest(name, [], meta)


GOOD_NET = {"name": "gpusnap-box", "host_if": "gs-box", "peer_if": "gp-box", "host_cidr": "10.77.9.1/24",
            "ns_cidr": "10.77.9.2/24"}
RUNSC = {"kind": "runsc", "container": "box", "runsc_args": ["--root=/tmp/rs1", "--platform=ptrace", "--network=none"],
         "bundle": "/b", "net": GOOD_NET, "netns_path": "/var/run/netns/gpusnap-box", "gpu": None}


# ---- the records ---------------------------------------------------------------------------------
@pytest.mark.parametrize("meta", [
    {"kind": "files", "paths": ["/data/model"]},
    {"kind": "gpu", "gpu_path": "custom-storage", "root_pid": 10, "pids": [10, 11],
     "gpus": [{"index": 0, "uuid": "GPU-1234", "name": "NVIDIA H200"}], "driver": "580.95.05", "gpu_stages": {}},
    {"kind": "criu", "root_pid": 10, "pids": [10, 11], "cuda_pids": [11], "criu": "4.1.1",
     "options": ["--shell-job"], "gpu_path": "host-staged", "ingest_stages": {"read": 1}},
    {**RUNSC, "gpu": {"gpus": [0], "runsc_args": ["--nvproxy=true"], "agent": True,
                      "agent_report": {"cuda_pids": [3], "snapshot": "s.gpu", "path": "custom-storage"}}},
])
def test_each_kind_round_trips(meta: dict) -> None:
    rec = parse_meta(_m(meta))
    assert rec is not None and rec.KIND.value == meta["kind"]
    again = parse_meta(_m(rec.to_json()))
    assert again == rec and again.to_json() == rec.to_json()
    assert all(k in rec.to_json() for k in meta)  # reports kept (extra), nothing dropped


def test_gpu_path_key_is_unified_and_old_snapshots_read() -> None:
    old = GpuMeta.of(_m({"kind": "gpu", "path": "host-staged", "root_pid": 5, "pids": [5]}))
    assert old.gpu_path == GpuPath.HOST_STAGED and old.to_json()["gpu_path"] == "host-staged"
    assert CriuMeta.of(_m({"kind": "criu", "root_pid": 5, "pids": [5], "cuda_pids": [5],
                           "gpu_path": "custom-storage"})).gpu_path == GpuPath.CUSTOM_STORAGE


@pytest.mark.parametrize("meta,why", [
    ({"kind": "gpu", "gpu_path": "warp-drive", "root_pid": 5, "pids": [5]}, "GPU path"),
    ({"kind": "gpu", "gpu_path": "host-staged", "root_pid": 5, "pids": ["5; rm -rf /"]}, "pids"),
    ({"kind": "gpu", "gpu_path": "host-staged", "root_pid": 5, "pids": [0]}, "pids"),
    ({"kind": "criu", "root_pid": 5, "pids": [5], "cuda_pids": [6], "gpu_path": "host-staged"}, "cuda_pids"),
    ({"kind": "criu", "root_pid": 7, "pids": [5], "cuda_pids": []}, "root_pid"),
    ({"kind": "criu", "root_pid": 5, "pids": [5], "cuda_pids": [], "meta_version": 9}, "version 9"),
    ({**RUNSC, "runsc_args": ["--network=none", "--debug", "--debug-log=/tmp/x"]},
     "'--debug' is not one gpusnap records"),
    ({**RUNSC, "runsc_args": ["--root", "/tmp/../etc"]}, "climbs"),
    ({**RUNSC, "runsc_args": ["--platform=ptrace; touch /x"]}, "--platform has a value"),
    ({**RUNSC, "container": "../x"}, "container"),
    ({**RUNSC, "gpu": {"runsc_args": ["--nvproxy=true", "--strace"], "agent": True}}, "'--strace'"),
    ({**RUNSC, "gpu": {"agent": True, "agent_report": {"snapshot": "someone-else", "cuda_pids": [3]}}},
     "not this snapshot's companion"),
    ({**RUNSC, "net": {**GOOD_NET, "host_if": "eth0"}}, "host interface 'eth0'"),
    ({**RUNSC, "net": {**GOOD_NET, "name": "../../etc/x"}}, "namespace name"),
    ({**RUNSC, "net": {**GOOD_NET, "host_cidr": "8.8.8.1/24", "ns_cidr": "8.8.8.2/24"}}, "private"),
    ({**RUNSC, "net": {**GOOD_NET, "ns_cidr": "10.77.9.1/24"}}, "two distinct hosts"),
    ({**RUNSC, "net": {**GOOD_NET, "extra": 1}}, "exactly the fields"),
])
def test_what_gpusnap_would_not_write_is_damage(meta: dict, why: str) -> None:
    with pytest.raises(SnapshotMetaError) as e:
        parse_meta(_m(meta))
    assert why in str(e.value) and e.value.exit_code == 3, str(e.value)


def test_wrong_kind_is_a_usage_error_not_damage() -> None:
    with pytest.raises(SnapshotKindError, match="is a 'files' snapshot, not a gpu one"):
        GpuMeta.of(_m({"kind": "files", "paths": []}))
    assert FilesMeta.of(_m({"kind": "files"})).paths == ()


def test_runsc_flags_allowlist() -> None:
    assert check_runsc_args(["--root", "/run/gs", "-platform=kvm", "--nvproxy", "--nvproxy-driver-version=580.95.05"])
    for bad in (["--debug"], ["--debug-log=/tmp/d"], ["--strace"], ["--network=host;x"], ["--root"], ["notaflag"]):
        with pytest.raises(RunscFlagError):
            check_runsc_args(bad)


@pytest.mark.parametrize("name,subnet,why", [("gpusnap-a", "8.8.8.0/24", "private"),
                                              ("gpusnap-a", "10.0.0.0/31", "too small"),
                                              ("other", "10.0.0.0/24", "namespace name")])
def test_netconfig_for_sandbox_validates(name: str, subnet: str, why: str) -> None:
    with pytest.raises(NetnsError, match=why):
        NetConfig.for_sandbox(name, subnet)
    assert NetConfig.for_sandbox("gpusnap-a", "10.1.2.0/24").address == "10.1.2.2"


# ---- store rm and companions ----------------------------------------------------------------------
def _as_runsc(cli: Cli, store_dir: Path, tmp_path: Path, name: str, companion: str | None) -> None:
    src = tmp_path / f"src-{name}"
    (src / "images").mkdir(parents=True)
    (src / "images" / "checkpoint.img").write_bytes(os.urandom(1000))
    cli.run("store", "put", name, str(src))
    gpu = {"gpus": [], "runsc_args": [], "agent": True, "agent_report": {"cuda_pids": [3], "snapshot": companion}}
    rewrite_manifest(store_dir / "snapshots" / f"{name}.json", lambda b: b.update(meta={**RUNSC, "gpu": gpu}))


def test_store_rm_removes_the_gpu_companion_and_nothing_else(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    for n in ("sb.gpu", "other"):
        (tmp_path / n).mkdir()
        (tmp_path / n / "f").write_text(n)
        cli.run("store", "put", n, str(tmp_path / n))
    _as_runsc(cli, store_dir, tmp_path, "sb", "sb.gpu")
    cli.run("store", "rm", "sb")
    assert [r["name"] for r in cli.json("store", "ls")] == ["other"]


def test_verify_reports_metadata_gpusnap_would_not_write(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    _as_runsc(cli, store_dir, tmp_path, "sb", "sb.gpu")
    assert cli.run("store", "verify", "sb").returncode == 0
    rewrite_manifest(store_dir / "snapshots" / "sb.json", lambda b: b["meta"]["runsc_args"].append("--debug"))
    v = cli.run("store", "verify", check=False)
    want = "DAMAGED sb: snapshot 'sb' metadata: runsc_args: runsc flag '--debug'"
    assert v.returncode == 3 and want in v.stdout, v.stdout


def test_a_crafted_companion_cannot_make_rm_remove_another_snapshot(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "f").write_text("keep me")
    cli.run("store", "put", "victim", str(tmp_path / "victim"))
    _as_runsc(cli, store_dir, tmp_path, "sb", "victim")
    cli.run("store", "rm", "sb")
    assert [r["name"] for r in cli.json("store", "ls")] == ["victim"]


# ---- pool socket -----------------------------------------------------------------------------------
def _server(path: Path):  # noqa: ANN202
    from support.driver_standin import StandInDriver
    from sandbox.gpu.pool_daemon import PoolServer
    from storage.gpu.device import HostDevice
    from support.custom_storage import FEATS
    return PoolServer(str(path), 16 << 20, driver=StandInDriver(), features=FEATS, device=HostDevice())


def test_pool_socket_refuses_a_regular_file_and_a_link(tmp_path: Path) -> None:
    from sandbox.gpu.pool_daemon import PoolDaemonError
    f = tmp_path / "pool.sock"
    f.write_text("precious")
    with pytest.raises(PoolDaemonError, match="not a socket"):
        _server(f)
    assert f.read_text() == "precious"
    link = tmp_path / "link.sock"
    link.symlink_to(f)
    with pytest.raises(PoolDaemonError, match="not a socket"):
        _server(link)
    assert link.is_symlink() and f.read_text() == "precious"


def test_pool_socket_replaces_only_a_stale_socket_of_ours(tmp_path: Path) -> None:
    from sandbox.gpu.pool_daemon import PoolDaemonError
    path = tmp_path / "pool.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # left behind, nobody listening: a daemon that died
    with _server(path) as srv:
        assert srv.sock is not None
        with pytest.raises(PoolDaemonError, match="already serves"):
            _server(path)
        assert path.exists()


# ---- through the real CLI and real runsc -----------------------------------------------------------
runsc_only = pytest.mark.skipif(os.geteuid() != 0, reason="runsc and namespaces need root")


@runsc_only
def test_runsc_restore_refuses_flags_and_networks_outside_what_gpusnap_records(cli: Cli, store_dir: Path,
                                                                               tmp_path: Path) -> None:
    import shutil
    import tempfile

    from pyroute2 import IPRoute

    from sandbox.runsc.oci_bundle import build_bundle
    from support.runsc import PY, COUNTER, wait_lines
    if not shutil.which("runsc"):
        pytest.fail("runsc not installed: run scripts/setup.sh (CI must not skip these)")
    tag = uuid.uuid4().hex[:6]
    root = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    args = [f"--runsc-arg=--root={root}", "--runsc-arg=--platform=ptrace", "--runsc-arg=--network=none"]
    bundle = tmp_path / "bundle"
    build_bundle(str(bundle), [PY, "-c", COUNTER])
    victim = f"victim{tag}"
    ids = [f"tr{tag}a", f"tr{tag}b", f"tr{tag}c"]
    try:
        cli.run("runsc", "run", ids[0], "--bundle", str(bundle), "--output", str(tmp_path / "a.out"), *args)
        wait_lines(tmp_path / "a.out", 3)
        cli.json("runsc", "checkpoint", ids[0], "snap", *args)
        manifest = store_dir / "snapshots" / "snap.json"
        good = manifest.read_bytes()
        debug = tmp_path / "debug"
        rewrite_manifest(manifest, lambda b: b["meta"]["runsc_args"].extend(["--debug", f"--debug-log={debug}/"]))
        p = cli.run("runsc", "restore", "snap", ids[1], "--bundle", str(bundle), "--output", str(tmp_path / "b.out"),
                    check=False)
        assert p.returncode == 3 and "'--debug' is not one gpusnap records" in p.stderr, p.stderr
        assert not debug.exists()
        assert subprocess.run(["runsc", f"--root={root}", "state", ids[1]], capture_output=True).returncode != 0
        # a network record naming a host interface gpusnap did not make: refused, the interface untouched
        with IPRoute() as ip:
            ip.link("add", ifname=victim, kind="veth", peer=f"{victim}p")  # (no dummy module here)
        manifest.write_bytes(good)
        rewrite_manifest(manifest, lambda b: b["meta"].update(net={**GOOD_NET, "name": f"gpusnap-{tag}",
                                                                    "host_if": victim}))
        p = cli.run("runsc", "restore", "snap", ids[1], "--bundle", str(bundle), "--output", str(tmp_path / "b.out"),
                    check=False)
        assert p.returncode == 3 and f"host interface {victim!r}" in p.stderr, p.stderr
        with IPRoute() as ip:
            assert ip.link_lookup(ifname=victim), "the host's interface must be left alone"
        # the untouched snapshot restores: the refusals were about the crafted fields alone
        manifest.write_bytes(good)
        cli.json("runsc", "restore", "snap", ids[2], "--bundle", str(bundle), "--output", str(tmp_path / "c.out"))
        wait_lines(tmp_path / "c.out", 2)
    finally:
        for cid in ids:
            subprocess.run(["runsc", f"--root={root}", "delete", "-force", cid], capture_output=True)
        with IPRoute() as ip:
            for idx in ip.link_lookup(ifname=victim):
                ip.link("del", index=idx)
        shutil.rmtree(root, ignore_errors=True)


@runsc_only
def test_runsc_checkpoint_refuses_to_record_a_flag_restore_would_refuse(cli: Cli, tmp_path: Path) -> None:
    p = cli.run("runsc", "checkpoint", "nosuch", "x", "--runsc-arg=--debug-log=/tmp/d", check=False)
    assert p.returncode == 1 and "'--debug-log=/tmp/d' is not one gpusnap records" in p.stderr, p.stderr


def test_meta_problems_for_verify() -> None:
    from sandbox.ops.snapshot_meta import meta_problems
    assert meta_problems(_m(RUNSC)) == [] and meta_problems(_m({})) == [] and meta_problems(_m({"kind": "other"})) == []
    bad = meta_problems(_m({**RUNSC, "runsc_args": ["--debug"]}))
    assert len(bad) == 1 and "'--debug' is not one gpusnap records" in bad[0]
