"""The transformers server of the benchmarks (scripts/workloads/transformers_server.py) on the CPU, with a
tiny random Llama: dumped and restored by `gpusnap criu` with the real CRIU, its own digests (weights,
KV pool, prefix cache: computed in the process) and its greedy answers equal before and after; and the
--helper side (prepare drops the KV pool, resume brings it back as zeros, answers unchanged)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import REPO, Cli
from support.criu import require_criu

MISSING = [m for m in ("torch", "transformers", "aiohttp", "safetensors") if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.root, pytest.mark.skipif(
    bool(MISSING), reason=f"the transformers server needs {', '.join(MISSING)} (not importable here)")]


class Server:
    """The server on the CPU (a ~5 MB model, 10 MB KV pool), started in its own session."""

    def __init__(self, tmp: Path, helper: bool = False) -> None:
        self.ready = tmp / "ready"
        self.log = open(tmp / "server.log", "w")
        argv = [sys.executable, "scripts/workloads/transformers_server.py", "--device", "cpu", "--gb", "0.005",
                "--kv-gb", "0.01", "--cache-dir", str(tmp / "models"), "--ready-file", str(self.ready)]
        self.p = subprocess.Popen(argv + (["--helper"] if helper else []), cwd=REPO, stdin=subprocess.DEVNULL,
                                  stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
        deadline = time.monotonic() + 240
        while not self.ready.exists():
            assert self.p.poll() is None, (tmp / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the server was not ready in 240 s"
            time.sleep(0.2)
        self.port = int(self.ready.read_text())
        self.pid = self.p.pid

    def call(self, method: str, path: str, timeout: float = 120) -> Any:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=b"{}" if method == "POST" else None,
                                     headers={"Connection": "close", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def close(self) -> None:
        for pid in (self.pid,):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.p.poll() is None:
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.log.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    yield s
    s.close()


def test_dump_restore_answers_and_digests_equal(cli: Cli, server: Server, tmp_path: Path) -> None:
    require_criu()
    before = server.call("GET", "/digest")
    tokens = server.call("POST", "/generate")["tokens"]
    assert len(tokens) == 16 and before["kv"] and before["prefix"] and not before["kv_zero"]
    rep = cli.json("criu", "dump", "--skip-in-flight", str(server.pid), "srv")
    assert server.pid in rep["pids"]
    server.p.wait(timeout=30)  # killed once the snapshot is committed
    r = cli.json("criu", "restore", "srv")
    assert r["restored_pid"] == server.pid
    assert server.call("GET", "/digest") == before, "weights, KV pool and prefix cache must be bit-exact"
    assert server.call("POST", "/generate")["tokens"] == tokens
    changed = server.call("POST", "/kv/dirty?pct=5")["bytes"]
    assert changed > 0 and server.call("GET", "/digest")["kv"] != before["kv"]


def test_helper_prepare_resume_keeps_answers(tmp_path: Path) -> None:
    s = Server(tmp_path, helper=True)
    try:
        before = s.call("GET", "/digest")
        tokens = s.call("POST", "/generate")["tokens"]
        health = s.call("GET", "/health")
        if importlib.util.find_spec("criu_hooks.workload_helper") is not None:
            # the helper's Gate holds the request path and serves the hooks on its own loopback port
            assert health["helper"] == "criu_hooks.workload_helper" and health["hook_port"] != s.port
            req = urllib.request.Request(f"http://127.0.0.1:{health['hook_port']}/prepare", method="POST", data=b"")
            with urllib.request.urlopen(req, timeout=60) as r:
                assert json.loads(r.read())["released_bytes"] == before["kv_bytes"]
            assert s.call("GET", "/health")["ok"]  # /health is not gated
        else:
            assert health["helper"] == "built in" and health["hook_port"] == s.port
        assert s.call("POST", "/prepare")["freed"] in (before["kv_bytes"], 0)  # 0: prepared already
        assert s.call("POST", "/resume") == {"ok": True}
        after = s.call("GET", "/digest")
        assert after["kv_zero"] and after["kv"] != before["kv"], "the KV pool comes back as zeros"
        assert (after["weights"], after["prefix"]) == (before["weights"], before["prefix"])
        assert s.call("POST", "/generate")["tokens"] == tokens
    finally:
        s.close()
