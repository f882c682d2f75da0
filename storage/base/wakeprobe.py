"""How late a Python thread of this process wakes: a measuring aid for phases whose threads may wait on
the interpreter's lock (the GIL) or the CPU scheduler rather than on the disk.

A WakeProbe thread sleeps INTERVAL at a time and adds up how much later than asked it runs again. A
thread of this process that waits for the GIL after each of its C calls (a read, a decode, a write
into a pipe) loses up to the switch interval (5 ms) per wait beside a thread that holds the lock in
pure Python; the probe loses the same, so its lateness says whether that happens and how much.
Turned on by $GPUSNAP_WAKE_PROBE=1 (for measuring: it wakes 200 times a second).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any


def wanted() -> bool:
    """Whether $GPUSNAP_WAKE_PROBE asks for the probe (1)."""
    return os.environ.get("GPUSNAP_WAKE_PROBE", "").strip() == "1"


class WakeProbe:
    """The probe runs from start() to stop() (or inside a with block); report() after it."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpusnap-wake-probe", daemon=True)
        self.samples = 0
        self.late = 0.0
        self.late_max = 0.0
        self.late_over_5ms = 0
        self.seconds = 0.0

    def _run(self) -> None:
        begin = time.perf_counter()
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.interval)
            late = max(0.0, time.perf_counter() - t0 - self.interval)
            self.samples += 1
            self.late += late
            self.late_max = max(self.late_max, late)
            self.late_over_5ms += late > 0.005
        self.seconds = time.perf_counter() - begin

    def start(self) -> "WakeProbe":
        self._thread.start()
        return self

    def stop(self) -> None:
        """The probe ended (again: nothing more)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> "WakeProbe":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def report(self) -> dict[str, Any]:
        """What the probe saw: its wakes, their total and largest lateness, how many were over 5 ms."""
        return {"seconds": round(self.seconds, 3), "wakes": self.samples, "late_s": round(self.late, 4),
                "late_max_ms": round(self.late_max * 1000, 2), "late_over_5ms": self.late_over_5ms}
