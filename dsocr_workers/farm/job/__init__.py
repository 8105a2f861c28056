"""The process that runs jobs (`process.py`) and one job's path from claim to result row (`execute.py`,
through the one claim path, `claims.py`; batched jobs: `batched.py`, `batch_steps.py`), with what serves
it: opening and warming the model before a claim (`opening.py`, `warm.py`), the next page prepared ahead
(`prefetch.py`), the ledger writes off the device's path (`ledger_threads.py`), the result row's columns
(`columns.py`) and the environment fingerprint its results reference (`fingerprint.py`)."""
