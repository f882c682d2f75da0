"""The memory tier's resident process (`gpusnap pool serve`) in CI: the daemon runs in this test's
process with the driver stand-in (custom storage, regions in real memory) and the engine on host
memory; the real `gpusnap` CLI talks to it over its real Unix socket."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from conftest import Cli
from support.driver_standin import StandInDriver
from sandbox.gpu.driver import Features, ProcessState as S
from sandbox.gpu.pool_daemon import PoolDaemonError, PoolServer, request
from storage.gpu.device import HostDevice
from support.custom_storage import FEATS, gpu_bytes


class Running:
    def __init__(self, path: Path, driver: StandInDriver, features: Features = FEATS, size: int = 64 << 20) -> None:
        self.srv = PoolServer(str(path), size, driver=driver, features=features, device=HostDevice())
        self.t = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.t.start()

    def stop(self) -> None:
        request(self.srv.path, {"op": "stop"})
        self.t.join(10)
        self.srv.close()


def test_swap_out_and_in_through_the_cli(tmp_path: Path, child: int) -> None:
    d = StandInDriver()
    d.add(child, gpu_bytes(11, 6))
    before = bytes(d.procs[child].gpu)
    sock = tmp_path / "pool.sock"
    run = Running(sock, d)
    try:
        assert oct(sock.stat().st_mode & 0o777) == "0o600"
        cli = Cli(tmp_path / "unused-store")
        out = cli.json("gpu", "checkpoint", str(child), "m1", "--tier", "memory", "--pool-socket", str(sock))
        assert out["pids"] == [child] and 0 < out["new_bytes"] < out["raw_bytes"]
        assert d.get_state(child) == S.CHECKPOINTED and len(d.procs[child].gpu) == 0
        ls = cli.json("pool", "ls", "--socket", str(sock))
        assert [s["name"] for s in ls] == ["m1"] and ls[0]["swapped_out"]
        p = cli.run("pool", "rm", "m1", "--socket", str(sock), check=False)
        assert p.returncode == 1 and "swapped out" in p.stderr, p.stderr
        p = cli.run("gpu", "restore", "m1", "1", "--tier", "memory", "--pool-socket", str(sock), check=False)
        assert p.returncode == 1 and "taken of pid" in p.stderr
        cli.json("gpu", "restore", "m1", str(child), "--tier", "memory", "--pool-socket", str(sock))
        assert d.get_state(child) == S.RUNNING and bytes(d.procs[child].gpu) == before
        assert cli.json("pool", "usage", "--socket", str(sock))["usage"]["snapshots"] == 1
        cli.run("pool", "rm", "m1", "--socket", str(sock))
        assert cli.json("pool", "usage", "--socket", str(sock))["usage"]["used"] == 0
    finally:
        run.stop()
    assert not sock.exists()


def test_full_pool_rolls_back_and_host_only_driver_is_refused(tmp_path: Path, child: int) -> None:
    d = StandInDriver()
    import numpy as np
    d.add(child, np.random.default_rng(3).bytes(8 << 20))  # random: 8 MiB stored, the pool has 4
    before = bytes(d.procs[child].gpu)
    run = Running(tmp_path / "small.sock", d, size=4 << 20)
    try:
        with pytest.raises(PoolDaemonError, match="full"):
            request(str(tmp_path / "small.sock"), {"op": "swap_out", "pid": child, "name": "big"})
        assert d.get_state(child) == S.RUNNING and bytes(d.procs[child].gpu) == before
        assert request(str(tmp_path / "small.sock"), {"op": "usage"})["usage"]["used"] == 0
    finally:
        run.stop()
    host_only = Features(checkpoint_api=True, custom_storage=False)
    run = Running(tmp_path / "host.sock", d, features=host_only)
    try:
        with pytest.raises(PoolDaemonError, match="custom-storage API"):
            request(str(tmp_path / "host.sock"), {"op": "swap_out", "pid": child, "name": "x"})
        assert d.get_state(child) == S.RUNNING
        with pytest.raises(PoolDaemonError, match="unknown request"):
            request(str(tmp_path / "host.sock"), {"op": "explode"})
        with pytest.raises(PoolDaemonError, match="already serves"):
            PoolServer(str(tmp_path / "host.sock"), 1 << 20, driver=d, features=host_only, device=HostDevice())
    finally:
        run.stop()


def test_an_idle_client_does_not_hold_the_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import time
    from sandbox.gpu import pool_daemon
    monkeypatch.setattr(pool_daemon, "IDLE_S", 0.3)
    run = Running(tmp_path / "p.sock", StandInDriver())
    try:
        idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        idle.connect(str(tmp_path / "p.sock"))  # connects, never speaks
        t0 = time.monotonic()
        assert request(str(tmp_path / "p.sock"), {"op": "usage"})["usage"]["used"] == 0
        assert time.monotonic() - t0 < 5
        idle.close()
    finally:
        run.stop()
