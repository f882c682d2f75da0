"""Typed snapshot metadata: one frozen record per snapshot kind, parsed and validated on load.

storage keeps a manifest's `meta` a JSON object with a `kind` and knows nothing more; this module says
what each kind gpusnap makes holds (storage/FORMAT.md, "Snapshot kinds") and is the only reader of it.
Guarantees kept here: a restore acts only on metadata that gpusnap itself would have written — pids
that are pids, a GPU path it knows, CRIU options of its own, runsc flags from an allowlist (anything
else, e.g. `--debug-log=DIR` appended to a snapshot from another node, is refused with the flag
named), a network record that sandbox/host/netns.py validates, and a GPU companion snapshot that can only
be `NAME.gpu`. Fields a restore never acts on (timings, reports) are kept as `extra`, unread.
Anything else is damage (exit 3), reported before a process, sandbox or network is touched.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar, Mapping

from storage.api import DamageError, GpusnapError
from storage.api import Manifest

from sandbox.ops.gpu_path import GpuPath
from sandbox.host.netns import NetConfig

META_VERSION = 1  # of the records below; a meta without `meta_version` is version 1
PID_MAX = 1 << 22  # the kernel's limit on pid_max


class SnapshotMetaError(DamageError):
    """A snapshot's metadata that gpusnap would not have written, or of another kind than asked for."""


class SnapshotKindError(GpusnapError):
    """A snapshot of another kind than the command works on (`gpusnap gpu restore` of a criu snapshot)."""


class RunscFlagError(GpusnapError):
    """A runsc flag outside the allowlist of flags gpusnap records."""


class SnapshotKind(str, Enum):
    FILES = "files"
    GPU = "gpu"
    CRIU = "criu"
    RUNSC = "runsc"


def companion_name(name: str) -> str:
    """The GPU companion snapshot of a runsc snapshot NAME (GPU memory streamed by the in-sandbox agent)."""
    return f"{name}.gpu"


# ---- field checks ------------------------------------------------------------------------------
def _fail(where: str, what: str) -> SnapshotMetaError:
    return SnapshotMetaError(f"{where}: {what}")


def _int(v: Any, where: str, what: str, low: int, high: int) -> int:
    if not (isinstance(v, int) and not isinstance(v, bool) and low <= v <= high):
        raise _fail(where, f"{what} {v!r} is not an integer in {low}..{high}")
    return v


def _pid(v: Any, where: str, what: str = "pid") -> int:
    return _int(v, where, what, 1, PID_MAX)


def _pids(v: Any, where: str, what: str, *, empty: bool = False) -> tuple[int, ...]:
    if not isinstance(v, list) or (not v and not empty):
        raise _fail(where, f"{what} is not a {'' if empty else 'non-empty '}list of pids")
    out = tuple(_pid(p, where, what) for p in v)
    if len(set(out)) != len(out):
        raise _fail(where, f"{what} names a pid twice")
    return out


def _str(v: Any, where: str, what: str, pattern: str = r"[^\x00\n]{0,4096}", *, optional: bool = False) -> Any:
    if v is None and optional:
        return None
    if not (isinstance(v, str) and re.fullmatch(pattern, v)):
        raise _fail(where, f"{what} {v!r} is not valid")
    return v


def _bool(v: Any, where: str, what: str) -> bool:
    if not isinstance(v, bool):
        raise _fail(where, f"{what} {v!r} is not true or false")
    return v


def _gpu_path(v: Any, where: str, *, optional: bool) -> GpuPath | None:
    """A recorded GPU path (sandbox.ops.gpu_path.GpuPath); None (or "none", as older snapshots wrote it)
    where OPTIONAL: the snapshot holds no GPU state."""
    if v in (None, "none") and optional:
        return None
    try:
        return GpuPath(v)
    except ValueError:
        raise _fail(where, f"GPU path {v!r} is not one of {', '.join(p.value for p in GpuPath)}") from None


