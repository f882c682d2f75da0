"""Container runtimes with gpusnap: `gpusnap hook install|status|uninstall` under real runc and real
Podman (runc runtime) with real CRIU, runtime checkpoints through the store (`gpusnap import podman|runc`,
`gpusnap export`), and `gpusnap criu dump` of a container's process. Nothing is mocked: containers run
a counter on a busybox-static root filesystem; every name is unique and everything is removed even on
failure (the real /etc/criu is restored byte for byte)."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from conftest import GPUSNAP, Cli, pythonpath
from support.containers import (BUSYBOX, RuncContainer, assert_continues, need, podman, read_count, real_etc_criu,
                                runc_container, runtime_env, snapshot_dir, wait_count)
from sandbox.containers import config_block
from sandbox.containers.hook_install import HOOK_NAME

pytestmark = pytest.mark.root


def gpusnap(*args: str, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    return Cli(Path("/nonexistent-store")).run(*args, check=check, env=env)


@contextmanager
def layout(tmp: Path, config_dir: str | None = None) -> Iterator[list[str]]:
    """Layout options for `gpusnap hook ...` in TMP (CONFIG_DIR: the real one instead); uninstalls at the end."""
    opts = ["--config-dir", config_dir or str(tmp / "etc-criu"), "--lib-dir", str(tmp / "lib"),
            "--sbin-dir", str(tmp / "sbin"), "--libexec-dir", str(tmp / "libexec")]
    try:
        yield opts
    finally:
        gpusnap("hook", "uninstall", *opts, check=False)


def record_hook_runs(lib: Path, log: Path) -> None:
    """Put a recording wrapper in front of the installed hook (test only): it logs each action and the
    real hook's exit status, and exits with that status."""
    hook = lib / HOOK_NAME
    real = lib / "real-hook"
    hook.rename(real)
    hook.write_text(f'#!/bin/sh\n"{real}" "$@"; rc=$?\necho "$CRTOOLS_SCRIPT_ACTION $rc" >> "{log}"\nexit $rc\n')
    hook.chmod(0o755)


def unrecord(lib: Path) -> None:
    if (lib / "real-hook").exists():
        (lib / "real-hook").replace(lib / HOOK_NAME)


def actions(log: Path) -> list[tuple[str, int]]:
    return [(a, int(rc)) for a, rc in (ln.split() for ln in log.read_text().splitlines())] if log.exists() else []


def hook_writes_log() -> bool:
    """Whether the installed hook keeps its own log (GPUSNAP_HOOK_LOG, one line per action): then the
    tests read it too."""
    from criu_hooks import action_script
    return "GPUSNAP_HOOK_LOG" in (getattr(action_script, "HELP", "") or "")


# --- install / status / uninstall on config files --------------------------------------------------

CONFIG_CASES = {
    "missing": None,
    "empty": b"",
    "no-final-newline": b"log-file /tmp/criu.log\ntcp-established",
    "others-lines": b"# site settings\naction-script /bin/true\n\nlink-remap\n",
}


