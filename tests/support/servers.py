"""Test helpers for real servers and forking trees under CRIU: start a workload in its own session,
speak HTTP over a socket kept open, find what is left of a session in /proc, poll for conditions."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar

SUPPORT = Path(__file__).resolve().parent
T = TypeVar("T")


def until(what: str, probe: Callable[[], T | None], timeout: float = 60.0, every: float = 0.05) -> T:
    """PROBE's first true answer, polled; AssertionError naming WHAT after TIMEOUT (generous: the machine
    may be loaded)."""
    end = time.monotonic() + timeout
    while True:
        try:
            got = probe()
        except (OSError, ValueError):
            got = None
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(every)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, session) of PID, None if gone."""
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = s[s.rindex(")") + 2:].split()
    return f[0], int(f[1]), int(f[3])


def session_procs(sid: int) -> list[str]:
    """Every live (not zombie) process of session SID, as 'pid comm state ppid'."""
    out = []
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        st = _stat(int(e))
        if st and st[2] == sid and st[0] != "Z":
            try:
                comm = Path(f"/proc/{e}/comm").read_text().strip()
            except OSError:  # it ended meanwhile
                continue
            out.append(f"{e} {comm} {st[0]} ppid {st[1]}")
    return out


def session_report(sid: int) -> list[str]:
    """Every process of session SID as 'pid comm state ppid', with where it sleeps in the kernel
    (wchan) and its pending and blocked signals: what a failed test says about a restored tree."""
    out = []
    for line in session_procs(sid):
        pid = line.split()[0]
        try:
            wchan = Path(f"/proc/{pid}/wchan").read_text().strip() or "-"
            sig = {k: v.strip() for k, _, v in (x.partition(":") for x in Path(f"/proc/{pid}/status").read_text().splitlines())}
        except OSError:
            continue
        out.append(f"{line} wchan {wchan} pending {sig.get('ShdPnd')}/{sig.get('SigPnd')} blocked {sig.get('SigBlk')}")
    return out


def session_gone(sid: int) -> bool:
    """No process of session SID at all, zombies included (they hold pids a restore needs)."""
    return not any(e.isdigit() and (st := _stat(int(e))) and st[2] == sid for e in os.listdir("/proc"))


def kill_session(sid: int) -> None:
    for e in os.listdir("/proc"):
        if e.isdigit() and (st := _stat(int(e))) and st[2] == sid:
            try:
                os.kill(int(e), signal.SIGKILL)
            except ProcessLookupError:
                pass


class Workload:
    """ARGV (its last argument is appended: a fresh control dir) in a session of its own, detached
    (an intermediate shell exits, so when it is killed init reaps it, as for a real workload). Its
    pid is read from DIR/ready (a number, or JSON with "pid")."""

    def __init__(self, argv: list[str], timeout: float = 60) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="gpusnap-srv-"))
        sh = ["sh", "-c", 'setsid "$@" </dev/null >>"$0/log" 2>&1 &', str(self.dir), *argv, str(self.dir)]
        subprocess.run(sh, check=True, cwd="/", timeout=30)
        raw = until("the workload is ready", lambda: (self.dir / "ready").read_text() or None, timeout)
        info = json.loads(raw)
        self.info = info if isinstance(info, dict) else {"pid": info}
        self.pid = int(self.info["pid"])
        self.sid = self.pid  # setsid made it the leader of its own session

    def kill(self) -> None:
        kill_session(self.sid)

    def describe(self) -> str:
        """What a failed test says of it: each process of its session (session_report) and the end of
        its log."""
        try:
            tail = (self.dir / "log").read_text(errors="replace")[-400:]
        except OSError as e:
            tail = f"({e.strerror})"
        return f"session {self.sid}: {session_report(self.sid)}; log: {tail}"

    def close(self) -> None:
        """Kill the session and remove the control dir (kill() alone keeps it for a restore)."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def python_workload(script: str, *args: str) -> Workload:
    """tests/support/SCRIPT ARGS... DIR, as a Workload."""
    return Workload([sys.executable, str(SUPPORT / script), *args])


class HttpConn:
    """One HTTP/1.1 connection kept open: request() sends GET / on it and reads one answer."""

    def __init__(self, host: str, port: int, timeout: float = 60) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.file = self.sock.makefile("rb")

    def send_line(self, text: bytes) -> None:
        self.sock.sendall(text)

    def request(self, head_sent: bool = False) -> tuple[int, str]:
        if not head_sent:
            self.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        self.sock.sendall(b"\r\n")
        status = self.file.readline().split()
        length = 0
        while True:
            h = self.file.readline()
            if not h or h in (b"\r\n", b"\n"):
                break
            k, _, v = h.decode().partition(":")
            if k.strip().lower() == "content-length":
                length = int(v)
        return int(status[1]), self.file.read(length).decode()

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def http_get(host: str, port: int, timeout: float = 30) -> tuple[int, str]:
    """One GET / on a fresh connection, HTTP/1.0 style (closed after the answer)."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        s.shutdown(socket.SHUT_WR)  # a keep-alive server sees the end and closes after its answer
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")
