"""GPUSNAP_THP: gpusnap's THP switch for the driver's copies and restores ("always", the default, or
"keep" the host's setting), a bad value refused before anything is touched, and the probe for a VM
that hands its free memory back to the hypervisor (where huge page faults are slow)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Cli
from sandbox.host.hugepages import HugePagesError, free_page_reporting, policy, thp_mode, wanted


def test_policy_and_what_it_lets_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUSNAP_THP", raising=False)
    assert policy() == "always" and wanted("always") == "always" and wanted(None) is None
    monkeypatch.setenv("GPUSNAP_THP", "keep")
    assert policy() == "keep" and wanted("always") is None
    for bad in ("never", "yes", "ALWAYS"):
        monkeypatch.setenv("GPUSNAP_THP", bad)
        with pytest.raises(HugePagesError, match="GPUSNAP_THP"):
            wanted("always")


def test_keep_leaves_the_hosts_setting_alone_during_a_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox.gpu.state import restore_huge_pages
    before = thp_mode()
    if before is None:
        pytest.skip("no THP setting on this kernel")
    monkeypatch.setenv("GPUSNAP_THP", "keep")
    with restore_huge_pages("always" if before != "always" else "madvise"):
        assert thp_mode() == before
    assert thp_mode() == before


def _balloon(root: Path, features: str, order: str | None) -> tuple[str, str]:
    dev = root / "drivers" / "virtio_balloon" / "virtio3"
    dev.mkdir(parents=True)
    (dev / "features").write_text(features + "\n")
    (root / "drivers" / "virtio_balloon" / "bind").write_text("")  # what else the driver's folder holds
    order_path = root / "page_reporting_order"
    if order is not None:
        order_path.write_text(order + "\n")
    return str(root / "drivers" / "virtio_balloon"), str(order_path)


def test_free_page_reporting_is_read_off_the_balloon_device(tmp_path: Path) -> None:
    assert free_page_reporting(str(tmp_path / "none"), str(tmp_path / "none-order")) is None
    on = "01100101" + "0" * 56
    assert free_page_reporting(*_balloon(tmp_path / "a", on, "10")) == 10
    assert free_page_reporting(*_balloon(tmp_path / "b", on, None)) == 9  # the kernel's default order
    off = "01100001" + "0" * 56  # a balloon without VIRTIO_BALLOON_F_REPORTING (bit 5)
    assert free_page_reporting(*_balloon(tmp_path / "c", off, "9")) is None
    assert free_page_reporting(*_balloon(tmp_path / "d", "011", "9")) is None  # too short to say


def test_a_bad_setting_fails_dump_and_restore_before_anything_is_touched(cli: Cli, tmp_path: Path) -> None:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        r = cli.run("criu", "dump", str(p.pid), "s1", check=False, env={"GPUSNAP_THP": "sometimes"})
        assert r.returncode != 0
        assert r.stderr.strip().count("\n") == 0 and "GPUSNAP_THP='sometimes'" in r.stderr, r.stderr
        with open(f"/proc/{p.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] in ("S", "R"), "the process runs on, never frozen"
        r = cli.run("criu", "restore", "s1", check=False, env={"GPUSNAP_THP": "sometimes"})
        assert r.returncode != 0 and "GPUSNAP_THP='sometimes'" in r.stderr, r.stderr
        ls = cli.run("store", "ls", check=False)
        assert "s1" not in ls.stdout, "no snapshot was made"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()


def test_doctor_says_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from sandbox import doctor
    monkeypatch.setenv("GPUSNAP_THP", "keep")
    assert doctor._thp_policy() == "keep"
    monkeypatch.setenv("GPUSNAP_THP", "bad")
    assert "GPUSNAP_THP='bad'" in doctor._thp_policy()


def test_a_bad_setting_fails_the_gpu_commands_before_the_driver_is_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sandbox.gpu.snapshot import gpu_checkpoint, gpu_restore
    from storage.repo.store import SnapshotStore
    monkeypatch.setenv("GPUSNAP_THP", "sometimes")
    st = SnapshotStore(str(tmp_path / "st"))

    class NoDriver:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"the driver was asked ({name}) before the setting was checked")
    with pytest.raises(HugePagesError, match="GPUSNAP_THP"):
        gpu_checkpoint(st, os.getpid(), "g", driver=NoDriver())  # type: ignore[arg-type]
    with pytest.raises(HugePagesError, match="GPUSNAP_THP"):
        gpu_restore(st, "g", os.getpid(), driver=NoDriver())  # type: ignore[arg-type]