def _gpu_bytes(v: Any, where: str, pids: tuple[int, ...], gpus: tuple["GpuInfo", ...]) -> dict[int, dict[str, int]]:
    """`gpu_bytes` ({"PID": {"GPU uuid": bytes}}, what each process held on each GPU at checkpoint):
    only the snapshot's pids and GPUs, counts in 0..2^50 (a PiB); absent in older snapshots."""
    if v is None:
        return {}
    if not isinstance(v, dict) or len(v) > len(pids):
        raise _fail(where, "gpu_bytes is not an object of the snapshot's pids")
    uuids = {g.uuid for g in gpus}
    out: dict[int, dict[str, int]] = {}
    for k, per in v.items():
        pid = _pid(int(k) if isinstance(k, str) and k.isdigit() and len(k) <= 8 else k, where, "gpu_bytes pid")
        if pid not in pids or not isinstance(per, dict) or not set(per) <= uuids:
            raise _fail(where, f"gpu_bytes of {k!r} names a pid or GPU the snapshot does not")
        out[pid] = {u: _int(n, where, "gpu_bytes count", 0, 1 << 50) for u, n in per.items()}
    return out


def _gpus(v: Any, where: str) -> tuple["GpuInfo", ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > 1024:
        raise _fail(where, "gpus is not a list")
    return tuple(GpuInfo.from_json(g, where) for g in v)


# ---- runsc flags -------------------------------------------------------------------------------
_BOOL = r"true|false"
# the runsc global flags gpusnap records (from --runsc-arg and the GPU sandbox setup), with their values
RUNSC_FLAGS: Mapping[str, str] = {
    "root": r"/[A-Za-z0-9_.+=@/-]{0,4095}",
    "platform": r"ptrace|kvm|systrap",
    "network": r"none|sandbox|host",
    "file-access": r"exclusive|shared",
    "overlay2": r"none|(root|all):(memory|self)",
    "ignore-cgroups": _BOOL,
    "nvproxy": _BOOL,
    "nvproxy-driver-version": r"[0-9]{1,4}(\.[0-9]{1,4}){0,3}",
    "nvproxy-allowed-driver-capabilities": r"[a-z]{1,16}(,[a-z]{1,16}){0,15}",
}
_BOOL_FLAGS = {k for k, v in RUNSC_FLAGS.items() if v == _BOOL}
_FLAG_RE = re.compile(r"--?([a-z0-9][a-z0-9-]*)(?:=(.*))?", re.S)


def check_runsc_args(args: Any, where: str = "runsc arguments") -> tuple[str, ...]:
    """ARGS if every one is a runsc global flag gpusnap records, with a valid value; else
    RunscFlagError naming the first that is not (`--flag=value`, `--flag value`, bare booleans).
    Read from a snapshot, the error becomes damage (SnapshotMetaError)."""
    if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        raise RunscFlagError(f"{where}: not a list of strings")
    i = 0
    while i < len(args):
        m = _FLAG_RE.fullmatch(args[i])
        name = m.group(1) if m else None
        if m is None or name is None or name not in RUNSC_FLAGS:
            raise RunscFlagError(f"{where}: runsc flag {args[i]!r} is not one gpusnap records (allowed: "
                                 f"{', '.join(sorted(RUNSC_FLAGS))}); refusing to pass it to runsc")
        value = m.group(2)
        if value is None and name not in _BOOL_FLAGS:
            if i + 1 >= len(args):
                raise RunscFlagError(f"{where}: runsc flag {args[i]!r} has no value")
            i += 1
            value = args[i]
        if value is not None and not re.fullmatch(str(RUNSC_FLAGS[name]), value):
            raise RunscFlagError(f"{where}: runsc flag --{name} has a value gpusnap does not record: {value!r}")
        if name == "root" and ".." in str(value).split("/"):
            raise RunscFlagError(f"{where}: runsc flag --root={value!r} climbs with '..'")
        i += 1
    return tuple(args)


# ---- the records -------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuInfo:
    index: int
    uuid: str
    name: str

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "uuid": self.uuid, "name": self.name}

    @classmethod
    def from_json(cls, v: Any, where: str) -> "GpuInfo":
        if not isinstance(v, dict):
            raise _fail(where, f"GPU record {v!r} is not an object")
        return cls(_int(v.get("index"), where, "GPU index", 0, 1023),
                   _str(v.get("uuid"), where, "GPU uuid", r"[A-Za-z0-9-]{1,64}"),
                   _str(v.get("name"), where, "GPU name", r"[^\x00\n]{0,256}"))


