"""`gpusnap swap`'s pure parts: the config (every key validated, one-line errors naming the key), the
LRU/budget policy, the HTTP framing copied byte for byte, and the status/metrics renderings."""
from __future__ import annotations

import asyncio
from typing import Any
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import GPUSNAP, REPO, pythonpath
from sandbox.swap import config, control, http
from sandbox.swap.config import Budget, ConfigError, Mode
from sandbox.swap.policy import Slot, plan
from sandbox.swap.registry import Server

GOOD: dict[str, Any] = {
    "listen": "127.0.0.1:8080", "gpu_memory": 0.6, "max_resident": 2, "control": "/run/x/swap.sock",
    "model": [
        {"name": "a", "command": ["python3", "a.py"], "port": 9001, "health": "/health", "mode": "criu",
         "listen": "127.0.0.1:8001", "gpu_memory": "2GiB", "env": {"X": "1"}, "prepare": ["/bin/true"]},
        {"name": "b", "command": ["python3", "b.py"], "port": 9002, "pinned": True},
    ],
}


def _with(top: dict | None = None, model: dict | None = None, drop: str | None = None) -> dict:
    d: dict[str, Any] = {**GOOD, **(top or {})}
    models: list[dict[str, Any]] = GOOD["model"]
    d["model"] = [{**models[0], **(model or {})}, dict(models[1])]
    if drop:
        d["model"][0].pop(drop)
    return d


def test_a_good_config_parses_into_frozen_dataclasses() -> None:
    c = config.parse(GOOD)
    a, b = c.models
    assert (a.name, a.command, a.port, a.mode, a.gpu_memory, a.env, a.prepare) == \
        ("a", ("python3", "a.py"), 9001, Mode.CRIU, 2 << 30, (("X", "1"),), ("/bin/true",))
    assert str(a.listen) == "127.0.0.1:8001" and a.snapshot == "swap.a"
    assert (b.mode, b.pinned, b.health, b.listen) == (Mode.GPU, True, "/", None)
    assert c.budget == Budget(fraction=0.6) and c.max_resident == 2 and c.run_dir == "/run/x"
    with pytest.raises(AttributeError):
        a.port = 1  # type: ignore[misc]


