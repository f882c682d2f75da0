"""gpusnap's two lines in a CRIU config file: a marker comment and `action-script PATH`.

Pure functions on the file's bytes. Guarantees: `add` is idempotent (a block already naming PATH
changes nothing; one naming another path is pointed at PATH); `remove` takes out exactly gpusnap's
lines, and the newline `add` had to put before them when the file did not end with one, so a file
that existed before `add` is byte-identical after `remove` (if nothing was appended after the block).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

MARKER = (b"# gpusnap-criu-hook: added by `gpusnap hook install`; "
          b"`gpusnap hook uninstall` removes this line and the next")
_ACTION = re.compile(rb"^\s*action-script\s+(\S+)\s*$")


class BadHookPath(ValueError):
    """A hook path that a CRIU config line cannot carry (relative, or with spaces or control characters)."""


def _lines(data: bytes) -> list[bytes]:
    """DATA split after each newline (the last element is a partial line or absent)."""
    return [ln for ln in re.split(rb"(?<=\n)", data) if ln]


def _blocks(lines: list[bytes]) -> list[int]:
    """Indexes of gpusnap's marker lines that are followed by an action-script line."""
    return [i for i, ln in enumerate(lines[:-1]) if ln.rstrip(b"\n") == MARKER and _ACTION.match(lines[i + 1])]


def action_scripts(data: bytes) -> list[tuple[str, bool]]:
    """Every `action-script PATH` line in DATA: (PATH, whether gpusnap's marker precedes it)."""
    lines = _lines(data)
    ours = {i + 1 for i in _blocks(lines)}
    out = []
    for i, ln in enumerate(lines):
        m = _ACTION.match(ln)
        if m and not ln.lstrip().startswith(b"#"):
            out.append((m.group(1).decode(errors="replace"), i in ours))
    return out


def _check(path: str) -> bytes:
    if not path.startswith("/") or re.search(r"[\s\x00-\x1f\x7f#'\"\\]", path):
        raise BadHookPath(f"{path!r}: a hook path in a CRIU config must be absolute, without spaces, "
                          f"quotes or control characters")
    return path.encode()


@dataclass(frozen=True)
class Added:
    data: bytes
    changed: bool
    added_newline: bool   # the file did not end with a newline; one was put before the block


def add(data: bytes, path: str) -> Added:
    line = b"action-script " + _check(path) + b"\n"
    lines = _lines(data)
    blocks = _blocks(lines)
    if blocks:
        for i in blocks:
            lines[i + 1] = line if lines[i + 1].endswith(b"\n") else line.rstrip(b"\n")
        new = b"".join(lines)
        return Added(new, new != data, False)
    if any(p == path for p, _ in action_scripts(data)):   # the same line written by hand: leave it
        return Added(data, False, False)
    sep = b"\n" if data and not data.endswith(b"\n") else b""
    return Added(data + sep + MARKER + b"\n" + line, True, bool(sep))


def remove(data: bytes, added_newline: bool) -> bytes:
    """DATA without gpusnap's blocks (and without the newline add put before a block left at the end)."""
    lines = _lines(data)
    for i in reversed(_blocks(lines)):
        at_end = i + 2 == len(lines)
        del lines[i:i + 2]
        if at_end and added_newline and i > 0 and lines[i - 1].endswith(b"\n"):
            lines[i - 1] = lines[i - 1][:-1]
    return b"".join(lines)
