"""S3 credentials, and read_checked: how every remote-config or credentials file is read.

Every file read here can be planted by someone else (a writer of the store, a path an operator was
handed): each is checked with lstat before it is opened (a link, FIFO, device or directory is never
opened), opened with O_NOFOLLOW | O_NONBLOCK, checked again on the open fd, and read to a bound.
"""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from typing import Mapping

from storage.remote.backend import BackendError

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREDENTIALS_MAX = 64 << 10


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str = field(repr=False)


def read_checked(path: str, limit: int, what: str, *, dir_fd: int | None = None) -> tuple[bytes, os.stat_result]:
    """The regular file PATH (relative to DIR_FD where given), at most LIMIT bytes, and its stat: never
    blocks on a FIFO, never follows a link, never opens anything but a regular file. BackendError
    (naming WHAT) otherwise; FileNotFoundError where it is not there."""
    st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode):
        raise BackendError(f"{what} {path} is not a regular file")
    try:
        fd = os.open(path, _READ, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise
        raise BackendError(f"{what} {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BackendError(f"{what} {path} is not a regular file")
        if st.st_size > limit:
            raise BackendError(f"{what} {path} is {st.st_size} bytes, more than it may be ({limit})")
        data = b""
        while len(data) <= limit:
            piece = os.read(fd, limit + 1 - len(data))
            if not piece:
                break
            data += piece
        if len(data) > limit:
            raise BackendError(f"{what} {path} grew past {limit} bytes while being read")
        return data, st
    finally:
        os.close(fd)


def load_credentials(name: str, credentials_file: str | None, env: Mapping[str, str] | None = None) -> Credentials:
    """From GPUSNAP_S3_ACCESS_KEY_ID/GPUSNAP_S3_SECRET_ACCESS_KEY (or the AWS_ names), else from the
    remote's credentials file, which must be a regular file of ours that nobody else can read."""
    environ: Mapping[str, str] = os.environ if env is None else env
    for a, s in (("GPUSNAP_S3_ACCESS_KEY_ID", "GPUSNAP_S3_SECRET_ACCESS_KEY"),
                 ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")):
        if environ.get(a) and environ.get(s):
            return Credentials(environ[a], environ[s])
    if credentials_file is None:
        raise BackendError(f"remote {name!r}: no credentials (set GPUSNAP_S3_ACCESS_KEY_ID and "
                           "GPUSNAP_S3_SECRET_ACCESS_KEY, or `remote add --credentials-file`)")
    return read_credentials_file(credentials_file)


def read_credentials_file(path: str) -> Credentials:
    """`access_key_id = ...` and `secret_access_key = ...` lines; the file must be a regular file of
    ours, mode 0600 or stricter (checked before it is opened: a FIFO there never blocks)."""
    try:
        data, st = read_checked(path, CREDENTIALS_MAX, "credentials file")
    except FileNotFoundError:
        raise BackendError(f"credentials file {path}: No such file or directory") from None
    except OSError as e:
        raise BackendError(f"credentials file {path}: {e.strerror}") from None
    if st.st_mode & 0o077:
        raise BackendError(f"credentials file {path} is readable by others (mode "
                           f"{stat.S_IMODE(st.st_mode):04o}); `chmod 600` it")
    if st.st_uid != os.geteuid():
        raise BackendError(f"credentials file {path} belongs to another user")
    values: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        k, sep, v = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            values[k.strip()] = v.strip()
    if not values.get("access_key_id") or not values.get("secret_access_key"):
        raise BackendError(f"credentials file {path} needs access_key_id = ... and secret_access_key = ...")
    return Credentials(values["access_key_id"], values["secret_access_key"])
