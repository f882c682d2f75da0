"""GPU test measurements: the size the GPU tests use ($GPUSNAP_TEST_GB, GiB) and where their figures go
($GPUSNAP_RESULTS, a JSON-lines file, as well as the test output); shared by every GPU test module."""
from __future__ import annotations

import json
import os
from typing import Any

GB = float(os.environ.get("GPUSNAP_TEST_GB", "2"))


def record(name: str, data: dict[str, Any]) -> None:
    """Measurements go to $GPUSNAP_RESULTS (a JSON-lines file) as well as the test output."""
    line = json.dumps({"test": name, **data})
    print(line)
    out = os.environ.get("GPUSNAP_RESULTS")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")
