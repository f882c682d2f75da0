"""`gpusnap swap` on a real GPU: a small run of scripts/bench/bench_swap.py (two transformers servers that
the budget does not hold together, requests alternating through `swap serve` in mode gpu, then criu):
no failed or wrong answer, every weights digest the same after each switch, NVML's GPU memory never over
the budget. Also the same flow with tiny CPU models (--dry-cpu, mode criu) where torch is installed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, have_gpu, pythonpath


def _bench(tmp_path: Path, *args: str, timeout: float) -> dict:
    out = tmp_path / "swap.json"
    r = subprocess.run([sys.executable, "-m", "scripts.bench.bench_swap", "--out", str(out), "--work",
                        str(tmp_path / "work"), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": pythonpath()})
    assert out.exists(), r.stdout + r.stderr
    res = json.loads(out.read_text())
    if "skipped" in res:
        pytest.skip(res["skipped"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return res


@pytest.mark.gpu
@pytest.mark.root
def test_two_transformers_servers_swap_on_one_gpu(tmp_path: Path) -> None:
    if not have_gpu() or os.geteuid() != 0:
        pytest.skip("needs an NVIDIA GPU and root")
    res = _bench(tmp_path, "--gb-each", "1", "--requests", "10", "--criu-requests", "4", timeout=900)
    for mode in ("gpu", "criu"):
        r = res["runs"][mode]
        assert r["failed"] == r["wrong_answers"] == r["wrong_digests"] == 0, r
        assert r["answers_differ"], "the two servers must answer differently (else misrouting would pass)"
        assert r["switch_s"]["n"] == r["requests"] // 2 and r["resident_s"]["n"] == r["requests"] // 2
        assert r["gpu_samples"] > 0 and not r["gpu_over_budget"], r
        assert all(s["swap_out"]["count"] >= 1 for s in r["daemon_status"].values()), r["daemon_status"]
    assert res["inplace"]["same_answer"]


@pytest.mark.root
def test_the_bench_flow_on_the_cpu(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    res = _bench(tmp_path, "--dry-cpu", "--criu-requests", "4", timeout=400)
    r = res["runs"]["criu"]
    assert r["failed"] == r["wrong_answers"] == r["wrong_digests"] == 0 and r["answers_differ"], r
    assert r["switch_s"]["n"] == 2 and r["daemon_status"]["a"]["swap_out"]["count"] >= 1
