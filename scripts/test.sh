#!/usr/bin/env bash
# The test command (README): lint, type-check the package, run the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check dsocr_workers tests benchmarks
"$PY" -m mypy dsocr_workers
"$PY" -m pytest -q "$@"
