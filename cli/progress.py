"""Progress reporting for long work, on stderr: a bar with bytes and GB/s on a terminal; a plain line
every few seconds (and one at the end) where stderr is not a terminal but progress was asked for (CI,
journald, a log file); nothing otherwise. Reporting never fails or slows the work it reports on."""
from __future__ import annotations

import sys
import threading
import time
from enum import Enum
from types import TracebackType
from typing import Any, TextIO

PLAIN_INTERVAL_S = 5.0


class Style(Enum):
    BAR = "bar"      # rich's live bar (stderr is a terminal)
    LINES = "lines"  # one plain line every PLAIN_INTERVAL_S and one when done
    OFF = "off"


def choose_style(requested: bool | None, tty: bool) -> Style:
    """--progress: a bar on a terminal, plain lines elsewhere; --no-progress: nothing; neither: a bar
    on a terminal, nothing elsewhere (a script's stderr stays quiet unless it asks)."""
    if requested is False:
        return Style.OFF
    if tty:
        return Style.BAR
    return Style.LINES if requested else Style.OFF


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


class Progress:
    """Thread-safe byte counter that reports on stderr in the chosen style."""

    def __init__(self, label: str, enabled: bool | None = None, *, interval_s: float = PLAIN_INTERVAL_S,
                 stream: TextIO | None = None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.style = choose_style(enabled, self.stream.isatty())
        self.enabled = self.style is not Style.OFF
        self.interval_s = interval_s
        self.done = 0
        self.total: int | None = None
        self._lock = threading.Lock()
        self._bar: Any = None
        self._task: Any = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._started = False
        self.t0 = time.perf_counter()

    def start(self, total: int | None) -> None:
        self.total = total
        self.t0 = time.perf_counter()
        self._started = True
        if self.style is Style.BAR:
            from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)
            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=False),
                            TransferSpeedColumn(), TimeRemainingColumn(), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=total)
        elif self.style is Style.LINES and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="gpusnap-progress", daemon=True)
            self._ticker.start()

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            if self._bar is not None:
                self._bar.update(self._task, completed=self.done)

    def line(self, final: bool = False, failed: bool = False) -> str:
        """`LABEL: 1.20 GB of 4.00 GB (30%), 0.52 GB/s`; final: `LABEL: done, 4.00 GB in 7.7 s, 0.52 GB/s`
        (`stopped` instead of `done` when the work failed)."""
        with self._lock:
            done, total = self.done, self.total
        secs = max(time.perf_counter() - self.t0, 1e-9)
        rate = f"{done / secs / 1e9:.2f} GB/s"
        if final:
            return f"{self.label}: {'stopped' if failed else 'done'}, {_gb(done)} in {secs:.1f} s, {rate}"
        of = f" of {_gb(total)} ({100 * done / total:.0f}%)" if total else ""
        return f"{self.label}: {_gb(done)}{of}, {rate}"

    def _say(self, text: str) -> None:
        try:
            print(text, file=self.stream, flush=True)
        except (OSError, ValueError):  # a closed or broken stderr must not fail the work
            pass

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._say(self.line())

    def close(self, failed: bool = False) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
            self._ticker = None
            self._say(self.line(final=True, failed=failed))

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close(failed=et is not None)
