"""GPU sandboxes, the parts that run without a GPU: runsc feature detection and nvproxy flags from
runsc's help texts (tests/data/README.md says which are captured), the OCI GPU devices from real
character-device nodes, and the in-sandbox GPU agent against the driver stand-in."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.runsc.oci_bundle import BundleError, build_bundle, bundle_gpus
from sandbox.runsc.runner import RunscError, parse_features

DATA = Path(__file__).parent / "data"


def features(kind: str):
    return parse_features((DATA / "runsc-20221219-version.txt").read_text(), (DATA / f"runsc-{kind}-flags.txt").read_text(),
                          (DATA / f"runsc-{kind}-checkpoint-help.txt").read_text())


def test_debian_runsc_has_no_nvproxy_and_says_so() -> None:
    f = features("20221219")
    assert f.version == "0.0~20221219.0" and "ptrace" in f.platforms and "kvm" in f.platforms
    assert not f.nvproxy and not f.can_store_uncompressed and not f.save_restore_exec and f.can_leave_running
    with pytest.raises(RunscError, match="no nvproxy"):
        f.gpu_args()


def test_newer_runsc_gpu_flags() -> None:
    f = features("newer")
    assert f.nvproxy and f.can_store_uncompressed and f.save_restore_exec
    assert f.gpu_args() == ["--nvproxy=true", "--nvproxy-allowed-driver-capabilities=compute,utility"]
    assert f.gpu_args(driver_version="580.126.20", capabilities=("compute",)) == [
        "--nvproxy=true", "--nvproxy-driver-version=580.126.20", "--nvproxy-allowed-driver-capabilities=compute"]
    # a runsc with nvproxy but without the ABI pin refuses the pin instead of dropping it
    older = parse_features("runsc version x", "  -nvproxy\n    \tenable\n", "")
    assert older.gpu_args(capabilities=()) == ["--nvproxy=true"]
    with pytest.raises(RunscError, match="driver ABI"):
        older.gpu_args(driver_version="580.126.20")


@pytest.fixture()
def dev_root(tmp_path: Path) -> Path:
    """Real character-device nodes with the NVIDIA majors (195; uvm's is dynamic: 511 here)."""
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    d = tmp_path / "dev"
    d.mkdir()
    for name, major, minor in (("nvidiactl", 195, 255), ("nvidia-uvm", 511, 0), ("nvidia0", 195, 0), ("nvidia1", 195, 1)):
        os.mknod(d / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    return d


def test_bundle_gets_gpu_devices_rules_and_env(tmp_path: Path, dev_root: Path) -> None:
    b = build_bundle(str(tmp_path / "b"), ["true"], gpus=[1], dev_root=str(dev_root))
    cfg = json.loads((Path(b) / "config.json").read_text())
    devs = {d["path"]: (d["type"], d["major"], d["minor"]) for d in cfg["linux"]["devices"]}
    assert devs == {"/dev/nvidiactl": ("c", 195, 255), "/dev/nvidia-uvm": ("c", 511, 0), "/dev/nvidia1": ("c", 195, 1)}
    rules = {(r["major"], r["minor"]) for r in cfg["linux"]["resources"]["devices"] if r["allow"]}
    assert rules == {(195, 255), (511, 0), (195, 1)}
    assert "NVIDIA_VISIBLE_DEVICES=1" in cfg["process"]["env"]
    assert sorted(bundle_gpus(b)) == ["/dev/nvidia-uvm", "/dev/nvidia1", "/dev/nvidiactl"]
    with pytest.raises(BundleError, match="nvidia7 does not exist"):
        build_bundle(str(tmp_path / "c"), ["true"], gpus=[7], dev_root=str(dev_root))
    (dev_root / "nvidia0").unlink()
    (dev_root / "nvidia0").write_text("")
    with pytest.raises(BundleError, match="not a character device"):
        build_bundle(str(tmp_path / "d"), ["true"], gpus=[0], dev_root=str(dev_root))


def test_parse_gpus(dev_root: Path) -> None:
    import click
    from cli.runsc_cmd import parse_gpus
    assert parse_gpus(None) == [] and parse_gpus("0,2") == [0, 2]
    assert parse_gpus("all", str(dev_root)) == [0, 1]
    with pytest.raises(click.UsageError):
        parse_gpus("first")


def test_agent_without_cuda_processes_needs_no_driver() -> None:
    """Inside a sandbox with no CUDA process the agent reports so and never loads the driver."""
    from conftest import REPO
    p = subprocess.run([sys.executable, "-m", "agents.gpu_agent", "status"], capture_output=True, text=True,
                       cwd="/", env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    rep = json.loads(p.stdout)
    assert rep["action"] == "status" and rep["cuda_pids"] == [] and rep["path"] is None
