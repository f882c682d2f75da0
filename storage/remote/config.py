"""Configured remotes (`STORE/remotes/NAME.json`, 0600, no secret in it) and S3 credentials.

Every file read here can be planted by someone else (a writer of the store, a path an operator was
handed): each is checked with lstat before it is opened (a link, FIFO, device or directory is never
opened), opened with O_NOFOLLOW | O_NONBLOCK, checked again on the open fd, and read to a bound.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping

from storage.base.limits import MAX_RECORD
from storage.format.storedir import REMOTES, path_in
from storage.remote.backend import BackendError, BackendSpec, check_url, scheme_of
from storage.repo.store import SnapshotStore

_REMOTE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREDENTIALS_MAX = 64 << 10


@dataclass(frozen=True)
class RemoteConfig:
    """One configured remote: URL (`s3://BUCKET/PREFIX` at ENDPOINT, or `file:///PATH`). Holds no secret."""
    name: str
    url: str
    endpoint: str | None = None
    region: str = "us-east-1"
    credentials_file: str | None = None

    @property
    def scheme(self) -> str:
        return scheme_of(self.url)

    def spec(self, pool: int = 16) -> BackendSpec:
        return BackendSpec(self.name, self.url, self.endpoint, self.region, self.credentials_file, pool)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "endpoint": self.endpoint, "region": self.region,
                "credentials_file": self.credentials_file}

    @classmethod
    def make(cls, name: str, url: str, endpoint: str | None = None, region: str = "us-east-1",
             credentials_file: str | None = None) -> "RemoteConfig":
        """A validated config: the URL checked (and made canonical) by its scheme's backend; an s3://
        remote needs an http(s) endpoint, a file:// one takes none."""
        url = check_url(url)
        if scheme_of(url) == "s3":
            if endpoint is None:
                raise BackendError(f"remote {name!r}: an s3:// remote needs --endpoint URL")
            endpoint = _endpoint(endpoint)
        elif endpoint is not None:
            raise BackendError(f"remote {name!r}: a {scheme_of(url)}:// remote takes no --endpoint")
        if credentials_file is not None and not isinstance(credentials_file, str):
            raise TypeError("credentials_file")
        return cls(validate_remote_name(name), url, endpoint, str(region or "us-east-1"), credentials_file)

    @classmethod
    def from_json(cls, v: Any) -> "RemoteConfig":
        if not isinstance(v, dict):
            raise BackendError("remote config is not a JSON object")
        try:
            return cls.make(v["name"], v["url"], v.get("endpoint"), v.get("region") or "us-east-1",
                            v.get("credentials_file"))
        except (KeyError, TypeError) as e:
            raise BackendError(f"remote config is malformed ({e})") from None


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str = field(repr=False)


def validate_remote_name(name: str) -> str:
    if not isinstance(name, str) or not _REMOTE_NAME_RE.fullmatch(name):
        raise BackendError(f"remote name {name!r} is invalid: letters, digits, _ . -, at most 64")
    return name


def _endpoint(url: str) -> str:
    if not isinstance(url, str) or not re.fullmatch(r"https?://[^\s/@]+(/[^\s@]*)?", url):
        raise BackendError(f"endpoint {url!r} is not an http(s):// URL (without credentials in it)")
    return url.rstrip("/")


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


# ---- STORE/remotes/ ------------------------------------------------------------------------------
def _remotes_dir(store: SnapshotStore) -> str:
    return path_in(store.path, REMOTES)


def add_remote(store: SnapshotStore, cfg: RemoteConfig) -> None:
    """Record CFG in STORE/remotes/NAME.json (0600), replacing an older entry of that name."""
    d = _remotes_dir(store)
    os.makedirs(d, mode=0o700, exist_ok=True)
    tmp = os.path.join(store.tmp_dir, f"remote.{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(cfg.to_json(), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(d, cfg.name + ".json"))


def remove_remote(store: SnapshotStore, name: str) -> None:
    """Remove remote NAME's configuration (STORE/remotes/NAME.json); nothing on the remote is touched."""
    path = os.path.join(_remotes_dir(store), validate_remote_name(name) + ".json")
    try:
        os.unlink(path)
    except FileNotFoundError:
        raise BackendError(f"no remote named {name!r} (`gpusnap remote list` lists them)") from None
    fd = os.open(_remotes_dir(store), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remote_exists(store: SnapshotStore, name: str) -> bool:
    return os.path.lexists(os.path.join(_remotes_dir(store), validate_remote_name(name) + ".json"))


def _names(store: SnapshotStore) -> list[str]:
    try:
        return sorted(f[:-5] for f in os.listdir(_remotes_dir(store)) if f.endswith(".json"))
    except FileNotFoundError:
        return []


def list_remotes(store: SnapshotStore) -> list[RemoteConfig]:
    return [load_remote(store, n) for n in _names(store)]


def load_remote(store: SnapshotStore, name: str | None) -> RemoteConfig:
    """The remote NAME, or the only one configured when NAME is None."""
    if name is None:
        names = _names(store)
        if len(names) != 1:
            raise BackendError("name the remote: " + (f"this store has {', '.join(names)}" if names else
                               "none is configured (`gpusnap remote add NAME s3://BUCKET/PREFIX --endpoint URL` "
                               "or `gpusnap remote add NAME file:///PATH`)"))
        name = names[0]
    path = os.path.join(_remotes_dir(store), validate_remote_name(name) + ".json")
    try:
        data, _ = read_checked(path, MAX_RECORD, f"remote {name!r}: config")
    except FileNotFoundError:
        raise BackendError(f"no remote named {name!r} (`gpusnap remote add` it first)") from None
    try:
        return RemoteConfig.from_json(json.loads(data))
    except (ValueError, RecursionError) as e:
        raise BackendError(f"remote {name!r}: unreadable config ({e})") from None


# ---- credentials ---------------------------------------------------------------------------------
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
