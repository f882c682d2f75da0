#!/usr/bin/env python3
"""`gpusnap swap` on a GPU (issue 57): two real transformers servers (random-init Llama-shaped models saved
with save_pretrained to safetensors, loaded with from_pretrained(device_map="cuda", bfloat16), served with
aiohttp: scripts/bench/swap_model_server.py) that do not fit the budget together, requests through
`gpusnap swap serve`, first in mode "gpu", then in mode "criu" (fewer requests).

Checked: every answer (greedy decoding of a fixed prompt) equals the one the same server gave before any
swap, and its weights' digest (computed inside the server) after every switch equals the one before; the
GPU memory NVML reports (polled every 20 ms the whole run) never goes over the budget. Reported: p50/p99
of the switch time (a request for a swapped-out server to its first response byte) and of resident
requests; the in-place `gpu checkpoint`/`gpu restore` of the same server outside the daemon (the CLI's
wall time, and from the restore call to the first answer) for comparison; the added latency of a resident
request through the proxy over a direct one (p50 of /ping, which does no model work).

Requests go A, A, B, B, ...: the first of each pair is a switch, the second a resident request.
--dry-cpu runs the same flow with tiny models on the CPU (mode "criu" only: no GPU), or writes a
skipped result where torch, transformers or aiohttp are missing. Needs root (CRIU, the CUDA driver's
checkpoint API). Usage:
  python3 -m scripts.bench.bench_swap --out swap.json [--gb-each 8] [--requests 100]
      [--criu-requests 20] [--dry-cpu] [--keep]
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "scripts" / "bench" / "swap_model_server.py"


def pct(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50": None, "p99": None}
    v = sorted(values)
    return {"n": len(v), "p50": round(statistics.median(v), 5), "p99": round(v[min(len(v) - 1, int(0.99 * len(v)))], 5),
            "max": round(v[-1], 5)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    criu = REPO / ".cache" / "criu" / "bin"
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
            "PATH": f"{criu}:{os.environ.get('PATH', '/usr/bin:/bin')}"}


def request(port: int, path: str, timeout: float = 600) -> tuple[int, bytes, float, float]:
    """(status, body, seconds to the first response byte (the head read), seconds to the end)."""
    t = time.monotonic()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        first = time.monotonic() - t
        body = r.read()
        return r.status, body, first, time.monotonic() - t
    finally:
        c.close()


def wait_up(port: int, timeout: float = 600) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if request(port, "/health", 10)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server on port {port} did not come up within {timeout:g} s")


# ------------------------------------------------------------------------------------------- models
def make_models(where: Path, gb_each: float, device: str, tiny: bool) -> list[Path]:
    """Two random-init Llama-shaped models of about GB_EACH GB each in bfloat16 (different seeds, so that
    their answers differ), saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if tiny:
        cfg = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4)
    else:
        h, inter, vocab = 4096, 11008, 32000
        per_layer, outer = 2 * (4 * h * h + 3 * h * inter), 2 * 2 * vocab * h   # bytes in bf16
        layers = max(1, round((gb_each * 1e9 - outer) / per_layer))
        cfg = dict(vocab_size=vocab, hidden_size=h, intermediate_size=inter, num_hidden_layers=layers,
                   num_attention_heads=32, num_key_value_heads=32)
    out = []
    for seed in (1, 2):
        d = where / f"model{seed}"
        torch.manual_seed(seed)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)   # the weights made in bf16 directly, on the device
        try:
            with torch.device(device):
                m = LlamaForCausalLM(LlamaConfig(max_position_embeddings=256, **cfg))
        finally:
            torch.set_default_dtype(prev)
        m.save_pretrained(d, safe_serialization=True)
        del m
        if device == "cuda":
            torch.cuda.empty_cache()
        out.append(d)
    return out


# --------------------------------------------------------------------------------------- GPU memory
class MemoryPoll:
    """NVML's used memory of every GPU together, every 20 ms, in a thread (nothing where NVML is missing)."""

    def __init__(self) -> None:
        from sandbox.gpu import nvml
        self.nvml = nvml
        self.samples: list[tuple[float, int]] = []
        self.total: int | None = None
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _used(self) -> int | None:
        m = self.nvml.memory()
        if not m:
            return None
        self.total = sum(t for t, _ in m.values())
        return sum(t - f for t, f in m.values())

    def _run(self) -> None:
        while not self._stop.is_set():
            u = self._used()
            if u is not None:
                self.samples.append((time.monotonic(), u))
            time.sleep(0.02)

    def __enter__(self) -> "MemoryPoll":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()

    def now(self) -> int | None:
        return self._used()


