"""Journal test support: the records a store's journal holds (gpusnap's own, not the rejected ones), and a
`gpusnap` held at a stage by the pause hook (GPUSNAP_TEST_PAUSE) so a test can look, or kill it, there;
shared by the hook tests."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from conftest import GPUSNAP, REPO, pythonpath


def records(store: Path) -> list[str]:
    j = store / "journal"
    return sorted(p.name for p in j.glob("*.json") if len(p.stem) == 32) if j.is_dir() else []  # not rejected-*


def paused(store: Path, args: list[str], stage: str, tmp: Path) -> subprocess.Popen[str]:
    """gpusnap ARGS held at STAGE by the pause hook (any number of journal records)."""
    flag = tmp / f"pause-{stage}"
    env = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_TEST_PAUSE": f"{stage}:{flag}"}
    p = subprocess.Popen([*GPUSNAP, "--store", str(store), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, f"never reached {stage}"
        time.sleep(0.02)
    return p
