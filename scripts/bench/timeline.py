"""What the machine did while a benchmark step ran: busy cores, iowait and the disk's read and write rates,
sampled from /proc every INTERVAL seconds, summarized per phase.

A phase is a span of time.monotonic() (CLOCK_MONOTONIC, the same clock in every process of the
machine): `gpusnap criu restore --json` reports its own phase boundaries (stages.served.monotonic),
so the benchmark can say, for instance, whether the split fill after CRIU kept the disk at its cold
read rate or the cores busy. Sampling costs one read of /proc/stat and /proc/diskstats per interval.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

SECTOR = 512


def _cpu() -> tuple[float, float, float, float]:
    """(busy, iowait, steal, total) clock ticks of all CPUs since boot. Busy counts steal too (the time
    a virtual machine's CPUs wanted to run while its host ran something else), as it always has here:
    the steal column says how much of it was that."""
    with open("/proc/stat") as f:
        v = [float(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = v[:7]
    steal = v[7] if len(v) > 7 else 0.0
    busy = user + nice + system + irq + softirq + steal
    return busy, iowait, steal, busy + idle + iowait


def disk_of(path: str) -> str | None:
    """The whole-disk name (as /proc/diskstats lists it) holding PATH's file system, or None."""
    st = os.stat(path)
    sys_dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        real = os.path.realpath(sys_dev)
    except OSError:
        return None
    if not os.path.exists(real):
        return None
    if os.path.exists(os.path.join(real, "partition")):
        real = os.path.dirname(real)
    return os.path.basename(real)


def _disk(name: str | None) -> tuple[int, int, int]:
    """(bytes read, bytes written, milliseconds with any I/O in flight) by disk NAME since boot (zeros
    without one). The bytes count when a request completes, so a sample in which large reads were
    in flight but none ended reads nothing; the milliseconds (io_ticks) tell that from an idle disk."""
    if name is None:
        return 0, 0, 0
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if len(p) > 12 and p[2] == name:
                return int(p[5]) * SECTOR, int(p[9]) * SECTOR, int(p[12])
    return 0, 0, 0


class Timeline:
    """Samples the machine every INTERVAL seconds while open (a context manager): rows of
    (monotonic seconds, busy cores, iowait cores, disk read GB/s, disk write GB/s, steal cores, disk
    busy: the share of the sample during which the disk had a request in flight)."""

    COLUMNS = ("t", "busy_cores", "iowait_cores", "read_gbps", "write_gbps", "steal_cores", "disk_busy")

    def __init__(self, path: str, interval: float = 0.1) -> None:
        self.disk = disk_of(path)
        self.interval = interval
        self.rows: list[tuple[float, float, float, float, float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)
        self.ncpu = os.cpu_count() or 1

    def _run(self) -> None:
        t, (b, w, st, tot), (r, wr, io) = time.monotonic(), _cpu(), _disk(self.disk)
        while not self._stop.wait(self.interval):
            t2, (b2, w2, st2, tot2), (r2, wr2, io2) = time.monotonic(), _cpu(), _disk(self.disk)
            dt, dtot = t2 - t, max(1.0, tot2 - tot)
            self.rows.append((t2, self.ncpu * (b2 - b) / dtot, self.ncpu * (w2 - w) / dtot,
                              (r2 - r) / dt / 1e9, (wr2 - wr) / dt / 1e9, self.ncpu * (st2 - st) / dtot,
                              min(1.0, (io2 - io) / 1e3 / dt)))
            t, b, w, st, tot, r, wr, io = t2, b2, w2, st2, tot2, r2, wr2, io2

    def __enter__(self) -> "Timeline":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def span(self, t0: float, t1: float) -> dict[str, float]:
        """Averages over the samples that ended in [T0, T1]: busy and iowait cores, disk GB/s, and the
        GB the disk read and wrote meanwhile."""
        rows = [r for r in self.rows if t0 < r[0] <= t1 + self.interval / 2]
        if not rows or t1 <= t0:
            return {"seconds": max(0.0, t1 - t0), "samples": 0}
        n = len(rows)
        return {"seconds": t1 - t0, "samples": n,
                "busy_cores": sum(r[1] for r in rows) / n, "iowait_cores": sum(r[2] for r in rows) / n,
                "steal_cores": sum(r[5] for r in rows) / n, "disk_busy": sum(r[6] for r in rows) / n,
                "read_gbps": sum(r[3] for r in rows) / n, "write_gbps": sum(r[4] for r in rows) / n,
                "read_gb": sum(r[3] for r in rows) * self.interval, "write_gb": sum(r[4] for r in rows) * self.interval}

    def phases(self, marks: list[tuple[str, float]]) -> dict[str, dict[str, float]]:
        """MARKS: (name, monotonic) in order; each phase runs from its mark to the next one's."""
        return {name: self.span(t, marks[i + 1][1]) for i, (name, t) in enumerate(marks[:-1])}

    def as_json(self, since: float) -> dict[str, Any]:
        """The raw rows, times relative to SINCE (for a plot)."""
        return {"disk": self.disk, "interval": self.interval, "ncpu": self.ncpu,
                "columns": list(self.COLUMNS),
                "rows": [[round(r[0] - since, 3), *(round(x, 3) for x in r[1:])] for r in self.rows if r[0] >= since]}


def phase_line(phases: dict[str, dict[str, float]]) -> str:
    """One line per benchmark step: each phase's seconds, busy cores and disk rates."""
    return "; ".join(f"{k} {v['seconds']:.1f} s" + (f" busy {v['busy_cores']:.1f} cores iowait {v['iowait_cores']:.1f}"
                                                    + (f" steal {v['steal_cores']:.1f}" if v.get("steal_cores", 0) >= 0.05 else "")
                                                    + f" read {v['read_gbps']:.2f} write {v['write_gbps']:.2f} GB/s"
                                                    if v.get("samples") else "")
                     for k, v in phases.items())