# ------------------------------------------------------------------------------- in-place restore
def inplace_restore(model: Path, store: Path, device: str) -> dict[str, Any]:
    """The same server outside the daemon: `gpu checkpoint`, then `gpu restore` timed (its wall time, and
    from the call to the first answer), the answer checked against the one before."""
    port = free_port()
    p = subprocess.Popen([sys.executable, str(SERVER), str(model), str(port), device], env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_up(port)
        before = request(port, "/generate")[1]
        cli = [sys.executable, "-m", "cli", "--store", str(store)]
        t = time.monotonic()
        subprocess.run([*cli, "gpu", "checkpoint", str(p.pid), "inplace", "--replace"], cwd=REPO, env=env(), check=True,
                       capture_output=True)
        out_s = time.monotonic() - t
        t = time.monotonic()
        subprocess.run([*cli, "gpu", "restore", "inplace", str(p.pid)], cwd=REPO, env=env(), check=True,
                       capture_output=True)
        restore_s = time.monotonic() - t
        code, after, first, _ = request(port, "/generate")
        return {"checkpoint_s": round(out_s, 4), "restore_s": round(restore_s, 4),
                "restore_to_first_answer_s": round(restore_s + first, 4), "same_answer": code == 200 and after == before}
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


# ------------------------------------------------------------------------------------- a swap run
def swap_run(mode: str, models: list[Path], device: str, store: Path, work: Path, requests: int,
             budget: int | None, hint: int | None, mem: MemoryPoll) -> dict[str, Any]:
    ports = [free_port(), free_port()]
    listen = free_port()
    names = ["a", "b"]
    run_dir = work / f"run-{mode}"
    lines = [f'listen = "127.0.0.1:{listen}"', f'control = "{run_dir}/swap.sock"', "request_timeout = 900",
             "start_timeout = 900"]
    lines.append(f"gpu_memory = {budget}" if budget else "max_resident = 1")
    for n, m, port in zip(names, models, ports):
        lines += ["[[model]]", f'name = "{n}"', f"command = {json.dumps([sys.executable, str(SERVER), str(m), str(port), device])}",
                  f"port = {port}", 'health = "/health"', f'mode = "{mode}"']
        if hint:
            lines.append(f"gpu_memory = {hint}")
    cfg = work / f"swap-{mode}.toml"
    cfg.write_text("\n".join(lines) + "\n")
    log = open(work / f"daemon-{mode}.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "cli", "--store", str(store), "swap", "serve", str(cfg)], cwd=REPO,
                              env=env(), stdout=log, stderr=log)
    status = [sys.executable, "-m", "cli", "swap", "status", str(cfg), "--json"]
    res: dict[str, Any] = {"mode": mode, "requests": requests}
    try:
        end = time.monotonic() + 120
        while subprocess.run(status, cwd=REPO, env=env(), capture_output=True).returncode != 0:
            if daemon.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the daemon did not start: {(work / f'daemon-{mode}.log').read_text()[-2000:]}")
            time.sleep(0.2)
        first_start = time.monotonic()
        base: dict[str, bytes] = {}
        digests: dict[str, bytes] = {}
        switch, resident, failed, wrong, bad_digest = [], [], 0, 0, 0
        for n in names:   # each server's answer and digest before any swap of it (its first start)
            code, body, _, _ = request(listen, f"/{n}/generate")
            if code != 200:
                raise RuntimeError(f"{n}: first answer {code}: {body[:200]!r}")
            base[n] = body
            digests[n] = request(listen, f"/{n}/digest")[1]
        res["first_starts_s"] = round(time.monotonic() - first_start, 3)
        res["answers_differ"] = base["a"] != base["b"]
        # the proxy's own cost: /ping direct and through the proxy, the server resident
        direct, proxied = [], []
        for _ in range(50):
            direct.append(request(ports[1], "/ping")[3])
            proxied.append(request(listen, "/b/ping")[3])
        for i in range(requests):
            n = names[(i // 2) % 2]
            is_switch = i % 2 == 0
            try:
                code, body, first, _ = request(listen, f"/{n}/generate")
            except OSError:
                failed += 1
                continue
            if code != 200:
                failed += 1
                continue
            if body != base[n]:
                wrong += 1
            (switch if is_switch else resident).append(first)
            if is_switch and request(listen, f"/{n}/digest")[1] != digests[n]:
                bad_digest += 1
        st = json.loads(subprocess.run(status, cwd=REPO, env=env(), capture_output=True, check=True).stdout)
        res.update(switch_s=pct(switch), resident_s=pct(resident), failed=failed, wrong_answers=wrong,
                   wrong_digests=bad_digest, direct_ping_s=pct(direct), proxied_ping_s=pct(proxied),
                   proxy_added_ms_p50=round((statistics.median(proxied) - statistics.median(direct)) * 1000, 3),
                   daemon_status={s["name"]: {k: s[k] for k in ("swap_out", "swap_in", "gpu_bytes", "restarts")}
                                  for s in st["servers"]})
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(300)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log.close()
    res["swap_log"] = [ln for ln in (work / f"daemon-{mode}.log").read_text().splitlines() if "resident after" in ln or "FAILED" in ln][-6:]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where the results go (JSON)")
    ap.add_argument("--gb-each", type=float, default=8.0, help="GB of weights per server (default 8)")
    ap.add_argument("--requests", type=int, default=100, help="requests in mode gpu (default 100)")
    ap.add_argument("--criu-requests", type=int, default=20, help="requests in mode criu (default 20; 0: skip)")
    ap.add_argument("--dry-cpu", action="store_true", help="tiny models on the CPU, mode criu only")
    ap.add_argument("--work", default=None, help="the working directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (models, store, logs)")
    a = ap.parse_args()
    out: dict[str, Any] = {"argv": sys.argv[1:], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import aiohttp  # noqa: F401
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        out["skipped"] = f"needs torch, transformers and aiohttp: {e}"
        Path(a.out).write_text(json.dumps(out, indent=2))
        print(out["skipped"])
        return 0
    device = "cpu" if a.dry_cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        out["skipped"] = "no CUDA GPU here (--dry-cpu runs the flow on the CPU)"
        Path(a.out).write_text(json.dumps(out, indent=2))
        print(out["skipped"])
        return 0
    if os.geteuid() != 0:
        print("needs root (CRIU, the CUDA driver's checkpoint API)", file=sys.stderr)
        return 4
    work = Path(a.work or tempfile.mkdtemp(prefix="bench-swap-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    store = work / "store"
    try:
        t = time.monotonic()
        models = make_models(work, a.gb_each, device, tiny=a.dry_cpu)
        out["models_made_s"] = round(time.monotonic() - t, 2)
        out["device"] = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
        with MemoryPoll() as mem:
            idle = mem.now()
            budget = hint = None
            if device == "cuda":
                # each server holds its weights plus its CUDA context and activations; the budget fits one
                # of them with room to spare, never two: 1.6x the weights above what the card used idle
                hint = int(a.gb_each * 1e9 * 1.15)
                budget = int(a.gb_each * 1e9 * 1.6)
                out["gpu_idle_used_bytes"] = idle
            out["budget_bytes"], out["model_hint_bytes"] = budget, hint
            if device == "cuda":
                out["inplace"] = inplace_restore(models[0], store, device)
            out["runs"] = {}
            for mode, n in (("gpu", a.requests), ("criu", a.criu_requests)):
                if n <= 0 or (mode == "gpu" and device != "cuda"):
                    continue
                start = len(mem.samples)
                out["runs"][mode] = r = swap_run(mode, models, device, store, work, n, budget, hint, mem)
                used = [u for _, u in mem.samples[start:]]
                if used and budget is not None and idle is not None:
                    peak = max(used) - idle
                    r["gpu_peak_used_over_idle_bytes"] = peak
                    r["gpu_over_budget"] = peak > budget
                    r["gpu_samples"] = len(used)
        targets = {}
        inplace = out.get("inplace", {})
        for mode, r in out["runs"].items():
            ok = r["failed"] == 0 and r["wrong_answers"] == 0 and r["wrong_digests"] == 0 and not r.get("gpu_over_budget")
            targets[mode] = {"no_failed_or_wrong": ok}
            if inplace and r["switch_s"]["p50"] is not None:
                targets[mode]["switch_p50_within_inplace_restore_plus_1s"] = \
                    r["switch_s"]["p50"] <= inplace["restore_to_first_answer_s"] + 1
            targets[mode]["proxy_added_p50_under_2ms"] = r["proxy_added_ms_p50"] <= 2.0
        out["targets"] = targets
        print(json.dumps({k: out[k] for k in ("device", "budget_bytes", "targets")}, indent=2))
        for mode, r in out["runs"].items():
            print(f"{mode}: switch p50 {r['switch_s']['p50']} s p99 {r['switch_s']['p99']} s; resident p50 "
                  f"{r['resident_s']['p50']} s p99 {r['resident_s']['p99']} s; proxy adds {r['proxy_added_ms_p50']} ms "
                  f"(p50); failed {r['failed']}, wrong {r['wrong_answers']}, digests {r['wrong_digests']}")
        if inplace:
            print(f"in-place gpu restore {inplace['restore_s']} s, to the first answer {inplace['restore_to_first_answer_s']} s")
        return 0 if all(t["no_failed_or_wrong"] for t in targets.values()) else 1
    finally:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2))
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
