"""Per-GPU memory as the NVIDIA management library (NVML) reports it: free bytes per GPU, bytes per process.

Read through ctypes from libnvidia-ml.so.1, which every NVIDIA driver installs, so gpusnap needs no
package for it and needs no CUDA context on a GPU to read its free memory. Everything is keyed by
GPU UUID ("GPU-..."), the one name CUDA and NVML share (their device indices may be ordered
differently). Nothing here raises: a machine without NVML, or an NVML that does not answer a
question, gives None ("unknown") and the callers carry on without that figure.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

_NOT_AVAILABLE = (1 << 64) - 1   # NVML_VALUE_NOT_AVAILABLE for usedGpuMemory
_INSUFFICIENT_SIZE = 7           # NVML_ERROR_INSUFFICIENT_SIZE
_MAX_PROCS = 4096                # per GPU: bounds what we allocate on NVML's word

_lock = threading.Lock()
_lib: Any = None
_tried = False


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t as the _v3 calls fill it
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


def _nvml() -> Any:
    """The initialized library, or None where there is none (loaded and initialized once)."""
    global _lib, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                lib = ctypes.CDLL("libnvidia-ml.so.1")
                init = getattr(lib, "nvmlInit_v2", None) or lib.nvmlInit
                if init() == 0:
                    _lib = lib
            except (OSError, AttributeError):
                _lib = None
        return _lib


def _devices(lib: Any) -> list[tuple[str, Any]]:
    """(uuid, handle) of every GPU NVML sees."""
    n = ctypes.c_uint(0)
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) != 0:
        return []
    out = []
    for i in range(min(n.value, 1024)):
        h = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(96)
        if lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h)) != 0 or lib.nvmlDeviceGetUUID(h, buf, 96) != 0:
            continue
        out.append((buf.value.decode("ascii", "replace"), h))
    return out


def memory() -> dict[str, tuple[int, int]] | None:
    """{GPU uuid: (total bytes, free bytes)} of every GPU here; None without NVML."""
    lib = _nvml()
    if lib is None:
        return None
    out: dict[str, tuple[int, int]] = {}
    try:
        for uuid, h in _devices(lib):
            m = _Memory()
            if lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(m)) == 0:
                out[uuid] = (int(m.total), int(m.free))
    except (OSError, AttributeError):
        return None
    return out


def process_memory(pids: list[int]) -> dict[int, dict[str, int]] | None:
    """{pid: {GPU uuid: bytes it holds there}} for PIDS (a pid on no GPU is absent); None when NVML
    is missing or cannot say (e.g. in a container whose pids NVML does not see, or memory 'not
    available' under some virtualization)."""
    lib = _nvml()
    if lib is None:
        return None
    fn = getattr(lib, "nvmlDeviceGetComputeRunningProcesses_v3", None)
    if fn is None:
        return None
    want = set(pids)
    out: dict[int, dict[str, int]] = {}
    try:
        for uuid, h in _devices(lib):
            count = ctypes.c_uint(0)
            rc = fn(h, ctypes.byref(count), None)
            if rc not in (0, _INSUFFICIENT_SIZE):
                return None
            if count.value == 0:
                continue
            cap = min(count.value + 16, _MAX_PROCS)  # processes may start between the two calls
            arr = (_ProcessInfo * cap)()
            count = ctypes.c_uint(cap)
            if fn(h, ctypes.byref(count), arr) != 0:
                return None
            for info in arr[:min(count.value, cap)]:
                if info.pid in want:
                    if info.usedGpuMemory == _NOT_AVAILABLE:
                        return None
                    per = out.setdefault(int(info.pid), {})
                    per[uuid] = per.get(uuid, 0) + int(info.usedGpuMemory)
    except (OSError, AttributeError):
        return None
    return out
