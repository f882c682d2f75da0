"""Open pack files shared by a store's threads: each pack opened (and checked) once, not once per read.

Why: every header look-up and base read of a put with a parent (storage/pipeline/put.py: `present`,
`entry_kind`, `delta_base`) opened the store's root, its packs/ directory and the pack, each checked,
read a few bytes and closed all three: some ten system calls around one pread, each giving the GIL up
and taking it back. A profile of a second dump on the H200 found ~12% of the put threads' time there
(BENCHMARKS.md section 30).

Guarantees kept here: a pack is opened only by the store's own checked opener (its packs/ directory
walked with directory fds, the pack refused unless it is a regular file); an fd is closed only when no
borrower holds it (an evicted, dropped or forgotten pack is closed by its last borrower), so no thread
ever reads through a number the kernel has handed to another file; at most MOST packs stay open once
their borrowers are done; an fd opened before a `forget` is never kept after it. The bytes read
through a cached fd are checked by the callers as any read is (an entry's header and its id), so a
pack replaced or removed since it was opened costs a failed check and a retry after `forget` (the
index refreshed), never wrong bytes.
"""
from __future__ import annotations

import collections
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass
class _Open:
    fd: int
    users: int = 0
    retired: bool = False  # out of the cache: closed by its last user


class PackFds:
    """Pack name -> an fd opened by OPENER(pack, cid) (which raises for a pack that cannot be read),
    cached while a `held()` block runs (a put, for all its threads)."""

    MOST = 64  # open once idle, at most (least recently used closed first): a store may hold thousands

    def __init__(self, opener: Callable[[str, str], int], most: int = MOST) -> None:
        self._opener = opener
        self._most = most
        self._lock = threading.Lock()
        self._open: collections.OrderedDict[str, _Open] = collections.OrderedDict()
        self._generation = 0  # forget() counts up: an fd opened across one is not cached
        self._holders = 0     # held() blocks running: fds are cached only while one runs

    @contextmanager
    def held(self) -> Iterator[None]:
        """Cache the packs opened during the block (nested and concurrent blocks share the cache); when
        the last block ends every pack is closed. Outside any block a borrow opens and closes its pack
        as before: a store object left alive holds no file open (a file system it was on unmounts)."""
        with self._lock:
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                last = self._holders == 0
            if last:
                self.forget()

    @contextmanager
    def borrowed(self, pack: str, cid: str) -> Iterator[int]:
        """PACK's fd for the block (CID: the chunk read, for the opener's errors)."""
        with self._lock:  # whether a held() block runs, and since which forget, read together
            caching = self._holders > 0
            generation = self._generation
        if not caching:  # no held() block: this borrower's own fd, closed after it
            fd = self._opener(pack, cid)
            try:
                yield fd
            finally:
                os.close(fd)
            return
        o: _Open | None = None
        closing: list[int] = []
        try:
            with self._lock:  # (the block ended since, or another forget came: nothing cached is taken)
                o = self._open.get(pack) if generation == self._generation else None
                if o is not None:
                    o.users += 1
                    self._open.move_to_end(pack)
            if o is None:
                fd = self._opener(pack, cid)  # outside the lock: opening walks directories
                with self._lock:
                    cached = self._open.get(pack) if generation == self._generation else None
                    if cached is not None:  # another thread opened it meanwhile: its fd is the one shared
                        closing.append(fd)
                        o = cached
                    elif generation == self._generation:
                        o = self._open[pack] = _Open(fd)
                    else:  # forgotten while it was opened: this borrower's alone, closed after it
                        o = _Open(fd, retired=True)
                    o.users += 1  # held before anything is evicted: never this borrower's own
                    closing += self._evict()
                for fd in closing:
                    os.close(fd)
                closing = []
            yield o.fd
        finally:
            if o is not None:
                with self._lock:
                    o.users -= 1
                    if o.retired and o.users == 0:
                        closing.append(o.fd)
                    elif o.users == 0 and len(self._open) > self._most:
                        closing += self._evict()  # those held past the bound when it was reached
            for fd in closing:
                os.close(fd)

    def _evict(self) -> list[int]:
        """(The lock held.) The idle packs beyond MOST out of the cache, least recent first: their fds,
        for the caller to close once it has let the lock go."""
        idle = [p for p, o in self._open.items() if o.users == 0]
        return [self._open.pop(p).fd for p in idle[:max(0, len(self._open) - self._most)]]

    def drop(self, pack: str) -> None:
        """PACK out of the cache (removed from the store: its space is freed once its fd is closed)."""
        with self._lock:
            o = self._open.pop(pack, None)
            if o is None:
                return
            o.retired = True
            fd = o.fd if o.users == 0 else -1
        if fd >= 0:
            os.close(fd)

    def forget(self) -> None:
        """Close every pack (each held one when its last borrower is done): the next reads open them
        again, as the index names them now."""
        with self._lock:
            self._generation += 1
            gone = list(self._open.values())
            self._open.clear()
            for o in gone:
                o.retired = True
            idle = [o.fd for o in gone if o.users == 0]
        for fd in idle:
            os.close(fd)

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)
