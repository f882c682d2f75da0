"""The warm tier on the commands that take and restore snapshots: `--keep-warm`, and restores reading it."""
from __future__ import annotations

import sys
from typing import Any, Callable

import click

from storage.api import GpusnapError


def keep_warm_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--keep-warm", is_flag=True,
                        help="Once committed, hold the snapshot's packs in the warm tier (host memory, within "
                             "its budget: `store warm`), so that a restore reads them at memory speed.")(fn)


def keep_warm(st: Any, name: str) -> dict[str, Any]:
    """NAME warmed after its commit; a failure is a warning (the snapshot is committed): {"error": ...}."""
    from storage.api import WarmTier
    try:
        return dict(WarmTier(st).warm(name).as_dict())
    except (GpusnapError, OSError) as e:
        click.echo(f"gpusnap: warning: {name} is committed but not warm: {e}", err=True)
        return {"error": str(e)}


def read_warm(st: Any) -> None:
    """A restore of ST reads the packs the warm tier holds from there (each entry checked as ever)."""
    try:
        st.use_warm()
    except (GpusnapError, OSError):
        pass  # no usable tier: the store's own packs


def warm_used(st: Any, name: str) -> dict[str, Any]:
    """After a restore: bytes read from the warm tier by this process; NAME marked used (LRU) if warm."""
    from storage.api import WarmTier
    out: dict[str, Any] = {"bytes_read": st.warm_bytes, "in_use": st.warm_in_use}
    if st.warm_in_use:
        try:
            out["touched"] = WarmTier(st).touch(name)
        except (GpusnapError, OSError) as e:
            print(f"gpusnap: warning: the warm tier: {e}", file=sys.stderr)
    return out
