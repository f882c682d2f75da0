#!/usr/bin/env bash
# Set up (idempotent, cached), type-check (mypy, zero errors) and run the whole CPU test suite against real CRIU, runsc, namespaces and
# disk. GPU tests skip here; scripts/gpu-tests.sh runs them on a GPU machine. Exit code 5 (pytest found
# no tests) is a failure, not a pass.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/setup.sh
export PATH="$root/.cache/criu/bin:$PATH"
scripts/setup/swift-setup.sh start >/dev/null  # one-node Swift with its S3 API on 127.0.0.1 (tests/test_remote.py)
# types first: mypy over the packages and tests/ ([tool.mypy] in pyproject.toml); any error fails the run
.venv/bin/python -m mypy
set +e
.venv/bin/python -m pytest -m "not gpu" "$@" tests
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "test.sh: pytest collected no tests: failing" >&2; exit 1; fi
exit "$rc"
