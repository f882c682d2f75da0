"""gpusnap's GPUSNAP_* settings read one way: parsed, checked, and refused in one line naming the
variable (for a host that must bound a setting, and for measuring)."""
from __future__ import annotations

import os
from typing import Any, Callable

from .errors import GpusnapError


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
