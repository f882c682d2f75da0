"""The seam between the remote tier and the place its objects live: the `Backend` protocol.

A backend stores named objects ("keys": `/`-separated names under the remote's root, FORMAT.md,
"Remote stores") and knows nothing of snapshots. `storage.remote.client.Remote` uses only this
protocol, so a snapshot pushed to `s3://...` and one pushed to `file:///...` are laid out and checked
alike. Backends are found by URL scheme (storage/remote/registry.py); retries, rate limits and the command's
deadline are wrappers around any backend (`Retrying`, `RateLimited`), and `list_keys` bounds every
listing in pages, keys and time, whatever the backend answers.

Guarantees every backend keeps (tests/test_backend_contract.py runs each against them):
- an object appears whole or not at all (a put that fails or is killed leaves the old object, or none);
- a read never returns or buffers more than the limit the caller names (the object's claimed and
  actual length are both checked), and a range read returns exactly the bytes asked or fails;
- a listing page holds keys in strictly ascending order, each with its size and modification time
  by the backend's own clock (`now` reads that clock), never a key outside the prefix;
- errors are `BackendError` (exit 1), `BackendUnavailable` (the backend did not answer in time or at
  all: exit 4) or `BackendDamage` (an object that is not what it claims: exit 3), with one line that
  names the remote and what was being done; a missing object is None, never an error.
Nothing in a signature is a type of any client library.
"""
from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, TypeVar, runtime_checkable

from storage.base.errors import DamageError, GpusnapError, UnavailableError

T = TypeVar("T")

# every remote command ends by this many seconds (env, or `--deadline` on the command line)
DEFAULT_DEADLINE_S = 3600.0
# a listing stops with an error past this many keys (about 20 MiB of names held) or pages
LIST_MAX_KEYS = 250_000
LIST_MAX_PAGES = 10_000
# a call is retried at most this many times in all, and not once it has failed for this long
DEFAULT_ATTEMPTS = 5
RETRY_BUDGET_S = 60.0
# what a clean-up (a lock object's removal) may take, also once the command's deadline has passed
CLEANUP_S = 10.0
# a request that waits this long for the next byte fails (and is retried): a silent server
READ_TIMEOUT_S = 30.0


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


class BackendError(GpusnapError):
    """A remote operation that cannot be done; the message says what to do about it."""


class BackendUnavailable(BackendError, UnavailableError):
    """The backend did not answer (down, refused, timed out, the command's deadline passed)."""


class BackendDamage(BackendError, DamageError):
    """An object or an answer that is not what it claims to be (too long, cut short, not a file)."""


class Deadline:
    """A point in time (monotonic) by which a whole remote command must end."""

    def __init__(self, seconds: float | None = None) -> None:
        if seconds is None:
            seconds = _env_float("GPUSNAP_REMOTE_DEADLINE_S", DEFAULT_DEADLINE_S)
        if not seconds > 0:
            raise BackendError(f"a remote deadline must be a positive number of seconds, not {seconds}")
        self.seconds = float(seconds)
        self.at = time.monotonic() + self.seconds

    def left(self) -> float:
        return self.at - time.monotonic()

    def check(self, doing: str, who: str = "the remote") -> float:
        """The seconds left; BackendUnavailable when none are."""
        left = self.left()
        if left <= 0:
            raise BackendUnavailable(f"{who}: gave up while {doing}: the command's deadline of {self.seconds:.0f} s "
                                     "passed (`--deadline` or GPUSNAP_REMOTE_DEADLINE_S sets it)")
        return left


@dataclass(frozen=True)
class ObjectInfo:
    """One object: its key (under the backend's root), size in bytes, and modification time (epoch
    seconds by the backend's clock)."""
    key: str
    size: int
    mtime: float


@dataclass(frozen=True)
class Page:
    """One page of a listing; `next` is the token of the next page, None after the last."""
    items: list[ObjectInfo]
    next: str | None


@dataclass
class BackendStats:
    requests: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.requests += 1
            self.bytes_sent += sent
            self.bytes_received += received


Sink = Callable[[bytes], None]


@runtime_checkable
class Backend(Protocol):
    """What the remote tier asks of a place that holds objects. KEY is a `/`-separated name relative
    to the backend's root; DEADLINE bounds the call (the command's deadline where None)."""

    who: str            # "remote 'NAME'", for messages
    url: str
    stats: BackendStats

    def ensure(self, deadline: Deadline | None = None) -> None:
        """Create the root (a bucket, a directory) if it is missing."""

    def put(self, key: str, data: bytes | bytearray | memoryview, deadline: Deadline | None = None) -> None:
        """Object KEY holds DATA, whole, replacing any older one."""

    def get(self, key: str, limit: int, deadline: Deadline | None = None) -> bytes | None:
        """Object KEY's bytes (BackendDamage past LIMIT), or None where there is none."""

    def get_into(self, key: str, buf: memoryview, deadline: Deadline | None = None) -> int | None:
        """Object KEY's bytes into BUF (BackendDamage where it is longer); its length, or None."""

    def get_stream(self, key: str, limit: int, sink: Sink, deadline: Deadline | None = None) -> bool:
        """Object KEY's bytes handed to SINK in pieces of at most 1 MiB, never more than LIMIT in all;
        False where there is no such object."""

    def get_range_into(self, key: str, offset: int, length: int, buf: memoryview,
                       deadline: Deadline | None = None) -> int | None:
        """Exactly LENGTH bytes of KEY from OFFSET into BUF, or None where there is no such object; an
        object too short for them, or an answer of another length, is BackendDamage."""

    def stat(self, key: str, deadline: Deadline | None = None) -> ObjectInfo | None:
        ...

    def list_page(self, prefix: str, token: str | None, deadline: Deadline | None = None) -> Page:
        """One page (at most 1000 keys) of the objects whose key starts with PREFIX, after TOKEN."""
        ...

    def delete(self, key: str, deadline: Deadline | None = None) -> None:
        """Object KEY gone (no error where it was not there)."""

    def now(self, deadline: Deadline | None = None) -> float:
        """The backend's clock (epoch seconds), the one its modification times are by."""
        ...

    def close(self) -> None:
        ...


