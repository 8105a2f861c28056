#!/usr/bin/env bash
# The main job on the embedded default, from a fresh clone: install, then profile the synthetic sample
# pages with the tiny random-weight preset on CPU, SQLite ledger, in-process worker (no Redis, no
# PostgreSQL), ending with the report. Extra arguments go to `dsocr run`, e.g.
#   bash scripts/demo.sh --model full --gpus 0        # on a GPU box
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

bash scripts/setup.sh

# The embedded default, whatever the shell has configured: the SQLite file ./dsocr.db, no broker.
export DSOCR_DATABASE_URL=sqlite:///./dsocr.db
unset DSOCR_BROKER_URL

"$PY" -m dsocr_workers db upgrade
# Random weights never choose EOS, so without a cap every page would decode up to the model's 8,192
# positions (the README's "Two commands to start" has the measured cost); 512 tokens a page keeps the
# demo to about two minutes on a 2-core machine, most of it the warm-up (the README has the measurement).
# Later arguments win: `bash scripts/demo.sh --max-new-tokens 8192` lifts it.
"$PY" -m dsocr_workers run datasets/samples/samples.txt --name demo --tag source=demo.sh --max-new-tokens 512 "$@"
