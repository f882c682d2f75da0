"""The journal's secret: what lets `gpusnap recover` tell a record gpusnap wrote, for this store, from a forged or copied one.

The key of a store's journal is derived from the host's (storage.fs.hostkey: /var/lib/gpusnap-host/key
for root, outside every store, root-only) and the store directory's identity: a copy of a store carries
records but never the power to make or check them, and a MAC made for one store never checks in
another. Every journal record carries an HMAC-SHA256 under it over all it says, including the boot it
was written in and the identity of the store directory it was written for (sandbox.ops.journal); a
dump's manifest carries one over the operation id, the snapshot's name and the pids it names
(`meta.op_mac`), and one over a recorded resume step (sandbox.ops.hooks). Whoever can
write a store (a tenant, another user, a backup restored from elsewhere) but cannot read the host key
cannot make a record or a commit that recovery acts on.

Stores written before the key left the store kept it in STORE/journal/key (legacy_key): a record
under that key is honoured only when the operator says so (`gpusnap recover --trust-old-key`), once,
because a store copied from elsewhere carries such a key and records made with it.

Guarantees kept here: every key file is opened O_NOFOLLOW | O_NONBLOCK and checked through its fd
(a regular file of our user, no group/other bits, exactly KEY_BYTES long) before a byte is read; a
key that fails the checks is an error, never replaced silently. MACs are compared in constant time.
"""
from __future__ import annotations

import os

from storage.api import GpusnapError, hostkey

KEY_NAME = "key"  # the in-store key of stores written before the host key (STORE/journal/key)
KEY_BYTES = hostkey.KEY_BYTES
JournalKey = hostkey.HostKey


class TrustError(GpusnapError):
    """A journal key cannot be read safely."""


def journal_key(store_id: str) -> JournalKey:
    """The key of the journal of the store directory STORE_ID (sandbox.ops.journal.Journal.store_id): derived
    from the host key, so that it never lives in the store and a MAC made for one store never checks in another."""
    try:
        return hostkey.host_key().derive("journal-key", store_id)
    except hostkey.HostStateError as e:
        raise TrustError(str(e)) from None


def legacy_key(journal_dir: str) -> JournalKey | None:
    """The key an older gpusnap kept inside the store (JOURNAL_DIR/key); None when there is none.
    Read without following a link or blocking, checked first (TrustError when it fails)."""
    try:
        fd = os.open(journal_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise TrustError(f"{journal_dir}: {e.strerror or e}") from None
    try:
        key = hostkey.read_small(fd, KEY_NAME, KEY_BYTES, f"the old in-store journal key {journal_dir}/{KEY_NAME}")
    except hostkey.HostStateError as e:
        raise TrustError(str(e)) from None
    finally:
        os.close(fd)
    if key is None:
        return None
    if len(key) != KEY_BYTES:
        raise TrustError(f"the old in-store journal key {journal_dir}/{KEY_NAME} is {len(key)} bytes, not {KEY_BYTES}")
    return JournalKey(key)
