"""What gpusnap remembers about each sandbox it started: its network, its output file, its GPU setup.

Kept under /run/gpusnap/runsc/ (root only, 0700; on tmpfs, so it goes at reboot as runsc's own state
does), one directory per sandbox named by runsc's root directory and the container id; never in the
user's bundle. Written by `runsc run`/`restore` before the sandbox starts, removed when that start
fails and when the sandbox is deleted, so a record never outlives its sandbox through gpusnap."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from enum import Enum
from typing import Any

from storage.api import GpusnapError

RECORDS_DIR = "/run/gpusnap/runsc"
# runsc's own rule for container ids; "." and ".." are refused as well
_ID = re.compile(r"[A-Za-z0-9_+.-]{1,128}")


class RecordError(GpusnapError):
    """A container id gpusnap cannot keep a record for."""


class Kind(Enum):
    NET = "net"   # the NetConfig gpusnap made for the sandbox
    RUN = "run"   # where the sandbox's stdout/stderr go
    GPU = "gpu"   # GPUs, nvproxy flags, whether the GPU agent is mounted


def check_id(cid: str) -> str:
    """CID if runsc would accept it as a container id, else RecordError (before anything is made)."""
    if not _ID.fullmatch(cid) or cid in (".", ".."):
        raise RecordError(f"{cid!r} is not a valid container id (letters, digits, _ + . -; at most 128)")
    return cid


def _root_dir(runsc_root: str) -> str:
    return os.path.join(RECORDS_DIR, hashlib.sha256(os.path.realpath(runsc_root).encode()).hexdigest()[:16])


def _dir(runsc_root: str, cid: str) -> str:
    return os.path.join(_root_dir(runsc_root), check_id(cid))


def write(runsc_root: str, cid: str, kind: Kind, data: dict[str, Any]) -> None:
    d = _dir(runsc_root, cid)
    os.makedirs(RECORDS_DIR, mode=0o700, exist_ok=True)
    os.chmod(RECORDS_DIR, 0o700)  # makedirs leaves an existing one as it was
    os.makedirs(d, mode=0o700, exist_ok=True)
    tmp = os.path.join(d, f".{kind.value}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(d, f"{kind.value}.json"))


def read(runsc_root: str, cid: str, kind: Kind) -> dict[str, Any] | None:
    try:
        with open(os.path.join(_dir(runsc_root, cid), f"{kind.value}.json")) as f:
            data = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def forget(runsc_root: str, cid: str) -> None:
    """Remove every record of CID (and the root's directory once it is empty)."""
    d = _dir(runsc_root, cid)
    shutil.rmtree(d, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(d))
    except OSError:
        pass


def forget_root(runsc_root: str) -> None:
    """Remove the records of every sandbox under RUNSC_ROOT (a runsc root that is itself going away)."""
    shutil.rmtree(_root_dir(runsc_root), ignore_errors=True)
