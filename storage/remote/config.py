"""Configured remotes (`STORE/remotes/NAME.json`, 0600, no secret in it): read as
storage/remote/credentials.py reads every file someone else may plant (read_checked)."""
from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from typing import Any

from storage.base.limits import MAX_RECORD
from storage.format.storedir import REMOTES, path_in
from storage.remote.backend import BackendError, BackendSpec
from storage.remote.credentials import read_checked
from storage.remote.registry import check_url, scheme_of
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


def validate_remote_name(name: str) -> str:
    if not isinstance(name, str) or not _REMOTE_NAME_RE.fullmatch(name):
        raise BackendError(f"remote name {name!r} is invalid: letters, digits, _ . -, at most 64")
    return name


def _endpoint(url: str) -> str:
    if not isinstance(url, str) or not re.fullmatch(r"https?://[^\s/@]+(/[^\s@]*)?", url):
        raise BackendError(f"endpoint {url!r} is not an http(s):// URL (without credentials in it)")
    return url.rstrip("/")


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
