"""A small real transformers server for the workload-helper tests: a Llama-shaped model (random init, saved
to safetensors and loaded back with from_pretrained) answering greedy generations over HTTP, with a
vLLM-like paged KV pool that the workload helper may drop (criu_hooks/workload_helper.py, imported as a
user would: the file put next to the server, on sys.path by itself).

    python llama_server.py --make MODEL_DIR            # write the model (seeded), then exit
    python llama_server.py MODEL_DIR CONTROL_DIR [cuda]  # serve; CONTROL_DIR/ready gets
                                                         # {"pid", "port", "hook_port"}

GET /generate?ids=1,2,3&n=8 -> {"tokens": [...]} (greedy, under the helper's gate; writes blocks of the
KV pool as a real server would, and the answer does not depend on what the pool held);
GET /digest -> {"weights": sha256 of every parameter's bytes, "kv_pool": shape or null};
the helper's endpoint: POST /prepare, /resume on hook_port."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

KV_BLOCKS, KV_BLOCK = 64, 4096   # 64 blocks of 4096 floats: 1 MiB of pool


def make(model_dir: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(cfg).save_pretrained(model_dir, safe_serialization=True)


def weights_digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Server:
    def __init__(self, model_dir: str, device: str) -> None:
        from transformers import LlamaForCausalLM
        self.device = device
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        self.kv_pool: torch.Tensor | None = torch.zeros(KV_BLOCKS, KV_BLOCK, device=device)
        self.lock = threading.Lock()
        self.served = 0

    def generate(self, ids: list[int], n: int) -> list[int]:
        with self.lock, torch.no_grad():
            assert self.kv_pool is not None, "a request ran while the KV pool was dropped"
            x = torch.tensor([ids], device=self.device)
            out = self.model.generate(x, max_new_tokens=n, do_sample=False, pad_token_id=0,
                                      attention_mask=torch.ones_like(x))
            toks = [int(t) for t in out[0, len(ids):]]
            # like a paged KV cache: this request's blocks written (a cache: answers never read it back)
            self.kv_pool[self.served % KV_BLOCKS].fill_(float(sum(toks)))
            self.served += 1
            return toks


def main() -> None:
    if sys.argv[1] == "--make":
        make(sys.argv[2])
        return
    model_dir, ctl = sys.argv[1], Path(sys.argv[-1])
    device = sys.argv[2] if len(sys.argv) > 3 else "cpu"
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "criu_hooks"))  # the file, as a user copies it
    if TYPE_CHECKING:  # the same file, found by its package
        from criu_hooks import workload_helper
    else:
        import workload_helper
    srv = Server(model_dir, device)
    gate = workload_helper.Gate(drain_timeout_s=20)
    gate.discardable("kv_pool", lambda: srv.kv_pool, lambda t: setattr(srv, "kv_pool", t))

    @gate.guarded
    def generate(ids: list[int], n: int) -> list[int]:
        return srv.generate(ids, n)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            u = urlsplit(self.path)
            q = parse_qs(u.query)
            if u.path == "/generate":
                body: dict[str, Any] = {"tokens": generate([int(i) for i in q["ids"][0].split(",")],
                                                           int(q.get("n", ["8"])[0]))}
            elif u.path == "/digest":
                body = {"weights": weights_digest(srv.model),
                        "kv_pool": list(srv.kv_pool.shape) if srv.kv_pool is not None else None,
                        "kv_pool_device": str(srv.kv_pool.device) if srv.kv_pool is not None else None}
            else:
                self.send_error(404)
                return
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    _, hook_port = gate.serve("127.0.0.1", 0)
    (ctl / "ready.tmp").write_text(json.dumps({"pid": os.getpid(), "port": httpd.server_address[1],
                                               "hook_port": hook_port}))
    os.rename(ctl / "ready.tmp", ctl / "ready")
    httpd.serve_forever()


if __name__ == "__main__":
    main()
