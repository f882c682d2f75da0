"""The journal's secret: what lets `gpusnap recover` tell a record gpusnap wrote from a forged one.

Each store's journal holds a random key in STORE/journal/key (32 bytes, mode 0600, owned by the user
gpusnap runs as, created on first use). Every journal record carries an HMAC-SHA256 over its canonical
JSON under that key, and a dump's manifest carries one over the operation id, the snapshot's name and
the pids it names (`meta.op_mac`): whoever can write the journal directory or a manifest but cannot read
the key (a tenant, another user) cannot make a record or a commit that recovery acts on.

Guarantees kept here: the key file is opened with O_NOFOLLOW, must be a regular file of our user with
no group or other permissions and exactly KEY_BYTES long, and appears whole (written to a temporary
file, then linked into place: two first uses at once agree on one key); a key that fails these checks is an error, never replaced silently (the
records signed with it would then all read as forged). MACs are compared in constant time.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from typing import Any

from storage.api import GpusnapError

KEY_NAME = "key"
KEY_BYTES = 32


class TrustError(GpusnapError):
    """The journal's key cannot be made or read safely."""


class JournalKey:
    """The HMAC key of one store's journal directory."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    @classmethod
    def of(cls, journal_dir: str) -> "JournalKey":
        """JOURNAL_DIR's key, created (0600) if it has none yet."""
        os.makedirs(journal_dir, mode=0o700, exist_ok=True)
        path = os.path.join(journal_dir, KEY_NAME)
        if os.path.lexists(path):
            return cls(_read_key(path))
        key = os.urandom(KEY_BYTES)
        tmp = os.path.join(journal_dir, f".key.{os.getpid()}.{os.urandom(4).hex()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, key)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # whole or not at all; the first of two at once wins
            except FileExistsError:
                return cls(_read_key(path))
            finally:
                os.unlink(tmp)
        except OSError as e:
            raise TrustError(f"cannot create the journal key {path}: {e.strerror or e}") from None
        return cls(key)

    def mac(self, what: str, value: Any) -> str:
        """Hex HMAC of VALUE's canonical JSON, for purpose WHAT (a record's MAC never passes as a commit's)."""
        data = json.dumps([what, value], sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    def check(self, what: str, value: Any, mac: Any) -> bool:
        return isinstance(mac, str) and hmac.compare_digest(self.mac(what, value), mac)


def _read_key(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise TrustError(f"cannot read the journal key {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise TrustError(f"the journal key {path} is not a regular file of ours that only we can read; "
                             "refusing to trust the journal")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise TrustError(f"the journal key {path} is {len(key)} bytes, not {KEY_BYTES}; refusing to trust the journal")
    return key