@pytest.mark.parametrize("doc,key", [
    (_with(model={"command": "python3 a.py"}), "command"),          # a string: never a shell
    (_with(model={"command": []}), "command"),
    (_with(model={"command": ["python3", 3]}), "command"),
    (_with(model={"name": "../x"}), "name"),
    (_with(model={"name": "metrics"}), "name"),
    (_with(model={"port": 0}), "port"),
    (_with(model={"port": 70000}), "port"),
    (_with(model={"port": True}), "port"),
    (_with(model={"port": 9002}), "port"),                          # b's port
    (_with(model={"listen": "127.0.0.1:8080"}), "listen"),          # the shared port
    (_with(model={"listen": "example:80"}), "listen"),
    (_with(model={"mode": "docker"}), "mode"),
    (_with(model={"health": "health"}), "health"),
    (_with(model={"pinned": "yes"}), "pinned"),
    (_with(model={"cwd": "relative"}), "cwd"),
    (_with(model={"env": {"A B": "1"}}), "env"),
    (_with(model={"prepare": "drain"}), "prepare"),
    (_with(model={"gpu_memory": "lots"}), "gpu_memory"),
    (_with(model={"colour": "red"}), "colour"),
    (_with(drop="port"), "port"),
    (_with({"gpu_memory": 1.5}), "gpu_memory"),
    (_with({"gpu_memory": 0.0}), "gpu_memory"),
    (_with({"gpu_memory": -5}), "gpu_memory"),
    (_with({"max_resident": 0}), "max_resident"),
    (_with({"control": "rel.sock"}), "control"),
    (_with({"request_timeout": -1}), "request_timeout"),
    (_with({"budget": 1}), "budget"),
    ({"listen": "127.0.0.1:8080"}, "model"),
])
def test_a_bad_config_is_refused_naming_the_key(doc: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        config.parse(doc)
    msg = str(e.value)
    assert msg.startswith("config: ") and key in msg and "\n" not in msg, msg


def test_twice_the_same_name_and_pinned_over_max_resident_are_refused() -> None:
    d = _with()
    d["model"][1]["name"] = "a"
    with pytest.raises(ConfigError, match="named twice"):
        config.parse(d)
    d = _with({"max_resident": 1}, {"pinned": True})
    with pytest.raises(ConfigError, match="pinned"):
        config.parse(d)


def test_sizes_and_budgets() -> None:
    assert config.parse_size("40GiB", "k") == 40 << 30 and config.parse_size("512 M", "k") == 512 << 20
    assert config.parse_size(1234, "k") == 1234
    assert Budget(bytes=5).resolve(None) == 5 and Budget().resolve(10) is None
    assert Budget(fraction=0.5).resolve(80 << 30) == 40 << 30
    with pytest.raises(ConfigError, match="NVML reports no GPU"):
        Budget(fraction=0.5).resolve(None)


def _s(name: str, last: float, gb: int = 1, *, resident: bool = True, pinned: bool = False, busy: int = 0) -> Slot:
    return Slot(name, resident, pinned, busy, last, gb << 30)


def test_policy_takes_the_least_recently_used_idle_unpinned_and_no_more_than_needed() -> None:
    slots = [_s("a", 3), _s("b", 1), _s("c", 2), _s("t", 0, resident=False)]
    assert plan(slots, "t", budget=None, max_resident=3).victims == ("b",)
    assert plan(slots, "t", budget=None, max_resident=2).victims == ("b", "c")
    assert plan(slots, "t", budget=3 << 30, max_resident=None).victims == ("b",)
    assert plan(slots, "t", budget=4 << 30, max_resident=None).victims == ()
    assert plan(slots, "t", budget=10 << 30, max_resident=None).victims == ()
    assert plan(slots, "a", budget=1, max_resident=1).victims == ()   # resident already


def test_policy_never_takes_pinned_or_busy_servers_and_says_why_it_waits() -> None:
    slots = [_s("p", 0, pinned=True), _s("busy", 1, busy=2), _s("idle", 5), _s("t", 0, resident=False)]
    assert plan(slots, "t", budget=None, max_resident=3).victims == ("idle",)
    p = plan(slots, "t", budget=None, max_resident=2)
    assert p.victims == () and p.wait is not None and "busy" in p.wait and "pinned" in p.wait and "p" in p.wait
    big = [_s("a", 1), _s("t", 0, 9, resident=False)]
    assert "over the whole budget" in (plan(big, "t", budget=8 << 30, max_resident=None).wait or "")


def _pipe(data: bytes, copy) -> bytes:
    async def go() -> bytes:
        r = asyncio.StreamReader()
        r.feed_data(data + b"TAIL")
        r.feed_eof()
        out = bytearray()

        class W:
            def write(self, b: bytes) -> None:
                out.extend(b)

            async def drain(self) -> None:
                pass
        await copy(r, W())
        assert await r.read() == b"TAIL", "read past the end of the message"
        return bytes(out)
    return asyncio.run(go())


def test_chunked_bodies_are_copied_byte_for_byte_and_stop_at_their_end() -> None:
    body = b"5;ext=1\r\nhello\r\n1A\r\n" + b"x" * 26 + b"\r\n0\r\nX-T: y\r\n\r\n"
    assert _pipe(body, http.copy_chunked) == body
    with pytest.raises(http.HttpError):
        _pipe(b"zz\r\n", http.copy_chunked)
    assert _pipe(b"abcdef", lambda r, w: http.copy_exact(r, w, 6)) == b"abcdef"


def test_heads_are_framed_and_bounded() -> None:
    async def head(data: bytes) -> http.Head | None:
        r = asyncio.StreamReader(limit=http.MAX_HEAD)
        r.feed_data(data)
        r.feed_eof()
        return await http.read_head(r)
    h = asyncio.run(head(b"POST /a/v1 HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n"))
    assert h is not None and h.start == ("POST", "/a/v1", "HTTP/1.1") and h.chunked and not h.keep_alive("HTTP/1.1")
    assert asyncio.run(head(b"")) is None
    with pytest.raises(http.HttpError):
        asyncio.run(head(b"GET / HTTP/1.1\r\n" + b"X: " + b"y" * (http.MAX_HEAD + 10) + b"\r\n\r\n"))
    with pytest.raises(http.HttpError):
        asyncio.run(head(b"GET / HTTP/1.1\r\nbad header\r\n\r\n"))


def test_status_text_and_metrics_carry_the_same_figures() -> None:
    c = config.parse(GOOD)
    s = Server(c.models[0], requests=7, gpu_bytes=3 << 30)
    s.swap_ins.add(1.5)
    s.swap_ins.add(2.5)
    st = {"servers": [s.as_dict(), Server(c.models[1]).as_dict()], "resident": 0, "max_resident": 2,
          "budget_bytes": 8 << 30, "gpu_bytes": 0, "swaps": 2, "queue": 0, "uptime_s": 3.0}
    text = control.render(st)
    assert "a " in text and "criu" in text and "pinned" in text and "8.0 GiB budget" in text
    m = control.metrics(st)
    assert 'gpusnap_swap_requests_total{model="a"} 7' in m
    assert 'gpusnap_swap_swap_in_total{model="a"} 2' in m
    assert 'gpusnap_swap_swap_in_seconds{model="a",quantile="0.5"} 2.5' in m
    assert 'gpusnap_swap_state{model="b",state="stopped"} 1' in m


def test_cli_refuses_a_bad_config_in_one_line_with_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "swap.toml"
    cfg.write_text('listen = "127.0.0.1:1"\n[[model]]\nname = "a"\ncommand = "python3 -m http.server"\nport = 2\n')
    r = subprocess.run([*GPUSNAP, "--store", str(tmp_path / "s"), "swap", "serve", str(cfg)], cwd=REPO,
                       capture_output=True, text=True, env={"PYTHONPATH": pythonpath(), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "command" in r.stderr and "shell" in r.stderr, r.stderr
    r = subprocess.run([*GPUSNAP, "swap", "status", "--socket", str(tmp_path / "none.sock")], cwd=REPO,
                       capture_output=True, text=True, env={"PYTHONPATH": pythonpath(), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1 and "no `gpusnap swap serve` answers" in r.stderr and r.stderr.count("\n") == 1
    r = subprocess.run([*GPUSNAP, "swap", "--help"], cwd=REPO, capture_output=True, text=True,
                       env={"PYTHONPATH": pythonpath(), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and "serve" in r.stdout and "status" in r.stdout and "max_resident" in r.stdout
