"""What a new user meets in the first hour (issue 14), through the real CLI: docs that stand alone,
--progress without a terminal, the help (exit codes, environment, every option explained), option
ranges, exit 4 for what the machine lacks, doctor's CRIU and nvCOMP detail, a quiet setup and a demo
that waits for its counter. The runsc items are in test_runsc.py (they need its sandboxes)."""
from __future__ import annotations

import ctypes.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import click
import pytest

from conftest import CODE_PACKAGES, GPUSNAP, REPO, Cli, pythonpath

from storage.base import errors


def _text_files() -> list[Path]:
    """The repository's tracked files (git), or every file outside caches when there is no .git."""
    if (REPO / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        return [REPO / p for p in out.decode().split("\0") if p]
    skip = {".git", ".venv", ".cache", "__pycache__", ".pytest_cache", ".whl", ".carry"}
    found = []
    for d, dirs, files in os.walk(REPO):
        dirs[:] = [x for x in dirs if x not in skip]
        found += [Path(d) / f for f in files]
    return found


# ------------------------------------------------------------------------------------------- item 1
def test_nothing_cites_notes_users_do_not_have() -> None:
    """The project's files stand alone: no reference to the developers' private notes; what users need
    from them is in docs/PLATFORM.md, which the README points to."""
    private = re.compile(r"FACTS\.md|DESIGN\.md|STYLE\.md|/work/shared")
    hits = []
    for p in _text_files():
        if p.resolve() == Path(__file__).resolve() or not p.is_file():
            continue
        try:
            text = p.read_text(errors="strict")
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{p.relative_to(REPO)}:{i}" for i, line in enumerate(text.splitlines(), 1) if private.search(line)]
    assert hits == [], hits
    platform = (REPO / "docs" / "PLATFORM.md").read_text()
    for must in ("vDSO", "--network=none", "hostinet", "THP", "libnvcomp.so.6", "GPUSNAP_CRIU"):
        assert must in platform, must
    assert "docs/PLATFORM.md" in (REPO / "README.md").read_text()


# ------------------------------------------------------------------------------------------- item 4
def test_progress_without_a_terminal(cli: Cli, tmp_path: Path) -> None:
    """stderr is a pipe here: by default nothing; --progress gives plain lines (the last one says the
    stage, the bytes and the rate); --no-progress nothing."""
    data = tmp_path / "data"
    data.write_bytes(os.urandom(3 << 20))
    quiet = cli.run("store", "put", "a", str(data))
    assert quiet.stderr == ""
    loud = cli.run("--progress", "store", "put", "b", str(data))
    lines = loud.stderr.splitlines()
    assert lines and re.fullmatch(r"put b: done, 0\.00 GB in \d+\.\d s, \d+\.\d\d GB/s", lines[-1]), loud.stderr
    assert "\x1b[" not in loud.stderr, "no terminal control sequences where stderr is not a terminal"
    got = cli.run("--progress", "store", "get", "b", str(tmp_path / "out"))
    assert got.stderr.splitlines()[-1].startswith("get b: done, ")
    assert cli.run("--no-progress", "store", "put", "c", str(data)).stderr == ""


def test_progress_lines_are_periodic() -> None:
    """The periodic line (every interval, here 0.05 s instead of 5): stage, done of total with the
    percentage, rate; then the final line; a failure says 'stopped'."""
    from cli.progress import Progress, Style
    r, w = os.pipe()
    with os.fdopen(w, "w") as stream, os.fdopen(r) as reader:
        with Progress("restore x", True, interval_s=0.05, stream=stream) as prog:
            assert prog.style is Style.LINES
            prog.start(4_000_000_000)
            for _ in range(4):
                prog.advance(500_000_000)
                time.sleep(0.06)
        with pytest.raises(RuntimeError):
            with Progress("put y", True, interval_s=10, stream=stream) as prog:
                prog.start(None)
                prog.advance(1)
                raise RuntimeError("the work failed")
        stream.close()
        lines = reader.read().splitlines()
    periodic = [l for l in lines if l.startswith("restore x: ") and "done" not in l]
    assert len(periodic) >= 2, lines
    assert re.fullmatch(r"restore x: \d+\.\d\d GB of 4\.00 GB \(\d+%\), \d+\.\d\d GB/s", periodic[0]), periodic
    assert re.fullmatch(r"restore x: done, 2\.00 GB in \d+\.\d s, \d+\.\d\d GB/s", lines[len(periodic)]), lines
    assert lines[-1].startswith("put y: stopped, "), lines


def test_progress_default_is_a_bar_on_a_terminal_only() -> None:
    from cli.progress import Style, choose_style
    assert choose_style(None, True) is Style.BAR and choose_style(None, False) is Style.OFF
    assert choose_style(True, True) is Style.BAR and choose_style(True, False) is Style.LINES
    assert choose_style(False, True) is Style.OFF and choose_style(False, False) is Style.OFF
    from cli.progress import Progress
    assert Progress("x", None, stream=io.StringIO()).enabled is False  # not a terminal, not asked


# ------------------------------------------------------------------------------------------- item 5
def test_help_names_exit_codes_and_environment(cli: Cli) -> None:
    out = cli.run("--help").stdout
    codes = {0: errors.EXIT_OK, 1: errors.EXIT_FAILED, 2: errors.EXIT_USAGE, 3: errors.EXIT_DAMAGED,
             4: errors.EXIT_UNAVAILABLE, 5: errors.EXIT_RECOVER}
    assert codes == {k: k for k in codes}
    for code, words in ((0, "success"), (1, "failed"), (2, "usage"), (3, "damage"), (4, "lacks"), (5, "recover")):
        assert re.search(rf"^\s+{code}\s+.*{words}", out, re.M), (code, out)
    for var in ("GPUSNAP_DEBUG", "GPUSNAP_STORE", "GPUSNAP_CRIU"):
        assert re.search(rf"^\s+{var}\s+\S", out, re.M), var
    assert "every 5 s" in out  # what --progress does where stderr is not a terminal


def test_every_option_has_help(cli: Cli) -> None:
    """Every option of every command explains itself; the two that did not, checked through --help."""
    from cli import main
    missing = []

    def walk(cmd: click.Command, path: str) -> None:
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.help:
                missing.append(f"{path} {p.opts[0]}")
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")
    walk(main, "gpusnap")
    assert missing == []
    assert "Replace an existing snapshot" in cli.run("runsc", "checkpoint", "--help").stdout
    assert re.search(r"--thp \[always\|keep\]\s+Transparent huge pages", cli.run("gpu", "restore", "--help").stdout)


def test_runsc_arg_help_is_truthful(cli: Cli) -> None:
    """Only checkpoint records runsc's flags in a snapshot; run and delete say what they do with them."""
    def helptext(cmd: str) -> str:
        return " ".join(cli.run("runsc", cmd, "--help").stdout.split())
    assert "recorded in the snapshot" in helptext("checkpoint")
    for cmd in ("run", "delete", "restore"):
        assert "recorded in the snapshot" not in helptext(cmd).replace("instead of the ones recorded in the snapshot", ""), cmd
    assert "passed to `runsc run`" in helptext("run") and "to find the sandbox" in helptext("delete")


@pytest.mark.parametrize("cmd", ["put", "get"])
def test_workers_must_be_at_least_one(cli: Cli, tmp_path: Path, cmd: str) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x")
    cli.run("store", "put", "s", str(f))
    args = ["store", "put", "t", str(f)] if cmd == "put" else ["store", "get", "s", str(tmp_path / "o")]
    p = cli.run(*args, "--workers", "0", check=False)
    assert p.returncode == 2 and "--workers" in p.stderr and "0" in p.stderr, p.stderr
    assert not (tmp_path / "o").exists() and [s["name"] for s in cli.json("store", "ls")] == ["s"]
    cli.run(*args, "--workers", "1")


def test_gpus_all_without_a_gpu_exits_4(cli: Cli, tmp_path: Path) -> None:
    """No GPU is an environment condition (exit 4), not a usage error (2); under --json a JSON error."""
    from sandbox.runsc.oci_bundle import build_bundle
    if any(n.startswith("nvidia") and n[6:].isdigit() for n in os.listdir("/dev")):
        pytest.skip("this machine has NVIDIA GPUs")
    bundle = build_bundle(str(tmp_path / "b"), ["/bin/true"])
    p = cli.run("runsc", "run", f"g-{os.getpid()}", "--bundle", bundle, "--gpus", "all", check=False)
    assert p.returncode == errors.EXIT_UNAVAILABLE == 4, p.stderr
    assert len(p.stderr.splitlines()) == 1 and "no NVIDIA GPU" in p.stderr, p.stderr
    assert sorted(os.listdir(bundle)) == ["config.json"]


def test_no_criu_exits_4(tmp_path: Path) -> None:
    """Without any usable CRIU, `criu dump` exits 4 with one line saying how to get one. Each place
    gpusnap looks is made empty for real: the CLI runs from a copy of the code (so the project's own
    build, .cache/criu beside the code, is not there), with no criu on PATH and GPUSNAP_CRIU empty, in
    a mount namespace of its own where an empty directory is bind-mounted over /usr/local/sbin (setup
    installs a CRIU there; the host's /usr/local/sbin is not touched)."""
    unshare = shutil.which("unshare")
    if not unshare:
        pytest.fail("unshare (util-linux) is missing")
    host_has_criu = os.path.lexists("/usr/local/sbin/criu")
    code = tmp_path / "code"
    for pkg in CODE_PACKAGES:
        shutil.copytree(REPO / pkg, code / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PYTHONPATH": str(code), "PATH": str(empty), "GPUSNAP_CRIU": ""}
    # root makes a private mount namespace; anyone else a user namespace too (as root inside it)
    ns = [unshare, "--mount", "--propagation", "private"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    masked = ["/bin/sh", "-c", 'PATH=/usr/bin:/bin /usr/bin/mount --bind "$0" /usr/local/sbin && '
              'test ! -e /usr/local/sbin/criu && exec "$@"', str(empty)]
    p = subprocess.run([*ns, *masked, *GPUSNAP, "--store", str(tmp_path / "store"), "criu", "dump", str(os.getpid()),
                        "x"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert p.returncode == 4 and "CRIU >= 4.0 not found" in p.stderr and len(p.stderr.splitlines()) == 1, \
        (p.returncode, p.stderr)
    assert os.path.lexists("/usr/local/sbin/criu") == host_has_criu, "the mask leaked out of its namespace"


# ------------------------------------------------------------------------------------------- item 6
def test_doctor_says_which_criu_and_why(cli: Cli, tmp_path: Path) -> None:
    from sandbox.criu.runner import find_criu
    real = find_criu()
    if real is None:
        pytest.fail("no CRIU >= 4 here: run scripts/setup.sh")
    chosen = cli.json("doctor")["criu_binary"]
    assert chosen["path"] == real and chosen["why"] in ("PATH", "the project's build by scripts/setup.sh",
                                                         "/usr/local/sbin")
    pinned = Cli(cli.store).run("doctor", "--json", env={"GPUSNAP_CRIU": real})
    got = json.loads(pinned.stdout)["criu_binary"]
    assert {k: got[k] for k in ("path", "why", "passed_over")} == {"path": real, "why": "GPUSNAP_CRIU", "passed_over": []}
    assert got["known_failures"] == [] and got["version"]
    bogus = tmp_path / "criu"
    bogus.write_text("not a program\n")  # mode 0644: not executable
    p = Cli(cli.store).run("doctor", env={"GPUSNAP_CRIU": str(bogus)})
    line = next(l for l in p.stdout.splitlines() if l.startswith("CRIU binary"))
    assert real in line and "chosen:" in line, p.stdout
    assert f"passed over {bogus} (GPUSNAP_CRIU): not an executable file" in p.stdout, p.stdout


def _nvcomp_loads() -> bool:
    try:
        from nvidia import nvcomp  # noqa: F401
        return True
    except Exception:  # noqa: BLE001
        return False


def test_doctor_says_which_nvcomp_wheel_is_missing(cli: Cli, tmp_path: Path) -> None:
    """Neither wheel: doctor names the Python package. The Python package without its library (an
    install with --no-deps): doctor names libnvcomp.so.6 and the wheel that has it. That second case
    uses the real wheel where one is carried in .whl/; else a package that, like the real one, loads
    libnvcomp.so.6 when imported (skipped where that library really is installed)."""
    if _nvcomp_loads():
        pytest.skip("nvCOMP is installed and loads here")
    d = cli.json("doctor")
    assert d["nvcomp"] is None and "nvidia-nvcomp-cu13" in d["nvcomp_missing"], d["nvcomp_missing"]
    site = tmp_path / "site"
    wheels = sorted((REPO / ".whl").glob("nvidia_nvcomp_cu13-*.whl")) if (REPO / ".whl").is_dir() else []
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        str(site), str(wheels[-1])], check=True)
    else:
        if ctypes.util.find_library("nvcomp"):
            pytest.skip("libnvcomp is installed system-wide")
        pkg = site / "nvidia" / "nvcomp"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text('import ctypes\n_lib = ctypes.CDLL("libnvcomp.so.6")\n__version__ = "6"\n')
    p = Cli(cli.store).run("doctor", "--json", env={"PYTHONPATH": f"{pythonpath()}{os.pathsep}{site}"})
    missing = json.loads(p.stdout)["nvcomp_missing"]
    assert "libnvcomp.so.6" in missing and "install nvidia-libnvcomp-cu13" in missing, missing
    text = Cli(cli.store).run("doctor", env={"PYTHONPATH": f"{pythonpath()}{os.pathsep}{site}"}).stdout
    assert re.search(r"^nvCOMP\s+not usable: .*nvidia-libnvcomp-cu13", text, re.M), text


def test_gpu_extra_has_both_nvcomp_wheels_and_the_readme_says_how() -> None:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    names = {re.split(r"[<>=!~ ]", r, maxsplit=1)[0] for r in extra}
    assert {"cuda-bindings", "nvidia-nvcomp-cu13", "nvidia-libnvcomp-cu13"} <= names, extra
    assert ".venv/bin/pip install -e '.[gpu]'" in (REPO / "README.md").read_text()


# ------------------------------------------------------------------------------------------- item 8
def _set_up_here() -> None:
    if os.geteuid() != 0:
        pytest.skip("setup and the demo run as root")
    if not (REPO / ".cache" / "venv.stamp").exists():
        pytest.skip("scripts/setup.sh has not run in this checkout (CI runs it before the tests)")


def test_setup_is_quiet(tmp_path: Path) -> None:
    """A second setup prints one summary line; the details are in its log."""
    _set_up_here()
    p = subprocess.run(["scripts/setup.sh"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "" and len(p.stderr.splitlines()) == 1 and p.stderr.startswith("setup: ok in "), p.stderr
    assert "log " in p.stderr and (REPO / ".cache" / "setup.log").exists()
    assert "DPkg::Lock::Timeout=300" in (REPO / "scripts" / "setup.sh").read_text()


def test_demo_waits_for_its_counter() -> None:
    """The demo end to end (real CRIU, the default store): the counts it prints are numbers, the
    restored process counts on, and the shell prints no job noise."""
    _set_up_here()
    p = subprocess.run(["scripts/demo.sh"], cwd=REPO, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "demo: OK" in p.stdout, out
    first = re.search(r"^pid \d+, counted to (\d+)$", p.stdout, re.M)
    gone = re.search(r"^the process is gone; it had counted to (\d+)$", p.stdout, re.M)
    on = re.search(r"^restored pid \d+ counts on: (\d+) -> (\d+)$", p.stdout, re.M)
    assert first and gone and on, out
    assert 0 < int(first.group(1)) <= int(gone.group(1)) == int(on.group(1)) < int(on.group(2))
    assert "Killed" not in out and "tail:" not in out and "Terminated" not in out, out


# --------------------------------------------------------------------------------------- structure
def test_scripts_are_modules_without_path_patches() -> None:
    """scripts/ is a package of folders run as `python3 -m scripts.X.Y` from the repo root: no script
    patches sys.path or imports another module's private name."""
    private_import = re.compile(r"^\s*from\s+\S+\s+import\s+.*\b_[a-z]\w*", re.M)
    for p in sorted((REPO / "scripts").rglob("*.py")):
        text = p.read_text()
        assert not re.search(r"sys\.path\s*(\.insert|\.append|\.extend|\[|\+?=)", text), p
        assert not private_import.search(text), p
    for sub in ("setup", "bench", "device", "workloads"):
        assert (REPO / "scripts" / sub).is_dir(), sub
    for kept in ("test.sh", "demo.sh", "setup.sh", "gpu-tests.sh"):
        assert os.access(REPO / "scripts" / kept, os.X_OK), kept
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.bench_store", "--help"], cwd=REPO,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=pythonpath()))
    assert proc.returncode == 0 and "--gb" in proc.stdout, proc.stderr


def test_workload_command_protocol_round_trip(tmp_path: Path) -> None:
    """The GPU workloads' control protocol (scripts/workloads/command_loop.py) spoken by a CPU process
    and driven by the controller the benchmarks use."""
    from scripts.workloads.workload_control import Workload
    code = ("import os, sys\n"
            "from scripts.workloads.command_loop import announce, serve\n"
            "state = {'n': 0}\n"
            "def handle(cmd):\n"
            "    if cmd[0] == 'add':\n"
            "        state['n'] += int(cmd[1]); return {'ok': True, 'n': state['n']}\n"
            "    return {'ok': False, 'error': 'unknown ' + cmd[0]}\n"
            "announce(sys.argv[1], {'pid': os.getpid(), 'size': 0})\n"
            "serve(sys.argv[1], handle)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=pythonpath()))
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        w = Workload.__new__(Workload)  # the controller without starting a GPU workload
        w.dir, w.proc, w.pid = str(tmp_path), proc, json.loads((tmp_path / "ready").read_text())["pid"]
        assert w.cmd("add 2") == {"cmd": "add", "ok": True, "n": 2, "seconds": pytest.approx(0, abs=5)}
        assert w.cmd("add 5")["n"] == 7
        assert w.cmd("nonsense")["ok"] is False
        w.close()  # `exit`: the workload ends
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
