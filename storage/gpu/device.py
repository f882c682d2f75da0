"""What the GPU data path needs from a device, and two devices that provide it.

CudaDevice is the product: streams, device and pinned host memory, async copies through the CUDA
driver (cuda.bindings), and nvCOMP codecs that encode and decode device memory on the GPU. Guarantee:
an nvCOMP payload depends on the chunk's bytes alone — every scratch buffer nvCOMP uses is zeroed
before it does (nvCOMP's device allocator in this process is ours: _ScratchBuffer), so equal memory
gives equal chunk ids and no byte of an earlier chunk reaches a later payload.

HostDevice runs the same engine with host memory standing in for device memory: "device pointers"
are addresses in this process, copies are memmove, the codec is zstd on the CPU. It exists so that
everything the engine does besides the CUDA calls themselves (lanes, the pinned frames, zero
detection by signature, raw-when-it-does-not-pay, the memory tier, verified restore straight into the
target) is tested in CI on machines without a GPU. It is not a fast path.

Both import their heavy dependencies lazily: this module imports anywhere.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Protocol

from storage.codecs.registry import NVCOMP_ALGORITHMS, CodecError, entry
from storage.fs.directio import ALIGN, align_up

from storage.base.errors import GpusnapError

class DeviceError(GpusnapError):
    """A CUDA or nvCOMP call failed, or the device (driver, library) is not available here."""


class HostBuffer(Protocol):
    """Page-aligned host memory the device can copy to and from: its address, size and a view."""

    ptr: int
    size: int
    view: memoryview

    def close(self) -> None: ...


class DeviceCodec(Protocol):
    def encode(self, src: int, n: int, out: int, cap: int) -> int:
        """Encode N bytes at SRC into OUT (CAP bytes, zeroed by the caller); returns the encoded size.
        The bytes are ready once the codec's stream is synchronized."""

    def decode(self, src: int, m: int, dst: int, n: int) -> None:
        """Decode M bytes at SRC into exactly N bytes at DST (on the codec's stream)."""

    def release(self) -> None:
        """Drop what the last call kept alive for its stream work (call after the stream synced)."""


