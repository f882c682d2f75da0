"""The workload helper (criu_hooks/workload_helper.py) with real torch: its gate (a request in flight holds
a prepare back; one that arrives while prepared waits for the resume; sync and asyncio), its endpoint
(idempotent, 503 when requests do not drain), and a small real transformers model (Llama-shaped,
random init, saved to safetensors and loaded with from_pretrained) served over HTTP with a KV pool it
drops: prepare -> criu dump (--leave-running, and not) -> restore -> resume through gpusnap's URL hooks;
the greedy answers after equal those before, and the weights' digest is equal bit for bit. The GPU
variant runs the same server on CUDA."""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from conftest import REPO, Cli
from support.servers import Workload, session_gone, until

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/setup.sh installs it unless "
                                            "GPUSNAP_NO_TORCH=1)")
pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh installs it)")
pytest.importorskip("safetensors", reason="safetensors is not installed (scripts/setup.sh installs it)")

sys.path.insert(0, str(REPO / "criu_hooks"))
if TYPE_CHECKING:  # the same file, found by its package
    from criu_hooks import workload_helper
else:
    import workload_helper  # the standalone file, imported as a user's server imports it

SERVER = REPO / "tests" / "support" / "llama_server.py"
PROMPTS = ["1,2,3", "7,7,7,7", "200,13,55,9,1"]


def post(port: int, path: str) -> tuple[int, dict[str, Any]]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request("POST", path, body=b"", headers={"Content-Length": "0"})
        r = c.getresponse()
        return r.status, json.loads(r.read())
    finally:
        c.close()


def get(port: int, path: str) -> Any:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request("GET", path)
        r = c.getresponse()
        assert r.status == 200, (path, r.status)
        return json.loads(r.read())
    finally:
        c.close()


# -- the gate, in this process ----------------------------------------------------------------------
class Holder:
    def __init__(self) -> None:
        self.pool: Any = torch.arange(1024, dtype=torch.float16).reshape(32, 32)


def test_prepare_waits_for_requests_in_flight_and_new_ones_wait_for_resume() -> None:
    h = Holder()
    gate = workload_helper.Gate(drain_timeout_s=20)
    gate.discardable("pool", lambda: h.pool, lambda t: setattr(h, "pool", t))
    release, entered = threading.Event(), threading.Event()

    @gate.guarded
    def slow() -> float:
        entered.set()
        release.wait(20)
        return float(h.pool.sum())

    results: list[Any] = []
    t = threading.Thread(target=lambda: results.append(slow()))
    t.start()
    entered.wait(10)
    got: dict[str, Any] = {}
    p = threading.Thread(target=lambda: got.update(gate.prepare()))
    p.start()
    time.sleep(0.3)
    assert not got and h.pool is not None, "prepare must wait for the request in flight"
    release.set()
    p.join(20)
    t.join(20)
    assert results == [float(torch.arange(1024, dtype=torch.float16).sum())]
    assert got["released_bytes"] == 1024 * 2 and got["released"] == {"pool": 2048}
    assert h.pool is None and gate.prepared
    assert gate.prepare()["already"] is True, "a second prepare changes nothing"

    late: list[Any] = []

    @gate.guarded
    def uses_pool() -> tuple[tuple[int, ...], Any]:
        return tuple(h.pool.shape), h.pool.dtype

    w = threading.Thread(target=lambda: late.append(uses_pool()))
    w.start()
    time.sleep(0.3)
    assert late == [], "a request must not run while prepared"
    r = gate.resume()
    w.join(20)
    assert r["recreated_bytes"] == 2048 and late == [((32, 32), torch.float16)]
    assert torch.equal(h.pool, torch.zeros(32, 32, dtype=torch.float16))
    assert gate.resume()["already"] is True, "a resume without a prepare changes nothing"


