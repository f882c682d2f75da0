"""The remote tier's test object store: the one-node Swift with its S3 API that
scripts/setup/swift-setup.sh starts on loopback, this run's bucket (RUN) and URLs in it, and a node (a
store with the remote `r` configured) that runs the real CLI against it; shared by the remote, delta,
docs, guide and second-hour tests."""
from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from conftest import GPUSNAP, REPO, Cli, pythonpath
from scripts.bench.bench_remote import CREDS, drop_bucket  # the same Swift account and clean-up as the benchmark

__all__ = ["CREDS", "RUN", "Node", "drop_bucket", "swift_start", "url_for"]

RUN = uuid.uuid4().hex[:8]


def swift_start(env: dict[str, str] | None = None) -> str:
    if os.geteuid() != 0:
        pytest.skip("starting Swift needs root")
    p = subprocess.run([str(REPO / "scripts" / "setup" / "swift-setup.sh"), "start"], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=600)
    if p.returncode != 0:
        pytest.fail(f"Swift did not start: {p.stderr[-2000:]}")
    return p.stdout.strip().splitlines()[-1]


class Node:
    """One node: its own store, the remote `r` at s3://BUCKET/PREFIX configured in it; ENV is added to
    every command it runs."""

    def __init__(self, store: Path, endpoint: str | None, url: str) -> None:
        self.cli = Cli(store)
        self.store = store
        self.env: dict[str, str] = {}
        self.cli.run("remote", "add", "r", url, *(["--endpoint", endpoint] if endpoint else []), env=CREDS)

    def run(self, *args: str, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return self.cli.run(*args, check=check, env={**CREDS, **self.env, **(env or {})})

    def json(self, *args: str, env: dict[str, str] | None = None) -> dict:
        return json.loads(self.run(*args, "--json", env=env).stdout)

    def popen(self, *args: str, env: dict[str, str]) -> subprocess.Popen[str]:
        e = {**os.environ, "PYTHONPATH": pythonpath(), **CREDS, **self.env, **env}
        return subprocess.Popen([*GPUSNAP, "--store", str(self.store), *args, "--json"], cwd=REPO, env=e,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def url_for(test: str) -> str:
    return f"s3://gpusnap-test-{RUN}/{test}"
