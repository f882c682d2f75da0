"""Which process owns a temporary entry of the store, written into the entry's name, and whether it still runs.

Guarantee kept here: an owner is alive only if a process with its pid exists now, started at the same
clock tick after the same boot; a reused pid, a reboot or an unreadable /proc entry of a vanished
process never make a dead owner look alive (FORMAT.md, "Temporary entries and their owners").
"""
from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass
from functools import lru_cache

_TOKEN = re.compile(r"(\d{1,10})-(\d{1,20})-([0-9a-f]{8})")


@lru_cache(maxsize=1)
def boot_tag() -> str:
    """The first 8 hex digits of this boot's id (a different boot: every recorded owner is gone)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:8]
    except OSError:
        return "00000000"


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (clock ticks after boot), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count fields after the last ')'
    rest = data[data.rfind(b")") + 2:].split()
    try:
        return int(rest[19])
    except (IndexError, ValueError):
        return None


@dataclass(frozen=True)
class ProcessOwner:
    pid: int
    start: int
    boot: str

    @classmethod
    def current(cls) -> "ProcessOwner":
        pid = os.getpid()
        return cls(pid, start_time(pid) or 0, boot_tag())

    @classmethod
    def parse(cls, token: str) -> "ProcessOwner | None":
        """The owner written as TOKEN (PID-START-BOOT), or None when TOKEN is not one."""
        m = _TOKEN.fullmatch(token)
        return cls(int(m.group(1)), int(m.group(2)), m.group(3)) if m else None

    @property
    def token(self) -> str:
        return f"{self.pid}-{self.start}-{self.boot}"

    def alive(self) -> bool:
        return self.boot == boot_tag() and start_time(self.pid) == self.start


_owner_cache: dict[int, ProcessOwner] = {}


def this_owner() -> ProcessOwner:
    """This process as the owner of the temporary entries it creates (recomputed after a fork)."""
    pid = os.getpid()
    if pid not in _owner_cache:
        _owner_cache.clear()
        _owner_cache[pid] = ProcessOwner.current()
    return _owner_cache[pid]


def owned_name(kind: str) -> str:
    """A fresh name for a tmp/ entry of KIND owned by this process and thread."""
    return f"{kind}.{this_owner().token}.{threading.get_ident()}.{time.monotonic_ns()}"
