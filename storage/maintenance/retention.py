"""Retention policies (`store forget`): which snapshots to keep, with restic's `forget` semantics.

A policy keeps the N most recent snapshots (--keep-last) and, for each of hourly/daily/weekly/
monthly/yearly, the most recent snapshot of each of the last N distinct periods in which a snapshot
exists (periods without snapshots do not count, as in restic); --keep-within DURATION keeps every
snapshot created within DURATION before the group's newest one (restic's reference: not the clock,
so a host that stopped backing up keeps what it had); --keep-tag keeps every snapshot that carries
all of one list of tags. A snapshot kept by any rule is kept;
the reasons are reported. Policies apply per group (the snapshot kind and host), so a busy host or
kind never pushes another's snapshots out. Only snapshots matching the --tag/--kind filters are
considered; the others are neither kept nor removed by the policy. Companion snapshots (NAME.gpu,
holding the GPU memory of NAME) are never judged on their own: they follow their parent.

Pure functions: nothing here touches the store.
"""
from __future__ import annotations

import calendar
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Callable, Iterable

from storage.base.errors import EXIT_USAGE, GpusnapError

COMPANION_SUFFIX = ".gpu"


class RetentionError(GpusnapError):
    """A retention policy that cannot be applied as given (a bad argument: exit 2)."""

    exit_code = EXIT_USAGE


_DURATION_RE = re.compile(r"(?:(\d+)y)?(?:(\d+)m)?(?:(\d+)d)?(?:(\d+)h)?")


@dataclass(frozen=True)
class Duration:
    """restic's --keep-within DURATION: years, months, days and hours (`1y5m7d2h`, `36h`, `2d`)."""

    years: int = 0
    months: int = 0
    days: int = 0
    hours: int = 0

    @classmethod
    def parse(cls, text: str) -> "Duration":
        m = _DURATION_RE.fullmatch(text.strip())
        if not text.strip() or m is None or len(text) > 40:
            raise RetentionError(f"{text!r}: give a duration of years, months, days and hours, as restic "
                                 "takes it: 1y5m7d2h, 30d, 36h (m is months)")
        d = cls(*(int(g or 0) for g in m.groups()))
        if max(d.years, d.months // 12, d.days // 366, d.hours // 8784) > 10000:
            raise RetentionError(f"{text!r}: a duration of more than 10000 years")
        return d

    def before(self, t: datetime) -> datetime:
        """T less this duration (months by the calendar, the day clamped to the month's last)."""
        months = t.year * 12 + t.month - 1 - self.years * 12 - self.months
        year, month = divmod(months, 12)
        if year < 1:
            return datetime.min.replace(tzinfo=t.tzinfo)
        day = min(t.day, calendar.monthrange(year, month + 1)[1])
        try:
            return t.replace(year=year, month=month + 1, day=day) - timedelta(days=self.days, hours=self.hours)
        except OverflowError:
            return datetime.min.replace(tzinfo=t.tzinfo)

    def __str__(self) -> str:
        return "".join(f"{v}{u}" for v, u in ((self.years, "y"), (self.months, "m"), (self.days, "d"),
                                              (self.hours, "h")) if v) or "0h"


@dataclass(frozen=True)
class Policy:
    last: int = 0
    hourly: int = 0
    daily: int = 0
    weekly: int = 0
    monthly: int = 0
    yearly: int = 0
    within: Duration | None = None
    tags: tuple[tuple[str, ...], ...] = ()   # --keep-tag: each a list of tags a kept snapshot carries all of

    def __post_init__(self) -> None:
        for k in ("last", "hourly", "daily", "weekly", "monthly", "yearly"):
            if getattr(self, k) < 0:
                raise RetentionError(f"--keep-{k} must not be negative")

    @property
    def empty(self) -> bool:
        return not (any(getattr(self, k) for k in ("last", "hourly", "daily", "weekly", "monthly", "yearly"))
                    or self.within is not None or self.tags)


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
        if policy.within is not None and group:
            cutoff = policy.within.before(group[0].created)
            for e in group:
                if e.created >= cutoff:
                    reasons.setdefault(e.name, []).append(f"within {policy.within}")
        for e in group:
            for want_tags in policy.tags:
                if all(t in e.tags for t in want_tags):
                    reasons.setdefault(e.name, []).append(f"tag {','.join(want_tags)}")
                    break
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
