"""Validation of snapshot names and stream names, the only strings that become paths."""
from __future__ import annotations

import re

from .errors import GpusnapError

NAME_MAX = 128
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=@-]{0,%d}" % (NAME_MAX - 1))


class InvalidNameError(GpusnapError, ValueError):
    """A snapshot or stream name that could escape the store or is otherwise unusable."""


def validate_snapshot_name(name: str) -> str:
    """Return NAME if it is a valid snapshot name, else raise InvalidNameError saying why."""
    if not isinstance(name, str) or name == "":
        raise InvalidNameError("snapshot name is empty")
    if "\x00" in name:
        raise InvalidNameError("snapshot name contains a NUL byte")
    if len(name) > NAME_MAX:
        raise InvalidNameError(f"snapshot name is {len(name)} characters long; the limit is {NAME_MAX}")
    if "/" in name or "\\" in name:
        raise InvalidNameError(f"snapshot name {name!r} contains a path separator")
    if name.startswith("."):
        raise InvalidNameError(f"snapshot name {name!r} starts with a dot")
    if not _NAME_RE.fullmatch(name):
        raise InvalidNameError(
            f"snapshot name {name!r} is invalid: use letters, digits and _ . + = @ -, "
            "starting with a letter, digit or _")
    return name


def validate_stream_name(name: str) -> str:
    """Return NAME if it is a relative POSIX path with no '', '.' or '..' component."""
    if not name or "\x00" in name or name.startswith("/"):
        raise InvalidNameError(f"stream name {name!r} must be a non-empty relative path")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise InvalidNameError(f"stream name {name!r} has an empty, '.' or '..' component")
    return name
