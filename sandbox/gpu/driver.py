"""The CUDA driver's process checkpoint API, called in-process through cuda-python (no CLI spawned).

Every call names the pid, the driver call and the CUresult when it fails. A driver without an entry
point (e.g. cuCheckpointOperationComplete before CUDA 13.4 / R615) is reported by probe() as absent,
never as a crash. The import of cuda.bindings is lazy: this module loads on machines with no GPU.
"""
from __future__ import annotations

import ctypes
import dataclasses
import enum
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol


from storage.api import EXIT_UNAVAILABLE, GpusnapError

class CudaDriverError(GpusnapError):
    """A driver checkpoint call that failed, with the pid, the call and the CUresult name; MISSING:
    this machine has no driver or no cuda-bindings at all (the CLI exits 4 for that, 1 otherwise)."""

    def __init__(self, message: str, *, pid: int | None = None, call: str | None = None,
                 result: str | None = None, missing: bool = False) -> None:
        super().__init__(message)
        self.pid, self.call, self.result = pid, call, result
        if missing:
            self.exit_code = EXIT_UNAVAILABLE


class ProcessState(enum.Enum):
    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3
    CHECKPOINTING = 4  # custom storage: regions mapped, waiting for cuCheckpointOperationComplete
    RESTORING = 5


@dataclass(frozen=True)
class DeviceRegion:
    """One GPU's checkpoint memory as the custom-storage API hands it out (mapped into our process)."""

    index: int
    dev_ptr: int
    size: int
    stream: int


@dataclass(frozen=True)
class CustomOperation:
    handle: int
    regions: list[DeviceRegion]


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    total_bytes: int
    compute_capability: tuple[int, int]
    numa_node: int | None
    decompression_engine: bool
    free_bytes: int | None = None  # free device memory when probed (NVML); None: unknown


@dataclass
class Features:
    """What the installed driver really offers (probed by calling, not by version guessing)."""

    bindings: str | None = None
    driver_version: str | None = None
    checkpoint_api: bool = False
    custom_storage: bool = False
    gpus: list[GpuInfo] = field(default_factory=list)
    reason: str | None = None

    @property
    def path(self) -> str:
        if self.custom_storage:
            return "custom-storage"
        return "host-staged" if self.checkpoint_api else "none"


class CheckpointDriver(Protocol):
    """The driver calls gpusnap needs; CudaDriver is the real one, tests use a state-machine stand-in."""

    def get_state(self, pid: int) -> ProcessState: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int, gpu_map: dict[str, str] | None = None) -> None: ...
    def unlock(self, pid: int) -> None: ...
    def restore_thread_id(self, pid: int) -> int: ...
    def checkpoint_custom(self, pid: int) -> CustomOperation: ...
    def restore_custom(self, pid: int, gpu_map: dict[str, str] | None = None) -> CustomOperation: ...
    def complete(self, pid: int, op: CustomOperation) -> None: ...


_HINTS = {
    "CUDA_ERROR_NOT_FOUND": "not a CUDA process (or it has not initialized CUDA)",
    "CUDA_ERROR_ILLEGAL_STATE": "the process is not in the state this call needs",
    "CUDA_ERROR_TIMEOUT": "timed out (the process kept CUDA calls running past the lock timeout)",
    "CUDA_ERROR_INVALID_VALUE": "invalid argument (unknown pid, or a GPU mapping the driver refuses)",
    "CUDA_ERROR_NOT_SUPPORTED": "not supported by this driver or for this process (UVM, MPS, MIG, IPC?)",
    "CUDA_ERROR_NOT_PERMITTED": "not permitted (need the same user or CAP_SYS_PTRACE)",
    "CUDA_ERROR_OUT_OF_MEMORY": "not enough GPU memory to restore the process",
}


def driver_error(pid: int | None, call: str, result: str, detail: str = "") -> CudaDriverError:
    """The error for a failed driver call: pid, call, CUresult name and what it usually means."""
    hint = detail or _HINTS.get(result, "")
    who = f"pid {pid}: " if pid is not None else ""
    return CudaDriverError(f"{who}{call} failed: {result}" + (f" ({hint})" if hint else ""),
                           pid=pid, call=call, result=result)


def _uuid_str(raw: Any) -> str:
    b = bytes(raw.bytes) if hasattr(raw, "bytes") else bytes(raw)
    h = b[:16].hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


