"""Store fault injection: kill -9 a real `gpusnap` at a named step of the pack write order (the pause
storage/format/packs.py makes under PAUSE_ENV); shared by the pack and delta store tests."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import GPUSNAP, REPO, pythonpath
from storage.format.packs import PAUSE_ENV


def killed_at(store: Path, args: list[str], stage: str, tmp: Path) -> None:
    """Start `gpusnap ARGS` on STORE, wait until it reaches STAGE of the pack write order (the pause
    storage/format/packs.py makes under PAUSE_ENV), kill -9 it."""
    flag = tmp / f"paused-{stage}"
    env = dict(os.environ, PYTHONPATH=pythonpath(), **{PAUSE_ENV: f"{stage}:{flag}"})
    p = subprocess.Popen([*GPUSNAP, "--store", str(store), *args], env=env, cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert p.poll() is None, p.communicate()[1]
        assert time.monotonic() < deadline, "the put never reached " + stage
        time.sleep(0.01)
    assert int(flag.read_text()) == p.pid
    p.send_signal(signal.SIGKILL)
    p.wait()
    flag.unlink()
