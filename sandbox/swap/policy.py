"""Which resident servers to swap out so that another fits: pure, decided from a snapshot of the figures.

Rules: only servers that are resident, not pinned and with no request in flight are candidates; the
least recently used go first; no more are taken than needed to fit both the memory budget and
max_resident. When even all candidates would not make room, nothing is taken (Plan.wait says why):
the caller waits for a request to finish, or for the request's deadline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Slot:
    """One server as the policy sees it."""

    name: str
    resident: bool        # holds the GPU (resident, starting, swapping in or out)
    pinned: bool
    in_flight: int
    last_used: float      # monotonic seconds of its last request (start or end)
    gpu_bytes: int        # what it holds, or held when last resident, or its configured estimate


@dataclass(frozen=True)
class Plan:
    victims: tuple[str, ...] = ()
    wait: str | None = None   # why no plan fits now (None: VICTIMS make room)


def plan(slots: Sequence[Slot], target: str, *, budget: int | None, max_resident: int | None) -> Plan:
    """The servers to swap out, in order, so that TARGET fits beside the rest."""
    by = {s.name: s for s in slots}
    me = by[target]
    if me.resident:
        return Plan()
    resident = [s for s in slots if s.resident and s.name != target]
    if budget is not None and me.gpu_bytes > budget:
        return Plan(wait=f"{target} needs {me.gpu_bytes} bytes of GPU memory, over the whole budget of {budget}")
    used = sum(s.gpu_bytes for s in resident)
    count = len(resident)

    def fits() -> bool:
        return ((budget is None or used + me.gpu_bytes <= budget)
                and (max_resident is None or count + 1 <= max_resident))
    victims: list[str] = []
    for s in sorted((s for s in resident if not s.pinned and s.in_flight == 0), key=lambda s: (s.last_used, s.name)):
        if fits():
            break
        victims.append(s.name)
        used -= s.gpu_bytes
        count -= 1
    if fits():
        return Plan(tuple(victims))
    busy = [s.name for s in resident if s.in_flight and not s.pinned]
    pinned = [s.name for s in resident if s.pinned]
    why = f"no room for {target}"
    if busy:
        why += f": waiting for the requests in flight on {', '.join(busy)}"
    if pinned:
        why += f" (pinned, never swapped out: {', '.join(pinned)})"
    return Plan(wait=why)