@dataclass(frozen=True)
class SnapshotMeta:
    """What every kind has: its kind, the version of its record, and the fields no restore reads."""
    KIND: ClassVar[SnapshotKind]
    FIELDS: ClassVar[tuple[str, ...]]
    version: int = field(default=META_VERSION, kw_only=True)
    extra: Mapping[str, Any] = field(default_factory=dict, kw_only=True, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {**self.extra, "kind": self.KIND.value, "meta_version": self.version, **self._fields()}

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_json(cls, meta: Any, name: str) -> "SnapshotMeta":
        """The record of snapshot NAME's META, validated; SnapshotMetaError (damage) if it is not one."""
        where = f"snapshot {name!r} metadata"
        if not isinstance(meta, dict):
            raise _fail(where, "not a JSON object")
        if meta.get("kind") != cls.KIND.value:
            raise SnapshotKindError(f"snapshot {name!r} is a {meta.get('kind')!r} snapshot, not a {cls.KIND.value} one")
        version = meta.get("meta_version", 1)
        if version != META_VERSION:
            raise _fail(where, f"version {version!r}; this gpusnap reads {META_VERSION}")
        extra = {k: v for k, v in meta.items() if k not in ("kind", "meta_version", *cls.FIELDS)}
        try:
            return cls._parse(meta, where, name, extra)
        except GpusnapError as e:
            if isinstance(e, SnapshotMetaError):
                raise
            raise _fail(where, str(e)) from None

    @classmethod
    def _parse(cls, meta: dict[str, Any], where: str, name: str, extra: dict[str, Any]) -> "SnapshotMeta":
        raise NotImplementedError

    @classmethod
    def of(cls, manifest: Manifest) -> Any:
        """The validated record of MANIFEST, which must be of this class's kind."""
        return cls.from_json(manifest.meta, manifest.name)


@dataclass(frozen=True)
class FilesMeta(SnapshotMeta):
    KIND = SnapshotKind.FILES
    FIELDS = ("paths",)
    paths: tuple[str, ...] = ()

    def _fields(self) -> dict[str, Any]:
        return {"paths": list(self.paths)}

    @classmethod
    def _parse(cls, meta: dict[str, Any], where: str, name: str, extra: dict[str, Any]) -> "FilesMeta":
        paths = meta.get("paths", [])
        if not isinstance(paths, list):
            raise _fail(where, "paths is not a list")
        return cls(tuple(_str(p, where, "path") for p in paths), extra=extra)


@dataclass(frozen=True)
class GpuMeta(SnapshotMeta):
    """`gpu` snapshots: GPU state of a process tree (custom storage: gpu/PID/INDEX streams)."""
    KIND = SnapshotKind.GPU
    FIELDS = ("gpu_path", "path", "root_pid", "pids", "gpus", "driver", "gpu_bytes")
    gpu_path: GpuPath = GpuPath.HOST_STAGED
    root_pid: int = 1
    pids: tuple[int, ...] = ()
    gpus: tuple[GpuInfo, ...] = ()
    driver: str | None = None
    gpu_bytes: Mapping[int, Mapping[str, int]] = field(default_factory=dict)

    def _fields(self) -> dict[str, Any]:
        return {"gpu_path": self.gpu_path.value, "root_pid": self.root_pid, "pids": list(self.pids),
                "gpus": [g.to_json() for g in self.gpus], "driver": self.driver,
                **({"gpu_bytes": {str(p): dict(u) for p, u in self.gpu_bytes.items()}} if self.gpu_bytes else {})}

    @classmethod
    def _parse(cls, meta: dict[str, Any], where: str, name: str, extra: dict[str, Any]) -> "GpuMeta":
        path = meta.get("gpu_path", meta.get("path"))  # `path` before the key was unified
        pids = _pids(meta.get("pids"), where, "pids")
        gpus = _gpus(meta.get("gpus", []), where)
        return cls(_gpu_path(path, where, optional=False),  # type: ignore[arg-type]
                   _pid(meta.get("root_pid"), where, "root_pid"), pids, gpus,
                   _str(meta.get("driver"), where, "driver version", r"[0-9A-Za-z.+-]{0,64}", optional=True),
                   _gpu_bytes(meta.get("gpu_bytes"), where, pids, gpus), extra=extra)

    @property
    def gpus_json(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self.gpus]


@dataclass(frozen=True)
class CriuMeta(SnapshotMeta):
    """`criu` snapshots: CRIU images under images/, GPU state by gpu_path."""
    KIND = SnapshotKind.CRIU
    FIELDS = ("root_pid", "pids", "cuda_pids", "criu", "options", "gpu_path", "gpus", "gpu_bytes", "staged_restore")
    root_pid: int = 1
    pids: tuple[int, ...] = ()
    cuda_pids: tuple[int, ...] = ()
    criu: str = ""
    options: tuple[str, ...] = ()
    gpu_path: GpuPath | None = None
    gpus: tuple[GpuInfo, ...] = ()
    gpu_bytes: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    staged_restore: str | None = None  # why the images must be files on a restore (CRIU reads some late)

    def _fields(self) -> dict[str, Any]:
        return {"root_pid": self.root_pid, "pids": list(self.pids), "cuda_pids": list(self.cuda_pids),
                "criu": self.criu, "options": list(self.options),
                **({"staged_restore": self.staged_restore} if self.staged_restore else {}),
                "gpu_path": self.gpu_path.value if self.gpu_path else None,
                **({"gpus": [g.to_json() for g in self.gpus]} if self.gpus else {}),
                **({"gpu_bytes": {str(p): dict(u) for p, u in self.gpu_bytes.items()}} if self.gpu_bytes else {})}

    @property
    def gpus_json(self) -> list[dict[str, Any]]:
        return [g.to_json() for g in self.gpus]

    @property
    def shell_job(self) -> bool:
        return "--shell-job" in self.options

    @classmethod
    def _parse(cls, meta: dict[str, Any], where: str, name: str, extra: dict[str, Any]) -> "CriuMeta":
        pids = _pids(meta.get("pids"), where, "pids")
        cuda = _pids(meta.get("cuda_pids", []), where, "cuda_pids", empty=True)
        if not set(cuda) <= set(pids):
            raise _fail(where, "cuda_pids are not among the snapshot's pids")
        root = _pid(meta.get("root_pid"), where, "root_pid")
        if root not in pids:
            raise _fail(where, f"root_pid {root} is not among the snapshot's pids")
        options = meta.get("options", [])
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            raise _fail(where, "options is not a list of strings")
        gpu_path = _gpu_path(meta.get("gpu_path"), where, optional=True)
        if bool(cuda) != (gpu_path is not None):
            raise _fail(where, f"gpu_path {meta.get('gpu_path')!r} does not match cuda_pids {list(cuda)}")
        gpus = _gpus(meta.get("gpus"), where)
        staged = meta.get("staged_restore")
        if staged is not None and (not isinstance(staged, str) or not 0 < len(staged) <= 512):
            raise _fail(where, "staged_restore is not a string of 1 to 512 characters")
        return cls(root, pids, cuda, _str(meta.get("criu", ""), where, "CRIU version", r"[0-9.]{0,32}"),
                   tuple(options), gpu_path, gpus, _gpu_bytes(meta.get("gpu_bytes"), where, cuda, gpus),
                   staged_restore=staged, extra=extra)


@dataclass(frozen=True)
class RunscGpu:
    """A GPU sandbox's record in a runsc snapshot: its GPUs, runsc's nvproxy flags, whether the agent
    ran, and what the agent reported (the CUDA pids it checkpointed; the companion snapshot, if any)."""
    gpus: tuple[int, ...] = ()
    runsc_args: tuple[str, ...] = ()
    agent: bool = False
    agent_report: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def cuda_pids(self) -> tuple[int, ...]:
        return tuple(self.agent_report.get("cuda_pids", ()))

    @property
    def companion(self) -> str | None:
        return self.agent_report.get("snapshot")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"gpus": list(self.gpus), "runsc_args": list(self.runsc_args), "agent": self.agent}
        if self.agent_report:
            out["agent_report"] = dict(self.agent_report)
        return out

    @classmethod
    def from_json(cls, v: Any, where: str, name: str) -> "RunscGpu":
        if not isinstance(v, dict):
            raise _fail(where, "gpu is not an object")
        gpus = v.get("gpus", [])
        if not isinstance(gpus, list):
            raise _fail(where, "gpu.gpus is not a list")
        report = v.get("agent_report") or {}
        if not isinstance(report, dict):
            raise _fail(where, "gpu.agent_report is not an object")
        report = dict(report)
        report["cuda_pids"] = list(_pids(report.get("cuda_pids", []), where, "gpu.agent_report.cuda_pids", empty=True))
        snap = report.get("snapshot")
        if snap is not None and snap != companion_name(name):
            raise _fail(where, f"the GPU agent's snapshot {snap!r} is not this snapshot's companion "
                               f"{companion_name(name)!r}")
        return cls(tuple(_int(g, where, "GPU index", 0, 1023) for g in gpus),
                   check_runsc_args(v.get("runsc_args", []), "gpu.runsc_args"),
                   _bool(v.get("agent", False), where, "gpu.agent"),
                   report)


