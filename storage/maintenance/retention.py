"""Retention policies (`store forget`): which snapshots to keep, with restic's `forget` semantics.

A policy keeps the N most recent snapshots (--keep-last) and, for each of hourly/daily/weekly/
monthly/yearly, the most recent snapshot of each of the last N distinct periods in which a snapshot
exists (periods without snapshots do not count, as in restic). A snapshot kept by any rule is kept;
the reasons are reported. Policies apply per group (the snapshot kind and host), so a busy host or
kind never pushes another's snapshots out. Only snapshots matching the --tag/--kind filters are
considered; the others are neither kept nor removed by the policy. Companion snapshots (NAME.gpu,
holding the GPU memory of NAME) are never judged on their own: they follow their parent.

Pure functions: nothing here touches the store.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterable

from storage.base.errors import GpusnapError

COMPANION_SUFFIX = ".gpu"


class RetentionError(GpusnapError):
    """A retention policy that cannot be applied as given."""


@dataclass(frozen=True)
class Policy:
    last: int = 0
    hourly: int = 0
    daily: int = 0
    weekly: int = 0
    monthly: int = 0
    yearly: int = 0

    def __post_init__(self) -> None:
        for k, v in self.__dict__.items():
            if v < 0:
                raise RetentionError(f"--keep-{k} must not be negative")

    @property
    def empty(self) -> bool:
        return not any(self.__dict__.values())


@dataclass(frozen=True)
class Entry:
    """What the policy needs of a snapshot."""

    name: str
    created: datetime
    kind: str
    host: str
    tags: tuple[str, ...] = ()


@dataclass
class Decision:
    keep: list[tuple[str, list[str]]] = field(default_factory=list)    # (name, reasons)
    remove: list[str] = field(default_factory=list)


def parse_created(text: str) -> datetime:
    """A manifest's ISO 8601 creation time, as an aware datetime (naive ones are taken as UTC)."""
    try:
        t = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise RetentionError(f"bad creation time {text!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


_BUCKETS: list[tuple[str, Callable[[datetime], tuple[int, ...]]]] = [
    ("hourly", lambda t: (t.year, t.month, t.day, t.hour)),
    ("daily", lambda t: (t.year, t.month, t.day)),
    ("weekly", lambda t: tuple(t.isocalendar()[:2])),
    ("monthly", lambda t: (t.year, t.month)),
    ("yearly", lambda t: (t.year,)),
]


def companion_parent(name: str) -> str | None:
    return name[: -len(COMPANION_SUFFIX)] if name.endswith(COMPANION_SUFFIX) else None


def decide(entries: Iterable[Entry], policy: Policy) -> Decision:
    """Split ENTRIES (already filtered) into kept (with reasons) and removed, per (kind, host) group."""
    if policy.empty:
        raise RetentionError("no --keep-* rule given: refusing to forget every snapshot")
    entries = list(entries)
    names = {e.name for e in entries}
    judged = [e for e in entries if not (companion_parent(e.name) in names)]
    groups: dict[tuple[str, str], list[Entry]] = {}
    for e in judged:
        groups.setdefault((e.kind, e.host), []).append(e)
    reasons: dict[str, list[str]] = {}
    for group in groups.values():
        group.sort(key=lambda e: (e.created, e.name), reverse=True)
        for i, e in enumerate(group[: policy.last]):
            reasons.setdefault(e.name, []).append(f"last {i + 1}")
        for rule, bucket in _BUCKETS:
            want = getattr(policy, rule)
            seen: list[tuple[int, ...]] = []
            for e in group:
                if len(seen) >= want:
                    break
                b = bucket(e.created.astimezone(timezone.utc))
                if b not in seen:
                    seen.append(b)
                    reasons.setdefault(e.name, []).append(f"{rule} {len(seen)}")
    out = Decision()
    for e in sorted(judged, key=lambda e: (e.created, e.name), reverse=True):
        if e.name in reasons:
            out.keep.append((e.name, reasons[e.name]))
        else:
            out.remove.append(e.name)
    kept = {n for n, _ in out.keep}
    for e in entries:
        parent = companion_parent(e.name)
        if parent in names:
            (out.keep.append((e.name, [f"companion of {parent}"])) if parent in kept
             else out.remove.append(e.name))
    return out
