"""GPU tests (marker `gpu`): nvCOMP on host-staged bytes against the CPU codecs, on the same data.

scripts/bench/bench_codecs.py on 64 MiB of each data kind, CPU rows and the four nvCOMP codecs (ANS,
GDeflate, LZ4, Bitcomp) fed from pinned host memory in one 64 MiB batch: every row must decode its
data byte for byte; the rows and the decode verdict are recorded ($GPUSNAP_RESULTS). Also: the
registry has every nvCOMP codec where nvCOMP is installed, and the device makes each of them.
Skipped where there is no GPU (conftest.py).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from support.gpu_results import record

pytestmark = pytest.mark.gpu


def test_nvcomp_codecs_are_registered_and_made_by_the_device() -> None:
    from storage.codecs import registry as C
    from storage.gpu.device import CudaDevice
    assert C.nvcomp_importable()
    assert set(C.gpu_codecs()) == set(C.NVCOMP_ALGORITHMS)
    dev = CudaDevice(0)
    s = dev.new_stream()
    try:
        for name in C.gpu_codecs():
            assert C.entry(name).where == "gpu"
            dev.codec(name, s, 64 << 10).release()
    finally:
        dev.destroy_stream(s)


def test_nvcomp_on_host_staged_bytes_against_the_cpu_codecs(tmp_path: Path) -> None:
    from scripts.bench import bench_codecs
    out = tmp_path / "codecs.json"
    threads = os.cpu_count() or 1
    rc = bench_codecs.main(["--mib", os.environ.get("CODECS_MIB", "64"), "--threads", f"1,{threads}",
                            "--json", str(out)])
    res = json.loads(out.read_text())
    for r in res["rows"]:
        record("codecs", r)
    record("codecs-verdict", {"verdict": res["verdict"], "machine": res["machine"]})
    assert rc == 0 and all(r["exact"] for r in res["rows"])
    gpu = {(r["data"], r["codec"]) for r in res["rows"] if r["where"] == "gpu"}
    assert {(k, c) for k in ("weights", "kv30", "random", "text") for c in bench_codecs.NVCOMP.values()} <= gpu, gpu
