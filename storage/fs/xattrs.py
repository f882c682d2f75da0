"""Extended attributes of stored files: read on put, checked on load, restored on get.

Guarantees kept here:
- Only the namespaces NAMESPACES are kept: user.* (always), security.* and trusted.* (where the
  reader may read them: trusted.* needs root), and of system.* only the POSIX ACLs (ACL_NAMES:
  the access ACL of a file or directory, a directory's default ACL), in the kernel's xattr form,
  checked entry by entry on load (check_acl). No other system.* name is stored.
- Reads go through the directory fd that holds the entry (/proc/self/fd/DFD/ENTRY, the last
  component not followed), so no link is followed to another file.
- A manifest's `xattrs` is bounded as the kernel bounds them: at most MAX_COUNT names per entry,
  each a string of at most 255 bytes in a kept namespace, each value (base64 in the manifest) at
  most 64 KiB decoded, at most MAX_TOTAL bytes per entry (check); anything else is damage.
- On get, user.* and ACLs are restored always (an ACL, like the mode bits, is what the owner of a
  file may set: it grants nothing a chmod could not); security.* and trusted.* only when PRIVILEGED
  (root restoring owners), so a snapshot cannot give a restoring user's file a capability or a label.
"""
from __future__ import annotations

import base64
import binascii
import os
import struct
from typing import Any

NAMESPACES = ("user.", "security.", "trusted.")
ACL_ACCESS = "system.posix_acl_access"
ACL_DEFAULT = "system.posix_acl_default"
ACL_NAMES = (ACL_ACCESS, ACL_DEFAULT)
ACL_VERSION = 2            # the kernel's POSIX_ACL_XATTR_VERSION
ACL_MAX_ENTRIES = 1024
_ACL_TAGS = {0x01: "user_obj", 0x02: "user", 0x04: "group_obj", 0x08: "group", 0x10: "mask", 0x20: "other"}
_UNDEFINED_ID = 0xFFFFFFFF
MAX_NAME = 255
MAX_VALUE = 64 << 10
MAX_COUNT = 128
MAX_TOTAL = 256 << 10


def _proc(dfd: int, entry: str) -> str:
    return f"/proc/self/fd/{dfd}/{entry}"


def acls_for(mode: int) -> tuple[str, ...]:
    """The ACL names kept for an entry of MODE: both for a directory, the access ACL for a file."""
    import stat
    return ACL_NAMES if stat.S_ISDIR(mode) else (ACL_ACCESS,) if stat.S_ISREG(mode) else ()


def read_xattrs(dfd: int, entry: str, acls: tuple[str, ...] = ()) -> dict[str, str]:
    """ENTRY's kept extended attributes (name -> base64 value), read without following it; of the
    ACL names, those in ACLS (acls_for: what its type can hold)."""
    path = _proc(dfd, entry)
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError as e:
        if e.errno in (95, 61):  # EOPNOTSUPP, ENODATA: a file system without xattrs
            return {}
        raise
    out: dict[str, str] = {}
    for n in sorted(names):
        if not (n.startswith(NAMESPACES) or n in acls):
            continue
        try:
            v = os.getxattr(path, n, follow_symlinks=False)
        except OSError as e:
            if e.errno in (61, 1, 13):  # gone meanwhile, or not readable by this user
                continue
            raise
        out[n] = base64.b64encode(v).decode()
    return out


def has_acl(xa: Any) -> bool:
    """Whether a stream's `xattrs` holds a POSIX ACL (a manifest of version 4)."""
    return isinstance(xa, dict) and any(n in ACL_NAMES for n in xa)


def check_acl(value: bytes) -> str | None:
    """What is wrong with VALUE as the kernel's xattr form of a POSIX ACL (None: nothing): a u32
    version 2, then 1..ACL_MAX_ENTRIES entries (u16 tag, u16 perm, u32 id), all little-endian."""
    if len(value) < 12 or (len(value) - 4) % 8 or (len(value) - 4) // 8 > ACL_MAX_ENTRIES:
        return "an ACL of a bad length"
    if struct.unpack_from("<I", value)[0] != ACL_VERSION:
        return "an ACL of an unknown version"
    for off in range(4, len(value), 8):
        tag, perm, ident = struct.unpack_from("<HHI", value, off)
        if tag not in _ACL_TAGS or perm > 7:
            return "an ACL entry of an unknown tag or permission"
        if (ident == _UNDEFINED_ID) == (tag in (0x02, 0x08)):
            return "an ACL entry whose id does not fit its tag"
    return None


def check(xa: Any, version: int = 4, kind: str | None = None) -> str | None:
    """What is wrong with a manifest's `xattrs` value (None: nothing). ACLs only from manifest
    VERSION 4, an access ACL on a file or directory, a default ACL on a directory (KIND: the stream's
    type, where known)."""
    if not isinstance(xa, dict) or len(xa) > MAX_COUNT:
        return "bad xattrs (not an object, or too many names)"
    total = 0
    for n, v in xa.items():
        try:
            size = len(os.fsencode(n)) if isinstance(n, str) else 0
        except UnicodeEncodeError:  # a lone surrogate outside the file system encoding's escapes
            size = 0
        acl = n in ACL_NAMES
        if acl and (version < 4 or (kind is not None and kind not in (("dir",) if n == ACL_DEFAULT else ("file", "dir")))):
            return f"xattr {n} {'before manifest version 4' if version < 4 else f'on a {kind}'}"
        if not (isinstance(n, str) and (n.startswith(NAMESPACES) or acl) and 0 < size <= MAX_NAME
                and "\x00" not in n and isinstance(v, str) and len(v) <= (MAX_VALUE * 4 // 3) + 4):
            return f"bad xattr {str(n)[:64]!r}"
        try:
            raw = base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError):
            return f"bad xattr value of {n[:64]!r}"
        total += len(raw)
        if acl and (why := check_acl(raw)):
            return f"{why} in xattr {n}"
    if total > MAX_TOTAL:
        return "xattrs too large"
    return None


def restore_xattrs(target: int | str, xa: dict[str, str], privileged: bool, user: bool = True) -> None:
    """Set XA on TARGET (an fd, or a /proc/self/fd path of one); user.* and ACLs when USER, the
    others only when PRIVILEGED. An ACL on a file system without ACLs (EOPNOTSUPP) is an error: it
    would otherwise widen or narrow access silently."""
    for n, v in xa.items():
        mine = n.startswith("user.") or n in ACL_NAMES
        if mine and not user:
            continue
        if not mine and not privileged:
            continue
        if isinstance(target, int):
            os.setxattr(target, n, base64.b64decode(v))
        else:
            os.setxattr(target, n, base64.b64decode(v), follow_symlinks=False)
