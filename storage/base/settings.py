"""gpusnap's GPUSNAP_* settings read one way: parsed, checked, and refused in one line naming the
variable (for a host that must bound a setting, and for measuring)."""
from __future__ import annotations

import os
from typing import Any, Callable

from storage.base.errors import GpusnapError


def setting(name: str, default: Any, parse: Callable[[str], Any], ok: Callable[[Any], bool], expected: str,
            error: type[GpusnapError]) -> Any:
    """$NAME parsed by PARSE (unset or empty: DEFAULT); ERROR "NAME='...': expected EXPECTED" when it does
    not parse or OK refuses it."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        x = parse(v)
    except ValueError:
        raise error(f"{name}={v!r}: expected {expected}") from None
    if not ok(x):
        raise error(f"{name}={v!r}: expected {expected}")
    return x


class SettingError(GpusnapError):
    """A GPUSNAP_* setting that does not parse or is out of its range."""


def switch(name: str, default: bool | None, error: type[GpusnapError] = SettingError) -> bool | None:
    """$NAME as an on/off switch: 1 True, 0 False, unset or empty DEFAULT; ERROR "NAME='...': expected 0
    or 1" for anything else."""
    v = setting(name, None, int, lambda v: v in (0, 1), "0 or 1", error)
    return default if v is None else bool(v)


SWITCH_LEAST_S, SWITCH_MOST_S = 1e-6, 0.1  # the interpreter keeps whole microseconds: less reads back as 0


def switch_interval() -> float | None:
    """$GPUSNAP_SWITCH_INTERVAL: seconds (1e-6 <= s <= 0.1) a thread that wants the interpreter's lock waits
    before the holder is made to drop it, for this process and the helpers it starts; None (unset):
    Python's own, 5 ms. For measuring. Each chunk's work gives the lock up for its C calls (the
    codecs, the hash, the reads) and takes it back after each: a pure-Python thread beside such a
    thread held each taking back up to the interval (on the dev VM a 1.6 ms decode took 18 ms beside a
    busy loop at 5 ms, 2.7 ms at 0.2 ms). Whether the put's and the fill's threads lose time so on
    a machine of many cores is what the setting is there to measure."""
    s: float | None = setting("GPUSNAP_SWITCH_INTERVAL", None, float, lambda s: SWITCH_LEAST_S <= s <= SWITCH_MOST_S,
                              f"seconds, from {SWITCH_LEAST_S:g} to {SWITCH_MOST_S:g}", SettingError)
    return s


def apply_switch_interval() -> None:
    """switch_interval(), set for this process (nothing when unset); SettingError for a bad value."""
    import sys
    s = switch_interval()
    if s is not None:
        sys.setswitchinterval(s)
