"""runsc test support: run-unique container ids and subnets, the counter and server workloads, the
`env` fixture (a fresh short runsc root, sandboxes made are deleted after), and reading a sandbox's
output (shared by the runsc, crash and trust tests)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import pytest

from conftest import Cli


def require_runsc() -> None:
    """Skip without root; fail (CI must not skip these) without runsc."""
    if os.geteuid() != 0:
        pytest.skip("runsc and namespaces need root")
    if not shutil.which("runsc"):
        pytest.fail("runsc not installed: run scripts/setup.sh (CI must not skip these)")


# The sandboxes see the host's / read-only with a fresh tmpfs on /tmp, so the venv (maybe under /tmp in
# a CI checkout) is hidden: run the base interpreter, which needs nothing from the venv.
PY = os.path.realpath(sys.executable)


def U(cid: str) -> str:
    """Container ids unique to this run: runsc's control sockets are host-global (@runsc-sandbox.ID)."""
    return f"{cid}-{os.getpid() % 100000}"


def SUBNET(n: int) -> str:
    """A /24 unique to this run (and to N): the host side of each veth takes an address in it."""
    return f"10.{100 + os.getpid() % 150}.{n}.0/24"

COUNTER = ("import os,sys,time,hashlib,random\n"
           "d=bytearray(random.Random(7).randbytes(4<<20))+bytearray(4<<20)\n"
           "h=hashlib.sha256(d).hexdigest()[:12]\nn=0\n"
           "while True:\n n+=1\n print(n,h,flush=True)\n time.sleep(0.1)\n")
SERVER = ("import socket,os\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
          "s.bind(('0.0.0.0',8080));s.listen()\n"
          "while True:\n c,_=s.accept();c.sendall(b'hello from the sandbox');c.close()\n")


@pytest.fixture
def env(tmp_path: Path):
    from sandbox.runsc.oci_bundle import build_bundle
    import tempfile
    # short: this runsc derives abstract socket names from the root path and truncates long ones,
    # which makes two sandboxes' control sockets collide
    root = Path(tempfile.mkdtemp(prefix="rs", dir="/tmp"))
    args = [f"--runsc-arg=--root={root}", "--runsc-arg=--platform=ptrace"]
    made: list[tuple[str, list[str]]] = []
    yield {"tmp": tmp_path, "args": args, "made": made, "build": build_bundle}
    from sandbox.host.netns import NetConfig, remove
    for cid, a in made:
        subprocess.run(["runsc", f"--root={root}", "delete", "-force", cid], capture_output=True)
    for cid, n in (("e1", 41), ("n1", 42), ("h1", 43)):
        remove(NetConfig.for_sandbox("gpusnap-" + U(cid), SUBNET(n)))  # whatever a failed test left
    from sandbox.runsc.records import forget_root
    forget_root(str(root))
    shutil.rmtree(root, ignore_errors=True)


def lines(path: Path) -> list[list[str]]:
    return [l.split() for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def wait_lines(path: Path, n: int, timeout: float = 30) -> list[list[str]]:
    deadline = time.monotonic() + timeout
    while len(lines(path)) < n:
        assert time.monotonic() < deadline, f"{path} has {len(lines(path))} lines"
        time.sleep(0.05)
    return lines(path)


def start_counter(cli: Cli, env: dict, cid: str, extra: Sequence[str] = ()) -> tuple[Path, Path]:
    bundle = env["tmp"] / f"bundle-{cid}"
    env["build"](str(bundle), [PY, "-c", COUNTER])
    out = env["tmp"] / f"{cid}.out"
    cli.run("runsc", "run", cid, "--bundle", str(bundle), "--output", str(out), *env["args"],
            "--runsc-arg=--network=none", *extra)
    env["made"].append((cid, env["args"]))
    wait_lines(out, 5)
    return bundle, out