@dataclass(frozen=True)
class RunscMeta(SnapshotMeta):
    """`runsc` snapshots: runsc's checkpoint image under images/, the flags and network to restore with."""
    KIND = SnapshotKind.RUNSC
    FIELDS = ("container", "runsc_args", "bundle", "net", "netns_path", "gpu")
    container: str = ""
    runsc_args: tuple[str, ...] = ()
    bundle: str | None = None
    net: NetConfig | None = None
    netns_path: str | None = None
    gpu: RunscGpu | None = None

    def _fields(self) -> dict[str, Any]:
        return {"container": self.container, "runsc_args": list(self.runsc_args), "bundle": self.bundle,
                "net": self.net.as_dict() if self.net else None, "netns_path": self.netns_path,
                "gpu": self.gpu.to_json() if self.gpu else None}

    @property
    def gpu_json(self) -> dict[str, Any]:
        """The validated GPU record as the restore flow reads it ({} for a CPU sandbox)."""
        return self.gpu.to_json() if self.gpu else {}

    @classmethod
    def _parse(cls, meta: dict[str, Any], where: str, name: str, extra: dict[str, Any]) -> "RunscMeta":
        net = meta.get("net")
        gpu = meta.get("gpu")
        return cls(_str(meta.get("container"), where, "container", r"[A-Za-z0-9_][A-Za-z0-9_.+=@-]{0,127}"),
                   check_runsc_args(meta.get("runsc_args"), "runsc_args"),
                   _str(meta.get("bundle"), where, "bundle", optional=True),
                   NetConfig.from_dict(net) if net is not None else None,
                   _str(meta.get("netns_path"), where, "netns_path", optional=True),
                   RunscGpu.from_json(gpu, where, name) if gpu is not None else None, extra=extra)


