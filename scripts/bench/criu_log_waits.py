"""Where a CRIU restore waited: the pauses between consecutive lines of its log (-v4, as gpusnap keeps it
with GPUSNAP_CRIU_LOGS), summed by what CRIU had just logged.

A pause after "Read page from self" is CRIU waiting for the page image's next bytes (served by gpusnap
on a streamed restore); after "premap", mapping the next area (a file's first area opens and checks
the file, cold reads CRIU makes itself); the rest is "other". Usage:
    python3 -m scripts.bench.criu_log_waits LOG[.xz] [LOG ...] [--min-ms 20]
"""
from __future__ import annotations

import argparse
import json
import lzma
import re
import sys
from typing import IO

_STAMP = re.compile(r"^\((\d+)\.(\d+)\)")


def kind(line: str) -> str:
    if "Read page from self" in line:
        return "page-read"
    if "premap" in line:
        return "premap"
    return "other"


def waits(f: IO[str], min_s: float) -> dict[str, object]:
    """{"seconds": the log's span, "waits": {kind: {"n", "seconds"}}} for pauses of at least MIN_S."""
    last: float | None = None
    prev = ""
    out: dict[str, dict[str, float]] = {}
    for line in f:
        m = _STAMP.match(line)
        if m is None:
            continue
        t = int(m.group(1)) + int(m.group(2)) / 10 ** len(m.group(2))
        if last is not None and t - last >= min_s:
            w = out.setdefault(kind(prev), {"n": 0, "seconds": 0.0})
            w["n"] += 1
            w["seconds"] = round(w["seconds"] + t - last, 4)
        last, prev = t, line
    return {"seconds": last or 0.0, "waits": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--min-ms", type=float, default=20.0, help="the shortest pause counted (default 20 ms)")
    a = ap.parse_args()
    for p in a.logs:
        opener = lzma.open if p.endswith(".xz") else open
        try:
            with opener(p, "rt", errors="replace") as f:  # type: ignore[operator]
                print(json.dumps({"log": p, **waits(f, a.min_ms / 1000)}))
        except (OSError, lzma.LZMAError) as e:
            sys.exit(f"{p}: {e}")


if __name__ == "__main__":
    main()