def list_keys(backend: Backend, prefix: str, deadline: Deadline, *, max_keys: int | None = None) -> Iterator[ObjectInfo]:
    """Every object under PREFIX, page by page, bounded whatever the backend answers: at most MAX_KEYS
    keys (GPUSNAP_REMOTE_LIST_MAX_KEYS, LIST_MAX_KEYS) and LIST_MAX_PAGES pages, by DEADLINE, each key
    under PREFIX and greater than the one before (a listing that repeats itself or never ends stops
    with BackendDamage). Holds one page at a time."""
    most = max_keys if max_keys is not None else int(_env_float("GPUSNAP_REMOTE_LIST_MAX_KEYS", LIST_MAX_KEYS))
    token: str | None = None
    last = ""
    seen = 0
    for pages in range(1, LIST_MAX_PAGES + 2):
        deadline.check(f"listing {prefix}", backend.who)
        page = backend.list_page(prefix, token, deadline)
        for o in page.items:
            if not o.key.startswith(prefix) or (last and o.key <= last):
                raise BackendDamage(f"{backend.who}: the listing of {prefix} is out of order or outside it "
                                    f"({o.key[:200]!r}); not used")
            last = o.key
            seen += 1
            if seen > most:
                raise BackendDamage(f"{backend.who}: the listing of {prefix} goes on past {most} keys, more than "
                                    "a remote may hold; stopped (GPUSNAP_REMOTE_LIST_MAX_KEYS raises the bound)")
            yield o
        if page.next is None:
            return
        if not page.items or page.next == token:
            raise BackendDamage(f"{backend.who}: the listing of {prefix} says it goes on but does not advance; stopped")
        if pages > LIST_MAX_PAGES:
            break
        token = page.next
    raise BackendDamage(f"{backend.who}: the listing of {prefix} goes on past {LIST_MAX_PAGES} pages; stopped")


# ---- wrappers ------------------------------------------------------------------------------------
class StreamedGets:
    """`get` and `get_into` of a backend, both through its own `get_stream` (one read path per backend)."""

    def get_stream(self, key: str, limit: int, sink: Sink, deadline: Deadline | None = None) -> bool:
        raise NotImplementedError

    def get(self, key: str, limit: int, deadline: Deadline | None = None) -> bytes | None:
        pieces: list[bytes] = []
        return b"".join(pieces) if self.get_stream(key, limit, pieces.append, deadline) else None

    def get_into(self, key: str, buf: memoryview, deadline: Deadline | None = None) -> int | None:
        got = 0

        def into(piece: bytes) -> None:
            nonlocal got
            buf[got:got + len(piece)] = piece
            got += len(piece)
        return got if self.get_stream(key, len(buf), into, deadline) else None