RECORDS: Mapping[SnapshotKind, type[SnapshotMeta]] = {r.KIND: r for r in (FilesMeta, GpuMeta, CriuMeta, RunscMeta)}


def parse_meta(manifest: Manifest) -> SnapshotMeta | None:
    """The validated record of MANIFEST's kind; None for an untyped snapshot or a kind gpusnap's sandbox
    layer does not make (nothing acts on those)."""
    try:
        kind = SnapshotKind(manifest.meta.get("kind"))
    except ValueError:
        return None
    return RECORDS[kind].of(manifest)


def meta_problems(manifest: Manifest) -> list[str]:
    """What is wrong with MANIFEST's metadata for its kind (for `store verify`, which reports it as
    damage); empty when it is valid, untyped, or of a kind the sandbox layer does not make."""
    try:
        parse_meta(manifest)
    except SnapshotMetaError as e:
        return [str(e)]
    return []


def companions(manifest: Manifest) -> list[str]:
    """Snapshots that belong to MANIFEST and go with it (`store rm`): a runsc snapshot's `NAME.gpu`."""
    meta = parse_meta(manifest)
    if isinstance(meta, RunscMeta) and meta.gpu is not None and meta.gpu.companion:
        return [meta.gpu.companion]
    return []


def remove_with_companions(store: Any, name: str) -> list[str]:
    """Remove snapshot NAME from STORE and its companions (validated: only ever `NAME.gpu`), the
    companions first, so that a failure never leaves a companion whose owner is gone. Returns what was
    removed. A NAME whose manifest or metadata is damaged is removed alone (nothing says what it owns)."""
    try:
        extra = companions(store.load(name))
    except GpusnapError:
        extra = []
    removed = []
    for c in extra:
        if c != name and store.exists(c):
            removed.append(store.remove(c))
    return [*removed, store.remove(name)]
