"""`gpusnap recover` run twice at once, and again after: one of them finishes the interrupted dump,
the other finds nothing left or waits its turn; neither signals the workload twice, and the third run
finds nothing (issue 26, "not yet tried"). Real CRIU, a real process tree."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import GPUSNAP, REPO, Cli, pythonpath
from support.criu import Tree, healthy
from support.crash import Paused, assert_nothing_left

pytestmark = pytest.mark.root


@pytest.mark.parametrize("stage", ["dumping", "after-commit"])
def test_two_recovers_at_once_then_a_third(stage: str, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    store = tmp_path / "store"
    cli = Cli(store)
    tree = Tree(mb=16, detached=True)
    try:
        c0 = tree.report()["counter"]
        p = Paused(store, ["criu", "dump", str(tree.pid), "snap"], stage, tmp_path)
        staging = p.record["staging"]
        assert p.stop(signal.SIGKILL).returncode == -signal.SIGKILL
        env = {**os.environ, "PYTHONPATH": pythonpath()}
        both = [subprocess.Popen([*GPUSNAP, "--store", str(store), "recover", "--json"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) for _ in range(2)]
        outs = [(r.communicate(timeout=180), r.returncode) for r in both]
        done = []
        for (out, err), rc in outs:
            assert rc in (0, 1), (rc, err)
            assert "Traceback" not in err, err
            if rc == 0:
                done += json.loads(out)["operations"]
            else:
                assert len(err.splitlines()) == 1, err
        assert len(done) == 1, outs   # the operation was finished exactly once
        assert cli.json("recover")["operations"] == []
        assert_nothing_left(store, staging)
        if stage == "after-commit":
            assert cli.json("store", "verify", "snap")["ok"]
        else:
            assert cli.json("store", "ls") == []
            after = tree.report()
            assert healthy(after) and after["pid"] == tree.pid and after["counter"] >= c0, after
    finally:
        tree.kill()