class Device(Protocol):
    """The operations the engine uses; every pointer is valid in this process."""

    name: str
    codecs: tuple[str, ...]      # codecs this device encodes/decodes, first is the default

    def bind_thread(self) -> None: ...
    def pinned(self, size: int) -> HostBuffer: ...
    def pool_memory(self, size: int) -> HostBuffer: ...
    def alloc(self, size: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def new_stream(self) -> Any: ...
    def destroy_stream(self, stream: Any) -> None: ...
    def memset0(self, ptr: int, n: int, stream: Any) -> None: ...
    def d2h(self, dst: int, src: int, n: int, stream: Any) -> None: ...
    def h2d(self, dst: int, src: int, n: int, stream: Any) -> None: ...
    def sync(self, stream: Any) -> None: ...
    def codec(self, name: str, stream: Any, nvcomp_chunk: int) -> DeviceCodec: ...


# --------------------------------------------------------------------------------------------- CUDA
def _drv() -> Any:
    try:
        from cuda.bindings import driver  # noqa: PLC0415
    except ImportError as e:
        raise DeviceError(f"the GPU data path needs cuda-bindings: {e}") from None
    return driver


def _nvcomp() -> Any:
    try:
        from nvidia import nvcomp  # noqa: PLC0415
    except ImportError as e:
        raise DeviceError(f"the GPU data path needs nvidia-nvcomp-cu13: {e}") from None
    return nvcomp


def _ck(out: Any, what: str) -> Any:
    err = out[0] if isinstance(out, tuple) else out
    if int(err) != 0:
        raise DeviceError(f"{what} failed: {getattr(err, 'name', err)}")
    if isinstance(out, tuple):
        return out[1] if len(out) == 2 else out[1:]
    return None


# The same two, public, for the benchmarks and probes in scripts/ that drive CUDA directly.
cuda_driver = _drv
check_cuda = _ck


class DeviceBytes:
    """A device pointer and length seen by nvCOMP as a uint8 array (CUDA array interface v3)."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class PinnedBuffer:
    """Page-locked host memory from cuMemHostAlloc, exposed as a memoryview (DMA-able, O_DIRECT-able).

    portable: usable from every context of the process (cuMemHostAlloc flag PORTABLE)."""

    def __init__(self, size: int) -> None:
        d = _drv()
        self.size = align_up(size)
        self.ptr = int(_ck(d.cuMemHostAlloc(self.size, 1), f"cuMemHostAlloc({self.size})"))
        if self.ptr % ALIGN:
            raise DeviceError("pinned allocation is not page aligned")
        self.view = memoryview((ctypes.c_char * self.size).from_address(self.ptr)).cast("B")

    def close(self) -> None:
        try:
            self.view.release()
        except BufferError:
            return  # a slice is still referenced (error path): keep the memory rather than free it under it
        _drv().cuMemFreeHost(self.ptr)


_SYS_MBIND = {"x86_64": 237, "aarch64": 235}
_MPOL_PREFERRED = 1


def numa_nodes() -> int:
    """How many NUMA nodes have memory here (1 when sysfs does not say)."""
    try:
        with open("/sys/devices/system/node/has_memory") as f:
            spec = f.read().strip()
    except OSError:
        return 1
    n = 0
    for part in spec.split(","):
        a, _, b = part.partition("-")
        n += (int(b) - int(a) + 1) if b else 1
    return max(n, 1)


def prefer_node(ptr: int, size: int, node: int) -> bool:
    """mbind(MPOL_PREFERRED) the not-yet-touched range to NUMA NODE; False where the kernel refuses."""
    nr = _SYS_MBIND.get(os.uname().machine)
    if nr is None or node < 0 or node >= 64:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(1 << node)
    r = libc.syscall(ctypes.c_long(nr), ctypes.c_void_p(ptr), ctypes.c_ulong(size), ctypes.c_int(_MPOL_PREFERRED),
                     ctypes.byref(mask), ctypes.c_ulong(65), ctypes.c_uint(0))
    return r == 0


class RegisteredBuffer:
    """Large pinned host memory for the memory tier: an anonymous mapping advised to transparent huge
    pages, placed on the GPU's NUMA node when the machine has several, then page-locked with
    cuMemHostRegister (pinning 2 MiB pages is much cheaper than cuMemHostAlloc's 4 KiB ones)."""

    HUGE = 2 << 20

    def __init__(self, size: int, numa_node: int | None = None) -> None:
        self.size = align_up(max(size, 1), self.HUGE)
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.ptr = ctypes.addressof(self._anchor)
        self.huge = False
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except OSError:
                pass
        self.numa_node = numa_node if numa_node is not None and numa_nodes() > 1 and \
            prefer_node(self.ptr, self.size, numa_node) else None
        try:
            _ck(_drv().cuMemHostRegister(self.ptr, self.size, 1), f"cuMemHostRegister({self.size})")  # PORTABLE
        except BaseException:
            del self._anchor
            self._map.close()
            raise
        self.view = memoryview(self._map)

    def close(self) -> None:
        try:
            self.view.release()
        except BufferError:
            return  # a slice is still referenced (error path): keep it registered rather than unmap it
        _drv().cuMemHostUnregister(self.ptr)
        del self._anchor
        self._map.close()


_CONTEXTS: dict[int, Any] = {}
_CONTEXTS_LOCK = threading.Lock()


def primary_context(device: int) -> Any:
    """The device's primary context, retained once per process and kept (shared with nvCOMP/torch)."""
    with _CONTEXTS_LOCK:
        ctx = _CONTEXTS.get(device)
        if ctx is None:
            d = _drv()
            dev = _ck(d.cuDeviceGet(device), "cuDeviceGet")
            ctx = _CONTEXTS[device] = _ck(d.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        return ctx


class _Blocks:
    """The device blocks one codec's nvCOMP calls used, kept for its next calls on its stream.

    nvCOMP allocates its scratch on every call and drops it after; a block given back here is reused
    by the next call of the same size (stream-ordered: the same stream, so never while in use), which
    spares a device allocation per chunk. Freed when the codec and every block it handed out are gone.
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.ctx = _ck(_drv().cuCtxGetCurrent(), "cuCtxGetCurrent")
        self._spare: dict[int, list[int]] = {}
        self._lock = threading.Lock()

    def take(self, size: int) -> int:
        with self._lock:
            free = self._spare.get(size)
            if free:
                return free.pop()
        return int(_ck(_drv().cuMemAllocAsync(size, self.stream), f"cuMemAllocAsync({size})"))

    def give(self, ptr: int, size: int) -> None:
        with self._lock:
            self._spare.setdefault(size, []).append(ptr)

    def __del__(self) -> None:
        for ptrs in self._spare.values():
            for ptr in ptrs:
                _free_device(self.ctx, ptr, self.stream)


def _free_device(ctx: Any, ptr: int, stream: Any) -> None:
    """Free device memory from any thread (CTX pushed for the call); quiet at interpreter shutdown."""
    try:
        d = _drv()
        pushed = _err(d.cuCtxPushCurrent(ctx)) == 0
    except Exception:  # noqa: BLE001 - interpreter shutdown: the driver frees it with the context
        return
    try:
        if stream is None or _err(d.cuMemFreeAsync(ptr, stream)) != 0:
            d.cuMemFree(ptr)  # also frees stream-ordered memory once its stream is gone
    finally:
        if pushed:
            d.cuCtxPopCurrent()


class _ScratchBuffer:
    """Device memory nvCOMP asked for (its scratch), zeroed before nvCOMP can use it.

    nvCOMP's kernels leave gaps in what they stage in scratch and copy into the output, so whatever
    scratch held before (an earlier chunk, another snapshot's or tenant's data) would reach the
    payload: encodes of equal input would differ (no dedup) and carry stale bytes. Scratch asked for
    while a codec runs comes from the codec's _Blocks and is zeroed on its stream when handed out;
    what nvCOMP keeps across calls is zeroed again before each encode (_NvcompCodec.encode).
    Anything else is allocated and zeroed synchronously."""

    __slots__ = ("__weakref__", "_blocks", "_ctx", "ptr", "size")

    def __init__(self, nbytes: int, owner: "_NvcompCodec | None") -> None:
        d = _drv()
        self.size = max(int(nbytes), 1)
        self._blocks = owner.blocks if owner is not None else None
        if owner is not None and self._blocks is not None:
            self._ctx = self._blocks.ctx
            self.ptr = self._blocks.take(self.size)
            _ck(d.cuMemsetD8Async(self.ptr, 0, self.size, self._blocks.stream), "cuMemsetD8Async")
            owner.scratch.add(self)
        else:
            self._ctx = _ck(d.cuCtxGetCurrent(), "cuCtxGetCurrent")
            self.ptr = int(_ck(d.cuMemAlloc(self.size), f"cuMemAlloc({self.size})"))
            _ck(d.cuMemsetD8(self.ptr, 0, self.size), "cuMemsetD8")
            _ck(d.cuCtxSynchronize(), "cuCtxSynchronize")  # before any stream of ours can use it

    def __del__(self) -> None:
        if self._blocks is not None:
            self._blocks.give(self.ptr, self.size)
        else:
            _free_device(self._ctx, self.ptr, None)


def _err(out: Any) -> int:
    """The status code of a cuda.bindings call's result."""
    return int(out[0] if isinstance(out, tuple) else out)


_OWNER = threading.local()  # .codec: the _NvcompCodec whose call runs on this thread
_ALLOCATOR_LOCK = threading.Lock()
_ALLOCATOR_SET = False


def _nvcomp_device_alloc(nbytes: int, stream: Any) -> _ScratchBuffer:
    """nvCOMP's device allocator in this process (nvcomp.set_device_allocator): zeroed scratch."""
    return _ScratchBuffer(nbytes, getattr(_OWNER, "codec", None))


def _install_nvcomp_allocator(nv: Any) -> None:
    global _ALLOCATOR_SET
    with _ALLOCATOR_LOCK:
        if not _ALLOCATOR_SET:
            nv.set_device_allocator(_nvcomp_device_alloc)
            _ALLOCATOR_SET = True


class _NvcompCodec:
    """One nvCOMP codec bound to one stream (nvCOMP codecs are not thread-safe: one per lane).

    Its output is a function of its input only: every buffer nvCOMP allocates for it is zeroed on
    its stream before nvCOMP uses it (see _ScratchBuffer), and the caller zeroes OUT."""

    def __init__(self, algorithm: str, stream: Any, nvcomp_chunk: int, device: int) -> None:
        self._nv = _nvcomp()
        _install_nvcomp_allocator(self._nv)
        self.stream = stream
        self.blocks = _Blocks(stream)
        self.scratch: weakref.WeakSet[_ScratchBuffer] = weakref.WeakSet()
        with self._owning():
            self._codec = self._nv.Codec(algorithm=algorithm, uncomp_chunk_size=nvcomp_chunk,
                                         cuda_stream=int(stream), device_id=device)
        self._keep: Any = None

    @contextmanager
    def _owning(self) -> Iterator[None]:
        """Bind what nvCOMP allocates on this thread meanwhile to this codec (and its stream)."""
        prev = getattr(_OWNER, "codec", None)
        _OWNER.codec = self
        try:
            yield
        finally:
            _OWNER.codec = prev

    @property
    def scratch_bytes(self) -> int:
        return sum(b.size for b in list(self.scratch))

    def encode(self, src: int, n: int, out: int, cap: int) -> int:
        nv, d = self._nv, _drv()
        with self._owning():
            for b in list(self.scratch):
                _ck(d.cuMemsetD8Async(b.ptr, 0, b.size, self.stream), "cuMemsetD8Async")
            enc = self._codec.encode(nv.as_array(DeviceBytes(src, n)), out=nv.as_array(DeviceBytes(out, cap)))
        self._keep = enc  # must outlive the stream work that follows (the D2H of its bytes)
        return int(enc.buffer_size)

    def decode(self, src: int, m: int, dst: int, n: int) -> None:
        nv = self._nv
        arr = nv.as_array(DeviceBytes(src, m))
        with self._owning():
            try:
                self._codec.decode(arr, out=nv.as_array(DeviceBytes(dst, n)))
                return
            except TypeError:
                pass  # an nvCOMP without external output buffers: decode, then copy on the device
            out = self._codec.decode(arr)
        if int(out.buffer_size) != n:
            raise DeviceError(f"nvCOMP decoded {int(out.buffer_size)} bytes, expected {n}")
        self._keep = out
        ptr = int(out.__cuda_array_interface__["data"][0])
        _ck(_drv().cuMemcpyDtoDAsync(dst, ptr, n, self.stream), "cuMemcpyDtoDAsync")

    def release(self) -> None:
        self._keep = None


class CudaDevice:
    """One GPU through the CUDA driver; nvCOMP for the codecs."""

    codecs = tuple(NVCOMP_ALGORITHMS)  # the format's nvCOMP codecs (storage.codecs.registry), ANS the default

    def __init__(self, index: int = 0) -> None:
        d = _drv()
        try:
            init = d.cuInit(0)
        except Exception as e:  # noqa: BLE001 - no libcuda on this machine
            raise DeviceError(f"no NVIDIA driver here ({type(e).__name__})") from None
        _ck(init, "cuInit")
        self.index = index
        self.name = f"cuda:{index}"
        self.ctx = primary_context(index)
        self.bind_thread()

    def bind_thread(self) -> None:
        _ck(_drv().cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def pinned(self, size: int) -> HostBuffer:
        return PinnedBuffer(size)

    def pool_memory(self, size: int) -> HostBuffer:
        """Host memory for a resident pool: huge pages, on this GPU's NUMA node, registered."""
        return RegisteredBuffer(size, self.numa_node())

    def numa_node(self) -> int | None:
        d = _drv()
        attr = getattr(d.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID", None)
        if attr is None:
            return None
        err, v = d.cuDeviceGetAttribute(attr, self.index)
        return int(v) if int(err) == 0 and int(v) >= 0 else None

    def alloc(self, size: int) -> int:
        return int(_ck(_drv().cuMemAlloc(size), f"cuMemAlloc({size})"))

    def free(self, ptr: int) -> None:
        _drv().cuMemFree(ptr)

    def new_stream(self) -> Any:
        return _ck(_drv().cuStreamCreate(1), "cuStreamCreate")  # non-blocking w.r.t. the null stream

    def destroy_stream(self, stream: Any) -> None:
        _drv().cuStreamDestroy(stream)

    def memset0(self, ptr: int, n: int, stream: Any) -> None:
        _ck(_drv().cuMemsetD8Async(ptr, 0, n, stream), "cuMemsetD8Async")

    def d2h(self, dst: int, src: int, n: int, stream: Any) -> None:
        _ck(_drv().cuMemcpyDtoHAsync(dst, src, n, stream), "cuMemcpyDtoHAsync")

    def h2d(self, dst: int, src: int, n: int, stream: Any) -> None:
        _ck(_drv().cuMemcpyHtoDAsync(dst, src, n, stream), "cuMemcpyHtoDAsync")

    def sync(self, stream: Any) -> None:
        _ck(_drv().cuStreamSynchronize(stream), "cuStreamSynchronize")

    def codec(self, name: str, stream: Any, nvcomp_chunk: int) -> DeviceCodec:
        if name not in NVCOMP_ALGORITHMS:
            raise DeviceError(f"{self.name} has no codec {name!r}; choose from raw, {', '.join(self.codecs)}")
        try:
            algorithm = entry(name).algorithm  # registered only where nvCOMP is importable
        except CodecError as e:
            raise DeviceError(f"the GPU data path needs nvidia-nvcomp-cu13 ({e})") from None
        return _NvcompCodec(algorithm or NVCOMP_ALGORITHMS[name], stream, nvcomp_chunk, self.index)


# --------------------------------------------------------------------------------------------- host
class HostMemory:
    """Page-aligned anonymous host memory with a stable address (mmap)."""

    def __init__(self, size: int) -> None:
        self.size = align_up(max(size, 1))
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self._map)
        self.ptr = ctypes.addressof(self._anchor)
        self.view = memoryview(self._map)

    def close(self) -> None:
        try:
            self.view.release()
            del self._anchor
            self._map.close()
        except (BufferError, AttributeError):
            # a slice is still referenced (an exception's traceback on the error path): the mapping
            # is unmapped when the last reference goes
            pass


def host_view(ptr: int, n: int) -> memoryview:
    """A writable view of N bytes at host address PTR (the caller keeps the memory alive)."""
    return memoryview((ctypes.c_char * n).from_address(ptr)).cast("B")


class _ZstdAt:
    """zstd on the CPU between host addresses (HostDevice's codec)."""

    def __init__(self, level: int = 1) -> None:
        import zstandard  # noqa: PLC0415
        self._c = zstandard.ZstdCompressor(level=level)
        self._d = zstandard.ZstdDecompressor()

    def encode(self, src: int, n: int, out: int, cap: int) -> int:
        data = self._c.compress(host_view(src, n))
        if len(data) > cap:
            return cap + 1  # did not fit: the caller stores the chunk raw
        ctypes.memmove(out, data, len(data))
        return len(data)

    def decode(self, src: int, m: int, dst: int, n: int) -> None:
        try:
            data = self._d.decompress(host_view(src, m), max_output_size=n)
        except Exception as e:  # noqa: BLE001 - zstd.ZstdError
            raise DeviceError(f"zstd decode failed: {e}") from None
        if len(data) != n:
            raise DeviceError(f"zstd decoded {len(data)} bytes, expected {n}")
        ctypes.memmove(dst, data, n)

    def release(self) -> None:
        pass  # synchronous: nothing outlives a call


class HostDevice:
    """Host memory standing in for device memory (CI and CPU-only machines); codec zstd."""

    name = "host"
    codecs: tuple[str, ...] = ("zstd",)

    def __init__(self) -> None:
        self._allocs: dict[int, HostMemory] = {}
        self._lock = threading.Lock()

    def bind_thread(self) -> None:
        pass

    def pinned(self, size: int) -> HostBuffer:
        return HostMemory(size)

    pool_memory = pinned

    def alloc(self, size: int) -> int:
        m = HostMemory(size)
        with self._lock:
            self._allocs[m.ptr] = m
        return m.ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            m = self._allocs.pop(ptr)
        m.close()

    def new_stream(self) -> Any:
        return None

    def destroy_stream(self, stream: Any) -> None:
        pass

    def memset0(self, ptr: int, n: int, stream: Any) -> None:
        ctypes.memset(ptr, 0, n)

    def d2h(self, dst: int, src: int, n: int, stream: Any) -> None:
        ctypes.memmove(dst, src, n)

    h2d = d2h

    def sync(self, stream: Any) -> None:
        pass

    def codec(self, name: str, stream: Any, nvcomp_chunk: int) -> DeviceCodec:
        if name != "zstd":
            raise DeviceError(f"the host device has no codec {name!r}; choose raw or zstd")
        return _ZstdAt()

    @property
    def live_allocations(self) -> int:
        with self._lock:
            return len(self._allocs)
