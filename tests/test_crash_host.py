"""Host settings a killed gpusnap leaves switched are put back: transparent huge pages (the record of the
value before, kept while the block runs, put back by `gpusnap recover` after a kill)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, REPO, Cli, pythonpath
from support.crash import SIGNALS, STAGES, Paused, assert_nothing_left, expect_exit, processes_mentioning, wait_dead

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_root")]


def test_thp_put_back_after_kill(tmp_path: Path) -> None:
    """thp() records the value before switching; a kill -9 inside the block leaves the record, and
    `gpusnap recover` puts the value back and removes it (a file stands in for the sysfs setting)."""
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    rundir = tmp_path / "run"
    ready = tmp_path / "ready"
    prog = textwrap.dedent(f"""
        import os, time
        from sandbox.host.hugepages import thp
        with thp("always", path={str(setting)!r}, record_dir={str(rundir)!r}):
            open({str(ready)!r}, "w").close()
            time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", prog], env={**os.environ, "PYTHONPATH": pythonpath()})
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.02)
    assert setting.read_text() == "always"
    assert len(list(rundir.iterdir())) == 1
    p.kill()
    p.wait()
    cli = Cli(tmp_path / "store")
    cli.run("store", "init")  # makes the store
    rep = json.loads(cli.run("recover", "--json", env={"GPUSNAP_RUN_DIR": str(rundir)}).stdout)
    assert rep["thp_put_back"] == [{"path": str(setting), "value": "madvise"}]
    # the THP record is gone; recover keeps its own per-operation state directory (ops/) in the same run dir
    assert setting.read_text() == "madvise" and [e.name for e in rundir.iterdir() if e.name != "ops"] == []


def test_thp_record_removed_after_a_normal_block(tmp_path: Path) -> None:
    from sandbox.host.hugepages import put_back, thp
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    with thp("always", path=str(setting), record_dir=str(tmp_path / "run")):
        assert setting.read_text() == "always"
        assert put_back(str(tmp_path / "run")) == [], "a live owner's record is not touched"
    assert setting.read_text() == "madvise" and list((tmp_path / "run").iterdir()) == []
