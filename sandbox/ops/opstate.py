"""Each journaled operation's state outside the store: what makes a journal record current, not just genuine.

A MAC proves that gpusnap wrote a record once; it cannot prove that the record is the one in force
now (a store writer can keep a copy, or rename the record away and put it back after the operation
finished). So every operation also keeps RUN/ops/OP.json (storage.fs.hostkey.run_dir: /run/gpusnap
for root, tmpfs, no group/other access, so no store writer reaches it and a reboot empties it):
the store it runs on, its owner (pid and start time), the MAC of its current record (and, only while
the next record is being renamed into place, the one before it) and whether a restore's split fill
finished. sandbox.ops.journal writes it before the record it vouches for and removes it after that
record; a record of this boot whose MAC it does not hold is not acted on.

Guarantees kept here: files are written whole (temporary file, rename) and read without following a
link or blocking, checked first (a regular file of ours, no group/other bits, bounded size); a state
that fails a check or does not parse is treated as absent (the record it would vouch for is then set
aside, never acted on).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Iterator

from storage.api import hostkey

_OP_RE = re.compile(r"[0-9a-f]{32}")
MAX_STATE = 4096


@dataclass
class OpState:
    op: str
    store: str                               # sandbox.ops.journal.Journal.store_id
    owner: tuple[int, int]                   # pid, start time (clock ticks after boot)
    macs: list[str] = field(default_factory=list)
    filled: bool = False                     # a restore's split fill finished: its tree runs whole

    def save(self) -> None:
        with _ops_dir() as dfd:
            hostkey.write_atomic(dfd, f"{self.op}.json", json.dumps(asdict(self)).encode(), durable=False)


class _Dir:
    def __enter__(self) -> int:
        run = hostkey.run_dir()
        top = hostkey.private_dir(run)
        os.close(top)
        self.fd = hostkey.private_dir(os.path.join(run, "ops"))
        return self.fd

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def _ops_dir() -> _Dir:
    return _Dir()


def load(op: str) -> OpState | None:
    """OP's state; None when there is none (or it fails a check: nothing is vouched for)."""
    if not _OP_RE.fullmatch(op):
        return None
    with _ops_dir() as dfd:
        try:
            data = hostkey.read_small(dfd, f"{op}.json", MAX_STATE, f"operation state {op}")
        except hostkey.HostStateError:
            return None
    if data is None:
        return None
    try:
        d = json.loads(data)
        st = OpState(op=str(d["op"]), store=str(d["store"]), owner=(int(d["owner"][0]), int(d["owner"][1])),
                     macs=[str(m) for m in d["macs"]][:2], filled=bool(d.get("filled")))
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return st if st.op == op else None


def remove(op: str) -> None:
    if not _OP_RE.fullmatch(op):
        return
    with _ops_dir() as dfd:
        try:
            os.unlink(f"{op}.json", dir_fd=dfd)
        except FileNotFoundError:
            pass


def every() -> Iterator[OpState]:
    """Every operation state of this boot (for recover's report of states whose record is gone)."""
    with _ops_dir() as dfd:
        names = os.listdir(dfd)
    for n in sorted(names):
        if n.endswith(".json") and _OP_RE.fullmatch(n[:-5]):
            st = load(n[:-5])
            if st is not None:
                yield st
