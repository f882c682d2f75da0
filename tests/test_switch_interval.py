"""GPUSNAP_SWITCH_INTERVAL (storage.base.settings.switch_interval): the interpreter's switch interval for gpusnap's
processes, a setting for measuring; a bad value is one line and exit 1 before anything is done."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from storage.base import settings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("value,want", [("", None), ("0.0005", 0.0005), ("1e-6", 1e-6), ("0.1", 0.1)])
def test_values_taken(value: str, want: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_SWITCH_INTERVAL", value)
    assert settings.switch_interval() == want


@pytest.mark.parametrize("value", ["abc", "0", "1e-7", "-0.001", "0.2", "nan", "inf"])
def test_values_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_SWITCH_INTERVAL", value)
    with pytest.raises(settings.SettingError, match="GPUSNAP_SWITCH_INTERVAL"):
        settings.switch_interval()


def test_applied_to_the_process() -> None:
    code = "import sys; from storage.base.settings import apply_switch_interval; apply_switch_interval(); print(sys.getswitchinterval())"
    env = {**os.environ, "GPUSNAP_SWITCH_INTERVAL": "0.0007"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0, r.stderr
    assert abs(float(r.stdout) - 0.0007) < 1e-9
    env.pop("GPUSNAP_SWITCH_INTERVAL")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert abs(float(r.stdout) - 0.005) < 1e-9  # Python's own when unset


def test_a_bad_value_is_one_line_at_the_cli(tmp_path: "os.PathLike[str]") -> None:
    env = {**os.environ, "GPUSNAP_SWITCH_INTERVAL": "fast"}
    r = subprocess.run([sys.executable, "-m", "cli", "--store", str(tmp_path), "store", "ls"], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip() == "gpusnap: GPUSNAP_SWITCH_INTERVAL='fast': expected seconds, from 1e-06 to 0.1"
    assert not os.listdir(tmp_path)  # nothing made
