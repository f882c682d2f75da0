"""Progress reporting for long work: a bar with bytes and GB/s on a terminal, silence otherwise."""
from __future__ import annotations

import sys
import threading
import time
from types import TracebackType


class Progress:
    """Thread-safe byte counter with an optional rich progress bar on stderr."""

    def __init__(self, label: str, enabled: bool | None = None) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.done = 0
        self.total: int | None = None
        self._lock = threading.Lock()
        self._bar = None
        self._task = None
        self.t0 = time.perf_counter()

    def start(self, total: int | None) -> None:
        self.total = total
        self.t0 = time.perf_counter()
        if not self.enabled:
            return
        from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TextColumn,
                                   TimeRemainingColumn, TransferSpeedColumn)
        self._bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=False),
                        TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
        self._bar.start()
        self._task = self._bar.add_task(self.label, total=total)

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
