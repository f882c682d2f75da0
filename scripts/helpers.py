"""What the Python scripts share: where the repository is, the environment a child process needs to
import the checkout, and cold-cache measurements (sync, then drop the kernel's page cache).

The scripts are a package: run them as modules from the repository root, e.g.
`python3 -m scripts.bench.bench_e2e --help`; no script patches sys.path."""
from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
    """os.environ with the checkout first on PYTHONPATH (for `python -m cli` children)."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def drop_caches(required: bool = False) -> bool:
    """Sync and drop the page cache (root only). Without root: raise if REQUIRED, else warn once."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError as e:
        if required:
            raise SystemExit(f"cannot drop the page cache ({e.strerror}): run the benchmark as root") from None
        print("(cannot drop caches: not root; read figures include the page cache)", file=sys.stderr)
        return False


def report_json(result: dict, path: str | None) -> None:
    """A benchmark's RESULT printed as indented JSON, and written to PATH too when one is given."""
    import json
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text)
