"""`--device-map` on real GPUs (marker `gpu`; skipped without one): the identity map a no-op and a map
naming a GPU that is not there refused in one line with the process left restorable (one GPU); a
process spanning two GPUs checkpointed and restored in place (`gpu` and `criu`), and a restore onto
the other GPU (`--device-map 0=1,1=0`), each checked by the process against its data recipe (two
GPUs). scripts/device/two_gpu.sh runs these and more on the two-GPU machine."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import Cli
from support.criu import require_criu
from support.gpu_results import GB, record

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def drv() -> Any:
    from sandbox.gpu.driver import CudaDriver
    return CudaDriver()


@pytest.fixture(scope="module")
def gpus(drv: Any) -> list[Any]:
    return drv.gpus()


def two_gpus(gpus: list[Any]) -> None:
    if len(gpus) < 2:
        pytest.skip(f"needs two GPUs ({len(gpus)} here)")


def test_identity_map_is_a_no_op_and_a_missing_gpu_is_refused(tmp_path: Path, drv: Any, gpus: list[Any]) -> None:
    from sandbox.gpu.driver import ProcessState as S
    from scripts.workloads.workload_control import Workload
    cli = Cli(tmp_path / "store")
    absent = str(len(gpus))  # `0=1` on a one-GPU machine
    with Workload(GB) as w:
        cli.json("gpu", "checkpoint", str(w.pid), "s1")
        meta = cli.json("store", "inspect", "s1")["meta"]
        assert gpus[0].uuid in meta["gpu_bytes"][str(w.pid)], meta  # recorded (NVML) before the lock
        bad = cli.run("gpu", "restore", "s1", str(w.pid), "--device-map", f"0={absent}", check=False)
        assert bad.returncode == 4 and f"no GPU '{absent}' on this machine" in bad.stderr, bad.stderr
        assert len(bad.stderr.splitlines()) == 1
        assert drv.get_state(w.pid) == S.CHECKPOINTED, "nothing was restored"
        cli.json("gpu", "restore", "s1", str(w.pid))  # restorable as it was
        assert drv.get_state(w.pid) == S.RUNNING and w.verify()
        cli.json("gpu", "checkpoint", str(w.pid), "s2")
        ident = ",".join(f"{g['index']}={g['index']}" for g in meta["gpus"])
        rep = cli.json("gpu", "restore", "s2", str(w.pid), "--device-map", ident)
        assert drv.get_state(w.pid) == S.RUNNING and w.verify()
        record("device_map_identity", {"gpus": len(gpus), "gb": w.size / 1e9, "restore_s": rep["seconds"],
                                       "gpu_bytes": meta["gpu_bytes"]})


def test_process_on_two_gpus_checkpoint_restore_in_place(tmp_path: Path, drv: Any, gpus: list[Any]) -> None:
    two_gpus(gpus)
    from scripts.workloads.workload_control import Workload
    cli = Cli(tmp_path / "store")
    with Workload(GB, script="multi_gpu_workload.py") as w:
        ck = cli.json("gpu", "checkpoint", str(w.pid), "both")
        used = cli.json("store", "inspect", "both")["meta"]["gpu_bytes"][str(w.pid)]
        assert {gpus[0].uuid, gpus[1].uuid} <= set(used), used
        rs = cli.json("gpu", "restore", "both", str(w.pid))
        v = w.cmd("verify")
        assert v["ok"], v
        record("two_gpu_in_place", {"gb_per_gpu": w.size / 1e9, "checkpoint": ck["seconds"], "restore": rs["seconds"],
                                    "gpu_bytes": used})


def test_process_on_two_gpus_criu_dump_restore(tmp_path: Path, gpus: list[Any]) -> None:
    two_gpus(gpus)
    require_criu(missing="skip")
    from scripts.workloads.workload_control import Workload
    cli = Cli(tmp_path / "store")
    with Workload(GB, script="multi_gpu_workload.py", detached=True) as w:
        d = cli.json("criu", "dump", str(w.pid), "both-criu")
        w.reap()
        assert not w.alive()
        r = cli.json("criu", "restore", "both-criu")
        assert r["restored_pid"] == w.pid
        v = w.cmd("verify")
        assert v["ok"], v
        record("two_gpu_criu", {"gb_per_gpu": w.size / 1e9, "dump": d["seconds"], "restore": r["seconds"]})


def _held_on(drv: Any, pid: int) -> dict[str, int]:
    return (drv.gpu_bytes([pid]) or {}).get(pid, {})


def test_restore_onto_the_other_gpu(tmp_path: Path, drv: Any, gpus: list[Any]) -> None:
    """A one-GPU process on GPU 0, restored with `--device-map 0=1,1=0`: its memory is then on GPU 1
    (NVML, from outside) and its data checks out; the process on both GPUs, swapped, checks out too."""
    two_gpus(gpus)
    from scripts.workloads.workload_control import Workload
    cli = Cli(tmp_path / "store")
    u0, u1 = gpus[0].uuid, gpus[1].uuid
    with Workload(GB) as w:
        assert set(_held_on(drv, w.pid)) == {u0}
        cli.json("gpu", "checkpoint", str(w.pid), "one")
        r = cli.json("gpu", "restore", "one", str(w.pid), "--device-map", "0=1,1=0")
        assert w.verify()
        where = _held_on(drv, w.pid)
        assert set(where) == {u1}, where
        record("swap_one_gpu_process", {"restore": r["seconds"], "held_after": where})
    with Workload(GB, script="multi_gpu_workload.py") as w:
        cli.json("gpu", "checkpoint", str(w.pid), "both")
        r = cli.json("gpu", "restore", "both", str(w.pid), "--device-map", "0=1,1=0")
        v = w.cmd("verify")
        assert v["ok"], v
        record("swap_two_gpu_process", {"restore": r["seconds"], "seen_inside": w.cmd("where")["uuids"],
                                        "before": w.info["uuids"]})


def test_criu_restore_onto_the_other_gpu(tmp_path: Path, drv: Any, gpus: list[Any]) -> None:
    two_gpus(gpus)
    require_criu(missing="skip")
    from scripts.workloads.workload_control import Workload
    cli = Cli(tmp_path / "store")
    with Workload(GB, detached=True) as w:
        cli.json("criu", "dump", str(w.pid), "c1")
        w.reap()
        r = cli.json("criu", "restore", "c1", "--device-map", "0=1,1=0")
        assert r["restored_pid"] == w.pid and w.verify()
        where = _held_on(drv, w.pid)
        assert set(where) == {gpus[1].uuid}, where
        record("criu_swap", {"restore": r["seconds"], "held_after": where})
