"""The custom-storage path end to end in CI: the driver's state machine (stand-in, its regions real
memory of this process, as the driver maps them) + the GPU engine on host memory (HostDevice) + a
real store on a real disk. `gpusnap gpu checkpoint/restore` and `gpusnap criu dump/restore` take
this path wherever the driver probe reports custom storage."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from driver_standin import StandInDriver
from sandbox.cuda_driver import Features, GpuInfo, ProcessState as S
from sandbox.gpu_snapshot import gpu_checkpoint, gpu_restore
from storage.device import HostDevice
from storage.store import SnapshotStore

FEATS = Features(bindings="stand-in", driver_version="stand-in", checkpoint_api=True, custom_storage=True,
                 gpus=[GpuInfo(0, "Stand-in GPU", "GPU-00000000-0000-0000-0000-000000000000", 1 << 30, (9, 0), None, False)])


def gpu_bytes(seed: int, mb: int) -> bytes:
    rng = np.random.default_rng(seed)
    n = mb << 20
    w = (rng.normal(0, 0.02, n // 5).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return w + bytes(n // 2) + rng.bytes(n - len(w) - n // 2)


@pytest.fixture()
def child() -> int:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p.pid
    p.kill()
    p.wait()


def test_gpu_swap_out_and_in_through_custom_storage(tmp_path: Path, child: int) -> None:
    d = StandInDriver()
    me = os.getpid()
    d.add(me, gpu_bytes(1, 6))
    d.add(child, gpu_bytes(2, 3))
    before = {p: bytes(d.procs[p].gpu) for p in (me, child)}
    st = SnapshotStore(str(tmp_path / "store"))
    rep = gpu_checkpoint(st, me, "swap", driver=d, features=FEATS, device=HostDevice(), thp_mode=None)
    assert sorted(rep.pids) == sorted([me, child]) and rep.path == "custom-storage"
    assert all(d.get_state(p) == S.CHECKPOINTED for p in (me, child))
    assert all(len(d.procs[p].gpu) == 0 for p in (me, child)), "GPU memory released"
    m = st.load("swap")
    assert {s.name for s in m.streams} == {f"gpu/{me}/0", f"gpu/{child}/0"}
    assert m.meta["path"] == "custom-storage" and 0 < rep.stored_bytes < rep.raw_bytes
    assert st.verify(["swap"]).ok
    gpu_restore(st, "swap", me, driver=d, features=FEATS, device=HostDevice(), thp_mode=None)
    assert all(d.get_state(p) == S.RUNNING for p in (me, child))
    assert {p: bytes(d.procs[p].gpu) for p in (me, child)} == before


@pytest.mark.root
def test_store_full_mid_swap_out_rolls_everything_back(tmp_path: Path, child: int) -> None:
    """The first process streams fine, the second does not fit: the first gets its memory back from
    the chunks already written, the second from the spill, both run on, no snapshot exists."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    try:
        d = StandInDriver()
        me = os.getpid()
        d.add(me, gpu_bytes(3, 1))                                   # ~0.5 MiB stored
        d.add(child, np.random.default_rng(4).bytes(8 << 20))         # 8 MiB random: does not fit
        before = {p: bytes(d.procs[p].gpu) for p in (me, child)}
        st = SnapshotStore(str(mnt / "store"))
        with pytest.raises(Exception, match="(?i)space|full"):
            gpu_checkpoint(st, me, "full", driver=d, features=FEATS, device=HostDevice(), thp_mode=None)
        assert all(d.get_state(p) == S.RUNNING for p in (me, child))
        assert {p: bytes(d.procs[p].gpu) for p in (me, child)} == before
        assert st.names() == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
