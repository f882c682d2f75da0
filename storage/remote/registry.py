"""Backends by URL scheme: `s3://` (storage/remote/s3backend.py) and `file://` (filebackend.py), and
`open_backend`, which wraps the one a remote's URL names in the rate limits and retries of
storage/remote/backend.py. A new backend registers its scheme here."""
from __future__ import annotations

from typing import Callable

from storage.remote import filebackend, s3backend
from storage.remote.backend import Backend, BackendError, BackendSpec, Deadline, RateLimited, Retrying, _env_float

Factory = Callable[[BackendSpec, Deadline], Backend]
Checker = Callable[[str], str]
_REGISTRY: dict[str, tuple[Factory, Checker, Checker]] = {}


def register(scheme: str, factory: Factory, check_url: Checker, resolve: Checker | None = None) -> None:
    """Backends for SCHEME:// URLs: FACTORY opens one, CHECK_URL validates a URL (and returns its
    canonical form) or raises BackendError; RESOLVE (CHECK_URL where None) is what `remote add` records
    (a file:// path with its links resolved, once)."""
    _REGISTRY[scheme] = (factory, check_url, resolve or check_url)


def scheme_of(url: str) -> str:
    scheme, sep, _ = (url or "").partition("://")
    if not sep or scheme not in _REGISTRY:
        raise BackendError(f"{url!r} is not a remote URL: " + " or ".join(f"{s}://..." for s in sorted(_REGISTRY)))
    return scheme


def check_url(url: str) -> str:
    """URL validated by its scheme's backend, in canonical form."""
    return _REGISTRY[scheme_of(url)][1](url)


def resolve_url(url: str) -> str:
    """URL as `remote add` records it (its scheme's RESOLVE)."""
    return _REGISTRY[scheme_of(url)][2](url)


def open_backend(spec: BackendSpec, deadline: Deadline, *, rps: float | None = None,
                 bps: float | None = None) -> Backend:
    """The backend for SPEC.url, wrapped: rate-limited (GPUSNAP_REMOTE_MAX_RPS and _MAX_BPS where set),
    then retried within DEADLINE."""
    b = _REGISTRY[scheme_of(spec.url)][0](spec, deadline)
    rps = _env_float("GPUSNAP_REMOTE_MAX_RPS", 0.0) if rps is None else rps
    bps = _env_float("GPUSNAP_REMOTE_MAX_BPS", 0.0) if bps is None else bps
    if rps > 0 or bps > 0:
        b = RateLimited(b, rps, bps)
    return Retrying(b, deadline)


register("s3", s3backend.open_s3, s3backend.check_url)
register("file", filebackend.open_file, filebackend.check_url, filebackend.canonical_url)
