"""A transformers model server for scripts/bench/bench_swap.py: loads a saved (random-init, Llama-shaped)
model with from_pretrained onto DEVICE in bfloat16 and serves it over HTTP with aiohttp.
Endpoints: /health; /ping (no model work: the proxy's own cost); /generate (greedy decoding of a fixed
prompt, 8 new tokens: the token ids); /digest (a checksum of every weight, computed on the device now).
Usage: python3 swap_model_server.py MODEL_DIR PORT DEVICE"""
from __future__ import annotations

import sys

import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

MODEL_DIR, PORT, DEVICE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
PROMPT = [1, 306, 4658, 278, 6368, 338, 263, 1243]
CHUNK = 1 << 24

try:
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, device_map=DEVICE, torch_dtype=torch.bfloat16)
except ValueError as e:   # device_map needs `accelerate`: where it is missing, loaded then moved
    if "accelerate" not in str(e):
        raise
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, torch_dtype=torch.bfloat16).to(DEVICE)
model.eval()
PROMPT = [t % model.config.vocab_size for t in PROMPT]


def digest() -> str:
    """Every weight as int16, summed plain and position-weighted (int64, on the device), over all tensors in
    name order: any changed bit changes it."""
    w = (torch.arange(CHUNK, device=DEVICE, dtype=torch.int64) % 65521) + 1
    total_a, total_b = 0, 0
    for i, (name, p) in enumerate(sorted(model.state_dict().items())):
        flat = p.detach().reshape(-1).contiguous().view(torch.int16)
        for off in range(0, flat.numel(), CHUNK):
            x = flat[off:off + CHUNK].to(torch.int64)
            total_a = (total_a + int(x.sum().item()) * (i + 1)) % (1 << 61)
            total_b = (total_b + int((x * w[:x.numel()]).sum().item())) % (1 << 61)
    return f"{total_a:x}-{total_b:x}"


async def health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def ping(_: web.Request) -> web.Response:
    return web.Response(text="pong")


async def generate(_: web.Request) -> web.Response:
    with torch.no_grad():
        ids = torch.tensor([PROMPT], device=DEVICE)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=0)
    return web.json_response({"tokens": out[0].tolist()})


async def get_digest(_: web.Request) -> web.Response:
    with torch.no_grad():
        return web.json_response({"digest": digest()})


app = web.Application()
app.add_routes([web.get("/health", health), web.get("/ping", ping), web.get("/generate", generate),
                web.post("/generate", generate), web.get("/digest", get_digest)])
web.run_app(app, host="127.0.0.1", port=PORT, print=None, handle_signals=True)
