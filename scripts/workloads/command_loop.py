"""The file protocol a test workload speaks with workload_control.Workload, in one place: the workload
writes `ready` (JSON) once, then polls for `cmd` (one line), runs it and answers in `cmd.done` (JSON
with the command's result and its seconds). Every file appears by rename, so the controller never
reads half of one. No torch here: the workloads bring their own."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable


def _publish(directory: str, name: str, doc: dict[str, Any]) -> None:
    tmp = os.path.join(directory, name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.rename(tmp, os.path.join(directory, name))


def announce(directory: str, ready: dict[str, Any]) -> None:
    """READY (pid, size, ...) published as DIRECTORY/ready: the controller starts from it."""
    _publish(directory, "ready", ready)


def serve(directory: str, handle: Callable[[list[str]], dict[str, Any] | None],
          settle: Callable[[], None] = lambda: None) -> None:
    """Run commands until `exit`: HANDLE(words) gives the result (None: stop without answering);
    SETTLE (e.g. a device synchronize) runs before the answer is timed and published."""
    cmdf = os.path.join(directory, "cmd")
    while True:
        if not os.path.exists(cmdf):
            time.sleep(0.01)
            continue
        with open(cmdf) as f:
            words = f.read().split() or [""]
        os.unlink(cmdf)
        t0 = time.perf_counter()
        if words[0] == "exit":
            return
        out = handle(words)
        if out is None:
            return
        settle()
        _publish(directory, "cmd.done", {"cmd": words[0], **out, "seconds": time.perf_counter() - t0})
