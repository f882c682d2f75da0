"""The docs say what is true: docs/COMMANDS.md is what `--help` says now; the README's worked examples
(a process, a container, an archive, a remote) run as written against a fresh store, with real CRIU,
Podman and Swift; every `gpusnap` command line shown in the README and the guide names commands and
options that exist. docs/GUIDE.md's commands themselves run in test_guide.py."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest

from conftest import REPO, pythonpath
from support.docs import GPUSNAP_FUNCTION, fenced_blocks, shell_env

DOCS = [REPO / "README.md", REPO / "docs" / "GUIDE.md"]


def test_command_reference_is_generated_and_current() -> None:
    p = subprocess.run([sys.executable, "-m", "scripts.docs.gen_commands"], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": pythonpath()}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (REPO / "docs" / "COMMANDS.md").read_text() == p.stdout, \
        "docs/COMMANDS.md is out of date: python3 -m scripts.docs.gen_commands > docs/COMMANDS.md"
    for must in ("## `gpusnap store ls`", "## `gpusnap store tag`", "## `gpusnap remote forget`"):
        assert must in p.stdout


def _commands_shown() -> list[tuple[Path, str]]:
    found = []
    for doc in DOCS:
        for block in fenced_blocks(doc.read_text()):
            joined = block.body.replace("\\\n", " ")
            for line in joined.splitlines():
                line = line.strip()
                if line.startswith("gpusnap "):
                    found.append((doc, line))
    return found


def _resolve(tokens: list[str]) -> tuple[click.Command, list[click.Command], list[str]]:
    from cli import main
    cmd: click.Command = main
    chain: list[click.Command] = [main]
    i = 0
    rest: list[str] = []
    while i < len(tokens):
        t = tokens[i]
        if t in ("--store",):
            i += 2
            continue
        if t.startswith("-") and t != "-":
            rest.append(t)
        elif isinstance(cmd, click.Group):
            name = t.split("|")[0]
            sub = cmd.get_command(click.Context(cmd), name)
            if sub is None:
                raise AssertionError(f"no command {name!r} under {cmd.name!r}")
            cmd = sub
            chain.append(sub)
        i += 1
    return cmd, chain, rest


def test_every_command_line_in_the_docs_exists() -> None:
    shown = _commands_shown()
    assert len(shown) > 40
    for doc, line in shown:
        first = re.split(r"\s(?:#|\|(?!\w)|;|&&|>)\s?", line + " ")[0]
        tokens = [t.strip("[]") for t in first.replace("...", "").split()[1:]]
        tokens = [t for t in tokens if t]
        cmd, chain, opts = _resolve(tokens)
        known = {o for c in chain for p in c.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
        for o in opts:
            name = o.split("=")[0]
            assert name in known, f"{doc.name}: `{line}`: {name} is not an option of `{' '.join(c.name or '' for c in chain)}`"


def _run_block(name: str, tmp: Path, extra_env: dict[str, str] | None = None,
               replace: dict[str, str] | None = None, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    body = {b.name: b.body for b in fenced_blocks((REPO / "README.md").read_text())}[name]
    body = body.replace("/tmp/", f"{tmp}/")
    for a, b in (replace or {}).items():
        body = body.replace(a, b)
    script = "set -euo pipefail\n" + GPUSNAP_FUNCTION + body
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=REPO,
                          env=shell_env(tmp / "store", extra_env), timeout=timeout)


def test_readme_archive_example_runs(tmp_path: Path) -> None:
    for _ in range(2):  # and runs again as it is (the README says so): new names, `latest`, a new restore
        p = _run_block("archive", tmp_path)
        assert p.returncode == 0, p.stderr
        assert '{"layers": 32}' in p.stdout and "data/models/weights.bin" in p.stdout
        assert (tmp_path / "restored" / "data" / "models" / "config.json").exists()
        names = [ln.split()[0] for ln in p.stdout.splitlines() if ln.startswith("data-")]
        assert names and all(n.startswith("data-20") for n in names), p.stdout


def test_readme_process_example_runs(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    try:
        p = _run_block("process", tmp_path)
        assert p.returncode == 0, p.stderr
        assert int(p.stdout.strip().splitlines()[-1]) > 5, p.stdout
        # and the restored process keeps counting (a frozen one would show its last count forever)
        before = int((tmp_path / "counter.txt").read_text())
        deadline = time.monotonic() + 10
        while int((tmp_path / "counter.txt").read_text()) <= before:
            assert time.monotonic() < deadline, f"the restored counter stopped at {before}"
            time.sleep(0.1)
    finally:
        pid_file = tmp_path / "counter.pid"
        if pid_file.exists():
            subprocess.run(["kill", "-9", pid_file.read_text().strip()], capture_output=True)


def test_readme_container_example_runs(tmp_path: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("podman") or not shutil.which("runc"):
        pytest.skip("needs root, Podman and runc")
    name = f"gsdoc-{os.getpid()}"
    try:
        p = _run_block("container", tmp_path, replace={"counter": name})
        assert p.returncode == 0, p.stderr
        assert int(p.stdout.strip().splitlines()[-1]) > 5, p.stdout
    finally:
        subprocess.run(["podman", "--runtime", "runc", "rm", "-f", name], capture_output=True)


def test_readme_remote_example_runs(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("starting Swift needs root")
    from support.swift import drop_bucket, swift_start
    endpoint = swift_start()
    bucket = f"gpusnap-demo-{os.getpid()}"
    try:
        p = _run_block("remote", tmp_path, replace={"gpusnap-demo": bucket})
        assert p.returncode == 0, p.stderr
        assert (tmp_path / "payload-on-B" / "payload" / "blob").read_bytes() == (tmp_path / "payload" / "blob").read_bytes()
    finally:
        drop_bucket(endpoint, bucket)


def test_readme_remote_example_runs_with_a_file_remote(tmp_path: Path) -> None:
    """The README's file:// block, and its S3 block with the remote swapped for a file:// one."""
    p = _run_block("remote_file", tmp_path)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "payload-on-B" / "payload" / "blob").read_bytes() == (tmp_path / "payload" / "blob").read_bytes()
    assert (tmp_path / "shared" / "fleet" / "gpusnap-remote.json").exists()
    other = tmp_path / "s3-block"
    other.mkdir()
    p = _run_block("remote", other, replace={"s3://gpusnap-demo/fleet --endpoint http://127.0.0.1:18480":
                                             f"file://{other}/shared/fleet",
                                             "scripts/setup/swift-setup.sh start": "true"})
    assert p.returncode == 0, p.stderr
    assert (other / "payload-on-B" / "payload" / "blob").read_bytes() == (other / "payload" / "blob").read_bytes()
    assert (other / "shared" / "fleet" / "snapshots" / "payload.json").exists()


def test_readme_swap_example_runs(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("swap serve with mode = \"criu\" needs root")
    import socket
    ports = {}
    for port in ("8400", "8401", "8402"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports[port] = str(s.getsockname()[1])
    try:
        p = _run_block("swap", tmp_path, replace=ports, timeout=300)
        assert p.returncode == 0, p.stderr + (tmp_path / "swap" / "daemon.log").read_text()
        assert p.stdout.splitlines()[:3] == ["model a", "model b", "model a"], p.stdout
        assert "resident 1/1" in p.stdout and "swapped-out" in p.stdout, p.stdout
        log = (tmp_path / "swap" / "daemon.log").read_text()
        assert "out a (criu dump)" in log and "in a (criu restore)" in log and "stopped" in log, log
    finally:
        left = []
        for n in os.listdir("/proc"):
            try:
                if n.isdigit() and str(tmp_path).encode() in Path(f"/proc/{n}/cmdline").read_bytes():
                    left.append(int(n))
                    os.kill(int(n), 9)
            except OSError:
                pass
    assert not left, f"processes the example started outlived it: {left}"