def test_config_block_keeps_lines_others_add_around_it() -> None:
    hook = "/usr/local/lib/gpusnap/gpusnap-criu-hook"
    a = config_block.add(b"tcp-established", hook)
    assert a.added_newline and a.data.startswith(b"tcp-established\n")
    assert config_block.add(a.data, hook).changed is False
    moved = config_block.add(a.data, "/opt/gpusnap/hook")
    assert moved.changed and config_block.action_scripts(moved.data) == [("/opt/gpusnap/hook", True)]
    edited = b"# admin\n" + a.data + b"link-remap\n"        # lines added after install
    assert config_block.remove(edited, a.added_newline) == b"# admin\ntcp-established\nlink-remap\n"
    assert config_block.remove(a.data, a.added_newline) == b"tcp-established"
    by_hand = b"action-script " + hook.encode() + b"\n"    # the same line written by hand: not doubled
    assert config_block.add(by_hand, hook).data == by_hand
    for bad in ("relative/hook", "/with space/hook", "/quote'd"):
        with pytest.raises(config_block.BadHookPath):
            config_block.add(b"", bad)


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_install_twice_then_uninstall_leaves_config_as_it_was(tmp_path: Path, case: str) -> None:
    need()
    etc = tmp_path / "etc-criu"
    before = CONFIG_CASES[case]
    if before is not None:
        etc.mkdir()
        (etc / "runc.conf").write_bytes(before)
        (etc / "default.conf").write_bytes(b"# untouched\n")
    with layout(tmp_path) as opts:
        first = json.loads(gpusnap("hook", "install", *opts, "--json").stdout)
        hook = tmp_path / "lib" / HOOK_NAME
        assert first["hook"] == str(hook) and str(etc / "runc.conf") in first["changed"]
        after_one = (etc / "runc.conf").read_bytes()
        assert config_block.action_scripts(after_one)[-1] == (str(hook), True)
        assert after_one.startswith(before or b"")
        second = json.loads(gpusnap("hook", "install", *opts, "--json").stdout)
        assert second["changed"] == [] and (etc / "runc.conf").read_bytes() == after_one
        assert os.access(hook, os.X_OK)
        st = json.loads(gpusnap("hook", "status", *opts, "--json").stdout)
        assert st["installed"] and st["runtimes"]["podman"]["criu_ok"]
        assert st["problems"] == []
        gpusnap("hook", "uninstall", *opts)
    if before is None:
        assert not etc.exists(), "a config directory install created must be gone"
    else:
        assert (etc / "runc.conf").read_bytes() == before
        assert (etc / "default.conf").read_bytes() == b"# untouched\n"
    assert not (tmp_path / "lib").exists()


