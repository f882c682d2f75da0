"""Validation of snapshot names and stream names, the only strings that become paths."""
from __future__ import annotations

import re

from storage.base.errors import EXIT_USAGE, GpusnapError

NAME_MAX = 128
# Stream names (paths inside a snapshot), bounded at load so no manifest can make a walk deep or long:
STREAM_PATH_MAX = 4096   # bytes of UTF-8: Linux's PATH_MAX, the longest path one system call takes
STREAM_COMPONENT_MAX = 255  # bytes of one component: Linux's NAME_MAX (longer names cannot exist on disk)
# components; the deepest real trees (node_modules, Maven layouts) stay far below 100. 256 bounds a
# get's chain of open directory fds and its work per file to what the default 1024 fds allow.
STREAM_DEPTH_MAX = 256
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+=@-]{0,%d}" % (NAME_MAX - 1))


class InvalidNameError(GpusnapError, ValueError):
    """A snapshot or stream name that could escape the store or is otherwise unusable. Given on the
    command line it is a bad argument (exit 2); read from a manifest it is damage (the loader turns it
    into a ManifestError)."""

    exit_code = EXIT_USAGE


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
    size = len(name.encode("utf-8", "surrogateescape"))  # file names that are not UTF-8 keep their bytes
    if size > STREAM_PATH_MAX:
        raise InvalidNameError(f"stream name {name[:64]!r}... is {size} bytes long; the limit is {STREAM_PATH_MAX}")
    parts = name.split("/")
    if len(parts) > STREAM_DEPTH_MAX:
        raise InvalidNameError(f"stream name {name[:64]!r}... is {len(parts)} components deep; the limit is "
                               f"{STREAM_DEPTH_MAX}")
    if any(part in ("", ".", "..") for part in parts):
        raise InvalidNameError(f"stream name {name!r} has an empty, '.' or '..' component")
    if any(len(part.encode("utf-8", "surrogateescape")) > STREAM_COMPONENT_MAX for part in parts):
        raise InvalidNameError(f"stream name {name[:64]!r}... has a component longer than {STREAM_COMPONENT_MAX} bytes")
    return name