class CudaDriver:
    """The real driver through cuda.bindings.driver. Thread-safe: calls are per-pid independent."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver  # noqa: PLC0415 - optional GPU dependency
        except ImportError as e:
            raise CudaDriverError(f"cuda-bindings is not installed ({e}); pip install 'gpusnap[gpu]'",
                                  missing=True) from None
        self.d = driver
        self._init_lock = threading.Lock()
        self._ctxs: dict[int, Any] = {}
        try:
            (err,) = driver.cuInit(0)
        except Exception as e:  # noqa: BLE001 - DynamicLibNotFoundError: no libcuda on this machine
            raise CudaDriverError(f"no NVIDIA driver here ({type(e).__name__}: libcuda not found)",
                                  call="cuInit", result="NO_DRIVER", missing=True) from None
        self._check(err, "cuInit", None)

    # -- plumbing -----------------------------------------------------------------------------
    def _check(self, err: Any, call: str, pid: int | None) -> None:
        if int(err) == 0:
            return
        raise driver_error(pid, call, getattr(err, "name", str(err)))

    def _call(self, fn_name: str, pid: int | None, *args: Any) -> Any:
        fn = getattr(self.d, fn_name, None)
        if fn is None:
            raise CudaDriverError(f"{fn_name} is not in this cuda-bindings", call=fn_name)
        try:
            out = fn(*args)
        except Exception as e:  # noqa: BLE001
            # cuda-bindings raises FunctionNotFoundError when the driver lacks the entry point
            if "NotFound" not in type(e).__name__ and not isinstance(e, RuntimeError):
                raise
            raise CudaDriverError(f"{fn_name} is not available in this driver: {e}", pid=pid, call=fn_name,
                                  result="FUNCTION_NOT_FOUND") from None
        if isinstance(out, tuple):
            self._check(out[0], fn_name, pid)
            return out[1] if len(out) == 2 else out[1:]
        self._check(out, fn_name, pid)
        return None

    def _gpu_pairs(self, gpu_map: dict[str, str] | None) -> list[Any]:
        pairs = []
        for old, new in (gpu_map or {}).items():
            p = self.d.CUcheckpointGpuPair()
            p.oldUuid = self._uuid_obj(old)
            p.newUuid = self._uuid_obj(new)
            pairs.append(p)
        return pairs

    def _uuid_obj(self, s: str) -> Any:
        u = self.d.CUuuid()
        raw = bytes.fromhex(s.removeprefix("GPU-").replace("-", ""))
        if len(raw) != 16:
            raise CudaDriverError(f"{s!r} is not a GPU UUID")
        ctypes.memmove(u.getPtr(), raw, 16)  # the binding's fields are read-only; write the struct
        return u

    def _handle(self, h: int) -> Any:
        make = getattr(self.d, "CUcheckpointOperationHandle", None)
        return make(h) if make is not None else h

    def ensure_contexts(self) -> None:
        """Retain the primary context on every GPU (custom storage needs one per GPU in this process)."""
        with self._init_lock:
            n = self._call("cuDeviceGetCount", None)
            for i in range(n):
                if i not in self._ctxs:
                    dev = self._call("cuDeviceGet", None, i)
                    self._ctxs[i] = (dev, self._call("cuDevicePrimaryCtxRetain", None, dev))

    # -- the API -----------------------------------------------------------------------------
    def get_state(self, pid: int) -> ProcessState:
        st = self._call("cuCheckpointProcessGetState", pid, pid)
        return ProcessState(int(st))

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = self.d.CUcheckpointLockArgs()
        args.timeoutMs = int(timeout_ms)
        self._call("cuCheckpointProcessLock", pid, pid, args)

    def checkpoint(self, pid: int) -> None:
        self._call("cuCheckpointProcessCheckpoint", pid, pid, self.d.CUcheckpointCheckpointArgs())

    def restore(self, pid: int, gpu_map: dict[str, str] | None = None) -> None:
        args = self.d.CUcheckpointRestoreArgs()
        pairs = self._gpu_pairs(gpu_map)
        if pairs:
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
        self._call("cuCheckpointProcessRestore", pid, pid, args)

    def unlock(self, pid: int) -> None:
        self._call("cuCheckpointProcessUnlock", pid, pid, self.d.CUcheckpointUnlockArgs())

    def restore_thread_id(self, pid: int) -> int:
        return int(self._call("cuCheckpointProcessGetRestoreThreadId", pid, pid))

    def _custom_info(self, slot: ctypes.c_void_p, pid: int, call: str) -> CustomOperation:
        if not slot.value:
            raise CudaDriverError(f"pid {pid}: {call} returned no custom-storage info", pid=pid, call=call)
        info = self.d.CUcheckpointCustomStorageInfo(_ptr=slot.value)
        regions = []
        for i in range(int(info.deviceCount)):
            pd = info.perDeviceData[i]
            regions.append(DeviceRegion(i, int(pd.devPtr), int(pd.size), int(pd.stream)))
        return CustomOperation(int(info.handle), regions)

    def checkpoint_custom(self, pid: int) -> CustomOperation:
        self.ensure_contexts()
        slot = ctypes.c_void_p(0)
        args = self.d.CUcheckpointCheckpointArgs()
        args.customStorageInfo_out = ctypes.addressof(slot)
        self._call("cuCheckpointProcessCheckpoint", pid, pid, args)
        return self._custom_info(slot, pid, "cuCheckpointProcessCheckpoint")

    def restore_custom(self, pid: int, gpu_map: dict[str, str] | None = None) -> CustomOperation:
        self.ensure_contexts()
        slot = ctypes.c_void_p(0)
        args = self.d.CUcheckpointRestoreArgs()
        args.customStorageInfo_out = ctypes.addressof(slot)
        pairs = self._gpu_pairs(gpu_map)
        if pairs:
            args.gpuPairs = pairs
            args.gpuPairsCount = len(pairs)
        self._call("cuCheckpointProcessRestore", pid, pid, args)
        return self._custom_info(slot, pid, "cuCheckpointProcessRestore")

    def complete(self, pid: int, op: CustomOperation) -> None:
        self._call("cuCheckpointOperationComplete", pid, self._handle(op.handle))

    # -- what is here -------------------------------------------------------------------------
    def gpus(self) -> list[GpuInfo]:
        d = self.d
        out = []
        for i in range(self._call("cuDeviceGetCount", None)):
            dev = self._call("cuDeviceGet", None, i)
            name = self._call("cuDeviceGetName", None, 256, dev)
            name = bytes(name).split(b"\0", 1)[0].decode()
            uuid = _uuid_str(self._call("cuDeviceGetUuid", None, dev))
            total = int(self._call("cuDeviceTotalMem", None, dev))
            attr = d.CUdevice_attribute
            major = int(self._call("cuDeviceGetAttribute", None, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev))
            minor = int(self._call("cuDeviceGetAttribute", None, attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev))
            numa = None
            na = getattr(attr, "CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID", None)
            if na is not None:
                try:
                    v = int(self._call("cuDeviceGetAttribute", None, na, dev))
                    numa = v if v >= 0 else None
                except CudaDriverError:
                    numa = None
            # Blackwell data-center parts (sm_100/sm_103) carry the decompression engine; Hopper does not.
            engine = False
            ea = getattr(attr, "CU_DEVICE_ATTRIBUTE_MEM_DECOMPRESS_ALGORITHM_MASK", None)
            if ea is not None:
                try:
                    engine = int(self._call("cuDeviceGetAttribute", None, ea, dev)) != 0
                except CudaDriverError:
                    engine = False
            out.append(GpuInfo(i, name, uuid, total, (major, minor), numa, engine))
        from sandbox.gpu import nvml
        free = nvml.memory() or {}
        return [dataclasses.replace(g, free_bytes=free[g.uuid][1]) if g.uuid in free else g for g in out]

    def gpu_bytes(self, pids: list[int]) -> dict[int, dict[str, int]] | None:
        """{pid: {GPU uuid: bytes}} each of PIDS holds on each GPU now (NVML); None: unknown."""
        from sandbox.gpu import nvml
        return nvml.process_memory(pids)


def probe(driver: CudaDriver | None = None) -> Features:
    """Find out what this machine's driver offers, by calling it. Never raises."""
    f = Features()
    try:
        import cuda.bindings as cb  # noqa: PLC0415
        f.bindings = getattr(cb, "__version__", "unknown")
    except ImportError:
        f.reason = "cuda-bindings not installed"
        return f
    try:
        drv = driver or CudaDriver()
    except CudaDriverError as e:
        f.reason = str(e)
        return f
    try:
        v = int(drv._call("cuDriverGetVersion", None))
        f.driver_version = f"{v // 1000}.{v % 1000 // 10}"
        f.gpus = drv.gpus()
    except CudaDriverError as e:
        f.reason = str(e)
        return f
    f.checkpoint_api = _has_entry(drv, "cuCheckpointProcessGetState", lambda: drv.get_state(1))
    # Completing handle 0 is harmless: a driver with the entry point answers with an error code
    # (invalid handle); one without it raises FunctionNotFound, which is what we look for.
    f.custom_storage = f.checkpoint_api and _has_entry(
        drv, "cuCheckpointOperationComplete", lambda: drv._call("cuCheckpointOperationComplete", None, drv._handle(0)))
    return f


def _has_entry(drv: CudaDriver, name: str, call: Any) -> bool:
    try:
        call()
    except CudaDriverError as e:
        return e.result != "FUNCTION_NOT_FOUND" and "not in this cuda-bindings" not in str(e)
    except Exception:  # noqa: BLE001 - a binding that cannot even make the call: treat as absent
        return False
    return True


def nvidia_driver_version() -> str | None:
    """The kernel module's version from /proc (works without cuda-bindings)."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            line = f.readline()
    except OSError:
        return None
    import re
    m = re.search(r"\b(\d{3}\.\d+(?:\.\d+)?)\b", line)
    return m.group(1) if m else None
