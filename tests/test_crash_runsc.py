"""gpusnap killed (SIGKILL) or stopped (SIGTERM) at every stage of a runsc checkpoint or restore, with real
runsc: the sandbox runs on (restarted from the staged checkpoint where runsc had stopped it), or the
snapshot is committed and restores it; a runsc that hangs is timed out; nothing is left behind. The
stage inside runsc's checkpoint is reached through a runsc wrapper that waits after the real checkpoint."""
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
from support.runsc import U, env, lines, start_counter, wait_lines  # noqa: F401 - env is a fixture

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_root")]

RUNSC_WRAPPER = """\
#!/bin/sh
# runsc as usual, except that `checkpoint` waits after the real checkpoint until {pause} is removed
for a in "$@"; do
  if [ "$a" = checkpoint ]; then
    {real} "$@"; rc=$?
    echo $$ > {pause}.tmp && mv {pause}.tmp {pause}
    while [ -e {pause} ]; do sleep 0.05; done
    exit $rc
  fi
done
exec {real} "$@"
"""


def _counting(out: Path) -> list[int]:
    ls = lines(out)
    nums = [int(l[0]) for l in ls]
    assert nums == list(range(nums[0], nums[0] + len(nums))), "the counter must continue without a gap or a restart"
    assert len({l[1] for l in ls}) == 1, "in-memory data changed"
    return nums


@pytest.mark.parametrize("sig", SIGNALS, ids=["kill9", "term"])
@pytest.mark.parametrize("stage", STAGES)
def test_runsc_checkpoint_interrupted(stage: str, sig: int, tmp_path: Path, env: dict, cli: Cli, store_dir: Path) -> None:
    import shutil
    cid = U(f"k{STAGES.index(stage)}{sig}")
    bundle, out = start_counter(cli, env, cid)
    wrapper_dir = None
    if stage == "dumping":
        wrapper_dir = tmp_path / "bin"
        wrapper_dir.mkdir()
        w = wrapper_dir / "runsc"
        w.write_text(RUNSC_WRAPPER.format(real=shutil.which("runsc"), pause=tmp_path / "pause-dumping"))
        w.chmod(0o755)
    p = Paused(store_dir, ["runsc", "checkpoint", cid, "snap", *env["args"], "--runsc-arg=--network=none"], stage,
               tmp_path, str(wrapper_dir) if wrapper_dir else None)
    staging = p.record["staging"]
    r = p.stop(sig)
    expect_exit(sig, stage, r)
    if sig == signal.SIGKILL:
        rec = cli.json("recover")
        assert rec["ok"] and len(rec["operations"]) == 1, rec
    else:
        assert cli.json("recover")["operations"] == []
    assert_nothing_left(store_dir, staging)
    if stage == "after-commit":  # committed: the sandbox stays stopped, as asked, and the snapshot restores it
        before = lines(out)
        time.sleep(0.5)
        assert lines(out) == before
        out2 = tmp_path / "restored.out"
        cid2 = U(f"r{STAGES.index(stage)}{sig}")
        cli.json("runsc", "restore", "snap", cid2, "--bundle", str(bundle), "--output", str(out2))
        env["made"].append((cid2, env["args"]))
        after = wait_lines(out2, 3)
        assert int(after[0][0]) == int(before[-1][0]) + 1 and after[0][1] == before[-1][1]
    else:
        assert cli.json("store", "ls") == []
        n = len(lines(out))
        wait_lines(out, n + 3)  # running again (restarted from the staged checkpoint where it had stopped)
        _counting(out)


def test_hanging_runsc_is_timed_out_and_leaves_nothing(tmp_path: Path, env: dict) -> None:
    """A runsc whose `run` starts the sandbox for real and then hangs: after the timeout the command's
    group, the container and its sandbox and gofer processes (re-parented to init) are all gone."""
    import shutil
    from sandbox.runsc.runner import Runsc, RunscError
    root = env["args"][0].split("=", 2)[2]
    wrapper = tmp_path / "runsc"
    wrapper.write_text(f"#!/bin/sh\n{shutil.which('runsc')} \"$@\"\n"  # `run` hangs after starting the sandbox
                       'case " $* " in *" run "*) while :; do sleep 1; done;; esac\n')
    wrapper.chmod(0o755)
    cid = U("hang")
    bundle = tmp_path / "bundle"
    env["build"](str(bundle), [sys.executable, "-c", "import time; time.sleep(600)"])
    r = Runsc([f"--root={root}", "--platform=ptrace", "--network=none"], binary=str(wrapper), timeout=8)
    with open(tmp_path / "out", "ab") as f, pytest.raises(RunscError, match="did not finish within 8 s"):
        r.run(cid, str(bundle), stdout=f, stderr=f)
    assert processes_mentioning(str(wrapper)) == [], "the hung runsc command's group must be gone"
    assert processes_mentioning(root) == [], "runsc-sandbox and runsc-gofer must be gone"
    assert Runsc([f"--root={root}"]).state(cid) is None, "the container must be deleted"
    assert [n for n in os.listdir(root) if cid in n] == [], "no state or lock file of the container may be left"


@pytest.mark.parametrize("stage", ["before-restore", "after-restore"])
def test_runsc_restore_killed(stage: str, tmp_path: Path, env: dict, cli: Cli, store_dir: Path) -> None:
    """kill -9 of `runsc restore` before runsc runs (no sandbox; a new restore works) or after it (the
    restored sandbox runs on, counting from the checkpoint); recover removes the materialized images."""
    cid = U(f"rk{stage[0]}")
    bundle, out = start_counter(cli, env, cid)
    cli.json("runsc", "checkpoint", cid, "s", *env["args"], "--runsc-arg=--network=none")
    last = int(lines(out)[-1][0])
    cid2 = U(f"rr{stage[0]}")
    out2 = tmp_path / "restored.out"
    env["made"].append((cid2, env["args"]))
    p = Paused(store_dir, ["runsc", "restore", "s", cid2, "--bundle", str(bundle), "--output", str(out2)], stage, tmp_path)
    staging = p.record["staging"]
    assert p.stop(signal.SIGKILL).returncode == -signal.SIGKILL
    rec = cli.json("recover")
    assert rec["ok"] and rec["operations"][0]["kind"] == "runsc-restore", rec
    assert_nothing_left(store_dir, staging)
    if stage == "before-restore":
        assert not out2.exists() or lines(out2) == [], "no sandbox may have started"
        cli.json("runsc", "restore", "s", cid2, "--bundle", str(bundle), "--output", str(out2))
    after = wait_lines(out2, 3)
    assert int(after[0][0]) == last + 1
