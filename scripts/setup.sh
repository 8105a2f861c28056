#!/usr/bin/env bash
# Install the project and its test dependencies into the current Python.
# torch==2.13.0 first: on the project machines it resolves to the local CPU build; any looser pin
# would pull the CUDA build and gigabytes of libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[dev]'
