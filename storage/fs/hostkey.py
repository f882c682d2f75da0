"""The host's own secret and boot-bound state, kept outside every store: what a copy of a store never carries.

Two directories, each a real directory of the user gpusnap runs as with no group or other access
(checked on every use; anything else is an error, never "fixed"):
- the host directory (root: /var/lib/gpusnap-host; another user: ~/.local/state/gpusnap-host) holds
  `key`, 32 random bytes made on first use: the HMAC key of every journal record and commit MAC of
  every store on this host (sandbox.ops.trust), and of the markers of root's `store get`s
  (storage.fs.getmark). It survives a reboot (a record left by a power loss is still recognised);
- the run directory (root: /run/gpusnap; another user: $XDG_RUNTIME_DIR/gpusnap) is on tmpfs: what
  it holds (each journaled operation's state, sandbox.ops.journal) vanishes at reboot, as the
  processes it names do.
$GPUSNAP_HOST_DIR and $GPUSNAP_RUN_DIR name other directories (tests; a host that keeps state
elsewhere): the same checks apply, so the environment can move them but not loosen them.

Guarantees kept here: the key is opened O_NOFOLLOW | O_NONBLOCK (a FIFO or device planted there
never blocks), checked through its fd before a byte is read (a regular file of our user, mode
without group/other bits, exactly KEY_BYTES long); it appears whole (written to a temporary file,
then linked into place: two first uses at once agree on one key); a key that fails a check is an
error, never replaced silently. MACs are compared in constant time.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import hmac
import json
import os
import stat
import threading
from typing import Any

from storage.base.errors import GpusnapError

KEY_NAME = "key"
KEY_BYTES = 32
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class HostStateError(GpusnapError):
    """The host's key or state directory cannot be made or read safely."""


def host_dir() -> str:
    """Where the host key lives (created on first use)."""
    env = os.environ.get("GPUSNAP_HOST_DIR")
    if env:
        return env
    if os.geteuid() == 0:
        return "/var/lib/gpusnap-host"
    return os.path.join(os.path.expanduser("~"), ".local", "state", "gpusnap-host")


def run_dir() -> str:
    """Where boot-bound state lives (tmpfs: empty after a reboot)."""
    env = os.environ.get("GPUSNAP_RUN_DIR")
    if env:
        return env
    if os.geteuid() == 0:
        return "/run/gpusnap"
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(xdg, "gpusnap") if xdg else os.path.join(host_dir(), "run")


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """This boot's id (/proc/sys/kernel/random/boot_id): a record of another boot names no live process."""
    with open("/proc/sys/kernel/random/boot_id", "rb") as f:  # procfs: not plantable
        return f.read(64).decode().strip()


def private_dir(path: str) -> int:
    """An fd of directory PATH (made 0700 if missing, its parent must exist), after checking that it is a
    real directory of ours that nobody else can enter; HostStateError otherwise."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno == errno.ENOENT:  # its parent is missing (~/.local/state on a fresh account)
            os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
            return private_dir(path)
        raise HostStateError(f"cannot make {path}: {e.strerror or e}") from None
    try:
        fd = os.open(path, _DIR)
    except OSError as e:
        raise HostStateError(f"{path} is not a directory gpusnap can use ({e.strerror or e})") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise HostStateError(f"{path} must be a directory of uid {os.geteuid()} with no group or other access "
                             f"(it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); refusing to use it")
    return fd


def read_small(dir_fd: int, name: str, most: int, where: str) -> bytes | None:
    """File NAME of DIR_FD, opened without following a link or blocking, checked (a regular file of our
    user, no group/other bits, at most MOST bytes) before it is read; None when there is none.
    HostStateError when it fails a check."""
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise HostStateError(f"{where}: cannot open it safely ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size > most:
            raise HostStateError(f"{where} is not a regular file of uid {os.geteuid()} of at most {most} bytes that "
                                 "only its owner can read; refusing to use it")
        return os.read(fd, most + 1)
    finally:
        os.close(fd)


def write_atomic(dir_fd: int, name: str, data: bytes, *, durable: bool = True, exclusive: bool = False) -> bool:
    """DATA as file NAME of DIR_FD (0600), whole or not at all (temporary file, then rename; with
    EXCLUSIVE a link, which fails if NAME exists: False then)."""
    tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if exclusive:
            try:
                os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp, dir_fd=dir_fd)
        else:
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if durable:
            os.fsync(dir_fd)
        return True
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


class HostKey:
    """The host's HMAC key."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def mac(self, what: str, value: Any) -> str:
        """Hex HMAC of VALUE's canonical JSON, for purpose WHAT (a MAC of one purpose never passes as another's)."""
        data = json.dumps([what, value], sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    def check(self, what: str, value: Any, mac: Any) -> bool:
        return isinstance(mac, str) and hmac.compare_digest(self.mac(what, value), mac)

    def derive(self, what: str, value: Any) -> "HostKey":
        """A key of its own for WHAT and VALUE (one store's journal: sandbox.ops.trust), made from this one."""
        return HostKey(bytes.fromhex(self.mac(what, value)))


_cache: dict[tuple[str, int], HostKey] = {}
_lock = threading.Lock()


def host_key() -> HostKey:
    """This host's key (made on first use)."""
    where = host_dir()
    with _lock:
        got = _cache.get((where, os.geteuid()))
        if got is not None:
            return got
        path = os.path.join(where, KEY_NAME)
        dfd = private_dir(where)
        try:
            key = read_small(dfd, KEY_NAME, KEY_BYTES, f"the host key {path}")
            if key is None:
                new = os.urandom(KEY_BYTES)
                try:
                    made = write_atomic(dfd, KEY_NAME, new, exclusive=True)
                except OSError as e:
                    raise HostStateError(f"cannot create the host key {path}: {e.strerror or e}") from None
                key = new if made else read_small(dfd, KEY_NAME, KEY_BYTES, f"the host key {path}")
        finally:
            os.close(dfd)
        if key is None or len(key) != KEY_BYTES:
            raise HostStateError(f"the host key {path} is {len(key or b'')} bytes, not {KEY_BYTES}; refusing to "
                                 "trust anything it signed (restore it from backup, or remove it: every record "
                                 "and get marker it signed is then set aside)")
        hk = _cache[(where, os.geteuid())] = HostKey(key)
        return hk
