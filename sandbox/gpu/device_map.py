"""`--device-map OLD=NEW`: which GPU each checkpointed GPU's state is restored onto, checked up front.

The driver restores a process onto other GPUs when it is given GPU UUID pairs; it wants every GPU
the process was checkpointed on, a GPU of the same chip, and enough memory on each new GPU. A map
that breaks one of those fails inside the driver, per process, after some may already be restored.
plan() checks all of it against the snapshot's record and this machine's GPUs before anything is
restored, so a bad map costs nothing.

Guarantees kept here:
- plan() returns {old uuid: new uuid} naming every checkpointed GPU (those the snapshot's processes
  held memory on, as recorded at checkpoint; every GPU the snapshot lists where that is not
  recorded), no GPU twice and no target twice, each a GPU of this machine of the same model, or
  raises DeviceMapError (one line); it reads and changes nothing but its arguments;
- the memory check sums, for each target GPU, the bytes every process of the snapshot held on the
  GPUs mapped onto it (as recorded at checkpoint) and refuses when that exceeds the target's free
  memory now. Where either figure is unknown (no NVML, an older snapshot) it is skipped and said so
  in DevicePlan.unchecked: the driver's own refusal then still leaves every process CHECKPOINTED.

Exit codes (cli/__init__.py): a malformed map, one that names a GPU twice, misses a checkpointed GPU
or names one the snapshot lacks is a usage error (2); a target GPU this machine does not have, of
another model, or without the free memory is something this machine lacks (4).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from storage.api import EXIT_UNAVAILABLE, EXIT_USAGE, GpusnapError

from sandbox.gpu.driver import Features, GpuInfo


class DeviceMapError(GpusnapError):
    """A --device-map that cannot be applied to this snapshot on this machine (nothing was touched)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class DevicePlan:
    gpu_map: dict[str, str]                       # old uuid -> new uuid ({} with no map)
    need: dict[str, int] = field(default_factory=dict)   # target uuid -> bytes that land there
    unchecked: str | None = None                  # why the memory was not checked, if it was not


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def used_gpus(usage: Mapping[int, Mapping[str, int]] | None) -> set[str] | None:
    """The GPUs the snapshot's processes held memory on (the checkpointed ones); None: not recorded."""
    if not usage:
        return None
    return {u for per in usage.values() for u in per}


def parse(items: Sequence[str], snapshot_gpus: Sequence[Mapping[str, Any]], here: Sequence[GpuInfo],
          checkpointed: set[str] | None = None) -> dict[str, str]:
    """OLD=NEW items (GPU index or UUID on each side) -> {old uuid: new uuid}, checked against the
    snapshot's GPUs and this machine's; {} for no items. CHECKPOINTED: the GPUs the map must cover
    (those the processes held memory on); None: every GPU the snapshot records."""
    if not items:
        return {}
    def find(spec: str, gpus: Sequence[Mapping[str, Any]], where: str, code: int) -> Mapping[str, Any]:
        for g in gpus:
            if spec == str(g["index"]) or spec == g["uuid"]:
                return g
        raise DeviceMapError(f"--device-map: no GPU {spec!r} {where}", code)
    here_d = [{"index": g.index, "uuid": g.uuid, "name": g.name} for g in here]
    out: dict[str, str] = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise DeviceMapError(f"--device-map {item!r}: expected OLD=NEW (GPU index or UUID)")
        g_old = find(old, snapshot_gpus, "in the snapshot", EXIT_USAGE)
        g_new = find(new, here_d, f"on this machine ({len(here_d)} GPU(s) here)", EXIT_UNAVAILABLE)
        if g_old["uuid"] in out:
            raise DeviceMapError(f"--device-map names the snapshot's GPU {g_old['index']} ({g_old['uuid']}) twice")
        if g_old["name"] != g_new["name"]:
            raise DeviceMapError(f"--device-map {item}: {g_old['name']} state cannot be restored onto a "
                                 f"{g_new['name']}", EXIT_UNAVAILABLE)
        out[str(g_old["uuid"])] = str(g_new["uuid"])
    targets = list(out.values())
    twice = sorted({t for t in targets if targets.count(t) > 1})
    if twice:
        raise DeviceMapError(f"--device-map maps two GPUs onto one ({', '.join(twice)}); the driver restores "
                             "each checkpointed GPU onto a GPU of its own")
    missing = [str(g["uuid"]) for g in snapshot_gpus
               if g["uuid"] not in out and (checkpointed is None or g["uuid"] in checkpointed)]
    if missing:
        raise DeviceMapError(f"--device-map must list every checkpointed GPU; missing {', '.join(missing)}")
    return out


