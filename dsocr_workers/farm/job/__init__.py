"""The process that runs jobs (`process.py`) and one job's path from claim to result row
(`execute.py`), with what serves it: the model's warm-up plan (`warm.py`), the next page prepared ahead
(`prefetch.py`), the ledger writes off the device's path (`ledger_threads.py`) and the environment
fingerprint its results reference (`fingerprint.py`)."""
