"""Writing 512 MiB into another process in 4 MiB pieces: process_vm_writev (by pid: what the split fill's
phase 0 did until 2026-12-06) against pwrite on its /proc/PID/mem (a descriptor bound to the process:
what every phase does since). Run: python3 memspeed.py (as root or on a child of yours)."""
import ctypes, mmap, os, time

N = 512 << 20


class Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


libc = ctypes.CDLL(None, use_errno=True)
libc.process_vm_writev.restype = ctypes.c_ssize_t
libc.process_vm_writev.argtypes = [ctypes.c_int, ctypes.POINTER(Iovec), ctypes.c_ulong, ctypes.POINTER(Iovec),
                                   ctypes.c_ulong, ctypes.c_ulong]
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    m = mmap.mmap(-1, N)
    m[:] = b"\1" * N
    os.write(w, ctypes.addressof(ctypes.c_char.from_buffer(m)).to_bytes(8, "little"))
    time.sleep(60)
    os._exit(0)
addr = int.from_bytes(os.read(r, 8), "little")
buf = ctypes.create_string_buffer(os.urandom(4 << 20), 4 << 20)
data = memoryview(buf).cast("B")
for _ in range(2):
    t = time.perf_counter()
    for off in range(0, N, 4 << 20):
        local, remote = Iovec(ctypes.addressof(buf), 4 << 20), Iovec(addr + off, 4 << 20)
        assert libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 4 << 20
    a = time.perf_counter() - t
    fd = os.open(f"/proc/{pid}/mem", os.O_WRONLY)
    t = time.perf_counter()
    for off in range(0, N, 4 << 20):
        assert os.pwrite(fd, data, addr + off) == 4 << 20
    b = time.perf_counter() - t
    os.close(fd)
    print(f"process_vm_writev {N / a / 1e9:.2f} GB/s, /proc/PID/mem pwrite {N / b / 1e9:.2f} GB/s")
os.kill(pid, 9)
os.waitpid(pid, 0)