def check_memory(gpu_map: Mapping[str, str], usage: Mapping[int, Mapping[str, int]] | None,
                 here: Sequence[GpuInfo]) -> tuple[dict[str, int], str | None]:
    """(bytes landing on each target GPU, why unchecked or None); DeviceMapError (4) when a target's
    free memory is less than what lands on it."""
    if not gpu_map:
        return {}, None
    if not usage:
        return {}, "the snapshot does not record its processes' GPU memory"
    need: dict[str, int] = {}
    who: dict[str, set[int]] = {}
    for pid, per in usage.items():
        for old, n in per.items():
            new = gpu_map.get(old)
            if new is not None:
                need[new] = need.get(new, 0) + n
                who.setdefault(new, set()).add(pid)
    by_uuid = {g.uuid: g for g in here}
    unknown = [u for u in need if by_uuid.get(u) is None or by_uuid[u].free_bytes is None]
    for uuid, n in need.items():
        g = by_uuid.get(uuid)
        if g is None or g.free_bytes is None or n <= g.free_bytes:
            continue
        pids = sorted(who[uuid])
        raise DeviceMapError(f"--device-map: GPU {g.index} ({uuid}) has {_gib(g.free_bytes)} free, the "
                             f"{len(pids)} process(es) {pids} mapped onto it held {_gib(n)}; nothing was restored",
                             EXIT_UNAVAILABLE)
    return need, (f"free memory unknown on {', '.join(unknown)}" if unknown else None)


def plan(items: Sequence[str], snapshot_gpus: Sequence[Mapping[str, Any]], here: Sequence[GpuInfo],
         usage: Mapping[int, Mapping[str, int]] | None) -> DevicePlan:
    """parse() and check_memory() in one: the map to hand the driver, or DeviceMapError. A map of
    every GPU onto itself (`0=0`) is checked like any other and then dropped: the driver gets no
    pairs, exactly as for a restore without a map."""
    gpu_map = parse(items, snapshot_gpus, here, used_gpus(usage))
    need, unchecked = check_memory(gpu_map, usage, here)
    if all(o == n for o, n in gpu_map.items()):
        gpu_map = {}
    return DevicePlan(gpu_map, need, unchecked)


def gpus_here(driver: Any, features: Features | None) -> list[GpuInfo]:
    """This machine's GPUs with their free memory now: the driver's own answer when it gives one
    (CudaDriver.gpus(), the stand-in's), else what FEATURES recorded."""
    fn = getattr(driver, "gpus", None)
    if callable(fn):
        return list(fn())
    return list(features.gpus) if features is not None else []


def usage_of(driver: Any, pids: Sequence[int]) -> dict[int, dict[str, int]]:
    """{pid: {GPU uuid: bytes}} the RUNNING PIDS hold now, read before they are locked (a
    checkpointed process holds none); {} when the driver cannot say."""
    fn = getattr(driver, "gpu_bytes", None)
    if not callable(fn):
        return {}
    try:
        got = fn(list(pids))
    except Exception:  # noqa: BLE001 - a figure we can do without: the checkpoint goes ahead
        return {}
    return {int(p): {str(u): int(n) for u, n in per.items()} for p, per in (got or {}).items() if p in pids}


class PerProcessMap:
    """DRIVER, with each process restored onto its own part of the map: the pairs of the GPUs it held
    memory on at checkpoint (the driver's "every checkpointed GPU" is per process; a pair for a GPU
    the process never used is not passed). A process with no record gets the whole map. Every other
    call goes to DRIVER as it is, so the freeze/thaw code and its undo see one driver."""

    def __init__(self, driver: Any, gpu_map: Mapping[str, str], usage: Mapping[int, Mapping[str, int]] | None) -> None:
        self._driver, self._map, self._usage = driver, dict(gpu_map), usage or {}

    def map_for(self, pid: int, gpu_map: Mapping[str, str] | None) -> dict[str, str] | None:
        if not gpu_map:
            return None
        used = self._usage.get(pid)
        return {o: n for o, n in gpu_map.items() if o in used} if used else dict(gpu_map)

    def restore(self, pid: int, gpu_map: dict[str, str] | None = None) -> None:
        self._driver.restore(pid, self.map_for(pid, gpu_map))

    def restore_custom(self, pid: int, gpu_map: dict[str, str] | None = None) -> Any:
        return self._driver.restore_custom(pid, self.map_for(pid, gpu_map))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)


def for_restore(driver: Any, gpu_map: Mapping[str, str], usage: Mapping[int, Mapping[str, int]] | None) -> Any:
    """The driver to restore through: DRIVER itself without a map, else PerProcessMap."""
    return PerProcessMap(driver, gpu_map, usage) if gpu_map else driver
