"""gpusnap installed as software: a wheel of this tree in a fresh virtual env made from the system's
python3 gives the `gpusnap` and `gpusnap-criu-hook` commands, which run from outside the checkout and
for a user other than root; scripts/setup/install-system.sh (what setup.sh runs as root) does the same
into a prefix and links `gpusnap` into a bin directory, and a second run changes nothing and is quick."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.root

SYSTEM_PYTHON = "/usr/bin/python3"
PACKAGE_FILES = ("pyproject.toml", "README.md", "cli", "agents", "criu_hooks", "sandbox", "storage")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.fixture(scope="module", autouse=True)
def need_system_python() -> None:
    if os.geteuid() != 0:
        pytest.skip("runs commands as another user (needs root)")
    if not os.access(SYSTEM_PYTHON, os.X_OK) or subprocess.run([SYSTEM_PYTHON, "-c", "import venv, ensurepip"],
                                                               capture_output=True).returncode != 0:
        pytest.fail(f"{SYSTEM_PYTHON} with venv (python3-venv) is missing: run scripts/setup.sh")


def copy_of_the_tree(dest: Path) -> Path:
    """The package's files, as a fresh checkout would have them (no caches, no build output)."""
    dest.mkdir()
    for name in PACKAGE_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def as_nobody(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    """ARGV as uid 65534 with an empty environment, from / (outside any checkout)."""
    return subprocess.run([*NOBODY, "env", "-i", "PATH=/usr/bin:/bin", "HOME=/nonexistent", *argv],
                          capture_output=True, text=True, cwd="/", timeout=300, **kw)  # type: ignore[call-overload]


def world_readable(path: Path) -> None:
    """Let uid 65534 reach PATH (pytest's temporary directories are 0700)."""
    for p in [path, *path.parents]:
        if p == Path("/"):
            break
        p.chmod(p.stat().st_mode | 0o055)


def test_wheel_installs_into_a_fresh_system_venv(tmp_path: Path) -> None:
    src = copy_of_the_tree(tmp_path / "src")
    wheels = tmp_path / "wheels"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(wheels), str(src)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    wheel, = wheels.glob("gpusnap-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "storage/FORMAT.md" in names and "criu_hooks/action_script.py" in names
    assert {p.split("/")[0] for p in names if not p.startswith("gpusnap-")} == {
        "cli", "agents", "criu_hooks", "sandbox", "storage"}, "no tests or scripts in the wheel"
    assert "gpusnap = cli:main" in entry_points and "gpusnap-criu-hook = criu_hooks.action_script:main" in entry_points
    shutil.rmtree(src)   # nothing installed may need the tree it was built from
    venv = tmp_path / "venv"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], check=True, timeout=300)
    p = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    world_readable(venv)
    h = as_nobody([str(venv / "bin" / "gpusnap"), "--help"])
    assert h.returncode == 0 and "Usage: gpusnap" in h.stdout, h.stderr
    d = as_nobody([str(venv / "bin" / "gpusnap"), "doctor"])
    assert d.returncode == 0 and "CRIU" in d.stdout, d.stdout + d.stderr
    k = as_nobody([str(venv / "bin" / "gpusnap-criu-hook"), "--help"])
    assert k.returncode == 0 and "CRIU action script" in k.stdout, k.stderr
    where = as_nobody([str(venv / "bin" / "python"), "-c", "import storage, os; print(os.path.realpath(storage.__file__))"])
    assert where.stdout.strip().startswith(str(venv)), where.stdout


def test_install_system_script_links_gpusnap_and_second_run_is_quick(tmp_path: Path) -> None:
    src = copy_of_the_tree(tmp_path / "src")
    (src / "scripts" / "setup").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "setup" / "install-system.sh", src / "scripts" / "setup")
    criu = shutil.which("criu") or str(REPO / ".cache" / "criu" / "bin" / "criu")
    prefix, bindir, sbindir = tmp_path / "opt" / "gpusnap", tmp_path / "bin", tmp_path / "sbin"
    argv = [str(src / "scripts" / "setup" / "install-system.sh"), "--prefix", str(prefix), "--bindir", str(bindir),
            "--sbindir", str(sbindir), *(["--criu", criu] if os.path.isfile(criu) else [])]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0 and p.stdout.strip() == str(bindir / "gpusnap"), p.stderr[-2000:]
    assert not (src / "build").exists() and not list(src.glob("*.egg-info")), "the tree is left as it was"
    assert os.readlink(bindir / "gpusnap") == str(prefix / "bin" / "gpusnap")
    assert (prefix / "bin" / "python").resolve() == Path(SYSTEM_PYTHON).resolve()
    t0 = time.monotonic()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t0
    assert again.returncode == 0 and took < 5, (took, again.stderr[-1000:])
    if os.path.isfile(criu):
        assert (prefix / "libexec" / "criu").read_bytes() == Path(criu).read_bytes()
        assert os.readlink(sbindir / "criu") == str(prefix / "libexec" / "criu")
    shutil.rmtree(src)
    world_readable(tmp_path)
    h = as_nobody([str(bindir / "gpusnap"), "--help"])
    assert h.returncode == 0 and "Usage: gpusnap" in h.stdout, h.stderr
    # the installed commands run isolated: a sitecustomize.py on PYTHONPATH, or in the current directory,
    # never runs (it did as root with pip's launchers, issue 58)
    planted = tmp_path / "planted"
    planted.mkdir()
    ran = tmp_path / "sitecustomize-ran"
    (planted / "sitecustomize.py").write_text(f"open({str(ran)!r}, 'w').write('ran')\n")
    (planted / "cli.py").write_text(f"open({str(ran)!r}, 'w').write('shadowed')\n")
    for cmd in ("gpusnap", "gpusnap-criu-hook"):
        r = subprocess.run([str(bindir / cmd), "--help"], capture_output=True, text=True, cwd=planted, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(planted), "PYTHONSTARTUP": str(planted / "cli.py")})
        assert r.returncode == 0 and ("Usage: gpusnap" in r.stdout or "CRIU action script" in r.stdout), (cmd, r.stderr)
        assert not ran.exists(), f"{cmd} ran {ran.read_text()!r} code from PYTHONPATH or the current directory"
    head = (prefix / "bin" / "gpusnap").read_text().splitlines()[0]
    assert head == f"#!{prefix}/bin/python -IS", head
    # the control: the same planted file does run in a python that is not isolated
    subprocess.run([str(prefix / "bin" / "python"), "-c", "pass"], env={**os.environ, "PYTHONPATH": str(planted)},
                   timeout=60, check=True)
    assert ran.exists(), "the planted sitecustomize.py is one Python runs when not isolated"
    # the byte planes' C helper built in the tree (scripts/setup.sh) is installed with it, and loads
    if (REPO / "storage" / "native" / "libgpusnap_shuffle2.so").is_file():
        d = as_nobody([str(bindir / "gpusnap"), "doctor"])
        assert d.returncode == 0 and "byte planes in C" in d.stdout, d.stdout + d.stderr
