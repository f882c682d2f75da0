#!/usr/bin/env python3
"""A transformers inference server for the benchmarks and the CPU tests: what issue 56 measured.

A Llama-shaped `LlamaForCausalLM` (random init from a fixed seed, config sized by --gb for the weights),
saved once with `save_pretrained` (safetensors) into a cache directory and loaded from there with
`from_pretrained(..., torch_dtype=torch.bfloat16, device_map=DEVICE)` (plain `.to(DEVICE)` where
accelerate, which device_map needs, is not installed); a vLLM-like paged KV pool (torch.zeros of
64 KiB blocks, 30% of them written); a prefix-cache session (a DynamicCache of a 1,024-token prompt
kept on the device). Served over HTTP by aiohttp on 127.0.0.1:

  GET  /health            {"ok": true, "pid": ...}
  POST /generate          greedy decode of the fixed prompt: {"tokens": [...]} (body {"n": N} optional)
  GET  /digest            BLAKE2b of every weight, of the KV pool and of the prefix cache, computed here
                          (bit-exactness is checked by the process itself): {"weights", "kv", "prefix", ...}
  POST /kv/dirty?pct=P    rewrites P% of the KV pool's blocks (new values): {"bytes": changed bytes}
  POST /prepare, /resume  with --helper: the workload side of gpusnap's hooks (`--prepare URL`). Through
                          criu_hooks.workload_helper's Gate where that module exists (which also serves
                          them on its own port: /health's "hook_port"), else the same semantics here:
                          wait until no request is in flight and hold new ones, free the KV pool,
                          empty the caching allocator; resume re-creates the KV pool as zeros of its shape
                          and lets requests through.

--ready-file F: once the first request could be answered, F gets the port (written aside, renamed).
--device cpu with a small --gb (e.g. 0.005) runs without a GPU: the CPU tests use it.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

BLOCK_BYTES = 64 * 1024
KV_WRITTEN = 0.30
PREFIX_TOKENS = 1024
PROMPT_TOKENS = 32
NEW_TOKENS = 16
PIECE = 64 << 20  # bytes per hashed piece


def config_for(gb: float, seed: int) -> dict[str, Any]:
    """A Llama config whose bf16 weights take about GB gigabytes (whole layers; at least one)."""
    if gb >= 8:
        h, inter, vocab, heads, kv = 4096, 14336, 128256, 32, 8
    elif gb >= 0.5:
        h, inter, vocab, heads, kv = 2048, 5632, 32000, 16, 4
    else:
        h, inter, vocab, heads, kv = 256, 688, 4096, 8, 2
    head_dim = h // heads
    per_layer = 2 * (2 * h * h + 2 * h * kv * head_dim + 3 * h * inter + 2 * h)
    fixed = 2 * (2 * vocab * h + h)
    layers = max(1, round((gb * 1e9 - fixed) / per_layer))
    return {"hidden_size": h, "intermediate_size": inter, "vocab_size": vocab, "num_attention_heads": heads,
            "num_key_value_heads": kv, "num_hidden_layers": layers, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "seed": seed}


def model_dir(cache: str, cfg: dict[str, Any]) -> str:
    key = hashlib.blake2b(json.dumps(cfg, sort_keys=True).encode(), digest_size=8).hexdigest()
    return os.path.join(cache, f"llama-{cfg['num_hidden_layers']}x{cfg['hidden_size']}-{key}")


def ensure_saved(cache: str, cfg: dict[str, Any], device: str) -> str:
    """The model's safetensors directory, made once (random init from the seed, then save_pretrained)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    path = model_dir(cache, cfg)
    if os.path.exists(os.path.join(path, "done")):
        return path
    os.makedirs(cache, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    conf = LlamaConfig(**{k: v for k, v in cfg.items() if k != "seed"})
    torch.manual_seed(cfg["seed"])
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(conf)
    finally:
        torch.set_default_dtype(old)
    model.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "done"), "w") as f:
        f.write("ok\n")
    del model
    os.rename(tmp, path)
    return path


