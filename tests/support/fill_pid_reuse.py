"""A restored process that ends during the split fill, its pid then taken by another process: the
fill must never write into the newcomer (sandbox/criu/split.py, check_pids and pin_memory). Run as
root inside a new pid namespace, where /proc/sys/kernel/ns_last_pid picks the next pid (standing in
for pid cycling): `unshare --pid --fork --mount-proc python3 fill_pid_reuse.py WHEN`, WHEN "during"
(the process ends while the fill runs, after its memory was pinned) or "before-pin" (it ends between
the pid check and the pinning) or "exec" (continued by someone after the check, it runs another
program before the pinning: same pid, same start time). Prints one JSON line: what the fill said and
what the newcomer's memory holds."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from sandbox.criu import split  # noqa: E402
from sandbox.criu.restored import boot_ticks, in_restored_tree  # noqa: E402
from sandbox.host.processes import state_of  # noqa: E402
from storage.format.manifest import ChunkRef, Stream  # noqa: E402

ADDR, SIZE = 0x100000000000, 1 << 16
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def map_fixed(fill: bytes) -> None:
    p = libc.mmap(ADDR, SIZE, 3, 0x22 | 0x100000, -1, 0)  # PROT_READ|WRITE, PRIVATE|ANONYMOUS|FIXED_NOREPLACE
    assert p == ADDR, p
    ctypes.memmove(ADDR, fill * (SIZE // len(fill)), SIZE)


def take_pid(pid: int) -> int:
    """A new process at PID (the one before it written to ns_last_pid; again until the kernel has
    freed PID), its memory at ADDR HOSTPROC."""
    for _ in range(500):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        h = os.fork()
        if h == 0:
            map_fixed(b"HOSTPROC")
            time.sleep(30)
            os._exit(0)
        if h == pid:
            time.sleep(0.2)
            return h
        os.kill(h, signal.SIGKILL)  # PID was not free yet
        os.waitpid(h, 0)
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never came free")


def main(when: str) -> None:
    born_after = boot_ticks()
    r_in, r_out = os.pipe()
    root = os.fork()
    if root == 0:  # the restored root: ignores SIGCHLD (its children are reaped at once), both stop
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        v = os.fork()
        if v == 0:
            map_fixed(b"TENANT--")
            os.write(r_out, str(os.getpid()).encode() + b"\n")
            os.kill(os.getpid(), signal.SIGSTOP)
            if when == "exec":
                os.execv("/bin/sleep", ["sleep", "30"])  # a setuid program, in an attack
            os._exit(0)
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
    victim = int(os.read(r_in, 64).split()[0])
    deadline = time.monotonic() + 20
    while not all(state_of(p) == "T" for p in (root, victim)):  # both stopped, as CRIU leaves a tree
        assert time.monotonic() < deadline, "the stand-in tree never stopped"
        time.sleep(0.01)
    tree = [root, victim]
    refs = [ChunkRef("a" * 64, SIZE, "raw", SIZE)]
    streams = {"pages-1.img": Stream("pages-1.img", {"type": "file"}, refs)}
    plan = split.Plan(victim, "pages-1.img", b"", (), (split.Run(ADDR, 0, SIZE),))
    jobs = split.fill_jobs([plan], streams)
    out: dict[str, object] = {"victim": victim}
    newcomer = 0

    def gone_and_replaced() -> int:
        os.kill(victim, signal.SIGKILL)  # reaped by the kernel at once: its parent ignores SIGCHLD
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{victim}"):
            assert time.monotonic() < deadline, "the victim was never reaped"
            time.sleep(0.01)
        return take_pid(victim)

    if when == "exec":  # continued by someone after the check, it runs another program (same pid, same start)
        checked = split.check_pids(jobs, lambda pid: in_restored_tree(pid, root, tree, born_after, stopped=True))
        os.kill(victim, signal.SIGCONT)
        exe = os.readlink(f"/proc/{victim}/exe")
        for _ in range(200):
            if os.readlink(f"/proc/{victim}/exe") != exe:
                break
            time.sleep(0.01)
        out["exec"] = os.readlink(f"/proc/{victim}/exe")
        try:
            split.pin_memory(checked)
            out["fill"] = "pinned"
        except split.SplitError as e:
            out["fill"] = f"SplitError: {e}"
        os.kill(victim, signal.SIGKILL)
        os.kill(root, signal.SIGKILL)
        print(json.dumps(out), flush=True)
        return
    if when == "before-pin":
        checked = split.check_pids(jobs, lambda pid: in_restored_tree(pid, root, tree, born_after, stopped=True))
        newcomer = gone_and_replaced()
        try:
            split.pin_memory(checked)
            out["fill"] = "pinned"
        except split.SplitError as e:
            out["fill"] = f"SplitError: {e}"
    else:
        held: list[split.Filler] = []

        def read(wants, deliver, stop):
            # the victim ends once the fill has checked the pids and pinned their memory, before a byte
            deadline = time.monotonic() + 20
            while not (held and held[0]._mem):
                assert time.monotonic() < deadline, "the fill never pinned the processes' memory"
                time.sleep(0.005)
            nonlocal newcomer
            newcomer = gone_and_replaced()
            for w in wants:
                deliver(w, memoryview(b"SNAPSHOT" * (SIZE // 8)))

        with split.Filler(jobs, read, 2, 4 * SIZE) as filler:
            held.append(filler)
            try:
                out["fill"] = f"wrote {filler.write(lambda pid: in_restored_tree(pid, root, tree, born_after, stopped=True))}"
            except split.SplitError as e:
                out["fill"] = f"SplitError: {e}"
    out["newcomer"] = newcomer
    with open(f"/proc/{newcomer}/mem", "rb") as f:
        f.seek(ADDR)
        out["newcomer_memory"] = f.read(16).decode(errors="replace")
    os.kill(newcomer, signal.SIGKILL)
    os.kill(root, signal.SIGKILL)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
