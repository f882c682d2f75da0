"""Test hooks that stop gpusnap at an exact step, so that a test can kill or signal it there: with
ENV=STAGE:FILE in the environment, the first time STAGE is reached in this process our pid is written
to FILE (atomically) and gpusnap waits until FILE is removed. Without it: one environment lookup."""
from __future__ import annotations

import os
import time

_paused: set[tuple[str, str]] = set()


def pause_at(env: str, stage: str) -> None:
    """Wait at STAGE if the environment variable ENV names it (see above)."""
    want, _, path = os.environ.get(env, "").partition(":")
    if want != stage or not path or (env, stage) in _paused:
        return
    _paused.add((env, stage))
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)
    while os.path.exists(path):
        time.sleep(0.02)
