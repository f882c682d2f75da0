"""The custom-storage path end to end in CI: the driver's state machine (stand-in, its regions real
memory of this process, as the driver maps them) + the GPU engine on host memory (HostDevice) + a
real store on a real disk. `gpusnap gpu checkpoint/restore` and `gpusnap criu dump/restore` take
this path wherever the driver probe reports custom storage."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import cast
from pathlib import Path

import numpy as np
import pytest

from conftest import small_tmpfs
from support.custom_storage import FEATS, gpu_bytes
from support.driver_standin import StandInDriver
from sandbox.gpu.driver import CudaDriver, ProcessState as S  # the stand-in, cast: FEATS given, probe() never runs
from sandbox.gpu.snapshot import gpu_checkpoint, gpu_restore
from storage.gpu.device import HostDevice
from storage.repo.store import SnapshotStore


def test_gpu_swap_out_and_in_through_custom_storage(tmp_path: Path, child: int) -> None:
    d = StandInDriver()
    me = os.getpid()
    d.add(me, gpu_bytes(1, 6))
    d.add(child, gpu_bytes(2, 3))
    before = {p: bytes(d.procs[p].gpu) for p in (me, child)}
    st = SnapshotStore(str(tmp_path / "store"))
    rep = gpu_checkpoint(st, me, "swap", driver=cast(CudaDriver, d), features=FEATS, device=HostDevice(), thp_mode=None)
    assert sorted(rep.pids) == sorted([me, child]) and rep.path == "custom-storage"
    assert all(d.get_state(p) == S.CHECKPOINTED for p in (me, child))
    assert all(len(d.procs[p].gpu) == 0 for p in (me, child)), "GPU memory released"
    m = st.load("swap")
    assert {s.name for s in m.streams} == {f"gpu/{me}/0", f"gpu/{child}/0"}
    assert m.meta["gpu_path"] == "custom-storage" and 0 < rep.stored_bytes < rep.raw_bytes
    assert st.verify(["swap"]).ok
    gpu_restore(st, "swap", me, driver=cast(CudaDriver, d), features=FEATS, device=HostDevice(), thp_mode=None)
    assert all(d.get_state(p) == S.RUNNING for p in (me, child))
    assert {p: bytes(d.procs[p].gpu) for p in (me, child)} == before


@pytest.mark.root
def test_store_full_mid_swap_out_rolls_everything_back(tmp_path: Path, child: int) -> None:
    """The first process streams fine, the second does not fit: the first gets its memory back from
    the chunks already written, the second from the spill, both run on, no snapshot exists."""
    with small_tmpfs(tmp_path / "small", "3m") as mnt:
        d = StandInDriver()
        me = os.getpid()
        d.add(me, gpu_bytes(3, 1))                                   # ~0.5 MiB stored
        d.add(child, np.random.default_rng(4).bytes(8 << 20))         # 8 MiB random: does not fit
        before = {p: bytes(d.procs[p].gpu) for p in (me, child)}
        st = SnapshotStore(str(mnt / "store"))
        with pytest.raises(Exception, match="(?i)space|full"):
            gpu_checkpoint(st, me, "full", driver=cast(CudaDriver, d), features=FEATS, device=HostDevice(), thp_mode=None)
        assert all(d.get_state(p) == S.RUNNING for p in (me, child))
        assert {p: bytes(d.procs[p].gpu) for p in (me, child)} == before
        assert st.names() == []


@pytest.mark.root
def test_criu_dump_and_restore_with_custom_storage(tmp_path: Path) -> None:
    """A real CRIU tree whose two processes the stand-in driver treats as CUDA processes: their GPU
    memory goes through the engine into the snapshot (gpu/PID/0 streams), CRIU dumps them
    CHECKPOINTED, and restore brings back the tree (real CRIU) and then the GPU memory, byte-exact."""
    from sandbox.criu.runner import find_criu
    from sandbox.criu.snapshot import criu_dump, criu_restore
    from support.criu import Tree, healthy
    if os.geteuid() != 0 or not find_criu():
        pytest.skip("CRIU needs root and scripts/setup.sh")
    tree = Tree(mb=16, detached=True)
    try:
        d = StandInDriver()
        d.add(tree.pid, gpu_bytes(5, 4))
        d.add(tree.child, gpu_bytes(6, 2))
        before = {p: bytes(d.procs[p].gpu) for p in (tree.pid, tree.child)}
        st = SnapshotStore(str(tmp_path / "store"))
        rep = criu_dump(st, tree.pid, "c", gpu_driver=d, features=FEATS, device=HostDevice())
        assert sorted(rep.cuda_pids) == sorted([tree.pid, tree.child])
        assert all(d.get_state(p) == S.CHECKPOINTED for p in (tree.pid, tree.child))
        m = st.load("c")
        assert m.meta["gpu_path"] == "custom-storage"
        names = {s.name for s in m.streams}
        assert {f"gpu/{tree.pid}/0", f"gpu/{tree.child}/0"} <= names and any(n.startswith("images/pages-") for n in names)
        deadline = time.monotonic() + 10
        while tree.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not tree.alive()
        criu_restore(st, "c", gpu_driver=d, device=HostDevice())
        assert healthy(tree.report())
        assert all(d.get_state(p) == S.RUNNING for p in (tree.pid, tree.child))
        assert {p: bytes(d.procs[p].gpu) for p in (tree.pid, tree.child)} == before
    finally:
        tree.close()


@pytest.mark.root
def test_criu_refusal_with_custom_storage_gives_gpu_memory_back(tmp_path: Path) -> None:
    """CRIU refuses (an external unix socket pair is fine, a TCP connection is not): the GPU memory
    already streamed into the uncommitted snapshot goes back, the processes are RUNNING, no snapshot."""
    import socket
    from sandbox.criu.runner import find_criu
    from sandbox.criu.snapshot import criu_dump
    if os.geteuid() != 0 or not find_criu():
        pytest.skip("CRIU needs root and scripts/setup.sh")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    prog = "import socket,time;s=socket.create_connection(('127.0.0.1',%d));time.sleep(120)" % srv.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-c", prog], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    conn, _ = srv.accept()
    try:
        d = StandInDriver()
        d.add(p.pid, gpu_bytes(7, 3))
        before = bytes(d.procs[p.pid].gpu)
        st = SnapshotStore(str(tmp_path / "store"))
        with pytest.raises(Exception, match="(?i)tcp|inet socket"):
            criu_dump(st, p.pid, "t", gpu_driver=d, features=FEATS, device=HostDevice())
        assert p.poll() is None and d.get_state(p.pid) == S.RUNNING and bytes(d.procs[p.pid].gpu) == before
        assert st.names() == []
    finally:
        p.kill()
        p.wait()
        conn.close()
        srv.close()
