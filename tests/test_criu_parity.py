"""CRIU parity (issue 61): what plain CRIU does, `gpusnap criu dump/restore` does too, through the real
CLI and the real CRIU: a process with private MAP_HUGETLB memory restored by default; a failed dump
leaves every process as it found it (running, stopped, traced); the CRIU options a user needs, each a
checked gpusnap option."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import Cli

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_criu")]


def _until(done, why: str, within: float = 15.0) -> None:
    deadline = time.monotonic() + within
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {why}")
        time.sleep(0.05)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---- hugetlb -------------------------------------------------------------------------------------

HUGE = r'''
import ctypes, mmap, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
N = 8 << 20
addr = libc.mmap(None, N, 3, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x40000, -1, 0)  # MAP_HUGETLB
if addr in (None, ctypes.c_void_p(-1).value):
    print("no huge pages", ctypes.get_errno(), flush=True)
    sys.exit(3)
buf = (ctypes.c_char * N).from_address(addr)
for off in range(0, N, 4096):
    buf[off:off + 4096] = bytes(((off >> 12) * 31 + i) % 251 for i in range(0, 4096, 512)) * 512
print("ready", flush=True)
while True:
    time.sleep(0.1)
    ok = all(buf[o:o + 4096] == bytes(((o >> 12) * 31 + i) % 251 for i in range(0, 4096, 512)) * 512
             for o in range(0, N, 4096))
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {'ok' if ok else 'bad'} {time.monotonic_ns()}")
    os.replace(tmp, sys.argv[1])
'''


@pytest.fixture
def huge_pages() -> Iterator[None]:
    """vm.nr_hugepages at least 16 for the test (the old value put back after); a skip where the
    kernel gives none."""
    path = "/proc/sys/vm/nr_hugepages"
    with open(path) as f:
        old = int(f.read())
    try:
        with open(path, "w") as f:
            f.write(str(max(old, 16)))
    except OSError as e:
        pytest.skip(f"vm.nr_hugepages cannot be set here: {e}")
    try:
        with open("/proc/meminfo") as f:
            free = next(int(l.split()[1]) for l in f if l.startswith("HugePages_Free:"))
        if free < 4:
            pytest.skip(f"the kernel gives no huge pages here (HugePages_Free {free} after vm.nr_hugepages=16)")
        yield
    finally:
        with open(path, "w") as f:
            f.write(str(old))


@pytest.mark.parametrize("dumped_by", ["stream", "staging"])
def test_private_hugetlb_memory_is_restored_by_the_default_restore(cli: Cli, tmp_path: Path, huge_pages: None,
                                                                   dumped_by: str) -> None:
    state = tmp_path / "state"
    script = tmp_path / "huge.py"
    script.write_text(HUGE)
    log = open(tmp_path / "out", "w")
    p = subprocess.Popen([sys.executable, str(script), str(state)], stdin=subprocess.DEVNULL, stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _until(lambda: state.exists() or p.poll() is not None, "the hugetlb workload")
        if p.poll() is not None:
            pytest.skip(f"no huge pages for the workload: {(tmp_path / 'out').read_text().strip()}")
        assert state.read_text().split()[1] == "ok"
        env = {k: v for k, v in os.environ.items() if k != "GPUSNAP_CRIU_IMAGES"}  # the default path
        d = cli.run("criu", "dump", str(p.pid), "huge", "--json", env={**env, "GPUSNAP_CRIU_IMAGES": dumped_by})
        rep = json.loads(d.stdout)
        assert rep["images_path"] == dumped_by and "MAP_HUGETLB" in rep["staged_restore"], rep
        p.wait(10)
        info = json.loads(cli.run("store", "inspect", "huge", "--json").stdout)
        assert "mm-" in info["meta"]["staged_restore"]
        state.unlink()
        r = json.loads(cli.run("criu", "restore", "huge", "--json", env=env).stdout)
        assert r["restored_pid"] == p.pid and r["images_path"] == "staging", r
        _until(state.exists, "the restored workload's check")
        assert state.read_text().split()[:2] == [str(p.pid), "ok"]
    finally:
        _kill(p.pid)
        if p.poll() is None:
            p.wait(10)
        log.close()


# ---- a failed dump leaves the tree as found --------------------------------------------------------

HELD_TREE = r'''
import ctypes, os, signal, sys, time
out = sys.argv[1]
libc = ctypes.CDLL(None, use_errno=True)
def beat(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
stopped = os.fork()
if stopped == 0:
    while True:
        time.sleep(0.1)
tracer = os.fork()
if tracer == 0:
    tracee = os.fork()
    if tracee == 0:
        libc.ptrace(0, 0, None, None)  # PTRACE_TRACEME
        os.kill(os.getpid(), signal.SIGSTOP)  # a signal-delivery stop: state t, until the tracer continues it
        beat(out + ".tracee", "continued")
        os._exit(0)
    os.waitpid(tracee, os.WUNTRACED)  # that stop
    events = []
    go = out + ".go"
    while not os.path.exists(go):  # the tracer waits for more stops of its tracee (none is expected)
        pid, status = os.waitpid(tracee, os.WNOHANG | os.WUNTRACED | 0x40000000)  # __WALL
        if pid:
            events.append(os.WSTOPSIG(status) if os.WIFSTOPPED(status) else -1)
        beat(out + ".tracer", f"{time.monotonic_ns()} {events}")
        time.sleep(0.05)
    libc.ptrace(7, tracee, None, None)  # PTRACE_CONT, no signal: the tracee goes on
    os.waitpid(tracee, 0)
    beat(out + ".tracer", f"done {events}")
    os._exit(0)
os.kill(stopped, signal.SIGSTOP)
beat(out, f"{stopped} {tracer}")
while True:
    time.sleep(0.1)
'''


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _status(pid: int, key: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(l.split(":", 1)[1].strip() for l in f if l.startswith(key + ":"))


def test_a_failed_dump_leaves_a_stopped_and_a_traced_process_exactly_as_they_were(cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "tree"
    script = tmp_path / "held.py"
    script.write_text(HELD_TREE)
    root = subprocess.Popen([sys.executable, str(script), str(out)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _until(lambda: out.exists() and Path(f"{out}.tracer").exists(), "the tree")
        stopped, tracer = map(int, out.read_text().split())
        tracee = int(open(f"/proc/{tracer}/task/{tracer}/children").read().split()[0])
        _until(lambda: _state(stopped) == "T" and _state(tracee) == "t", "the stopped and the traced process")
        before = {p: (_state(p), _status(p, "TracerPid"), _status(p, "SigPnd"), _status(p, "ShdPnd"))
                  for p in (root.pid, stopped, tracer, tracee)}
        assert before[tracee][1] == str(tracer)
        r = cli.run("criu", "dump", str(root.pid), "held", check=False)
        assert r.returncode != 0, "CRIU cannot seize a process another tracer holds: the dump must fail"
        assert "seize" in r.stderr.lower() or "ptrace" in r.stderr.lower() or "state t" in r.stderr, r.stderr
        time.sleep(0.5)  # a signal sent would have been delivered by now
        after = {p: (_state(p), _status(p, "TracerPid"), _status(p, "SigPnd"), _status(p, "ShdPnd"))
                 for p in (root.pid, stopped, tracer, tracee)}
        sigcont = 1 << (signal.SIGCONT - 1)
        for p in (stopped, tracee):  # exactly as they were: state, tracer, no SIGCONT pending
            assert after[p][:2] == before[p][:2], (p, before[p], after[p])
            # (CRIU itself re-sends SIGSTOP to a stopped task it lets go, as plain CRIU does: that one may be pending)
            assert not (int(after[p][2], 16) | int(after[p][3], 16)) & sigcont, (p, after[p])
        assert after[root.pid][0] in "RS" and after[tracer][0] in "RS", after
        # the tracer is not hung: it saw no new stop of its tracee, still runs, and can let it go on
        beat = Path(f"{out}.tracer").read_text()
        assert beat.split(" ", 1)[1] == "[]", beat
        Path(f"{out}.go").write_text("")
        _until(lambda: Path(f"{out}.tracer").read_text().startswith("done"), "the tracer to finish")
        assert Path(f"{out}.tracer").read_text() == "done []"
        assert Path(f"{out}.tracee").read_text() == "continued"
        assert _state(stopped) == "T"
    finally:
        for p in _tree_pids(root.pid):
            _kill(p)
        root.wait(10)


def _tree_pids(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            todo += [int(x) for x in open(f"/proc/{p}/task/{p}/children").read().split()]
        except OSError:
            pass
    return out


# ---- TCP: the network lock, --tcp-close ------------------------------------------------------------

ECHO = r'''
import os, socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
def put(text):
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(text)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
put("connected")
while True:
    try:
        d = s.recv(100)
    except OSError as e:
        d = None
        put(f"closed {e.errno}")
    if not d:
        if d is not None:
            put("closed eof")
        while True:
            time.sleep(1)
    s.sendall(d)
    put("echoed " + d.decode())
'''

NO_IPTABLES = "/usr/bin:/bin"  # iptables-restore lives in /usr/sbin (Debian): a machine without it, to CRIU and gpusnap


class Peer:
    """A loopback listener (outside the tree) and the workload connected to it."""

    def __init__(self, tmp_path: Path) -> None:
        import socket
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(1)
        self.state = tmp_path / "echo"
        script = tmp_path / "echo.py"
        script.write_text(ECHO)
        self.p = subprocess.Popen([sys.executable, str(script), str(self.srv.getsockname()[1]), str(self.state)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        self.conn, _ = self.srv.accept()
        self.conn.settimeout(10)
        _until(lambda: self.state.exists(), "the workload's connection")

    def echo(self, word: str) -> str:
        self.conn.sendall(word.encode())
        return self.conn.recv(100).decode()

    def close(self) -> None:
        _kill(self.p.pid)
        if self.p.poll() is None:
            self.p.wait(10)
        self.conn.close()
        self.srv.close()


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[Peer]:
    p = Peer(tmp_path)
    yield p
    p.close()


def test_without_iptables_a_tcp_dump_names_the_cause_and_network_lock_skip_dumps_and_restores(
        cli: Cli, peer: Peer) -> None:
    env = {"PATH": NO_IPTABLES}
    r = cli.run("criu", "dump", "--tcp-established", str(peer.p.pid), "tcp", check=False, env=env)
    assert r.returncode == 4, (r.returncode, r.stderr)
    line = r.stderr.strip()
    assert "\n" not in line and "iptables-restore" in line and "--network-lock skip" in line \
        and "--network-lock nftables" in line, line
    assert peer.echo("a") == "a", "nothing was frozen: the connection still works"
    doc = json.loads(cli.run("doctor", "--json", env=env).stdout)
    assert "iptables-restore" in doc["criu_network_lock"]["problem"]
    assert "warning: criu dump --tcp-established" in cli.run("doctor", env=env).stdout
    assert json.loads(cli.run("doctor", "--json").stdout)["criu_network_lock"]["problem"] is None
    bad = cli.run("criu", "dump", "--tcp-established", "--network-lock", "iptables;true", str(peer.p.pid), "x",
                  check=False)
    assert bad.returncode == 2 and "--network-lock" in bad.stderr
    cli.run("criu", "dump", "--tcp-established", "--network-lock", "skip", str(peer.p.pid), "tcp", env=env)
    peer.p.wait(10)
    assert "--network-lock" in json.loads(cli.run("store", "inspect", "tcp", "--json").stdout)["meta"]["options"]
    cli.run("criu", "restore", "tcp", env=env)  # the dump's method (skip) again: no iptables needed
    assert peer.echo("b") == "b", "the connection came back established"
    _until(lambda: peer.state.read_text() == "echoed b", "the restored workload's echo")


def test_tcp_close_restores_the_connections_closed(cli: Cli, peer: Peer) -> None:
    assert peer.echo("a") == "a"
    cli.run("criu", "dump", "--tcp-established", "--network-lock", "skip", str(peer.p.pid), "tcpc")
    peer.p.wait(10)
    cli.run("criu", "restore", "--tcp-close", "tcpc")
    _until(lambda: peer.state.read_text().startswith("closed"), "the restored workload to see its connection closed")
    assert not _gone(peer.p.pid), "the restored process runs on"


# ---- a process in its own mount namespace: --root, --external ------------------------------------

READER = r'''
import os, sys, time
while True:
    try:
        with open(sys.argv[1]) as f:
            text = f.read()
    except OSError as e:
        text = f"error {e.errno}"
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {text}")
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(0.05)
'''


def test_a_process_in_its_own_mount_namespace_restores_with_root_and_an_external_mount(cli: Cli, tmp_path: Path) -> None:
    dst, host, state = tmp_path / "dst", tmp_path / "host", tmp_path / "state"
    dst.mkdir()
    host.mkdir()
    (host / "f").write_text("from the host")
    script = tmp_path / "reader.py"
    script.write_text(READER)
    inner = (f"mount -t tmpfs gpusnap-test {dst} && echo -n inside > {dst}/f && "
             f"exec {sys.executable} {script} {dst}/f {state} </dev/null >/dev/null 2>&1")
    p = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sh", "-c", inner], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _until(lambda: state.exists(), "the workload in its mount namespace")
        assert state.read_text().split(" ", 1) == [str(p.pid), "inside"]
        assert os.readlink(f"/proc/{p.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        for bad in ("mnt[relative]:c", "mnt[/a/../b]:c", "mnt[/x]:c;rm", "bogus[1]:x", "veth[a]:b", f"mnt[{dst}]"):
            r = cli.run("criu", "dump", "--external", bad, str(p.pid), "ns", check=False)
            assert r.returncode == 2 and "--external" in r.stderr, (bad, r.returncode, r.stderr)
        r = cli.run("criu", "dump", "--root", "relative/dir", str(p.pid), "ns", check=False)
        assert r.returncode == 2 and "--root" in r.stderr
        assert state.read_text().endswith("inside"), "nothing was frozen by a refused option"
        cli.run("criu", "dump", "--external", f"mnt[{dst}]:data", str(p.pid), "ns")
        p.wait(10)
        r = cli.run("criu", "restore", "--external", f"mnt[data]:{tmp_path}/missing", "ns", check=False)
        assert r.returncode == 2 and "does not exist" in r.stderr
        state.unlink()
        cli.run("criu", "restore", "--root", "/", "--external", f"mnt[data]:{host}", "ns")
        _until(lambda: state.exists(), "the restored workload")
        assert state.read_text().split(" ", 1) == [str(p.pid), "from the host"], "the external mount is the host's dir"
        assert os.readlink(f"/proc/{p.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    finally:
        _kill(p.pid)
        if p.poll() is None:
            p.wait(10)


# ---- deleted files (--ghost-limit, --no-ghost-fiemap), inotify (--force-irmap, --irmap-scan-path) -----

GHOST = r'''
import os, sys, time
path = sys.argv[1]
with open(path, "wb") as f:
    f.write(bytes(range(256)) * (3 << 12))  # 3 MiB: over CRIU's default ghost limit (1 MiB)
fd = os.open(path, os.O_RDONLY)
os.unlink(path)
while True:
    data = os.pread(fd, 3 << 20, 0)
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write("ok" if data == bytes(range(256)) * (3 << 12) else f"bad {len(data)}")
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(0.05)
'''


def test_a_deleted_file_over_the_default_ghost_limit_dumps_with_ghost_limit(cli: Cli, tmp_path: Path) -> None:
    state = tmp_path / "state"
    script = tmp_path / "ghost.py"
    script.write_text(GHOST)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path / "gone"), str(state)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _until(lambda: state.exists(), "the workload")
        r = cli.run("criu", "dump", str(p.pid), "g", check=False)
        assert r.returncode != 0 and "ghost" in r.stderr.lower(), r.stderr
        assert not _gone(p.pid) and _state(p.pid) in "RS"
        for bad in ("12Q", "-1", "2T", "1M;x"):
            r = cli.run("criu", "dump", "--ghost-limit", bad, str(p.pid), "g", check=False)
            assert r.returncode == 2 and "--ghost-limit" in r.stderr, (bad, r.stderr)
        rep = cli.json("criu", "dump", "--ghost-limit", "4M", "--no-ghost-fiemap", str(p.pid), "g")
        p.wait(10)
        opts = json.loads(cli.run("store", "inspect", "g", "--json").stdout)["meta"]["options"]
        assert "--no-ghost-fiemap" in opts and opts[opts.index("--ghost-limit") + 1] == str(4 << 20), opts
        assert rep["pids"] == [p.pid]
        state.unlink()
        cli.run("criu", "restore", "g")
        _until(lambda: state.exists(), "the restored workload")
        assert state.read_text() == "ok", "the deleted file's 3 MiB came back"
    finally:
        _kill(p.pid)
        if p.poll() is None:
            p.wait(10)


WATCH = r'''
import ctypes, os, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init()
assert libc.inotify_add_watch(fd, sys.argv[1].encode(), 0x100) >= 0  # IN_CREATE
with open(sys.argv[2], "w") as f:
    f.write("watching")
while True:
    buf = os.read(fd, 4096)
    wd, mask, cookie, n = struct.unpack_from("iIII", buf)
    name = buf[16:16 + n].rstrip(b"\0").decode()
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(f"created {name}")
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
'''


def test_an_inotify_watch_is_dumped_with_force_irmap_and_an_irmap_scan_path(cli: Cli, tmp_path: Path) -> None:
    watched, state = tmp_path / "watched", tmp_path / "state"
    watched.mkdir()
    script = tmp_path / "watch.py"
    script.write_text(WATCH)
    p = subprocess.Popen([sys.executable, str(script), str(watched), str(state)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _until(lambda: state.exists(), "the watcher")
        for bad in ("relative", f"{tmp_path}/../{tmp_path.name}", f"{tmp_path}//x"):
            r = cli.run("criu", "dump", "--irmap-scan-path", bad, str(p.pid), "w", check=False)
            assert r.returncode == 2 and "--irmap-scan-path" in r.stderr, (bad, r.stderr)
        cli.run("criu", "dump", "--force-irmap", "--irmap-scan-path", str(tmp_path), str(p.pid), "w")
        p.wait(10)
        opts = json.loads(cli.run("store", "inspect", "w", "--json").stdout)["meta"]["options"]
        assert "--force-irmap" in opts and ["--irmap-scan-path", str(tmp_path)] == opts[opts.index("--irmap-scan-path"):][:2]
        cli.run("criu", "restore", "w")
        time.sleep(0.3)
        (watched / "new-file").write_text("")
        _until(lambda: state.read_text() == "created new-file", "the restored watch to see a new file")
    finally:
        _kill(p.pid)
        if p.poll() is None:
            p.wait(10)


def test_a_dump_with_tcp_close_restores_the_connection_closed_and_cgroups_are_a_checked_choice(
        cli: Cli, peer: Peer) -> None:
    assert peer.echo("a") == "a"
    bad = cli.run("criu", "dump", "--manage-cgroups", "all;x", str(peer.p.pid), "c", check=False)
    assert bad.returncode == 2 and "--manage-cgroups" in bad.stderr
    cli.run("criu", "dump", "--tcp-close", "--manage-cgroups", "soft", str(peer.p.pid), "c", env={"PATH": NO_IPTABLES})
    peer.p.wait(10)
    opts = json.loads(cli.run("store", "inspect", "c", "--json").stdout)["meta"]["options"]
    assert "--tcp-close" in opts and "--manage-cgroups=soft" in opts, opts
    cli.run("criu", "restore", "--tcp-close", "--manage-cgroups", "ignore", "c")
    _until(lambda: peer.state.read_text().startswith("closed"), "the restored workload to see its connection closed")


def test_images_criu_reads_by_their_size_make_the_restore_staged() -> None:
    """A network namespace's nftables rules: CRIU reads nftables-N.img by its file size (fstat), which a
    pipe lacks (zdtm's namespace flavor failed with a broken pipe): such a snapshot restores staged."""
    from sandbox.criu.images import late_reads
    assert late_reads({"nftables-10.img": b"table inet x {}", "pstree.img": b"p"}) is not None
    assert "nftables-10.img" in (late_reads({"nftables-10.img": b"t"}) or "")
    assert late_reads({"nftables-10.img": b"", "pstree.img": b"p", "nftables-1.img.x": b"t"}) is None