def test_uninstall_per_runtime_and_with_installs_flags(tmp_path: Path) -> None:
    """`hook uninstall` takes install's flags: --runtime takes one runtime off (the shared runc.conf
    block, the hook and its code stay while another installed runtime reads them), --criu must name
    the CRIU install copied (else nothing is removed); the last runtime's uninstall removes it all."""
    env = runtime_env()
    criu = env["PATH"].split(":")[0] + "/criu"
    bare = {**os.environ, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    if shutil.which("criu", path=bare["PATH"]):
        pytest.skip("a criu is installed in the system's directories")
    etc = tmp_path / "etc-criu"
    with layout(tmp_path) as opts:
        gpusnap("hook", "install", "--runtime", "runc", "--runtime", "podman", "--criu", criu, *opts, env=bare)
        conf = (etc / "runc.conf").read_bytes()
        wrong = gpusnap("hook", "uninstall", "--criu", "/bin/true", *opts, check=False)
        assert wrong.returncode == 1 and "not /usr/bin/true" in wrong.stderr and len(wrong.stderr.splitlines()) == 1
        assert (tmp_path / "lib" / HOOK_NAME).exists() and (tmp_path / "libexec" / "criu").exists()
        part = json.loads(gpusnap("hook", "uninstall", "--runtime", "podman", "--criu", criu, *opts, "--json").stdout)
        assert "removed runtime podman" in part["undone"] and any(u.startswith("kept ") for u in part["undone"])
        assert (etc / "runc.conf").read_bytes() == conf and (tmp_path / "lib" / HOOK_NAME).exists()
        rec = json.loads((tmp_path / "lib" / "hook-install.json").read_text())
        assert rec["runtimes"] == ["runc"]
        st = json.loads(gpusnap("hook", "status", *opts, "--json", env={**bare, "PATH": f"{tmp_path / 'sbin'}:{bare['PATH']}"}).stdout)
        assert st["installed"] and st["problems"] == [], st["problems"]
        rest = json.loads(gpusnap("hook", "uninstall", "--runtime", "runc", *opts, "--json").stdout)["undone"]
        assert f"removed {tmp_path / 'libexec' / 'criu'}" in rest and f"removed {tmp_path / 'lib' / 'python'}" in rest
    for d in ("lib", "libexec", "sbin", "etc-criu"):
        assert not (tmp_path / d).exists(), d


def test_install_refuses_symlinked_config_and_non_root(tmp_path: Path) -> None:
    need("unshare")
    etc = tmp_path / "etc-criu"
    etc.mkdir()
    target = tmp_path / "elsewhere.conf"
    target.write_bytes(b"keep me\n")
    (etc / "runc.conf").symlink_to(target)
    with layout(tmp_path) as opts:
        p = gpusnap("hook", "install", *opts, check=False)
        assert p.returncode != 0 and "symbolic link" in p.stderr and len(p.stderr.strip().splitlines()) == 1
        assert target.read_bytes() == b"keep me\n" and (etc / "runc.conf").is_symlink()
        assert not (tmp_path / "lib").exists(), "a failed install takes back what it wrote"
    (etc / "runc.conf").unlink()
    # not root: a user namespace makes the CLI see itself as uid 65534 while its files stay readable
    # wherever this checkout sits (a clone under a 0700 directory is not readable by a real uid 65534)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": pythonpath()}
    p = subprocess.run(["unshare", "--user", *GPUSNAP, "hook", "install", *opts], capture_output=True, text=True,
                       cwd="/", env=env)
    assert p.returncode == 4 and "must run as root" in p.stderr, p.stderr  # needs root: 4, as everywhere
    assert not (etc / "runc.conf").exists()


def test_install_links_criu_only_when_path_has_none(tmp_path: Path) -> None:
    env = runtime_env()
    criu = env["PATH"].split(":")[0] + "/criu"
    bare = {**os.environ, "PATH": "/usr/bin:/bin"}   # no CRIU >= 4 here
    if shutil.which("criu", path=bare["PATH"]):
        pytest.skip("a criu is installed in /usr/bin")
    with layout(tmp_path) as opts:
        out = json.loads(gpusnap("hook", "install", *opts, "--criu", criu, "--json", env=bare).stdout)
        link, copy = tmp_path / "sbin" / "criu", tmp_path / "libexec" / "criu"
        # a copy of CRIU that install owns, never a link into the tree CRIU was built in
        assert link.is_symlink() and os.readlink(link) == str(copy)
        assert copy.read_bytes() == Path(criu).read_bytes() and copy.stat().st_mode & 0o777 == 0o755
        assert str(link) in out["changed"] and str(copy) in out["changed"]
        assert out["warnings"], "sbin dir is not on PATH: install must say so"
        # with the sbin dir on PATH, runc and Podman find it
        on_path = {**bare, "PATH": f"{tmp_path / 'sbin'}:/usr/bin:/bin"}
        st = json.loads(gpusnap("hook", "status", *opts, "--json", env=on_path).stdout)
        assert st["runtimes"]["runc"]["criu"] == str(link) and st["runtimes"]["podman"]["criu_ok"]
        again = json.loads(gpusnap("hook", "install", *opts, "--json", env=on_path).stdout)
        assert again["changed"] == []
        # a criu >= 4 already first on PATH: nothing is linked
        json.loads(gpusnap("hook", "install", *opts, "--json", env=env).stdout)
        assert link.is_symlink()   # the one install made is kept until uninstall
        undone = json.loads(gpusnap("hook", "uninstall", *opts, "--json").stdout)["undone"]
        assert f"removed {link}" in undone and not link.exists()
        assert f"removed {copy}" in undone and not (tmp_path / "libexec").exists()
    with layout(tmp_path / "second") as opts:
        gpusnap("hook", "install", *opts, env=env)
        assert not (tmp_path / "second" / "sbin" / "criu").exists()


def test_status_flags_a_missing_action_script(tmp_path: Path) -> None:
    need()
    etc = tmp_path / "etc-criu"
    etc.mkdir()
    (etc / "runc.conf").write_text("action-script /usr/local/bin/gpusnap-criu-hook-missing\n")
    st = json.loads(gpusnap("hook", "status", "--config-dir", str(etc), "--lib-dir", str(tmp_path / "lib"),
                            "--json").stdout)
    assert not st["installed"]
    assert any("gpusnap-criu-hook-missing does not exist" in p for p in st["problems"])
    # CRIU's own cuda plugin where CRIU loads plugins from (CRIU_LIBS_DIR): install warns, status says so
    plugins = tmp_path / "criu-plugins"
    plugins.mkdir()
    (plugins / "cuda_plugin.so").write_bytes(b"\x7fELF")
    env = {**runtime_env(), "CRIU_LIBS_DIR": str(plugins)}
    with layout(tmp_path) as opts:
        p = gpusnap("hook", "install", *opts, env=env)
        assert "cuda plugin" in p.stderr
        st = json.loads(gpusnap("hook", "status", *opts, "--json", env=env).stdout)
        assert st["cuda_plugins"] == [str(plugins / "cuda_plugin.so")]
        assert any("keep one" in p for p in st["problems"])


# --- runc and Podman checkpoints with the hook -----------------------------------------------------

def test_runc_checkpoint_restore_runs_the_hook(tmp_path: Path) -> None:
    need("runc", BUSYBOX)
    env = runtime_env()
    etc = tmp_path / "etc-criu"
    etc.mkdir()
    original = b"# site config\nghost-limit 1M"   # no final newline: uninstall must not add one
    (etc / "runc.conf").write_bytes(original)
    log = tmp_path / "hook-runs.log"
    hook_log = tmp_path / "hook.log"   # the hook's own log, where it keeps one (runc's environment reaches it)
    env = {**env, "GPUSNAP_HOOK_LOG": str(hook_log), "GPUSNAP_HOOK_STATE": str(tmp_path / "hook-state")}
    with layout(tmp_path) as opts:
        gpusnap("hook", "install", "--runtime", "runc", *opts, env=env)
        record_hook_runs(tmp_path / "lib", log)
        try:
            with runc_container(tmp_path / "c", env, criu_config=str(etc / "runc.conf")) as c:
                wait_count(c.count_file, 15)
                c.checkpoint(tmp_path / "img", tmp_path / "work")
                assert c.state() is None, "runc checkpoint stops the container"
                frozen = read_count(c.count_file)
                dumped = [a for a, _ in actions(log)]
                assert all(rc == 0 for _, rc in actions(log))
                for a in ("pre-dump", "network-lock", "post-dump"):
                    # CRIU 4.1.1 runs scripts from a config passed over RPC twice (fixed upstream after 4.1.1)
                    assert dumped.count(a) in (1, 2), dumped
                assert "Running pre-dump scripts" in (tmp_path / "work" / "dump.log").read_text()
                c.restore(tmp_path / "img", tmp_path / "work2")
                assert_continues(c, frozen)
                restored = [a for a, _ in actions(log)][len(dumped):]
                for a in ("pre-restore", "post-restore", "network-unlock", "post-resume"):
                    assert restored.count(a) in (1, 2), restored
                if hook_writes_log():
                    logged = hook_log.read_text()
                    for a in ("pre-dump", "network-unlock", "post-resume"):
                        assert f" {a}: " in logged, logged
                    assert "FAILED" not in logged, logged
        finally:
            unrecord(tmp_path / "lib")
        gpusnap("hook", "uninstall", *opts)
    assert (etc / "runc.conf").read_bytes() == original


def test_podman_checkpoint_restore_runs_the_hook(tmp_path: Path) -> None:
    """Podman (runc runtime) with the hook installed, through the container's `org.criu.config`
    annotation (the real /etc/criu is left alone): checkpoint and restore run the hook at each action,
    none fails, none takes long, and the counter goes on."""
    need("runc", "podman", BUSYBOX)
    env = runtime_env()
    etc = tmp_path / "etc-criu"
    log = tmp_path / "hook-runs.log"   # Podman does not pass its environment to runc: a wrapper records
    with layout(tmp_path) as opts, podman(tmp_path / "p", env) as pm:
        gpusnap("hook", "install", "--runtime", "podman", *opts, env=env)
        record_hook_runs(tmp_path / "lib", log)
        try:
            name = f"gpusnap-test-{uuid.uuid4().hex[:10]}"
            pm.start_counter(name, "--annotation", f"org.criu.config={etc / 'runc.conf'}")
            pm.wait_count(name, 15)
            pm("container", "checkpoint", name, timeout=300)
            frozen = pm.count_file(name)
            t0 = time.monotonic()
            pm("container", "restore", name, timeout=300)
            took = time.monotonic() - t0
            v = pm.wait_count(name, frozen + 1)
            assert v <= frozen + 2 + 10 * (time.monotonic() - t0), f"counter jumped from {frozen} to {v}"
            assert pm.wait_count(name, v + 3) > v
            ran = actions(log)
            for a in ("pre-dump", "post-dump", "pre-restore", "network-unlock", "post-resume"):
                assert a in [x for x, _ in ran], ran
            assert all(rc == 0 for _, rc in ran), ran
            assert took < 120, f"podman restore took {took:.0f} s"
        finally:
            unrecord(tmp_path / "lib")


def test_hook_outlives_the_tree_it_was_installed_from(tmp_path: Path) -> None:
    """Install from a copy of the code, delete that copy: a runc checkpoint and restore (through the
    CRIU copy install linked, no other CRIU on PATH) still run the hook, nothing installed names the
    copy, and uninstall leaves none of the directories install made."""
    need("runc", BUSYBOX)
    src = tmp_path / "checkout"
    src.mkdir()
    for pkg in ("cli", "agents", "criu_hooks", "sandbox", "storage"):
        shutil.copytree(Path(__file__).resolve().parents[1] / pkg, src / pkg,
                        ignore=shutil.ignore_patterns("__pycache__"))
    criu = runtime_env()["PATH"].split(":")[0] + "/criu"
    system = "/usr/sbin:/usr/bin:/sbin:/bin"   # iptables-restore, which CRIU runs, is in /usr/sbin
    bare = {**os.environ, "PATH": f"{tmp_path / 'sbin'}:{system}", "PYTHONPATH": str(src)}
    if shutil.which("criu", path=system):
        pytest.skip("a criu is installed in the system's directories")
    etc = tmp_path / "etc-criu"
    hook_log = tmp_path / "hook.log"
    with layout(tmp_path) as opts:
        p = subprocess.run([sys.executable, "-m", "cli", "hook", "install", "--runtime", "runc", "--criu", criu, *opts],
                           capture_output=True, text=True, env=bare, cwd="/", timeout=300)
        assert p.returncode == 0, p.stderr
        shutil.rmtree(src)
        installed = [tmp_path / "lib", tmp_path / "libexec", tmp_path / "sbin", etc]
        for top in installed:
            for f in top.rglob("*"):
                if f.is_symlink():
                    assert str(src) not in os.readlink(f) and not os.readlink(f).startswith(os.path.dirname(criu)), f
                elif f.is_file() and f.stat().st_size < 1 << 20:
                    assert str(src).encode() not in f.read_bytes(), f"{f} names the deleted copy"
        env = {k: v for k, v in bare.items() if k != "PYTHONPATH"}
        env.update(GPUSNAP_HOOK_LOG=str(hook_log), GPUSNAP_HOOK_STATE=str(tmp_path / "hook-state"))
        assert shutil.which("criu", path=env["PATH"]) == str(tmp_path / "sbin" / "criu"), "runc runs the copy"
        with runc_container(tmp_path / "c", env, criu_config=str(etc / "runc.conf")) as c:
            wait_count(c.count_file, 10)
            c.checkpoint(tmp_path / "img", tmp_path / "work")
            frozen = read_count(c.count_file)
            c.restore(tmp_path / "img", tmp_path / "work2")
            assert_continues(c, frozen)
        logged = hook_log.read_text()
        for a in ("pre-dump", "network-unlock", "post-resume"):
            assert f" {a}: " in logged, logged
        assert "FAILED" not in logged, logged
        undone = json.loads(gpusnap("hook", "uninstall", *opts, "--json").stdout)["undone"]
        assert undone and all(not d.exists() for d in installed), (undone, [d for d in installed if d.exists()])


def test_real_etc_criu_runc_and_podman(tmp_path: Path) -> None:
    """Installed into the real /etc/criu: runc and Podman (no annotation) read /etc/criu/runc.conf."""
    need("runc", "podman", BUSYBOX)
    env = runtime_env()
    log = tmp_path / "hook-runs.log"
    with real_etc_criu(), layout(tmp_path, config_dir="/etc/criu") as opts:
        gpusnap("hook", "install", *opts, env=env)
        st = json.loads(gpusnap("hook", "status", *opts, "--json", env=env).stdout)
        assert st["installed"] and st["runtimes"]["runc"]["config"] == "/etc/criu/runc.conf"
        record_hook_runs(tmp_path / "lib", log)
        try:
            with runc_container(tmp_path / "c", env) as c:
                wait_count(c.count_file, 15)
                c.checkpoint(tmp_path / "img", tmp_path / "work")
                frozen = read_count(c.count_file)
                assert "pre-dump" in [a for a, _ in actions(log)]
                c.restore(tmp_path / "img", tmp_path / "work2")
                assert_continues(c, frozen)
            n = len(actions(log))
            with podman(tmp_path / "p", env) as pm:
                name = f"gpusnap-test-{uuid.uuid4().hex[:10]}"
                pm.start_counter(name)
                pm.wait_count(name, 15)
                pm("container", "checkpoint", name)
                podman_runs = [a for a, _ in actions(log)][n:]
                assert "pre-dump" in podman_runs and "post-dump" in podman_runs, podman_runs
                pm("container", "restore", name)
                v = pm.wait_count(name, 1)
                assert pm.wait_count(name, v + 3) > v
                assert "post-resume" in [a for a, _ in actions(log)][n:]
        finally:
            unrecord(tmp_path / "lib")
        gpusnap("hook", "uninstall", *opts)


def test_podman_without_criu_on_path_says_so(tmp_path: Path) -> None:
    """What `hook install` fixes: Podman looks for criu on PATH only."""
    need("podman", BUSYBOX)
    env = runtime_env()
    bare = {**env, "PATH": "/usr/bin:/bin"}
    if shutil.which("criu", path=bare["PATH"]):
        pytest.skip("a criu is installed in /usr/bin")
    with podman(tmp_path / "p", env) as pm:
        name = f"gpusnap-test-{uuid.uuid4().hex[:10]}"
        pm.start_counter(name)
        p = pm("container", "checkpoint", name, check=False, env=bare)
        assert p.returncode != 0 and "CRIU" in p.stderr
        assert pm.count(name) >= 0   # still running


def test_podman_export_import_through_the_store(tmp_path: Path, cli: Cli) -> None:
    need("podman", BUSYBOX)
    env = runtime_env()
    with podman(tmp_path / "p", env) as pm:
        name = f"gpusnap-test-{uuid.uuid4().hex[:10]}"
        pm.start_counter(name)
        pm.wait_count(name, 15)
        pid = pm("inspect", "-f", "{{.State.Pid}}", name).stdout.strip()
        p = cli.run("criu", "dump", pid, "x", check=False)
        assert p.returncode == 1 and "runs in podman container" in p.stderr, p.stderr
        archive = tmp_path / "ckpt.tar.zst"
        pm("container", "checkpoint", "--export", str(archive), name)
        with tarfile.open(fileobj=io.BytesIO(subprocess.run(
                ["zstd", "-dc", str(archive)], capture_output=True, check=True).stdout)) as t:
            frozen_names = t.getnames()
        assert any(n.startswith("checkpoint/pages-") for n in frozen_names)
        first = cli.json("import", "podman", str(archive), "ckpt1")
        assert first["kind"] == "podman-checkpoint" and first["raw_bytes"] > 0
        meta = cli.json("store", "inspect", "ckpt1")["meta"]
        assert meta["compression"] == "zstd"
        archive.unlink()
        pm("rm", "-f", name)
        assert pm("container", "exists", name, check=False).returncode != 0
        out = tmp_path / "back.tar"
        cli.json("export", "ckpt1", str(out))
        with tarfile.open(out) as t:
            assert sorted(t.getnames()) == sorted(n.rstrip("/") for n in frozen_names if n not in (".", "./"))
        pm("container", "restore", "--import", str(out))
        v = pm.wait_count(name, 16)
        assert pm.wait_count(name, v + 3) > v
        # a second checkpoint of the same container shares most of its chunks with the first
        again = tmp_path / "ckpt2.tar"
        pm("container", "checkpoint", "--compress", "none", "--export", str(again), name)
        second = cli.json("import", "podman", str(again), "ckpt2")
        assert second["new_bytes"] < second["raw_bytes"] / 2, second
        p = cli.run("export", "ckpt1", str(out), check=False)
        assert p.returncode != 0 and "already exists" in p.stderr


def test_runc_image_dir_through_the_store(tmp_path: Path, cli: Cli) -> None:
    need("runc", BUSYBOX)
    env = runtime_env()
    with runc_container(tmp_path / "c", env, criu_config="") as c:
        wait_count(c.count_file, 15)
        img = tmp_path / "img"
        c.checkpoint(img, tmp_path / "work")
        frozen = read_count(c.count_file)
        files = sorted(p.name for p in img.iterdir())
        r = cli.json("import", "runc", str(img), "runc1")
        assert r["kind"] == "runc-checkpoint"
        shutil.rmtree(img)
        back = tmp_path / "img-back"
        cli.json("export", "runc1", str(back))
        assert sorted(p.name for p in back.iterdir()) == files
        c.restore(back, tmp_path / "work2")
        assert_continues(c, frozen)


def test_criu_dump_of_a_container_process_points_at_the_runtime(tmp_path: Path, cli: Cli) -> None:
    need("runc", BUSYBOX)
    env = runtime_env()
    with runc_container(tmp_path / "c", env, criu_config="") as c:
        v = wait_count(c.count_file, 3)
        p = cli.run("criu", "dump", str(c.pid()), "x", check=False, env={"PATH": env["PATH"]})
        assert p.returncode == 1
        line, = p.stderr.strip().splitlines()
        assert "runs in a container" in line and "runc checkpoint" in line and "gpusnap import" in line
        assert wait_count(c.count_file, v + 3) > v, "the container keeps running"


def test_import_refuses_unsafe_archives(tmp_path: Path, cli: Cli) -> None:
    need()
    good = tmp_path / "payload"
    good.write_bytes(b"x" * 100)
    for i, (member, kind) in enumerate([("../escape", tarfile.REGTYPE), ("/abs", tarfile.REGTYPE),
                                        ("checkpoint/hard", tarfile.LNKTYPE), ("checkpoint/dev", tarfile.CHRTYPE)]):
        bad = tmp_path / f"bad{i}.tar"
        with tarfile.open(bad, "w") as t:
            t.add(good, "checkpoint/core-1.img")
            ti = tarfile.TarInfo(member)
            ti.type = kind
            ti.linkname = "checkpoint/core-1.img" if kind == tarfile.LNKTYPE else ""
            t.addfile(ti)
        p = cli.run("import", "podman", str(bad), f"bad{i}", check=False)
        assert p.returncode == 1 and "refusing the archive" in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1
    notcp = tmp_path / "notcp.tar"
    with tarfile.open(notcp, "w") as t:
        t.add(good, "other")
    assert "not a Podman checkpoint" in cli.run("import", "podman", str(notcp), "n", check=False).stderr
    assert cli.json("store", "ls") == []


# --- GPU processes in a container (driver stand-in) ------------------------------------------------

GPU_BYTES = bytes(range(256)) * 64
# The hook must be idempotent per action (CRIU 4.1.1 runs each twice through runc) and resume GPU
# processes at network-unlock (a failed dump, --leave-running).

@contextmanager
def standin_gpu_container(tmp_path: Path, env: dict[str, str]) -> Iterator[tuple[RuncContainer, Path]]:
    """A runc container whose init process is a "GPU process" of the file-backed driver stand-in, and a
    CRIU config (runc.conf, read over RPC: every action runs twice) with the test hook around gpusnap's."""
    need("runc", BUSYBOX)
    from support.driver_standin import SharedStandIn
    from support.standin_hook import STANDIN_PID
    state = tmp_path / "gpu-state.pkl"
    SharedStandIn.create(str(state), {STANDIN_PID: GPU_BYTES})
    script = tmp_path / "standin-hook"
    tests = Path(__file__).resolve().parent
    # the hook's own log and per-dump records (where the hook keeps them) stay in this test's directory
    script.write_text(f"#!/bin/sh\nexport GPUSNAP_HOOK_LOG={tmp_path / 'hook.log'} GPUSNAP_HOOK_STATE={tmp_path / 'hook-state'}\n"
                      f"export GPUSNAP_HOOK_TIMEOUT={os.environ.get('GPUSNAP_HOOK_TIMEOUT', '180')}\n"
                      f"PYTHONPATH={pythonpath()} exec {sys.executable} {tests / 'support' / 'standin_hook.py'} {state} \"$@\"\n")
    script.chmod(0o755)
    conf = tmp_path / "runc.conf"
    conf.write_text(f"action-script {script}\n")
    with runc_container(tmp_path / "c", env, criu_config=str(conf)) as c:
        yield c, state


def gpu_state(state: Path) -> tuple[str, bool]:
    from support.driver_standin import SharedStandIn
    from support.standin_hook import STANDIN_PID
    p = SharedStandIn(str(state)).procs[STANDIN_PID]
    data = p.gpu if p.state.name != "CHECKPOINTED" else p.host
    return p.state.name, data == GPU_BYTES


def hook_runs(state: Path) -> list[str]:
    p = Path(f"{state}.runs")
    return p.read_text().split("\n") if p.exists() else []


def test_gpu_double_pre_dump_then_restore_ends_running(tmp_path: Path) -> None:
    env = runtime_env()
    with standin_gpu_container(tmp_path, env) as (c, state):
        wait_count(c.count_file, 10)
        c.checkpoint(tmp_path / "img", tmp_path / "work")
        # CRIU 4.1.1 runs it twice through runc, 4.2 once (tests/test_criu_hook.py gives every action twice)
        assert hook_runs(state).count("pre-dump 0") in (1, 2) and "pre-dump 1" not in hook_runs(state)
        assert gpu_state(state) == ("CHECKPOINTED", True)
        frozen = read_count(c.count_file)
        c.restore(tmp_path / "img", tmp_path / "work2")
        assert_continues(c, frozen)
        assert gpu_state(state) == ("RUNNING", True)


def test_gpu_failed_dump_ends_running(tmp_path: Path) -> None:
    env = runtime_env()
    with standin_gpu_container(tmp_path, env) as (c, state):
        v = wait_count(c.count_file, 10)
        Path(f"{state}.fail-at-network-lock").touch()
        p = c.checkpoint(tmp_path / "img", tmp_path / "work", check=False)
        assert p.returncode != 0
        assert c.state() is not None and wait_count(c.count_file, v + 5) > v, "the container keeps running"
        assert "network-unlock 0" in hook_runs(state)
        assert gpu_state(state) == ("RUNNING", True)


def test_gpu_leave_running_ends_running(tmp_path: Path) -> None:
    env = runtime_env()
    with standin_gpu_container(tmp_path, env) as (c, state):
        v = wait_count(c.count_file, 10)
        c.checkpoint(tmp_path / "img", tmp_path / "work", "--leave-running")
        assert c.state() is not None and wait_count(c.count_file, v + 5) > v
        assert gpu_state(state) == ("RUNNING", True)


def test_gpu_standin_hook_reaches_the_stand_in(tmp_path: Path) -> None:
    """Passes with today's hook too: gpusnap's hook reaches the container's "GPU process" at the dump's
    first pre-dump (lock, then checkpoint)."""
    env = runtime_env()
    with standin_gpu_container(tmp_path, env) as (c, state):
        wait_count(c.count_file, 10)
        c.checkpoint(tmp_path / "img", tmp_path / "work", check=False)
        from support.driver_standin import SharedStandIn
        calls = [c for _, c in SharedStandIn(str(state)).load().calls]
        assert calls[:2] == ["lock", "checkpoint"], calls
        assert hook_runs(state)[0] == "pre-dump 0"


@pytest.mark.parametrize("action", ["network-unlock", "post-resume"])
def test_a_stalled_hook_at_restore_lets_the_restore_finish(tmp_path: Path, action: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook hangs at a restore-side action (as a driver call that never returns): its deadline
    ends it and CRIU goes on; the restore finishes and the container counts on."""
    monkeypatch.setenv("GPUSNAP_HOOK_TIMEOUT", "3")
    env = runtime_env()
    with standin_gpu_container(tmp_path, env) as (c, state):
        wait_count(c.count_file, 10)
        c.checkpoint(tmp_path / "img", tmp_path / "work")
        frozen = read_count(c.count_file)
        Path(f"{state}.stall-at-{action}").touch()
        t0 = time.monotonic()
        c.restore(tmp_path / "img", tmp_path / "work2")
        assert time.monotonic() - t0 < 90
        assert_continues(c, frozen)
        assert f"{action} 1" in hook_runs(state), hook_runs(state)
        assert "did not finish in 3 s" in (tmp_path / "work2" / "restore.log").read_text()


def test_a_stalled_pre_dump_aborts_the_checkpoint_and_the_container_runs_on(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_HOOK_TIMEOUT", "3")
    env = runtime_env()
    with standin_gpu_container(tmp_path, env) as (c, state):
        v = wait_count(c.count_file, 10)
        Path(f"{state}.stall-at-pre-dump").touch()
        t0 = time.monotonic()
        p = c.checkpoint(tmp_path / "img", tmp_path / "work", check=False)
        assert p.returncode != 0 and time.monotonic() - t0 < 90
        assert "pre-dump 1" in hook_runs(state)
        assert c.state() is not None and wait_count(c.count_file, v + 5) > v, "the container keeps running"
        assert gpu_state(state) == ("RUNNING", True)
