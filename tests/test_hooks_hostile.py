"""Workload hooks against a hostile workload, tenant or store writer, through the real CLI and real CRIU:
a hook URL whose endpoint trickles its answer (or sends `100 Continue` for ever) cannot hold gpusnap
past --hook-timeout; `localhost` is never looked up; a malformed URL is a usage error; a timed-out
command step that leaves its process group (setsid) is killed all the same; a resume step run after a
SIGTERM does not inherit ignored signals; a step's output cannot fill the disk nor write terminal
controls to the operator; a restore --from a remote tells truly what it did with a record it cannot
verify; a restore that will refuse runs no prepare step; the helper's endpoint refuses what a web page
could send it."""
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import pytest

from conftest import Cli
from support.criu import Tree, healthy

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_root")]


def proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


class Hostile:
    """A loopback HTTP endpoint that answers every connection with TALK(conn, stop) on its own thread."""

    def __init__(self, talk: Callable[[socket.socket, threading.Event], None]) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.talk = talk
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        try:
            c.recv(65536)
            self.talk(c, self.stop)
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for c in self.conns:
            c.close()


def _continue_forever(c: socket.socket, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        c.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")


def _trickle_headers(c: socket.socket, stop: threading.Event) -> None:
    c.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    while not stop.wait(0.2):
        c.sendall(b"a")


def _trickle_chunked_body(c: socket.socket, stop: threading.Event) -> None:
    c.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1")
    while not stop.wait(0.2):
        c.sendall(b"0")


@pytest.fixture
def tree() -> Iterator[Tree]:
    t = Tree(mb=4, detached=True)
    try:
        yield t
    finally:
        t.close()


@pytest.mark.parametrize("talk", [_continue_forever, _trickle_headers, _trickle_chunked_body],
                         ids=["100-continue-forever", "trickled-headers", "trickled-chunk-size"])
def test_a_url_step_that_trickles_its_answer_cannot_outlast_the_deadline(
        talk: Callable[[socket.socket, threading.Event], None], tmp_path: Path, tree: Tree) -> None:
    """Every read of the answer was bounded, not the answer: an endpoint sending a byte every 0.2 s
    (or interim `100 Continue` answers forever) held gpusnap for ever."""
    srv = Hostile(talk)
    try:
        t0 = time.monotonic()
        r = Cli(tmp_path / "store").run("criu", "dump", str(tree.pid), "s", "--prepare",
                                        f"http://127.0.0.1:{srv.port}/prepare", "--hook-timeout", "2",
                                        check=False, timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "got no complete answer within 2 s" in r.stderr and "no snapshot was taken" in r.stderr, r.stderr
        assert took < 20, f"gpusnap took {took:.1f} s on a 2 s deadline"
        assert healthy(tree.report()) and tree.running()
    finally:
        srv.close()


def test_a_timed_out_step_that_left_its_process_group_is_killed(tmp_path: Path, tree: Tree) -> None:
    """A step that calls setsid() (a daemonizing tool) is no longer in the group gpusnap kills at the
    deadline: it ran on, as root, after gpusnap said the step was killed."""
    pidfile = tmp_path / "escaped.pid"
    prepare = (f"/bin/sh -c 'setsid /bin/sh -c \"echo \\$\\$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; "
               f"exec sleep 300\" & exec sleep 300'")
    r = Cli(tmp_path / "store").run("criu", "dump", str(tree.pid), "s", "--prepare", prepare,
                                    "--hook-timeout", "2", check=False, timeout=120)
    assert r.returncode == 1 and "did not finish within 2 s" in r.stderr, (r.returncode, r.stderr)
    escaped = int(pidfile.read_text())
    try:
        deadline = time.monotonic() + 5
        while proc_state(escaped) not in ("gone", "Z") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc_state(escaped) in ("gone", "Z"), "a process the timed-out step started in its own session runs on"
    finally:
        if proc_state(escaped) not in ("gone", "Z"):
            os.kill(escaped, 9)
    assert healthy(tree.report()) and tree.running()


# -- the helper's endpoint: what a web page on this host could send it --------------------------------
def _raw(port: int, request: bytes) -> int:
    """The status line's code of REQUEST sent as it is to 127.0.0.1:PORT."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while b"\r\n" not in data:
            part = s.recv(4096)
            if not part:
                break
            data += part
    return int(data.split(b" ", 2)[1])


@pytest.mark.parametrize("extra,code", [
    (b"Host: 127.0.0.1\r\nOrigin: http://evil.example\r\n", 403),      # a cross-site form or fetch()
    (b"Host: rebound.example:1\r\n", 403),                              # DNS rebinding: a name, not loopback
    (b"Host: 127.0.0.1.rebound.example\r\n", 403),
    (b"Host: 127.0.0.1\r\nSec-Fetch-Site: cross-site\r\n", 403),
    (b"Host: 127.0.0.1\r\nContent-Length: -1\r\n", 400),                # read to the end of the stream: a hung thread
    (b"Host: [::1]:80\r\n", 200),                                       # what tools send
    (b"Host: localhost:80\r\n", 200),
], ids=["origin", "rebound-name", "rebound-127-prefix", "sec-fetch", "negative-length", "v6", "localhost"])
def test_the_helper_refuses_what_a_web_page_could_send(extra: bytes, code: int) -> None:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "criu_hooks"))
    if TYPE_CHECKING:  # the same file, found by its package
        from criu_hooks import workload_helper
    else:
        import workload_helper
    gate = workload_helper.Gate(drain_timeout_s=0.5)
    _, port = gate.serve("127.0.0.1", 0)
    try:
        got = _raw(port, b"POST /prepare HTTP/1.1\r\n" + extra + b"Connection: close\r\n\r\n")
        assert got == code
        assert gate.prepared == (code == 200), "a refused request prepared the server"
    finally:
        gate.close()


def test_a_resume_step_after_sigterm_does_not_inherit_ignored_signals(tmp_path: Path, tree: Tree) -> None:
    """gpusnap ignores SIGTERM/SIGHUP/SIGINT while it undoes a dump it was told to stop; an ignored
    disposition survives exec, so the resume step it then runs (and a daemon that step starts) could not
    be stopped by SIGTERM or Ctrl-C."""
    import signal
    import subprocess

    from conftest import GPUSNAP, REPO, pythonpath
    store, pidfile, log = tmp_path / "store", tmp_path / "prepare.pid", tmp_path / "log"
    prepare = f"/bin/sh -c 'echo $$ > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; exec sleep 60'"
    resume = f"/bin/sh -c 'grep ^SigIgn: /proc/$$/status >> {log}'"
    p = subprocess.Popen([*GPUSNAP, "--store", str(store), "criu", "dump", str(tree.pid), "s", "--prepare", prepare,
                          "--resume", resume], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": pythonpath()},
                         cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + 60
    while not pidfile.exists():
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, (p.returncode, err)
    ignored = int(log.read_text().split()[1], 16)
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        assert not ignored & (1 << (s - 1)), f"the resume step ran with {s.name} ignored (SigIgn {ignored:#x})"
    assert healthy(tree.report()) and tree.running()


def test_a_restore_from_another_store_says_truly_that_it_restored_and_did_not_resume(tmp_path: Path,
                                                                                   tree: Tree) -> None:
    """`criu restore NAME --from REMOTE` on another node: the recorded step is checked only once the
    snapshot is here, after CRIU restored it. Its MAC is the other store's, so it is not run; the error
    said "nothing was restored" of a workload that was running (a retry then collides with it)."""
    from support.crash import wait_dead
    from support.swift import Node, swift_start, url_for
    log = tmp_path / "log"
    endpoint = swift_start()
    url = url_for(f"hookreview-{os.getpid()}-{time.monotonic_ns()}")
    a, b = Node(tmp_path / "a", endpoint, url), Node(tmp_path / "b", endpoint, url)
    a.json("criu", "dump", str(tree.pid), "snap", "--resume", f"/bin/sh -c 'echo r >> {log}'")
    a.json("push", "snap")
    wait_dead(tree)
    r = b.run("criu", "restore", "snap", "--from", "r", check=False)
    assert r.returncode == 1, (r.returncode, r.stderr)
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1, line
    assert tree.alive() and healthy(tree.report()), "the restore itself succeeded"
    assert "nothing was restored" not in line, line
    assert f"restored (root pid {tree.pid})" in line and "was not run" in line, line
    assert not log.exists(), "a step that does not verify ran"


@pytest.mark.parametrize("cmd", ["dump", "restore"])
def test_a_prepare_step_does_not_run_for_a_command_that_will_refuse(cmd: str, tmp_path: Path, tree: Tree) -> None:
    """A journal waiting for `gpusnap recover` makes `criu dump` and `criu restore` refuse (exit 5), but
    only after the --prepare step had run: a server was put to sleep (its cache dropped) for nothing."""
    import signal

    from support.journal import paused as _paused, records
    store, log = tmp_path / "store", tmp_path / "log"
    cli = Cli(store)
    cli.json("criu", "dump", "--leave-running", str(tree.pid), "snap")
    p = _paused(store, ["criu", "dump", "--leave-running", str(tree.pid), "other", "--prepare", "/bin/true",
                        "--resume", "/bin/true"], "after-prepare", tmp_path)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    (tmp_path / "pause-after-prepare").unlink()
    assert records(store), "an interrupted operation waits for recover"
    args = (["criu", "dump", str(tree.pid), "x"] if cmd == "dump" else ["criu", "restore", "snap"])
    r = cli.run(*args, "--prepare", f"/bin/sh -c 'echo p >> {log}'", check=False)
    assert r.returncode == 5 and "gpusnap recover" in r.stderr, (r.returncode, r.stderr)
    assert not log.exists(), "the prepare step ran for a command that refused"
    assert tree.running()


def _escape_answer(c: socket.socket, stop: threading.Event) -> None:
    body = b"\x1b]2;owned\x07\x1b[2J\x1b[31mfine\x9b1m"
    c.sendall(b"HTTP/1.1 500 Oops\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.parametrize("kind", ["url", "command"])
def test_a_steps_answer_cannot_write_terminal_controls_to_the_operator(kind: str, tmp_path: Path, tree: Tree) -> None:
    """What the step (the workload's endpoint, or a tool relaying it) answers is quoted in gpusnap's
    error line: escape sequences in it reached the operator's terminal (retitle, clear, recolour it)."""
    srv = Hostile(_escape_answer)
    try:
        step = (f"http://127.0.0.1:{srv.port}/prepare" if kind == "url"
                else "/usr/bin/printf '\\033]2;owned\\007\\033[2Jfine\\302\\2331m'")
        if kind == "command":
            step = f"/bin/sh -c \"{step}; exit 3\""
        r = Cli(tmp_path / "store").run("criu", "dump", str(tree.pid), "s", "--prepare", step, check=False,
                                        timeout=60)
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "fine" in r.stderr, r.stderr
        assert not any(not c.isprintable() for c in r.stderr.rstrip("\n")), repr(r.stderr)
    finally:
        srv.close()


def _escape_status_line(c: socket.socket, stop: threading.Event) -> None:
    c.sendall(b"\x1b]2;owned\x07 nonsense\r\n\r\n")


def test_a_bad_status_line_is_not_echoed_raw(tmp_path: Path, tree: Tree) -> None:
    srv = Hostile(_escape_status_line)
    try:
        r = Cli(tmp_path / "store").run("criu", "dump", str(tree.pid), "s", "--prepare",
                                        f"http://127.0.0.1:{srv.port}/prepare", check=False, timeout=60)
        assert r.returncode == 1 and "owned" in r.stderr, (r.returncode, r.stderr)
        assert not any(not c.isprintable() for c in r.stderr.rstrip("\n")), repr(r.stderr)
    finally:
        srv.close()


def test_a_step_that_floods_its_output_does_not_fill_the_disk(tmp_path: Path, tree: Tree) -> None:
    """A command step's output went whole to a temporary file (only its tail is ever read): a step
    relaying a workload's endless answer (curl on its endpoint) filled /tmp at disk speed until its
    deadline. The step reports the size its output file has after 64 MiB."""
    flood = (f"/bin/sh -c 'yes | head -c 67108864; sleep 0.5; "
             f"echo size=$(stat -L -c %s /proc/$$/fd/1) blocks=$(stat -L -c %b /proc/$$/fd/1); exit 3'")
    r = Cli(tmp_path / "store").run("criu", "dump", str(tree.pid), "s", "--prepare", flood, check=False,
                                    timeout=120)
    assert r.returncode == 1 and "exited 3" in r.stderr, (r.returncode, r.stderr)
    words = dict(w.rstrip(";").split("=") for w in r.stderr.split() if w.startswith(("size=", "blocks=")))
    assert int(words["blocks"]) * 512 <= 8 << 20, f"the step's output holds {int(words['blocks']) * 512} bytes on disk"
    assert r.stderr.rstrip().endswith("; no snapshot was taken") and "y y y" in r.stderr, r.stderr


@pytest.mark.parametrize("url", ["http://[::1]x/prepare", "http://[::1/prepare"])
def test_a_malformed_hook_url_is_a_one_line_usage_error(url: str, tmp_path: Path, tree: Tree) -> None:
    """urlsplit's own ValueError escaped as a traceback (exit 1)."""
    r = Cli(tmp_path / "store").run("criu", "dump", str(tree.pid), "s", "--prepare", url, check=False)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stderr.count("\n") == 1 and "hook URL" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert tree.running()


def test_localhost_is_loopback_whatever_the_resolver_says(tmp_path: Path, tree: Tree) -> None:
    """`http://localhost/...` passed the check as a name, then was resolved by the system's resolver
    (/etc/hosts, then DNS where it lacks the name): the resolver, not gpusnap, chose the address. Here a
    private /etc/hosts (a mount namespace of this test's own) names 127.0.0.2 as localhost: gpusnap must
    still contact 127.0.0.1."""
    import shutil
    import subprocess

    from conftest import GPUSNAP, REPO, pythonpath
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    hits: dict[str, int] = {"127.0.0.1": 0, "127.0.0.2": 0}

    def ok(addr: str) -> Callable[[socket.socket, threading.Event], None]:
        def talk(c: socket.socket, stop: threading.Event) -> None:
            hits[addr] += 1
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        return talk
    good = Hostile(ok("127.0.0.1"))
    other = socket.socket()
    other.bind(("127.0.0.2", good.port))
    other.listen(8)
    got: list[int] = []

    def record() -> None:
        try:
            c, _ = other.accept()
        except OSError:
            return
        got.append(1)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        c.close()
    threading.Thread(target=record, daemon=True).start()
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 localhost\n")
    try:
        # a restore's prepare step runs before the restore (which then finds no such snapshot): no CRIU
        # runs in the test's mount namespace
        Cli(tmp_path / "store").run("store", "init")
        script = (f"mount --bind {hosts} /etc/hosts && exec \"$@\"")
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "/bin/sh", "-c", script, "sh", *GPUSNAP,
                            "--store", str(tmp_path / "store"), "criu", "restore", "nosuch",
                            "--prepare", f"http://localhost:{good.port}/prepare"],
                           capture_output=True, text=True, cwd=REPO, timeout=120,
                           env={**os.environ, "PYTHONPATH": pythonpath()})
        assert r.returncode != 0 and "nosuch" in r.stderr and "prepare step" not in r.stderr, (r.returncode, r.stderr)
        assert not got, "gpusnap contacted the address the resolver gave for localhost"
        assert hits["127.0.0.1"] == 1
    finally:
        good.close()
        other.close()


def test_the_sweep_of_a_timed_out_step_spares_a_workload_below_gpusnap(tmp_path: Path) -> None:
    """After `criu restore` the restored tree is gpusnap's child while its resume step runs, so a process
    the workload orphans then comes to gpusnap (the child subreaper) too: the sweep after a timeout
    must end only what the step left, never the workload's. This process plays gpusnap (hooks.run, as
    the restore's resume runs it); its child in a session of its own plays the restored tree, which
    orphans a process while the step runs."""
    import subprocess

    from sandbox.ops import hooks
    mark, escaped = tmp_path / "orphaned.pid", tmp_path / "escaped.pid"
    workload = subprocess.Popen(["/bin/sh", "-c", f"sleep 1; /bin/sh -c 'echo $$ > {mark}.tmp; mv {mark}.tmp {mark}; "
                                 "exec sleep 300' & exec sleep 300"], start_new_session=True)
    orphan = None
    try:
        step = hooks.Hook.parse(f"/bin/sh -c 'setsid /bin/sh -c \"echo \\$\\$ > {escaped}; exec sleep 300\" & "
                                "exec sleep 300'")
        # the workload's orphan: its parent (the workload's root) is killed while the step runs
        killer = threading.Timer(1.5, lambda: os.kill(workload.pid, 9))
        killer.start()
        with pytest.raises(hooks.HookError, match="did not finish within 4 s"):
            hooks.run(step, hooks.Step.RESUME, 4)
        killer.join()
        workload.wait()
        orphan = int(mark.read_text())
        assert proc_state(orphan) not in ("gone", "Z"), "the sweep killed the workload's own process"
        assert proc_state(int(escaped.read_text())) in ("gone", "Z"), "what the step left in its own session runs on"
    finally:
        for pid in (orphan, int(escaped.read_text()) if escaped.exists() else None):
            if pid is not None and proc_state(pid) not in ("gone", "Z"):
                os.kill(pid, 9)
        if orphan is not None:  # adopted by this process while the step ran: ours to reap
            try:
                os.waitpid(orphan, 0)
            except ChildProcessError:
                pass
        if workload.poll() is None:
            workload.kill()
            workload.wait()
