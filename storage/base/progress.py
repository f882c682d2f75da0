"""The progress interface storage reports to: what long work (put, get, verify, push, pull, a GPU
checkpoint) tells whoever watches it. storage calls only this; the CLI's cli/progress.py implements it
(a bar or plain lines on stderr). Reporting is optional everywhere: callers pass None for no reports."""
from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """A byte counter for one piece of work."""

    def start(self, total: int | None) -> None:
        """The work begins; total: the bytes it will move, None if not known."""

    def advance(self, n: int) -> None:
        """n more bytes done (called from any thread)."""
