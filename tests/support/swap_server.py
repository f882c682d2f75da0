"""A small HTTP/1.1 model-server stand-in for `gpusnap swap` tests (stdlib only; CRIU dumps and restores it).
Usage: swap_server.py NAME PORT. Endpoints: /health; /hello (name, pid, a counter kept in memory);
/chunked (a chunked answer, chunk by chunk); /sse (server-sent events until EOF); POST /echo (the body
back); /slow?s=SECONDS; /crash (exits 3); /order?seq=K (recorded in accept order) and /orders."""
import json
import os
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

NAME, PORT = sys.argv[1], int(sys.argv[2])
state = {"n": 0, "accepted": 0}
orders: list[list[int]] = []
accept_of: dict[object, int] = {}
lock = threading.Lock()


class Server(ThreadingHTTPServer):
    daemon_threads = True

    def process_request(self, request, client_address):
        with lock:
            state["accepted"] += 1
            accept_of[request] = state["accepted"]
        super().process_request(request, client_address)


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        u = urlparse(self.path)
        q = parse_qs(u.query)
        if u.path == "/health":
            self._send(200, b"ok\n", "text/plain")
        elif u.path == "/hello":
            with lock:
                state["n"] += 1
                n = state["n"]
            self._send(200, json.dumps({"name": NAME, "pid": os.getpid(), "n": n, "path": self.path}).encode())
        elif u.path == "/chunked":
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(5):
                data = f"{NAME} chunk {i}\n".encode()
                self.wfile.write(b"%x;ext=%d\r\n%s\r\n" % (len(data), i, data))
                self.wfile.flush()
                time.sleep(0.02)
            self.wfile.write(b"0\r\nX-Trailer: done\r\n\r\n")
        elif u.path == "/sse":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            for i in range(int(q.get("n", ["4"])[0])):
                self.wfile.write(f"id: {i}\nevent: tick\ndata: {NAME} {i}\n\n".encode())
                self.wfile.flush()
                time.sleep(float(q.get("gap", ["0.05"])[0]))
            self.close_connection = True
        elif u.path == "/slow":
            time.sleep(float(q.get("s", ["1"])[0]))
            self._send(200, json.dumps({"name": NAME, "slept": True}).encode())
        elif u.path == "/crash":
            os._exit(3)
        elif u.path == "/order":
            with lock:
                orders.append([accept_of.get(self.request, 0), int(q["seq"][0])])
            self._send(200, b"{}")
        elif u.path == "/orders":
            with lock:
                self._send(200, json.dumps(sorted(orders)).encode())
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0], 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                body += self.rfile.read(size)
                self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._send(200, json.dumps({"name": NAME, "path": self.path, "body": body.decode()}).encode())


socketserver.TCPServer.allow_reuse_address = True
Server(("127.0.0.1", PORT), H).serve_forever()
