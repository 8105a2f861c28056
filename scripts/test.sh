#!/usr/bin/env bash
# The test command (README): lint, type-check the package, run the suite.
#   bash scripts/test.sh                 the CI suite
#   bash scripts/test.sh --run-slow      also the long scenarios (marked slow)
#   bash scripts/test.sh -n 0 tests/x    any pytest arguments; `-n 0` runs pytest in one process
# pytest-xdist runs 3 test processes: most of the long tests wait on worker subprocesses, leases,
# outages and compilation, so on 2 cores a third process keeps the CPUs busy while one of them waits.
# They take tests one by one in collection order, the longest first (tests/conftest.py LONGEST).
# mypy (one core, ~40 s from a fresh clone) runs beside pytest for the same reason; its output is
# shown only when it finds something, so that pytest's summary stays the last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# One OpenMP thread per process (tests and the workers they start): three test processes, each with
# torch's default of a thread per core, plus their workers oversubscribe 2 cores, and OpenMP's threads
# spin while they wait — the engine tests took 5 min 10 s and 10 CPU-minutes that way, 2 min 26 s and
# 4.4 CPU-minutes with one thread each (tests/engine/test_batched.py + test_session.py, -n 3, this machine).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PY" -m ruff check dsocr_workers migrations tests benchmarks

mypy_out=$(mktemp)
"$PY" -m mypy dsocr_workers migrations >"$mypy_out" 2>&1 &
mypy_pid=$!
trap 'kill "$mypy_pid" 2>/dev/null || true; rm -f "$mypy_out"' EXIT

status=0
# The slowest tests are listed before the summary: what to look at when the suite gets slower.
"$PY" -m pytest -q -n 3 --dist loadgroup --durations=15 "$@" || status=$?
if ! wait "$mypy_pid"; then
  cat "$mypy_out" >&2
  echo "mypy dsocr_workers migrations failed (above)" >&2
  [ "$status" -ne 0 ] || status=1
fi
exit "$status"
