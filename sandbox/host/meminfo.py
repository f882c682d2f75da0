"""The host's /proc/meminfo, read in one place (the split fill's budgets, doctor's huge-page figures)."""
from __future__ import annotations


def meminfo() -> dict[str, int]:
    """Every /proc/meminfo line as name -> its number (kB for sizes, a count for the HugePages_* lines);
    empty where the file cannot be read."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                try:
                    out[k] = int(v.split()[0])
                except (ValueError, IndexError):
                    continue
    except OSError:
        pass
    return out


def available_bytes() -> int:
    """MemAvailable in bytes (0 where unknown)."""
    return meminfo().get("MemAvailable", 0) * 1024
