"""The kill soak in CI size: scripts/soak/criu_kill_soak.py for a few cycles (the full run is >= 50),
dump/restore of a real CRIU tree with gpusnap SIGKILLed at random moments and `gpusnap recover` after
each kill; no process is left stopped or lost and the workload's counter continues."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, pythonpath

pytestmark = [pytest.mark.root, pytest.mark.soak]


def test_criu_kill_soak_ci_sized() -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    # a high kill chance: most dumps and restores are killed somewhere, a few finish
    r = subprocess.run([sys.executable, "-m", "scripts.soak.criu_kill_soak", "--cycles", "8",
                        "--kill-p", "0.7", "--mb", "16"], capture_output=True, text=True, timeout=170,
                       env={**os.environ, "PYTHONPATH": pythonpath()}, cwd=REPO)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["ok"], (out, r.stderr[-2000:])
    assert out["cycles"] == 8 and out["problems"] == []
    # every attempt ending before a kill came (each failing at once, say) would leave nothing soaked
    assert sum(out["kills"].values()) > 0, ("the soak must have killed gpusnap at least once", out)
