"""scripts/bench/fill_stalls: the samples of a restore's disk timeline in which nothing was read."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from scripts.bench.fill_stalls import idle_disk, main, stalls
from scripts.bench.timeline import Timeline

COLUMNS = ["t", "busy_cores", "iowait_cores", "read_gbps", "write_gbps"]  # as scripts/bench/timeline.py recorded until 2026-12-06
NOW = list(Timeline.COLUMNS)  # ... and since: steal cores and the disk's busy share added


def test_only_active_samples_count_and_a_stall_is_one_that_read_nothing() -> None:
    #        t    busy iowait read  write
    rows = [[0.1, 1.0, 0.0, 0.0, 0.0],   # idle: neither waiting nor reading
            [0.2, 4.0, 3.0, 2.0, 0.0],   # reading
            [0.3, 0.5, 6.5, 0.0, 0.0],   # waiting, nothing read: a stall
            [0.4, 3.0, 0.5, 1.0, 0.0],   # reading, little waiting
            [0.5, 1.0, 0.2, 0.0, 0.0]]   # idle again
    assert stalls({"columns": COLUMNS, "rows": rows}, 1.0) == (3, 1, pytest.approx(1.0))
    assert stalls({"columns": COLUMNS, "rows": []}, 1.0) == (0, 0, 0.0)
    assert stalls({}, 1.0) == (0, 0, 0.0)


def test_main_reports_fill_and_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = {"gpusnap_stream": {"restore_timeline": {"columns": COLUMNS, "rows": [[0.1, 1, 6, 0.0, 0], [0.2, 1, 2, 2.0, 0]]}},
           "baseline": {"criu_restore_timeline": {"columns": COLUMNS, "rows": [[0.1, 1, 0.5, 1.5, 0]]}}}
    (tmp_path / "e2e.json").write_text(json.dumps(run))
    (tmp_path / "none.json").write_text(json.dumps({"baseline": {}}))  # no restore timeline: no line
    main([str(tmp_path / "e2e.json"), str(tmp_path / "none.json")])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and "fill 1/2 samples read nothing (50.0%), mean 1.00 GB/s | baseline 0/1, mean 1.50 GB/s" in out[0]


def test_a_sample_inside_a_long_read_is_not_an_idle_disk() -> None:
    #        t    busy iowait read write steal disk_busy
    rows = [[0.1, 4.0, 3.0, 2.0, 0.0, 0.0, 1.0],   # reading
            [0.2, 0.5, 6.0, 0.0, 0.0, 0.0, 1.0],   # nothing completed, a request in flight all along
            [0.3, 0.5, 6.0, 0.0, 0.0, 0.0, 0.2],   # nothing completed, the disk mostly idle: a stall
            [0.4, 1.0, 0.1, 0.0, 0.0, 0.0, 0.0]]   # not active
    tl = {"columns": NOW, "rows": rows}
    assert stalls(tl, 1.0) == (3, 2, pytest.approx(2.0 / 3))
    assert idle_disk(tl, 1.0) == 1
    assert idle_disk({"columns": COLUMNS, "rows": [r[:5] for r in rows]}, 1.0) is None  # recorded before the column


def test_main_says_how_many_found_the_disk_idle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = {"gpusnap_stream": {"restore_timeline": {"columns": NOW, "rows": [[0.1, 1, 6, 0.0, 0, 0, 0.9],
                                                                           [0.2, 1, 6, 0.0, 0, 0, 0.1],
                                                                           [0.3, 1, 2, 2.0, 0, 0, 1.0]]}}}
    (tmp_path / "e2e.json").write_text(json.dumps(run))
    main([str(tmp_path / "e2e.json")])
    assert "fill 2/3 samples read nothing (66.7%, 1 with the disk idle), mean 0.67 GB/s | no baseline timeline" \
        in capsys.readouterr().out


def test_the_timeline_records_every_column_it_names(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.write_bytes(b"x" * (8 << 20))
    with Timeline(str(tmp_path), interval=0.05) as tl:
        end = time.monotonic() + 0.4
        while time.monotonic() < end:
            with open(data, "rb") as f:
                while f.read(1 << 20):
                    pass
    j = tl.as_json(0.0)
    assert j["columns"] == NOW and len(j["rows"]) >= 2
    col = {c: i for i, c in enumerate(NOW)}
    for r in j["rows"]:
        assert len(r) == len(NOW)
        assert 0.0 <= r[col["disk_busy"]] <= 1.0 and r[col["steal_cores"]] >= 0.0 and r[col["busy_cores"]] >= 0.0
    span = tl.span(tl.rows[0][0] - 0.05, tl.rows[-1][0])
    assert {"steal_cores", "disk_busy", "busy_cores"} <= span.keys()
