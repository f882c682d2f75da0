"""storage.base.wakeprobe: how late a thread of this process wakes (the restore's CRIU phase reports it
under GPUSNAP_WAKE_PROBE=1; tests/test_criu_stream.py checks the report)."""
from __future__ import annotations

import sys
import threading
import time

from storage.base.wakeprobe import WakeProbe


def test_a_thread_holding_the_interpreter_makes_the_probe_late() -> None:
    stop = threading.Event()

    def hog() -> None:  # pure Python: gives the interpreter's lock up only when made to
        n = 0
        while not stop.is_set():
            n += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    try:
        with WakeProbe(interval=0.001) as probe:
            t = threading.Thread(target=hog)
            t.start()
            time.sleep(0.3)
            stop.set()
            t.join()
    finally:
        sys.setswitchinterval(old)
    r = probe.report()
    assert r["wakes"] >= 10 and r["seconds"] >= 0.25, r
    # each wake waits for the hog to be made to drop the lock: up to the 5 ms interval (more on a busy machine)
    assert r["late_max_ms"] >= 1.0 and r["late_s"] > 0, r
    probe.stop()  # again: nothing more
    assert probe.report() == r
