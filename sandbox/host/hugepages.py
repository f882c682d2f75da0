"""Transparent huge pages for the duration of a driver host copy, put back afterwards even on failure.

On an H200 the driver's own checkpoint of 16 GB ran at 1.64 GB/s with THP `madvise` and 2.43 GB/s
with `always` (restore 4.99 -> 6.48 GB/s; docs/PLATFORM.md): the driver's host buffers are not
madvised, so only `always` gives them huge pages. The kernel has no per-process "always" switch (prctl only disables THP), so
this changes the system setting and restores the previous value on exit.

Crash safety: before switching, the previous value is recorded (fsynced) in RECORD_DIR
(/run/gpusnap: it goes with a reboot, as the setting itself does); the record is removed once the
value is back. `gpusnap recover` (put_back) restores the value of any record whose owner died, so
a kill -9 in between does not leave the machine's setting changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from storage.api import GpusnapError

from sandbox.host.meminfo import meminfo
from sandbox.host.processes import Proc

THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
RECORD_DIR = os.environ.get("GPUSNAP_RUN_DIR", "/run/gpusnap")  # env: tests, or a machine without /run


class HugePagesError(GpusnapError):
    """The THP setting could not be read or changed."""


THP_SETTING = "GPUSNAP_THP"
_POLICIES = ("always", "keep")


def policy() -> str:
    """$GPUSNAP_THP: "always" (the default: THP set to `always` for the driver's host copies and the
    restore's page faults, measured faster on the H200) or "keep" (the host's setting left alone:
    for hosts where a huge page fault is slow, as in a VM whose free memory goes back to its
    hypervisor; see free_page_reporting). HugePagesError for anything else."""
    v = os.environ.get(THP_SETTING, "").strip() or "always"
    if v not in _POLICIES:
        raise HugePagesError(f"{THP_SETTING}={v!r}: expected one of {', '.join(_POLICIES)}")
    return v


def wanted(mode: str | None) -> str | None:
    """MODE as the THP policy allows it (None under "keep": leave the setting alone)."""
    return None if mode is None or policy() == "keep" else mode


PAGE_REPORTING = "/sys/module/page_reporting/parameters/page_reporting_order"
BALLOON_DEVICES = "/sys/bus/virtio/drivers/virtio_balloon"
_F_REPORTING = 5  # VIRTIO_BALLOON_F_REPORTING: the guest reports free pages, the host takes them back


def free_page_reporting(devices: str = BALLOON_DEVICES, order_path: str = PAGE_REPORTING) -> int | None:
    """The page order at which this (virtual) machine hands free memory back to its hypervisor
    (a virtio balloon with free page reporting), else None. Where it does, free blocks of that order
    and up (2 MiB at order 9: a huge page) are unbacked on the host, and a huge page fault there
    costs the host's faults too: on the 2-core development VM a cold restore of random memory took
    0.64-0.84x the time with THP left at `madvise` than with `always`, one of weights 1.05x
    (BENCHMARKS.md, section 28)."""
    try:
        names = [n for n in os.listdir(devices) if n.startswith("virtio")]
    except OSError:
        return None
    for n in names:
        try:
            with open(os.path.join(devices, n, "features")) as f:
                bits = f.read().strip()
        except OSError:
            continue
        if len(bits) > _F_REPORTING and bits[_F_REPORTING] == "1":
            try:
                with open(order_path) as f:
                    return int(f.read().strip())
            except (OSError, ValueError):
                return 9  # the kernel's default (pageblock order)
    return None


def thp_mode(path: str = THP_ENABLED) -> str | None:
    try:
        with open(path) as f:
            m = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


@dataclass(frozen=True)
class ThpRecord:
    """The value to put back into PATH, and who changed it."""

    path: str
    before: str
    owner: Proc


def _record_path(path: str, record_dir: str) -> str:
    return os.path.join(record_dir, "thp-" + hashlib.sha256(path.encode()).hexdigest()[:16] + ".json")


def _write_record(rec: ThpRecord, record_dir: str) -> str | None:
    """REC on disk (fsynced) unless a record for the same setting exists (its value is the one to put
    back); the record's path if written here."""
    os.makedirs(record_dir, mode=0o700, exist_ok=True)
    dst = _record_path(rec.path, record_dir)
    tmp = f"{dst}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"path": rec.path, "before": rec.before, "owner": {"pid": rec.owner.pid, "start": rec.owner.start}}, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, dst)
    except FileExistsError:
        return None
    finally:
        os.unlink(tmp)
    fd = os.open(record_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return dst


@contextmanager
def thp(mode: str | None, path: str = THP_ENABLED, record_dir: str = RECORD_DIR) -> Iterator[str | None]:
    """Set THP to MODE ('always', 'madvise', 'never'; None: leave alone) inside the block; the value
    before is recorded in RECORD_DIR first, for `gpusnap recover` after a crash."""
    before = thp_mode(path)
    if mode is None or before is None or before == mode:
        yield before
        return
    me = Proc.of(os.getpid())
    assert me is not None
    try:
        record = _write_record(ThpRecord(path, before, me), record_dir)
    except OSError as e:
        raise HugePagesError(f"cannot record the transparent huge pages setting in {record_dir}: {e.strerror}") from None
    try:
        with open(path, "w") as f:
            f.write(mode)
    except OSError as e:
        _drop(record)
        raise HugePagesError(f"cannot set transparent huge pages to {mode!r}: {e.strerror} (need root)") from None
    try:
        yield before
    finally:
        with open(path, "w") as f:
            f.write(before)
        _drop(record)


def _drop(record: str | None) -> None:
    if record:
        try:
            os.unlink(record)
        except FileNotFoundError:
            pass


def put_back(record_dir: str = RECORD_DIR) -> list[ThpRecord]:
    """Every THP value recorded by a process that died before putting it back: put back, record
    removed. Records of live owners are left alone. Returns what was put back."""
    done = []
    try:
        names = sorted(os.listdir(record_dir))
    except FileNotFoundError:
        return []
    for n in names:
        p = os.path.join(record_dir, n)
        if n.endswith(".tmp") and re.fullmatch(r"thp-[0-9a-f]{16}\.json\.\d+\.tmp", n):
            if Proc.of(int(n.split(".")[-2])) is None:
                os.unlink(p)
            continue
        if not re.fullmatch(r"thp-[0-9a-f]{16}\.json", n):
            continue
        try:
            with open(p) as f:
                d = json.load(f)
            rec = ThpRecord(str(d["path"]), str(d["before"]), Proc(int(d["owner"]["pid"]), int(d["owner"]["start"])))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise HugePagesError(f"{p}: unreadable THP record: {e}") from None
        if rec.owner.alive():
            continue
        if not re.fullmatch(r"\w+", rec.before) or _record_path(rec.path, record_dir) != p:
            raise HugePagesError(f"{p}: THP record does not match its name or value")
        try:
            with open(rec.path, "w") as f:
                f.write(rec.before)
        except OSError as e:
            raise HugePagesError(f"cannot put transparent huge pages back to {rec.before!r}: {e.strerror}") from None
        os.unlink(p)
        done.append(rec)
    return done


def hugetlb_pages() -> dict[str, int]:
    return {k: v for k, v in meminfo().items() if k in ("HugePages_Total", "HugePages_Free", "Hugepagesize")}
