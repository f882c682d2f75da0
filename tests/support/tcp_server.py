"""A forking HTTP/1.1 server for CRIU tests: listens on each ADDR (127.0.0.1, ::1) given, forks one
worker per connection (keep-alive: a connection's requests are served by its worker until it closes).
Usage: tcp_server.py ADDR... DIR ; writes DIR/ready (JSON: pid and the port per address) atomically
(tmp + rename) once it listens. Each answer is `200` with a body `worker PID request N`."""
import json
import os
import select
import signal
import socket
import sys

addrs, d = sys.argv[1:-1], sys.argv[-1]
signal.signal(signal.SIGCHLD, lambda *_: None)  # reaped below; the handler makes select wake up


def serve(conn: socket.socket) -> None:
    n = 0
    f = conn.makefile("rb")
    while True:
        line = f.readline()
        if not line:
            os._exit(0)
        while True:  # the headers, up to the blank line
            h = f.readline()
            if not h or h in (b"\r\n", b"\n"):
                break
        n += 1
        body = f"worker {os.getpid()} request {n}\n".encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


listeners = []
for a in addrs:
    s = socket.socket(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((a, 0))
    s.listen(64)
    listeners.append(s)
tmp = os.path.join(d, "ready.tmp")
with open(tmp, "w") as f:
    json.dump({"pid": os.getpid(), "ports": {a: s.getsockname()[1] for a, s in zip(addrs, listeners)}}, f)
os.rename(tmp, os.path.join(d, "ready"))
while True:
    try:
        ready, _, _ = select.select(listeners, [], [], 1.0)
    except InterruptedError:
        ready = []
    for s in ready:
        try:
            conn, _ = s.accept()
        except OSError:
            continue
        if os.fork() == 0:
            for x in listeners:
                x.close()
            serve(conn)
        conn.close()
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