class State:
    """The served model, the KV pool and the prefix cache; the request gate the hooks use."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from transformers import LlamaForCausalLM
        self.torch = torch
        self.device = args.device
        t0 = time.monotonic()
        cfg = config_for(args.gb, args.seed)
        path = ensure_saved(args.cache_dir, cfg, args.device)
        t1 = time.monotonic()
        try:
            import accelerate  # noqa: F401  (device_map needs it)
            self.model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16, device_map=args.device)
            self.loaded_with = "device_map"
        except ImportError:
            self.model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).to(args.device)
            self.loaded_with = "to"
        self.model.eval()
        t2 = time.monotonic()
        g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
        vocab = cfg["vocab_size"]
        self.prompt = torch.randint(0, vocab, (1, PROMPT_TOKENS), generator=g).to(args.device)
        prefix_ids = torch.randint(0, vocab, (1, PREFIX_TOKENS), generator=g).to(args.device)
        self.kv_shape = (max(1, int(args.kv_gb * 1e9) // BLOCK_BYTES), BLOCK_BYTES // 2)
        self.kv: Any = torch.zeros(self.kv_shape, dtype=torch.bfloat16, device=args.device)
        written = int(self.kv_shape[0] * KV_WRITTEN)
        self._fill(0, written, args.seed + 2)
        self.dirty_round = 0
        with torch.no_grad():
            self.prefix = self.model(prefix_ids, use_cache=True).past_key_values
        self.helper: Any = None
        self.hook_port = 0  # where POST /prepare and /resume are served (the helper's port, or ours)
        self.gate = threading.Condition()
        self.in_flight = 0
        self.held = False
        self.pool = concurrent.futures.ThreadPoolExecutor(max(2, min(16, os.cpu_count() or 2)))
        self.times = {"import_to_init": t0 - START, "save_if_needed": t1 - t0, "load": t2 - t1,
                      "setup": time.monotonic() - t2}

    def _fill(self, first: int, count: int, seed: int) -> None:
        torch = self.torch
        g = torch.Generator(device=self.device).manual_seed(seed)
        step = max(1, (256 << 20) // BLOCK_BYTES)
        for b in range(first, first + count, step):
            n = min(step, first + count - b)
            self.kv[b:b + n] = torch.randn((n, self.kv_shape[1]), generator=g, device=self.device,
                                           dtype=torch.float32).to(torch.bfloat16)

    @contextmanager
    def request(self) -> Iterator[None]:
        if self.helper is not None:
            with self.helper.request():
                yield
            return
        with self.gate:
            while self.held:
                self.gate.wait()
            self.in_flight += 1
        try:
            yield
        finally:
            with self.gate:
                self.in_flight -= 1
                self.gate.notify_all()

    def prepare(self) -> dict[str, Any]:
        """Hold new requests, wait for those in flight, free the KV pool, empty the caching allocator."""
        if self.helper is not None:  # criu_hooks.workload_helper's Gate does all of it
            freed = self.kv.numel() * 2 if self.kv is not None else 0
            return {"freed": freed, "helper": self.helper.prepare()}
        with self.gate:
            self.held = True
            while self.in_flight:
                self.gate.wait()
        freed = self.kv.numel() * 2 if self.kv is not None else 0
        self.kv = None
        self._sync()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()
        return {"freed": freed}

    def resume(self) -> dict[str, Any]:
        if self.helper is not None:
            self.helper.resume()
            return {"ok": True}
        if self.kv is None:
            self.kv = self.torch.zeros(self.kv_shape, dtype=self.torch.bfloat16, device=self.device)
        self._sync()
        with self.gate:
            self.held = False
            self.gate.notify_all()
        return {"ok": True}

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def generate(self, n: int) -> list[int]:
        with self.torch.no_grad():
            out = self.model.generate(self.prompt, attention_mask=self.torch.ones_like(self.prompt),
                                      max_new_tokens=n, do_sample=False, pad_token_id=0)
        return [int(t) for t in out[0, PROMPT_TOKENS:].tolist()]

    def _digest_tensors(self, tensors: list[Any]) -> str:
        """BLAKE2b over the pieces' BLAKE2b digests, pieces hashed on the pool's threads (hashlib drops
        the GIL on large buffers); each tensor's bytes copied to host memory a piece at a time."""
        torch = self.torch
        futures: list[concurrent.futures.Future[bytes]] = []
        for t in tensors:
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
            for off in range(0, flat.numel(), PIECE):
                host = flat[off:off + PIECE].cpu().numpy()
                futures.append(self.pool.submit(lambda b: hashlib.blake2b(b, digest_size=32).digest(), host))
        top = hashlib.blake2b(digest_size=32)
        for f in futures:
            top.update(f.result())
        return top.hexdigest()

    def digest(self) -> dict[str, Any]:
        with self.request():
            named = sorted(self.model.state_dict().items())
            weights = self._digest_tensors([t for _, t in named])
            kv = self._digest_tensors([self.kv]) if self.kv is not None else None
            layers = getattr(self.prefix, "layers", None)
            if layers is not None:
                pre = [x for lay in layers for x in (lay.keys, lay.values)]
            else:
                pre = [x for pair in self.prefix for x in pair]
            prefix = self._digest_tensors(pre)
        return {"weights": weights, "kv": kv, "prefix": prefix, "tensors": len(named),
                "weight_bytes": sum(t.numel() * t.element_size() for _, t in named),
                "kv_bytes": self.kv_shape[0] * BLOCK_BYTES, "kv_zero": self.kv is not None and not bool(self.kv.any())}

    def dirty(self, pct: float) -> int:
        with self.request():
            if self.kv is None:
                raise RuntimeError("the KV pool is released (prepared)")
            n = min(self.kv_shape[0], max(1, int(self.kv_shape[0] * pct / 100)))
            self.dirty_round += 1
            first = (self.dirty_round * 7919 * n) % max(1, self.kv_shape[0] - n + 1)
            self._fill(first, n, 1000 + self.dirty_round)
            self._sync()
            return n * BLOCK_BYTES


