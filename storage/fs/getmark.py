"""The marker a `store get` leaves in its hidden staging tree, so that gc deletes only trees it proves a get made.

Guarantees kept here: a get's tmp/ record holds a fresh random nonce; the get writes a file named
after that nonce as the first entry of its staging tree, and removes it just before the tree becomes
DEST. Its content (marker_content): for a get run as root, the HMAC of the nonce and uid under the
host key (storage.fs.hostkey, root-only, outside every store), which no other user can compute; for
a get run as another user, the nonce itself (that user could remove the tree anyway; gc then also
checks that every entry of it is that user's, storage.maintenance.gc). gc deletes a killed get's
staging tree only if that tree is a real directory (no link followed) of the record's user holding
such a marker: a regular file of that user, on the same device, whose content is the record's
marker content. A record nobody's get wrote (forged, or copied from another store) cannot name a
nonce that some directory carries, so it makes gc delete nothing.
"""
from __future__ import annotations

import errno
import hmac
import os
import re
import secrets
import stat

from storage.fs import hostkey

NONCE = re.compile(r"[0-9a-f]{32}")
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def new_nonce() -> str:
    return secrets.token_hex(16)


def marker_name(nonce: str) -> str:
    return f".gpusnap-get.{nonce}"


def marker_content(nonce: str, uid: int) -> bytes | None:
    """What the marker of NONCE in a tree of UID holds; None when this process cannot compute it (a
    root get's marker, checked by a process without the host key)."""
    if uid != 0:
        return nonce.encode()
    if os.geteuid() != 0:
        return None
    return hostkey.host_key().mac("get-marker", [nonce, uid]).encode()


def write_marker(dir_fd: int, nonce: str) -> None:
    """The marker of NONCE in the (new, empty) staging directory DIR_FD."""
    content = marker_content(nonce, os.geteuid())
    assert content is not None
    fd = os.open(marker_name(nonce), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=dir_fd)
    try:
        os.write(fd, content)
    finally:
        os.close(fd)


def remove_marker(dir_fd: int, nonce: str) -> None:
    try:
        os.unlink(marker_name(nonce), dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def carries_marker(dir_fd: int, nonce: str, uid: int) -> bool:
    """Whether the directory DIR_FD (already opened without following links) holds the marker of NONCE,
    written by UID on DIR_FD's device."""
    if not NONCE.fullmatch(nonce):
        return False
    want = marker_content(nonce, uid)
    if want is None:
        return False
    st_dir = os.fstat(dir_fd)
    try:
        fd = os.open(marker_name(nonce), _READ, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO, errno.EACCES, errno.EISDIR):
            return False
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_dev != st_dir.st_dev or st.st_size != len(want):
            return False
        return hmac.compare_digest(os.read(fd, len(want) + 1), want)
    finally:
        os.close(fd)
