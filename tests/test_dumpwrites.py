"""How a dump writes its packs (sandbox.host.dumpwrites): the setting wins, else the machine decides,
and doctor's line says the same decision the dump takes."""
from __future__ import annotations

import pytest

from sandbox.host import dumpwrites
from storage.base.settings import SettingError


@pytest.mark.parametrize("reporting", [None, 9])
@pytest.mark.parametrize("asked,direct", [(None, None), ("0", False), ("1", True)])
def test_the_setting_wins_else_free_page_reporting_decides_and_doctor_says_the_same(
        monkeypatch: pytest.MonkeyPatch, reporting: int | None, asked: str | None, direct: bool | None) -> None:
    monkeypatch.setattr(dumpwrites, "free_page_reporting", lambda: reporting)
    if asked is None:
        monkeypatch.delenv("GPUSNAP_DUMP_DIRECT", raising=False)
        direct = reporting is not None
    else:
        monkeypatch.setenv("GPUSNAP_DUMP_DIRECT", asked)
    assert dumpwrites.dump_packs_direct() is direct
    line = dumpwrites.describe()
    assert line.startswith("written past" if direct else "written through"), line
    assert ("GPUSNAP_DUMP_DIRECT" in line) == (asked is not None), line
    assert ("hypervisor" in line) == (asked is None and direct), line


def test_a_bad_setting_is_refused_by_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_DUMP_DIRECT", "yes")
    with pytest.raises(SettingError, match="GPUSNAP_DUMP_DIRECT"):
        dumpwrites.dump_packs_direct()
    with pytest.raises(SettingError, match="GPUSNAP_DUMP_DIRECT"):
        dumpwrites.describe()