def test_async_requests_wait_without_blocking_the_loop() -> None:
    h = Holder()
    gate = workload_helper.Gate()
    gate.discardable("pool", lambda: h.pool, lambda t: setattr(h, "pool", t))

    @gate.guarded
    async def handler() -> int:
        return int(h.pool.numel())

    async def scenario() -> tuple[int, int, int]:
        first = await handler()
        gate.prepare()
        pending = asyncio.ensure_future(handler())
        ticks = 0
        for _ in range(20):  # the loop keeps running while the request waits
            await asyncio.sleep(0.01)
            ticks += 1
        assert not pending.done()
        await asyncio.get_running_loop().run_in_executor(None, gate.resume)
        return first, await pending, ticks

    assert asyncio.run(scenario()) == (1024, 1024, 20)


def test_endpoint_is_idempotent_and_a_request_that_does_not_drain_is_a_503() -> None:
    h = Holder()
    gate = workload_helper.Gate(drain_timeout_s=0.5)
    gate.discardable("pool", lambda: h.pool, lambda t: setattr(h, "pool", t))
    _, port = gate.serve("127.0.0.1", 0)
    try:
        assert post(port, "/resume") == (200, {"state": "running", "recreated_bytes": 0, "already": True})
        with gate.request():  # in flight: the prepare cannot drain, nothing is released
            code, body = post(port, "/prepare")
        assert code == 503 and "in flight" in body["error"] and h.pool is not None and not gate.prepared
        code, body = post(port, "/sleep?level=1")  # vLLM's path works too
        assert code == 200 and body["released_bytes"] == 2048 and h.pool is None
        assert post(port, "/prepare")[1]["already"] is True
        assert get(port, "/state")["state"] == "prepared"
        assert post(port, "/wake_up")[1]["recreated_bytes"] == 2048 and h.pool is not None and h.pool.shape == (32, 32)
        assert post(port, "/nope")[0] == 404
        with pytest.raises(ValueError):
            workload_helper.Gate().serve("0.0.0.0", 0)
    finally:
        gate.close()


# -- a real transformers server through gpusnap -----------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("llama") / "model"
    import subprocess
    subprocess.run([sys.executable, str(SERVER), "--make", str(d)], check=True, timeout=300, cwd="/")
    assert (d / "model.safetensors").is_file()
    return d


def answers(port: int) -> list[list[int]]:
    return [get(port, f"/generate?ids={p}&n=8")["tokens"] for p in PROMPTS]


@pytest.mark.root
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_transformers_server_prepared_dumped_restored_and_resumed_answers_the_same(
        device: str, model_dir: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    cli = Cli(tmp_path / "store")
    w = Workload([sys.executable, str(SERVER), str(model_dir), device], timeout=180)
    try:
        port, hook = w.info["port"], w.info["hook_port"]
        before, digest = answers(port), get(port, "/digest")
        assert digest["kv_pool"] == [64, 4096]
        hooks = ["--prepare", f"http://127.0.0.1:{hook}/prepare", "--resume", f"http://127.0.0.1:{hook}/resume"]
        # --leave-running: prepared, dumped, resumed, answering the same
        d = cli.json("criu", "dump", "--leave-running", str(w.pid), "live", *hooks)
        prep, res = d["hooks"]
        assert '"released_bytes": 1048576' in prep["detail"] and '"recreated_bytes": 1048576' in res["detail"]
        assert answers(port) == before and get(port, "/digest") == digest
        # ended by the dump, restored, resumed by the step the snapshot recorded
        cli.json("criu", "dump", str(w.pid), "gone", *hooks)
        until("the dumped server's session reaped", lambda: session_gone(w.sid), timeout=120)
        r = cli.json("criu", "restore", "gone")
        assert r["restored_pid"] == w.pid and [h["step"] for h in r["hooks"]] == ["resume"]
        assert '"recreated_bytes": 1048576' in r["hooks"][0]["detail"]
        assert get(port, "/digest") == digest, "the weights after the restore differ"
        assert answers(port) == before, "the answers after the restore differ"
    except BaseException:
        print(w.describe())
        raise
    finally:
        w.close()
