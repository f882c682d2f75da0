"""scripts/bench/fill_stalls: the samples of a restore's disk timeline in which nothing was read."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.bench.fill_stalls import main, stalls

COLUMNS = ["t", "busy_cores", "iowait_cores", "read_gbps", "write_gbps"]  # as scripts/bench/timeline.py records


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