START = time.monotonic()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=16.0, help="GB of bf16 weights (whole layers)")
    ap.add_argument("--kv-gb", type=float, default=6.0, help="GB of the paged KV pool")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--port", type=int, default=0, help="127.0.0.1 port (0: any free one)")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/gpusnap-bench-models"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--helper", action="store_true", help="serve the hooks' /prepare and /resume")
    ap.add_argument("--ready-file", default=None)
    ap.add_argument("--save-only", action="store_true", help="make the cached model and exit")
    args = ap.parse_args()
    if args.save_only:
        print(ensure_saved(args.cache_dir, config_for(args.gb, args.seed), args.device), flush=True)
        return 0
    import torch
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    state = State(args)
    if args.helper:
        state.helper = load_helper(state)
    from aiohttp import web

    def blocking(fn: Any, *a: Any) -> Any:
        return asyncio.get_running_loop().run_in_executor(None, fn, *a)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "pid": os.getpid(), "times": state.times,
                                  "loaded_with": state.loaded_with, "hook_port": state.hook_port,
                                  "helper": "criu_hooks.workload_helper" if state.helper is not None else
                                  ("built in" if args.helper else None)})

    async def generate(req: web.Request) -> web.Response:
        body = await req.json() if req.can_read_body else {}
        n = int(body.get("n", NEW_TOKENS))

        def run() -> list[int]:
            with state.request():
                return state.generate(n)
        return web.json_response({"tokens": await blocking(run)})

    async def digest(_: web.Request) -> web.Response:
        return web.json_response(await blocking(state.digest))

    async def dirty(req: web.Request) -> web.Response:
        return web.json_response({"bytes": await blocking(state.dirty, float(req.query.get("pct", "5")))})

    async def prepare(_: web.Request) -> web.Response:
        return web.json_response(await blocking(state.prepare))

    async def resume(_: web.Request) -> web.Response:
        return web.json_response(await blocking(state.resume))

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/generate", generate)
    app.router.add_get("/digest", digest)
    app.router.add_post("/kv/dirty", dirty)
    if args.helper:  # also where the helper serves its own port: the same steps, one answer shape
        app.router.add_post("/prepare", prepare)
        app.router.add_post("/resume", resume)

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None, handle_signals=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", args.port, reuse_address=True)
        await site.start()
        port = runner.addresses[0][1]
        state.hook_port = state.hook_port or port
        state.generate(1)  # the first request's one-time costs (kernels, caches) before "ready"
        if args.ready_file:
            tmp = f"{args.ready_file}.tmp"
            with open(tmp, "w") as f:
                f.write(f"{port}\n")
            os.rename(tmp, args.ready_file)
        print(f"serving on 127.0.0.1:{port} pid {os.getpid()} ({json.dumps(state.times)})", flush=True)
        while True:
            await asyncio.sleep(3600)

    asyncio.run(serve())
    return 0


def load_helper(state: State) -> Any:
    """criu_hooks.workload_helper's Gate where that module exists (the KV pool registered as discardable,
    its loopback endpoint started), else None: this module's own gate serves /prepare and /resume."""
    try:
        from criu_hooks import workload_helper  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return None
    gate = workload_helper.Gate()
    gate.discardable("kv_pool", lambda: state.kv, lambda t: setattr(state, "kv", t))
    _, state.hook_port = gate.serve(port=0)
    return gate


if __name__ == "__main__":
    sys.exit(main())