class _Wrapper:
    """Passes every call to INNER (a Backend), through `_call`."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.who, self.url, self.stats = inner.who, inner.url, inner.stats

    def _call(self, doing: str, fn: Callable[[], T], deadline: Deadline | None, cost: int = 0,
              restartable: bool = True) -> T:
        return fn()

    def ensure(self, deadline: Deadline | None = None) -> None:
        self._call("creating the remote's root", lambda: self.inner.ensure(deadline), deadline)

    def put(self, key: str, data: bytes | bytearray | memoryview, deadline: Deadline | None = None) -> None:
        self._call(f"writing {key}", lambda: self.inner.put(key, data, deadline), deadline, len(data))

    def get(self, key: str, limit: int, deadline: Deadline | None = None) -> bytes | None:
        return self._call(f"reading {key}", lambda: self.inner.get(key, limit, deadline), deadline)

    def get_into(self, key: str, buf: memoryview, deadline: Deadline | None = None) -> int | None:
        return self._call(f"reading {key}", lambda: self.inner.get_into(key, buf, deadline), deadline)

    def get_stream(self, key: str, limit: int, sink: Sink, deadline: Deadline | None = None) -> bool:
        return self._call(f"reading {key}", lambda: self.inner.get_stream(key, limit, sink, deadline), deadline,
                          restartable=False)

    def get_range_into(self, key: str, offset: int, length: int, buf: memoryview,
                       deadline: Deadline | None = None) -> int | None:
        return self._call(f"reading {key}", lambda: self.inner.get_range_into(key, offset, length, buf, deadline),
                          deadline)

    def stat(self, key: str, deadline: Deadline | None = None) -> ObjectInfo | None:
        return self._call(f"checking {key}", lambda: self.inner.stat(key, deadline), deadline)

    def list_page(self, prefix: str, token: str | None, deadline: Deadline | None = None) -> Page:
        return self._call(f"listing {prefix}", lambda: self.inner.list_page(prefix, token, deadline), deadline)

    def delete(self, key: str, deadline: Deadline | None = None) -> None:
        self._call(f"deleting {key}", lambda: self.inner.delete(key, deadline), deadline)

    def now(self, deadline: Deadline | None = None) -> float:
        return self._call("reading the remote's clock", lambda: self.inner.now(deadline), deadline)

    def close(self) -> None:
        self.inner.close()


class Retrying(_Wrapper):
    """INNER with each call retried on BackendUnavailable (exponential backoff with jitter): at most
    ATTEMPTS tries, none started once the call has failed for RETRY_BUDGET_S or DEADLINE has passed.
    DEADLINE (the command's) also bounds every call made without one. Damage and refusals are never
    retried; nor is a streamed read that has handed over bytes already. A call given its own deadline
    (a clean-up after the command's passed: a lock's release) keeps to that one."""

    def __init__(self, inner: Backend, deadline: Deadline, attempts: int | None = None,
                 budget_s: float | None = None) -> None:
        super().__init__(inner)
        self.deadline = deadline
        self.attempts = max(1, attempts if attempts is not None else int(_env_float(
            "GPUSNAP_REMOTE_MAX_ATTEMPTS", _env_float("GPUSNAP_S3_MAX_ATTEMPTS", DEFAULT_ATTEMPTS))))
        self.budget_s = budget_s if budget_s is not None else _env_float("GPUSNAP_REMOTE_RETRY_BUDGET_S", RETRY_BUDGET_S)

    def _call(self, doing: str, fn: Callable[[], T], deadline: Deadline | None, cost: int = 0,
              restartable: bool = True) -> T:
        dl = deadline if deadline is not None else self.deadline
        first = time.monotonic()
        for attempt in range(1, self.attempts + 1):
            dl.check(doing, self.who)
            try:
                return fn()
            except BackendUnavailable:
                spent = time.monotonic() - first
                if attempt == self.attempts or spent >= self.budget_s or not restartable:
                    raise
                pause = min(0.2 * 2 ** (attempt - 1), 5.0) * (0.5 + random.random() / 2)
                if dl.left() <= pause:
                    raise
                time.sleep(pause)
        raise AssertionError("unreachable")

    def get_stream(self, key: str, limit: int, sink: Sink, deadline: Deadline | None = None) -> bool:
        started = [False]

        def fed(piece: bytes) -> None:
            started[0] = True
            sink(piece)
        dl = deadline if deadline is not None else self.deadline
        first = time.monotonic()
        for attempt in range(1, self.attempts + 1):
            dl.check(f"reading {key}", self.who)
            try:
                return self.inner.get_stream(key, limit, fed, dl)
            except BackendUnavailable:
                if started[0] or attempt == self.attempts or time.monotonic() - first >= self.budget_s:
                    raise
                time.sleep(min(0.2 * 2 ** (attempt - 1), 5.0))
        raise AssertionError("unreachable")


class RateLimited(_Wrapper):
    """INNER with at most RPS requests and BPS bytes written per second (token buckets, shared by the
    command's threads; 0: no limit). A wait never passes the call's deadline."""

    def __init__(self, inner: Backend, rps: float = 0.0, bps: float = 0.0) -> None:
        super().__init__(inner)
        self.rps, self.bps = rps, bps
        self._lock = threading.Lock()
        self._next_request = time.monotonic()
        self._next_byte = time.monotonic()

    def _call(self, doing: str, fn: Callable[[], T], deadline: Deadline | None, cost: int = 0,
              restartable: bool = True) -> T:
        with self._lock:
            now = time.monotonic()
            wait = 0.0
            if self.rps > 0:
                self._next_request = max(self._next_request, now) + 1.0 / self.rps
                wait = self._next_request - 1.0 / self.rps - now
            if self.bps > 0 and cost:
                self._next_byte = max(self._next_byte, now) + cost / self.bps
                wait = max(wait, self._next_byte - cost / self.bps - now)
        if wait > 0:
            if deadline is not None and deadline.left() < wait:
                deadline.check(doing, self.who)
                raise BackendUnavailable(f"{self.who}: gave up while {doing}: the rate limit would pass the "
                                         "command's deadline")
            time.sleep(wait)
        return fn()


@dataclass(frozen=True)
class BackendSpec:
    """What a registry entry needs to open one remote's backend."""
    name: str                 # the remote's name
    url: str                  # SCHEME://...
    endpoint: str | None = None
    region: str = "us-east-1"
    credentials_file: str | None = None
    pool: int = 16            # connections the command may use at once
