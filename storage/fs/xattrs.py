"""Extended attributes of stored files: read on put, checked on load, restored on get.

Guarantees kept here:
- Only the namespaces NAMESPACES are kept: user.* (always), security.* and trusted.* (where the
  reader may read them: trusted.* needs root). system.* (ACLs, kept by the kernel in their own
  format) is not stored.
- Reads go through the directory fd that holds the entry (/proc/self/fd/DFD/ENTRY, the last
  component not followed), so no link is followed to another file.
- A manifest's `xattrs` is bounded as the kernel bounds them: at most MAX_COUNT names per entry,
  each a string of at most 255 bytes in a kept namespace, each value (base64 in the manifest) at
  most 64 KiB decoded, at most MAX_TOTAL bytes per entry (check); anything else is damage.
- On get, user.* is restored always; security.* and trusted.* only when PRIVILEGED (root restoring
  owners), so a snapshot cannot give a restoring user's file a capability or a label.
"""
from __future__ import annotations

import base64
import binascii
import os
from typing import Any

NAMESPACES = ("user.", "security.", "trusted.")
MAX_NAME = 255
MAX_VALUE = 64 << 10
MAX_COUNT = 128
MAX_TOTAL = 256 << 10


def _proc(dfd: int, entry: str) -> str:
    return f"/proc/self/fd/{dfd}/{entry}"


def read_xattrs(dfd: int, entry: str) -> dict[str, str]:
    """ENTRY's kept extended attributes (name -> base64 value), read without following it."""
    path = _proc(dfd, entry)
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (95, 61):  # EOPNOTSUPP, ENODATA: a file system without xattrs
            return {}
        raise
    out: dict[str, str] = {}
    for n in sorted(names):
        if not n.startswith(NAMESPACES):
            continue
        try:
            v = os.getxattr(path, n, follow_symlinks=False)
        except OSError as e:
            if e.errno in (61, 1, 13):  # gone meanwhile, or not readable by this user
                continue
            raise
        out[n] = base64.b64encode(v).decode()
    return out


def check(xa: Any) -> str | None:
    """What is wrong with a manifest's `xattrs` value (None: nothing)."""
    if not isinstance(xa, dict) or len(xa) > MAX_COUNT:
        return "bad xattrs (not an object, or too many names)"
    total = 0
    for n, v in xa.items():
        try:
            size = len(os.fsencode(n)) if isinstance(n, str) else 0
        except UnicodeEncodeError:  # a lone surrogate outside the file system encoding's escapes
            size = 0
        if not (isinstance(n, str) and n.startswith(NAMESPACES) and 0 < size <= MAX_NAME
                and "\x00" not in n and isinstance(v, str) and len(v) <= (MAX_VALUE * 4 // 3) + 4):
            return f"bad xattr {str(n)[:64]!r}"
        try:
            total += len(base64.b64decode(v, validate=True))
        except (binascii.Error, ValueError):
            return f"bad xattr value of {n[:64]!r}"
    if total > MAX_TOTAL:
        return "xattrs too large"
    return None


def restore_xattrs(target: int | str, xa: dict[str, str], privileged: bool, user: bool = True) -> None:
    """Set XA on TARGET (an fd, or a /proc/self/fd path of one); user.* when USER, the others only
    when PRIVILEGED."""
    for n, v in xa.items():
        if n.startswith("user.") and not user:
            continue
        if not n.startswith("user.") and not privileged:
            continue
        if isinstance(target, int):
            os.setxattr(target, n, base64.b64decode(v))
        else:
            os.setxattr(target, n, base64.b64decode(v), follow_symlinks=False)
