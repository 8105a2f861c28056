#!/usr/bin/env bash
# The test command (README): lint, type-check the package, run the suite.
#   bash scripts/test.sh                 the CI suite
#   bash scripts/test.sh --run-slow      also the long scenarios (marked slow)
#   bash scripts/test.sh -n 0 tests/x    any pytest arguments; `-n 0` runs in this one process
# pytest-xdist runs 3 test processes: most of the long tests wait on worker subprocesses, leases,
# outages and compilation, so on 2 cores a third process keeps the CPUs busy while one of them waits.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check dsocr_workers tests benchmarks
"$PY" -m mypy dsocr_workers
"$PY" -m pytest -q -n 3 --dist loadgroup "$@"
