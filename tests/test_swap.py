"""`gpusnap swap serve` end to end on the CPU: real stdlib HTTP servers (tests/support/swap_server.py)
started from the config's command, swapped by real CRIU (mode = "criu") through the journaled
operations; real HTTP clients. Routing by port, /NAME/ prefix and JSON "model"; chunked and SSE
answers byte for byte; keep-alive; queueing in arrival order during a swap; LRU with max_resident and a
pinned server; deadlines (503 with the reason, also while the only candidates are busy); a crashed
server restarted from its snapshot; `swap status --json` and /metrics; the control socket root-only;
kill -9 of the daemon mid-swap, then `gpusnap recover`, then a new daemon adopting what is left."""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import GPUSNAP, REPO, pythonpath
from support.servers import until

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_root")]
SERVER = REPO / "tests" / "support" / "swap_server.py"
CRIU_BIN = REPO / ".cache" / "criu" / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath(), "PATH": f"{CRIU_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


class Swap:
    """A `gpusnap swap serve` of models NAMES (criu mode) under TMP, its ports and its log."""

    def __init__(self, tmp: Path, names: list[str], *, extra: str = "", per_model: dict[str, str] | None = None,
                 pause: str | None = None, model_lines: dict[str, list[str]] | None = None) -> None:
        self.tmp, self.names = tmp, names
        self.store, self.run_dir = tmp / "store", tmp / "run"
        self.port = {n: free_port() for n in names}
        self.listen, self.own = free_port(), free_port()
        self.control = self.run_dir / "swap.sock"
        lines = [f'listen = "127.0.0.1:{self.listen}"', f'control = "{self.control}"', extra]
        for n in names:
            cmd = (per_model or {}).get(n) or json.dumps([sys.executable, str(SERVER), n, str(self.port[n]), str(tmp)])
            lines += ["[[model]]", f'name = "{n}"', f"command = {cmd}", f"port = {self.port[n]}",
                      'health = "/health"', 'mode = "criu"']
            if n == names[0]:
                lines.append(f'listen = "127.0.0.1:{self.own}"')
            if n.startswith("pinned"):
                lines.append("pinned = true")
            lines += (model_lines or {}).get(n, [])
        self.config = tmp / "swap.toml"
        self.config.write_text("\n".join(lines) + "\n")
        self.log = tmp / "daemon.log"
        self.pause = pause
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> "Swap":
        e = env()
        if self.pause:
            e["GPUSNAP_TEST_PAUSE"] = self.pause
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*GPUSNAP, "--store", str(self.store), "swap", "serve", str(self.config)],
                                         cwd=REPO, env=e, stdout=log, stderr=log)
        until("the daemon answers its control socket", self._answers, 60)
        return self

    def _answers(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
        try:
            return self.status()["pid"] == self.proc.pid
        except AssertionError:
            return False

    def status(self) -> dict[str, Any]:
        r = subprocess.run([*GPUSNAP, "swap", "status", "--socket", str(self.control), "--json"], cwd=REPO,
                           env=env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def server(self, name: str) -> dict[str, Any]:
        return next(s for s in self.status()["servers"] if s["name"] == name)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def cleanup(self) -> None:
        """Every process this test started (its command lines name TMP), by pid."""
        self.stop()
        for n in os.listdir("/proc"):
            if n.isdigit() and int(n) != os.getpid():
                try:
                    if str(self.tmp).encode() in Path(f"/proc/{n}/cmdline").read_bytes():
                        os.kill(int(n), signal.SIGKILL)
                except OSError:
                    pass


def get(port: int, path: str, *, timeout: float = 60, **kw: Any) -> tuple[int, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(kw.pop("method", "GET"), path, **kw)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def hello(port: int, path: str) -> dict[str, Any]:
    code, body = get(port, path)
    assert code == 200, body
    return json.loads(body)


def raw(port: int, path: str) -> tuple[bytes, bytes, list[float]]:
    """(head, body, arrival times of the body's reads) of GET PATH with Connection: close, as bytes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    t0 = time.monotonic()
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data, times = b"", []
    while b := s.recv(65536):
        data += b
        times.append(time.monotonic() - t0)
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body, times


def without_date(head: bytes) -> list[bytes]:
    return [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"date:")]


@pytest.fixture(scope="module")
def swap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swap]:
    tmp = tmp_path_factory.mktemp("swap")
    never = json.dumps([sys.executable, "-c", f"import time; time.sleep(600)  # {tmp}"])
    sw = Swap(tmp, ["a", "b", "e", "pinned", "never"], extra="max_resident = 3\nrequest_timeout = 6",
              per_model={"never": never})
    try:
        yield sw.start()
    finally:
        sw.cleanup()


def test_prepare_and_resume_hooks_run_around_each_swap(tmp_path: Path) -> None:
    """A model's prepare step runs before it is dumped, its resume step after it is restored, as the
    commands' --prepare/--resume do; each step sees the snapshot it is for."""
    said = tmp_path / "said"
    hooks = {n: [f"prepare = {json.dumps(['/bin/sh', '-c', f'echo prepare {n} $GPUSNAP_SNAPSHOT >> {said}'])}",
                 f"resume = {json.dumps(['/bin/sh', '-c', f'echo resume {n} $GPUSNAP_SNAPSHOT >> {said}'])}",
                 "hook_timeout = 20"] for n in ("a", "b")}
    sw = Swap(tmp_path, ["a", "b"], extra="max_resident = 1", model_lines=hooks)
    try:
        sw.start()
        assert hello(sw.listen, "/a/hello")["name"] == "a"
        assert hello(sw.listen, "/b/hello")["name"] == "b"     # a out: its prepare step
        assert hello(sw.listen, "/a/hello")["name"] == "a"     # b out, a in: b's prepare, a's resume
        lines = said.read_text().splitlines()
        assert lines == ["prepare a swap.a", "prepare b swap.b", "resume a swap.a"], lines
    finally:
        sw.cleanup()


def test_a_non_loopback_hook_url_is_refused_at_load(tmp_path: Path) -> None:
    cfg = tmp_path / "swap.toml"
    cfg.write_text('[[model]]\nname = "a"\ncommand = ["true"]\nport = 8000\nhealth = "/"\nmode = "criu"\n'
                   'prepare = ["http://10.0.0.1:8000/sleep"]\n')
    r = subprocess.run([*GPUSNAP, "--store", str(tmp_path / "store"), "swap", "serve", str(cfg)], cwd=REPO,
                       env=env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "prepare/resume" in r.stderr and "loopback" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_routes_by_own_port_by_path_prefix_and_by_json_model(swap: Swap) -> None:
    a = hello(swap.own, "/hello")
    assert a["name"] == "a" and a["path"] == "/hello"
    b = hello(swap.listen, "/b/hello?x=1")
    assert b["name"] == "b" and b["path"] == "/hello?x=1", "the /NAME prefix is taken off, the query kept"
    body = json.dumps({"model": "e", "messages": [{"role": "user", "content": "hi"}]}, separators=(",", ":"))
    code, out = get(swap.listen, "/v1/chat/completions", method="POST", body=body,
                    headers={"Content-Type": "application/json"})
    got = json.loads(out)
    assert code == 200 and got["name"] == "e" and got["path"] == "/v1/chat/completions" and got["body"] == body
    code, out = get(swap.listen, "/v1/x", method="POST", body=json.dumps({"model": "nope"}))
    assert code == 404 and b"no model to route" in out
    with socket.create_connection(("127.0.0.1", swap.listen), timeout=60) as s:   # the body is never sent whole:
        s.sendall(b"POST /v1/x HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n{\"model\": \"e\"")
        out = s.makefile("rb").read()
    assert out.startswith(b"HTTP/1.1 400 ") and b"over the 1048576" in out, out   # the routing read is bounded


def test_chunked_and_sse_answers_pass_through_byte_for_byte(swap: Swap) -> None:
    hello(swap.listen, "/b/hello")   # b resident
    head, body, _ = raw(swap.listen, "/b/chunked")
    dhead, dbody, _ = raw(swap.port["b"], "/chunked")
    assert body == dbody and without_date(head) == without_date(dhead)
    assert b"Transfer-Encoding: chunked" in head and body.startswith(b"a;ext=0\r\nb chunk 0\n\r\n") \
        and body.endswith(b"0\r\nX-Trailer: done\r\n\r\n"), body
    head, body, times = raw(swap.listen, "/b/sse?n=4&gap=0.4")
    dhead, dbody, _ = raw(swap.port["b"], "/sse?n=4&gap=0.01")
    assert body == dbody and b"text/event-stream" in head
    assert times[0] < 1.0 and times[-1] > 1.1, f"events must go out as they come, not at the end: {times}"


def test_keep_alive_serves_several_requests_on_one_connection(swap: Swap) -> None:
    c = http.client.HTTPConnection("127.0.0.1", swap.listen, timeout=60)
    try:
        c.request("GET", "/b/hello")
        r1 = c.getresponse()
        r1.read()
        sock = c.sock
        c.request("GET", "/b/hello")
        r2 = c.getresponse()
        r2.read()
        assert r1.status == r2.status == 200 and c.sock is sock and not r2.will_close
    finally:
        c.close()


def test_lru_max_resident_and_pinned(swap: Swap) -> None:
    hello(swap.listen, "/pinned/hello")
    hello(swap.listen, "/a/hello")
    hello(swap.listen, "/b/hello")
    hello(swap.listen, "/a/hello")   # a more recent than b
    states = {s["name"]: s["state"] for s in swap.status()["servers"]}
    if states["e"] == "resident":     # an earlier test left e resident: bring it out
        hello(swap.listen, "/b/hello")
        hello(swap.listen, "/a/hello")
    st = {s["name"]: s["state"] for s in swap.status()["servers"]}
    assert [n for n in ("a", "b", "pinned") if st[n] == "resident"] == ["a", "b", "pinned"], st
    hello(swap.listen, "/e/hello")    # max_resident 3: the least recently used idle unpinned one goes: b
    st = {s["name"]: s["state"] for s in swap.status()["servers"]}
    assert (st["a"], st["b"], st["e"], st["pinned"]) == ("resident", "swapped-out", "resident", "resident"), st
    hello(swap.listen, "/b/hello")    # now a is the least recently used
    st = {s["name"]: s["state"] for s in swap.status()["servers"]}
    assert (st["a"], st["b"], st["e"], st["pinned"]) == ("swapped-out", "resident", "resident", "resident"), st
    assert swap.server("pinned")["swap_out"]["count"] == 0
    assert swap.status()["resident"] == 3


def test_requests_during_a_swap_queue_in_arrival_order(swap: Swap) -> None:
    assert swap.server("a")["state"] == "swapped-out"
    results: dict[int, int] = {}

    def one(k: int) -> None:
        results[k] = get(swap.listen, f"/a/order?seq={k}")[0]
    threads = []
    for k in range(6):
        t = threading.Thread(target=one, args=(k,))
        t.start()
        threads.append(t)
        time.sleep(0.02)
    for t in threads:
        t.join(60)
    assert results == {k: 200 for k in range(6)}
    orders = json.loads(get(swap.listen, "/a/orders")[1])
    assert [seq for _, seq in orders] == list(range(6)), f"forwarded out of order: {orders}"
    assert "a resident after" in swap.log.read_text()


def test_a_deadline_gives_503_with_the_reason(swap: Swap) -> None:
    t = time.monotonic()
    code, body = get(swap.listen, "/never/x")
    took = time.monotonic() - t
    assert code == 503 and b"not ready within the request deadline of 6 s" in body and b"starting" in body, body
    assert 5.5 < took < 15, took
    until("the never-healthy server is given up", lambda: swap.server("never")["state"] == "failed", 30)
    assert "given up" in (swap.server("never")["error"] or "")


def test_busy_servers_are_never_swapped_out(swap: Swap) -> None:
    busy, idle = ["a", "b"], "e"
    for n in (*busy, "pinned"):
        hello(swap.listen, f"/{n}/hello")
    assert [swap.server(n)["state"] for n in (*busy, idle)] == ["resident", "resident", "swapped-out"]
    slow = [threading.Thread(target=get, args=(swap.listen, f"/{n}/slow?s=8")) for n in busy]
    for t in slow:
        t.start()
    until("both requests in flight", lambda: all(swap.server(n)["in_flight"] == 1 for n in busy), 30)
    code, body = get(swap.listen, f"/{idle}/hello")
    assert code == 503 and b"waiting for the requests in flight on" in body, body
    assert all(swap.server(n)["state"] == "resident" for n in busy)
    for t in slow:
        t.join(60)
    assert hello(swap.listen, f"/{idle}/hello")["name"] == idle, "served once a server is idle"


def test_a_crashed_server_is_restarted_from_its_snapshot(swap: Swap) -> None:
    hello(swap.listen, "/a/hello")
    before = swap.server("a")
    assert before["snapshot"] == "swap.a"
    code, body = get(swap.listen, "/a/crash")
    assert code == 502 and b"closed the connection without an answer" in body, body
    until("a restarted", lambda: swap.server("a")["restarts"] == before["restarts"] + 1, 30)
    assert hello(swap.listen, "/a/hello")["name"] == "a"
    log = swap.log.read_text()
    assert "a: its server died (exit status 3); restarting it from its last snapshot 'swap.a'" in log, log[-2000:]


def test_status_json_metrics_and_a_root_only_control_socket(swap: Swap) -> None:
    before = swap.server("pinned")["requests"]
    for _ in range(3):
        hello(swap.listen, "/pinned/hello")
    st = swap.status()
    p = next(s for s in st["servers"] if s["name"] == "pinned")
    assert p["requests"] == before + 3 and p["state"] == "resident" and p["pinned"] and p["pid"]
    assert st["resident"] == 3 and st["max_resident"] == 3 and st["swaps"] > 0 and st["queue"] == 0
    a = next(s for s in st["servers"] if s["name"] == "a")
    assert a["swap_out"]["count"] >= 1 and a["swap_in"]["count"] >= 1 and a["swap_in"]["p50"] > 0
    code, m = get(swap.listen, "/metrics")
    assert code == 200 and f'gpusnap_swap_requests_total{{model="pinned"}} {before + 3}'.encode() in m
    assert f'gpusnap_swap_swap_out_total{{model="a"}} {a["swap_out"]["count"]}'.encode() in m
    text = subprocess.run([*GPUSNAP, "swap", "status", str(swap.config)], cwd=REPO, env=env(), capture_output=True,
                          text=True, check=True).stdout
    assert "pinned" in text and "resident 3/3" in text
    mode = os.stat(swap.control).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600 and stat.S_IMODE(os.stat(swap.run_dir).st_mode) == 0o700
    r = subprocess.run([sys.executable, "-c", "import os, socket, sys; os.setgid(65534); os.setuid(65534); "
                        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])", str(swap.control)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "PermissionError" in r.stderr, r.stderr


@pytest.mark.parametrize("stage", ["before-commit", "after-commit", "split-fill"])
def test_kill9_mid_swap_then_recover_leaves_each_server_running_or_restorable(stage: str, tmp_path: Path) -> None:
    flag = tmp_path / "paused"
    sw = Swap(tmp_path, ["a", "b"], extra="max_resident = 1\nrequest_timeout = 60", pause=f"{stage}:{flag}")
    try:
        sw.start()
        assert hello(sw.listen, "/a/hello")["n"] == 1
        assert hello(sw.listen, "/a/hello")["n"] == 2
        if stage == "split-fill":
            hello(sw.listen, "/b/hello")   # a dumped (no pause on a dump stage), b started
        def ask() -> None:
            try:
                get(sw.listen, f"/{'a' if stage == 'split-fill' else 'b'}/hello")
            except (ConnectionError, http.client.HTTPException):
                pass   # the daemon is killed mid-answer
        asked = threading.Thread(target=ask)
        asked.start()
        until(f"the daemon paused at {stage}", flag.exists, 60)
        sw.kill()
        flag.unlink()
        asked.join(60)
        r = subprocess.run([*GPUSNAP, "--store", str(sw.store), "recover", "--json"], cwd=REPO, env=env(),
                           capture_output=True, text=True, timeout=120)
        rec = json.loads(r.stdout)
        assert r.returncode == 0 and rec["ok"] and len(rec["operations"]) == 1, r.stdout + r.stderr
        if stage == "before-commit":   # not committed: a runs on where it was, its memory intact
            assert hello(sw.port["a"], "/hello")["n"] == 3
        else:                          # committed (and a killed) / half-restored (killed): the snapshot holds it
            with pytest.raises(ConnectionError):
                get(sw.port["a"], "/hello", timeout=5)
            assert json.loads(subprocess.run([*GPUSNAP, "--store", str(sw.store), "store", "verify", "swap.a",
                                              "--json"], cwd=REPO, env=env(), capture_output=True, text=True,
                                             check=True).stdout)["ok"]
        sw.pause = None
        sw.start()                     # a new daemon adopts what is running and what is in the store
        assert hello(sw.listen, "/a/hello")["n"] == 3 + (stage == "before-commit")
        assert hello(sw.listen, "/b/hello")["name"] == "b"
        assert "adopted" in sw.log.read_text()
    finally:
        sw.cleanup()
