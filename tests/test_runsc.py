"""gVisor integration against the real runsc (Debian's 20221219 build with the ptrace platform) and
real network namespaces made with pyroute2. This runsc checkpoints only --network=none sandboxes
(docs/PLATFORM.md). Every name a test makes (runsc root, container ids, netns, veth, subnet) is unique
to the run, so two suites on one machine do not collide."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO, cast

import pytest

from conftest import REPO, Cli, chunk_files
from support.runsc import (COUNTER, PY, SERVER, SUBNET, U, env, lines, start_counter,  # noqa: F401
                           wait_lines)  # env is a fixture

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_runsc")]


def test_counter_continues_after_restore_under_a_new_id(cli: Cli, env: dict) -> None:
    bundle, out1 = start_counter(cli, env, U("c1"))
    rep = cli.json("runsc", "checkpoint", U("c1"), "s1", *env["args"], "--runsc-arg=--network=none")
    assert rep["raw_bytes"] > 0
    before = lines(out1)
    time.sleep(0.5)
    assert lines(out1) == before, "the sandbox must be stopped after a checkpoint without --leave-running"
    last, digest = int(before[-1][0]), before[-1][1]
    out2 = env["tmp"] / (U("c2") + ".out")
    cli.json("runsc", "restore", "s1", U("c2"), "--bundle", str(bundle), "--output", str(out2))  # flags from the snapshot
    env["made"].append((U("c2"), env["args"]))
    after = wait_lines(out2, 3)
    assert int(after[0][0]) == last + 1, (last, after[:3])
    assert {l[1] for l in after} == {digest}, "in-memory data changed across the restore"


def test_leave_running(cli: Cli, env: dict) -> None:
    _, out = start_counter(cli, env, U("lr"))
    before = lines(out)
    cli.json("runsc", "checkpoint", "--leave-running", U("lr"), "a", *env["args"], "--runsc-arg=--network=none")
    after = wait_lines(out, len(before) + 5)  # still counting, in the same output
    nums = [int(l[0]) for l in after[len(before) - 1:]]
    assert nums == sorted(nums) and len({l[1] for l in after}) == 1
    assert cli.json("store", "verify", "a")["ok"]


def test_second_checkpoint_dedups(cli: Cli, env: dict) -> None:
    from sandbox.runsc.runner import Runsc
    if not Runsc().features().can_store_uncompressed:
        pytest.skip("this runsc always compresses checkpoint.img (no -compression flag: Debian's 20221219 "
                    "build), so no two images share bytes; dedup needs a runsc with -compression=none")
    _, out = start_counter(cli, env, U("dd"))
    a = cli.json("runsc", "checkpoint", "--leave-running", U("dd"), "a", *env["args"], "--runsc-arg=--network=none")
    b = cli.json("runsc", "checkpoint", "--leave-running", U("dd"), "b", *env["args"], "--runsc-arg=--network=none")
    assert b["new_bytes"] <= 0.15 * a["new_bytes"], (a, b)


def test_errors_leave_nothing_behind(cli: Cli, env: dict, store_dir: Path) -> None:
    from sandbox.host.netns import NetConfig, leftovers
    p = cli.run("runsc", "checkpoint", "ghost", "x", *env["args"], check=False)
    assert p.returncode == 1 and "no container 'ghost'" in p.stderr and len(p.stderr.splitlines()) == 1
    bundle, _ = start_counter(cli, env, U("e1"), ["--net-subnet", SUBNET(41)])
    net = NetConfig.for_sandbox("gpusnap-" + U("e1"), SUBNET(41))
    cli.json("runsc", "checkpoint", "--leave-running", U("e1"), "snap", *env["args"], "--runsc-arg=--network=none")
    p = cli.run("runsc", "restore", "snap", U("e1"), "--bundle", str(bundle), check=False)
    assert p.returncode == 1 and "already exists" in p.stderr
    victim = max(chunk_files(store_dir), key=lambda q: q.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[4096 + 10] ^= 0xFF
    victim.write_bytes(bytes(data))
    cli.run("runsc", "delete", U("e1"), *env["args"], "--runsc-arg=--network=none")
    assert leftovers(net) == []
    p = cli.run("runsc", "restore", "snap", U("e9"), "--bundle", str(bundle), check=False)
    assert p.returncode == 3 and "damaged" in p.stderr and len(p.stderr.splitlines()) == 1
    root = env["args"][0].split("=", 2)[2]
    st = subprocess.run(["runsc", f"--root={root}", "state", U("e9")], capture_output=True)
    assert st.returncode != 0, "no sandbox may be left from a failed restore"
    assert leftovers(net) == [], "no namespace or veth may be left from a failed restore"


def test_network_config_saved_and_recreated_at_the_same_address(cli: Cli, env: dict) -> None:
    from sandbox.host.netns import NetConfig, enter, leftovers
    bundle, out = start_counter(cli, env, U("n1"), ["--net-subnet", SUBNET(42)])
    net = NetConfig.for_sandbox("gpusnap-" + U("n1"), SUBNET(42))
    rep = cli.json("runsc", "checkpoint", U("n1"), "net1", *env["args"], "--runsc-arg=--network=none")
    assert rep["address"] == net.address
    assert cli.json("store", "inspect", "net1")["meta"]["net"]["ns_cidr"] == net.ns_cidr
    cli.run("runsc", "delete", U("n1"), *env["args"], "--runsc-arg=--network=none")
    assert leftovers(net) == []  # torn down
    out2 = env["tmp"] / (U("n2") + ".out")
    r = cli.json("runsc", "restore", "net1", U("n2"), "--bundle", str(bundle), "--output", str(out2))
    env["made"].append((U("n2"), env["args"]))
    assert r["address"] == net.address and leftovers(net)  # recreated
    wait_lines(out2, 2)
    srv = subprocess.Popen([PY, "-c", SERVER], preexec_fn=lambda: enter(net.name))
    try:
        assert _ask(net.address) == b"hello from the sandbox"
    finally:
        srv.kill()
        srv.wait()
    cli.run("runsc", "delete", U("n2"), *env["args"], "--runsc-arg=--network=none")
    assert leftovers(net) == []


def _ask(addr: str, timeout: float = 20) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, 8080), timeout=2) as s:
                return s.recv(100)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_hostinet_sandbox_serves_tcp_and_refuses_checkpoint_cleanly(cli: Cli, env: dict) -> None:
    from sandbox.host.netns import NetConfig, leftovers
    bundle = env["tmp"] / ("bundle-" + U("h1"))
    env["build"](str(bundle), [PY, "-c", SERVER])
    net = NetConfig.for_sandbox("gpusnap-" + U("h1"), SUBNET(43))
    args = [*env["args"], "--runsc-arg=--network=host"]
    cli.run("runsc", "run", U("h1"), "--bundle", str(bundle), "--net-subnet", SUBNET(43),
            "--output", str(env["tmp"] / (U("h1") + ".out")), *args)
    env["made"].append((U("h1"), env["args"]))
    assert _ask(net.address) == b"hello from the sandbox"
    p = cli.run("runsc", "checkpoint", U("h1"), "hx", *args, check=False)
    assert p.returncode == 1 and "host network" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    assert _ask(net.address) == b"hello from the sandbox", "the sandbox must keep running"
    assert cli.json("store", "ls") == []
    cli.run("runsc", "delete", U("h1"), *args)
    assert leftovers(net) == []


def test_netstack_checkpoint_where_runsc_supports_it(env: dict) -> None:
    """The full network flow needs a runsc whose own netstack runs here and checkpoints (Debian's
    20221219 build fails with --network=sandbox on this kernel: docs/PLATFORM.md). Probed, not assumed."""
    from sandbox.runsc.oci_bundle import build_bundle
    root = env["tmp"] / "probe-root"
    bundle = build_bundle(str(env["tmp"] / "probe"), ["/bin/true"])
    p = subprocess.run(["runsc", f"--root={root}", "--platform=ptrace", "--network=sandbox", "run", "-bundle",
                        bundle, U("probe")], capture_output=True, text=True, timeout=60)
    subprocess.run(["runsc", f"--root={root}", "delete", "-force", U("probe")], capture_output=True)
    if p.returncode != 0:
        pytest.skip(f"this runsc cannot run its netstack here: {p.stderr.strip().splitlines()[-1][:120]}")
    pytest.fail("this runsc runs its netstack here: extend this test to checkpoint/restore a serving sandbox")


def test_feature_detection_from_runsc_help() -> None:
    from sandbox.runsc.runner import Runsc, parse_features
    f = Runsc().features()
    assert "ptrace" in f.platforms and f.can_leave_running and not f.nvproxy
    assert "compression" not in f.checkpoint_flags  # Debian's build predates it
    newer_global = ("  -nvproxy\n    \tEXPERIMENTAL: enable support for Nvidia GPUs\n"
                    "  -platform string\n    \tspecifies which platform to use: systrap, ptrace, kvm (default \"systrap\")\n")
    newer_ckpt = ("  -compression value\n  -direct\n  -exclude-committed-zero-pages\n  -image-path string\n"
                  "  -leave-running\n")
    g = parse_features("runsc version release-20250101.0\n", newer_global, newer_ckpt)
    assert g.nvproxy and g.platforms == ("systrap", "ptrace", "kvm") and g.version == "release-20250101.0"
    assert {"compression", "direct", "exclude-committed-zero-pages", "leave-running"} <= set(g.checkpoint_flags)


def test_gpu_sandbox_refused_by_a_runsc_without_nvproxy(cli: Cli, env: dict) -> None:
    """`--gpus` with this runsc (no nvproxy): one line saying so, the bundle untouched, no sandbox."""
    bundle = env["tmp"] / "bundle-g0"
    env["build"](str(bundle), [PY, "-c", COUNTER])
    spec = (bundle / "config.json").read_text()
    p = cli.run("runsc", "run", U("g0"), "--bundle", str(bundle), "--gpus", "0", *env["args"],
                "--runsc-arg=--network=none", check=False)
    assert p.returncode == 1 and "no nvproxy" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    assert (bundle / "config.json").read_text() == spec and sorted(os.listdir(bundle)) == ["config.json"]
    root = env["args"][0].split("=", 2)[2]
    assert subprocess.run(["runsc", f"--root={root}", "state", U("g0")], capture_output=True).returncode != 0


def test_gpu_agent_runs_inside_the_sandbox_around_checkpoint_and_restore(cli: Cli, env: dict) -> None:
    """A sandbox started with --gpu-agent (gpusnap's code bind-mounted, the store not; no GPU here):
    checkpoint runs the agent inside through `runsc exec` before `runsc checkpoint`; it sees the
    sandbox's own processes (pid 1 is the counter), finds no CUDA process, and the flow goes on; the
    restored sandbox (new id, a fresh bundle prepared the same way) continues counting."""
    bundle, out1 = start_counter(cli, env, U("ga"), ["--gpu-agent"])
    spec = json.loads((bundle / "config.json").read_text())
    binds = {m["destination"]: m["source"] for m in spec["mounts"] if m.get("type") == "bind"}
    assert binds == {"/run/gpusnap/code": str(REPO)}
    agent_env = {"GPUSNAP_AGENT_PYTHON": PY}
    r = cli.run("runsc", "checkpoint", U("ga"), "gs", *env["args"], "--runsc-arg=--network=none", "--json", env=agent_env)
    rep = json.loads(r.stdout)
    assert "gpu_checkpoint" in rep["seconds"]
    meta = cli.json("store", "inspect", "gs")["meta"]
    agent = meta["gpu"]["agent_report"]
    assert agent["action"] == "checkpoint" and agent["cuda_pids"] == [] and agent["path"] is None
    assert agent["init"] == [PY, "-c"], agent  # it ran inside: pid 1 there is the sandbox's counter
    last = int(lines(out1)[-1][0])
    fresh = env["tmp"] / "bundle-gb"
    env["build"](str(fresh), [PY, "-c", COUNTER])
    out2 = env["tmp"] / (U("gb") + ".out")
    cli.run("runsc", "restore", "gs", U("gb"), "--bundle", str(fresh), "--output", str(out2), env=agent_env)
    env["made"].append((U("gb"), env["args"]))
    assert int(wait_lines(out2, 2)[0][0]) == last + 1
    restored = json.loads((fresh / "config.json").read_text())
    assert any(m.get("destination") == "/run/gpusnap/code" for m in restored["mounts"])


def test_gpu_agent_failure_leaves_the_sandbox_running(cli: Cli, env: dict) -> None:
    """The GPU agent cannot run inside (its interpreter is missing): checkpoint fails in one line
    naming the agent, no snapshot appears, and the sandbox keeps counting."""
    _, out = start_counter(cli, env, U("gf"), ["--gpu-agent"])
    p = cli.run("runsc", "checkpoint", U("gf"), "nope", *env["args"], "--runsc-arg=--network=none", check=False,
                env={"GPUSNAP_AGENT_PYTHON": "/nonexistent/python3"})
    assert p.returncode == 1 and "GPU agent" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    assert cli.json("store", "ls") == []
    n = len(lines(out))
    wait_lines(out, n + 3)


def test_gpu_sandbox_cannot_see_the_store(cli: Cli, env: dict) -> None:
    """From inside a real GPU-agent sandbox: the former store mount point is gone, nothing under /run
    shows the store (a marker file planted in it is found nowhere), only gpusnap's code is mounted."""
    cli.run("store", "init")  # the store exists
    marker = f"marker-{os.getpid()}-{time.monotonic_ns()}"
    (cli.store / marker).write_text("secret")
    start_counter(cli, env, U("gn"), ["--gpu-agent"])
    # (the sandbox's root here is the host's / read-only, so an empty /run/gpusnap/store directory
    # left on the host by an earlier sandbox may show: what matters is that nothing is mounted there)
    probe = ("import json,os,sys\n"
             "mounts=[l.split()[4] for l in open('/proc/self/mountinfo')]\n"
             "st='/run/gpusnap/store'\n"
             "found=[os.path.join(d,f) for d,_,fs in os.walk('/run') for f in fs if f==sys.argv[1]]\n"
             "print(json.dumps({'mounted': [m for m in mounts if m.startswith('/run/gpusnap')],"
             " 'store_listing': sorted(os.listdir(st)) if os.path.isdir(st) else [],"
             " 'store_path': os.path.exists(sys.argv[2]), 'found': found}))\n")
    root = env["args"][0].split("=", 2)[2]
    p = subprocess.run(["runsc", f"--root={root}", "--platform=ptrace", "exec", U("gn"), PY, "-c", probe, marker,
                        str(cli.store)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout.strip().splitlines()[-1])
    assert seen == {"mounted": ["/run/gpusnap/code"], "store_listing": [], "store_path": False, "found": []}


CHANNEL_AGENT = """
import hashlib, os, random, sys
sys.path.insert(0, "/run/gpusnap/code/tests")
from support.driver_standin import StandInDriver
from agents.gpu_agent import run
from sandbox.gpu.channel import report_frame, write_header
from sandbox.gpu.driver import Features
from storage.gpu.device import HostDevice
feats = Features(checkpoint_api=True, custom_storage=True)
d = StandInDriver()
me = os.getpid()
d.add(me, random.Random(5).randbytes(3 << 20) + bytes(2 << 20))
out, inp = sys.stdout.buffer, sys.stdin.buffer
kw = dict(driver=d, features=feats, device=HostDevice(), pids=[me])
write_header(out, report_frame(run("checkpoint", out=out, **kw)))
out.flush()
print("released", len(d.procs[me].gpu), file=sys.stderr)
write_header(out, report_frame(run("restore", out=out, inp=inp, path="custom-storage", **kw)))
out.flush()
print("digest", hashlib.sha256(d.procs[me].gpu).hexdigest(), file=sys.stderr)
"""


def test_agent_channel_through_a_real_sandbox(cli: Cli, env: dict) -> None:
    """The agent's real code inside a real sandbox (its 'GPU memory' the stand-in's real memory there)
    streams a checkpoint over `runsc exec`'s pipes into the host's store, and takes it back."""
    import hashlib
    import random
    from sandbox.gpu.channel import AgentFrames, read_report, receive, send
    from sandbox.runsc.runner import Runsc
    from storage.repo.store import SnapshotStore
    start_counter(cli, env, U("gc"), ["--gpu-agent"])
    r = Runsc([a.split("=", 1)[1] for a in env["args"]])
    p = r.exec_piped(U("gc"), [PY, "-c", CHANNEL_AGENT], env={"PYTHONPATH": "/run/gpusnap/code"},
                     stderr=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None
    stdin, stdout = cast(BinaryIO, p.stdin), cast(BinaryIO, p.stdout)  # binary pipes, as sandbox/runsc/gpu_agent.py has them
    st = SnapshotStore(str(cli.store))
    try:
        with st.writer("sb.gpu", meta={"kind": "gpu", "path": "custom-storage"}) as w:
            frames = AgentFrames(stdout, "checkpoint")
            receive(frames, w)
            w.commit()
        assert frames.report is not None and frames.report.states == {str(frames.report.cuda_pids[0]): "CHECKPOINTED"}
        pid = frames.report.cuda_pids[0]
        m = st.load("sb.gpu")
        assert [(s.name, s.size) for s in m.streams] == [(f"gpu/{pid}/0", 5 << 20)]
        assert send(stdin, stdout, st, m.streams) == [pid]
        p.stdin.close()
        assert read_report(stdout, "restore").states == {str(pid): "RUNNING"}
        assert p.wait(timeout=60) == 0
        err = p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    want = hashlib.sha256(random.Random(5).randbytes(3 << 20) + bytes(2 << 20)).hexdigest()
    assert "released 0" in err and f"digest {want}" in err, err
    assert st.verify(["sb.gpu"]).ok


STANDIN_AGENT = "/run/gpusnap/code/tests/support/agent_standin.py"


def standin_digest(env: dict, cid: str) -> list[str]:
    root = env["args"][0].split("=", 2)[2]
    p = subprocess.run(["runsc", f"--root={root}", "--platform=ptrace", "exec", cid, STANDIN_AGENT, "digest"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_gpu_sandbox_checkpoint_and_restore_through_the_agent_channel(cli: Cli, env: dict) -> None:
    """`gpusnap runsc checkpoint/restore` of a sandbox whose agent has custom storage (the stand-in,
    its state in the sandbox's /tmp): the GPU memory leaves through the agent's pipes into snapshot
    NAME.gpu on the host, the sandbox is checkpointed holding none of it, and after the restore under
    a new id the agent gets it back, byte for byte."""
    import hashlib
    from support.agent_standin import memory
    _, out1 = start_counter(cli, env, U("gs"), ["--gpu-agent"])
    want = hashlib.sha256(memory()).hexdigest()
    assert standin_digest(env, U("gs")) == ["RUNNING", want]
    agent_env = {"GPUSNAP_AGENT_PYTHON": STANDIN_AGENT}
    cli.run("runsc", "checkpoint", U("gs"), "gsc", *env["args"], "--runsc-arg=--network=none", env=agent_env)
    meta = cli.json("store", "inspect", "gsc")["meta"]
    rep = meta["gpu"]["agent_report"]
    assert rep["path"] == "custom-storage" and rep["cuda_pids"] == [1] and rep["snapshot"] == "gsc.gpu"
    assert rep["states"] == {"1": "CHECKPOINTED"}
    gpu = cli.json("store", "inspect", "gsc.gpu")
    assert [(s["name"], s["size"]) for s in gpu["streams"]] == [("gpu/1/0", len(memory()))], gpu
    assert gpu["meta"]["kind"] == "gpu" and gpu["meta"]["pids"] == [1]
    fresh = env["tmp"] / "bundle-gr"
    env["build"](str(fresh), [PY, "-c", COUNTER])
    out2 = env["tmp"] / (U("gr") + ".out")
    cli.run("runsc", "restore", "gsc", U("gr"), "--bundle", str(fresh), "--output", str(out2), env=agent_env)
    env["made"].append((U("gr"), env["args"]))
    wait_lines(out2, 2)
    assert standin_digest(env, U("gr")) == ["RUNNING", want]


def test_gpu_agent_channel_refusal_leaves_the_gpu_process_running(cli: Cli, env: dict) -> None:
    """The host refuses the agent's bytes (over its limit): the agent, its pipe closed, gives the
    process its memory back; no NAME.gpu snapshot; the sandbox runs on."""
    import hashlib
    from support.agent_standin import memory
    from sandbox.gpu.channel import ChannelLimits
    from sandbox.runsc.runner import Runsc
    from sandbox.runsc.snapshot import RunscSnapshotError, agent_checkpoint
    from storage.repo.store import SnapshotStore
    _, out = start_counter(cli, env, U("gl"), ["--gpu-agent"])
    r = Runsc([a.split("=", 1)[1] for a in env["args"]])
    os.environ["GPUSNAP_AGENT_PYTHON"] = STANDIN_AGENT
    try:
        with pytest.raises(RunscSnapshotError, match="GPU agent .* failed to checkpoint: .*more than 1024 bytes"):
            agent_checkpoint(r, U("gl"), SnapshotStore(str(cli.store)), "gl.gpu", ChannelLimits(max_total=1024))
    finally:
        del os.environ["GPUSNAP_AGENT_PYTHON"]
    assert standin_digest(env, U("gl")) == ["RUNNING", hashlib.sha256(memory()).hexdigest()]
    assert cli.json("store", "ls") == []
    n = len(lines(out))
    wait_lines(out, n + 2)


# ---------------------------------------------------------------- what a new user trips over (issue 14)
def _records(root: str, cid: str) -> Path:
    from sandbox.runsc import records
    return Path(records._dir(root, cid))


def test_missing_or_empty_bundle_is_one_line(cli: Cli, env: dict) -> None:
    missing = env["tmp"] / "missing"
    p = cli.run("runsc", "run", U("mb"), "--bundle", str(missing), *env["args"], check=False)
    assert p.returncode == 1 and p.stderr == f"gpusnap: --bundle {missing}: no such directory\n", p.stderr
    assert not missing.exists()
    (env["tmp"] / "empty").mkdir()
    p = cli.run("runsc", "run", U("mb"), "--bundle", str(env["tmp"] / "empty"), *env["args"], check=False)
    assert p.returncode == 1 and "no config.json (not an OCI bundle)" in p.stderr and len(p.stderr.splitlines()) == 1
    assert os.listdir(env["tmp"] / "empty") == []


def test_nothing_is_written_into_the_bundle(cli: Cli, env: dict) -> None:
    """gpusnap keeps its record of a sandbox outside the user's bundle, and removes it when the start
    fails and when the sandbox is deleted; a failed start leaves the bundle exactly as it was."""
    root = env["args"][0].split("=", 2)[2]
    bundle, _ = start_counter(cli, env, U("nb"), ["--net-subnet", SUBNET(44)])
    assert sorted(os.listdir(bundle)) == ["config.json"]
    rec = _records(root, U("nb"))
    assert json.loads((rec / "run.json").read_text())["output"].endswith(f"{U('nb')}.out")
    assert json.loads((rec / "net.json").read_text())["name"] == "gpusnap-" + U("nb")
    cli.run("runsc", "delete", U("nb"), *env["args"])
    assert not rec.exists()
    from sandbox.host.netns import NetConfig, leftovers
    assert leftovers(NetConfig.for_sandbox("gpusnap-" + U("nb"), SUBNET(44))) == []
    broken = env["tmp"] / "broken"
    env["build"](str(broken), ["/nonexistent/program"])
    spec = (broken / "config.json").read_text()
    p = cli.run("runsc", "run", U("fb"), "--bundle", str(broken), "--net-subnet", SUBNET(45), *env["args"],
                "--runsc-arg=--network=none", "--output", str(env["tmp"] / "fb.out"), check=False)
    env["made"].append((U("fb"), env["args"]))
    assert p.returncode == 1 and len(p.stderr.splitlines()) == 1 and "runsc run" in p.stderr, p.stderr
    assert sorted(os.listdir(broken)) == ["config.json"] and (broken / "config.json").read_text() == spec
    assert not _records(root, U("fb")).exists()
    assert leftovers(NetConfig.for_sandbox("gpusnap-" + U("fb"), SUBNET(45))) == []


def test_container_messages_name_the_root_and_runsc_reason(cli: Cli, env: dict) -> None:
    """No container: the message names the runsc root searched (no empty '(runsc )'). runsc matches ids
    by prefix; gpusnap acts only on the exact id, and says runsc's own reason for an ambiguous one."""
    p = cli.run("runsc", "checkpoint", "nosuch", "x", check=False)
    assert p.returncode == 1 and p.stderr == "gpusnap: no container 'nosuch' under runsc root /var/run/runsc\n", p.stderr
    root = env["args"][0].split("=", 2)[2]
    stem = U("amb")
    start_counter(cli, env, f"{stem}-1")
    p = cli.run("runsc", "delete", stem, *env["args"], check=False)
    assert p.returncode == 1 and "no container" in p.stderr and f"{stem}-1" in p.stderr, p.stderr
    assert cli.run("runsc", "checkpoint", stem, "y", *env["args"], check=False).returncode == 1
    st = subprocess.run(["runsc", f"--root={root}", "state", f"{stem}-1"], capture_output=True, text=True)
    assert json.loads(st.stdout)["status"] == "running", "a prefix must never delete another sandbox"
    start_counter(cli, env, f"{stem}-2")
    p = cli.run("runsc", "delete", stem, *env["args"], check=False)
    assert p.returncode == 1 and "ambiguous" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    assert cli.json("store", "ls") == []


def test_restore_says_where_the_output_goes(cli: Cli, env: dict, store_dir: Path) -> None:
    bundle = env["tmp"] / f"bundle-{U('ro')}"
    env["build"](str(bundle), [PY, "-c", COUNTER])
    out1 = env["tmp"] / "ro.out"
    p = cli.run("runsc", "run", U("ro"), "--bundle", str(bundle), "--output", str(out1), *env["args"],
                "--runsc-arg=--network=none")
    env["made"].append((U("ro"), env["args"]))
    assert p.stdout == f"{U('ro')}: running; output goes to {out1}\n", p.stdout
    wait_lines(out1, 3)
    cli.json("runsc", "checkpoint", U("ro"), "ro", *env["args"], "--runsc-arg=--network=none")
    last = int(lines(out1)[-1][0])
    p = cli.run("runsc", "restore", "ro", U("rp"), "--bundle", str(env["tmp"] / f"bundle-{U('ro')}"))
    env["made"].append((U("rp"), env["args"]))
    logs = store_dir / "logs" / f"runsc-{U('rp')}.out"
    assert f"output goes to {logs}" in p.stdout and f"the checkpointed sandbox wrote to {out1}" in p.stdout, p.stdout
    assert int(wait_lines(logs, 2)[0][0]) == last + 1  # it really goes there
    cli.run("runsc", "delete", U("rp"), *env["args"])
    out3 = env["tmp"] / "again.out"
    r = cli.json("runsc", "restore", "ro", U("rq"), "--bundle", str(env["tmp"] / f"bundle-{U('ro')}"),
                 "--output", str(out3))
    env["made"].append((U("rq"), env["args"]))
    assert r["output"] == str(out3) and r["recorded_output"] == str(out1)
    assert int(wait_lines(out3, 2)[0][0]) == last + 1
