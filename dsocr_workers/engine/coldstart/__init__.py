"""A process's cold start: what it does once, when it opens a model, so that no job meets a compilation,
a graph capture or a first use of a cache bucket.

- `warmup.py`: the warm-up (`warm(session, ...)`, the one entry point, called when a process opens a
  model) and its report;
- `helpers.py`, `helper_process.py`: compile helpers, forked before the model loads, that compile the
  warm-up's graphs into the shared compile cache in parallel (share locks, done files);
- `cache.py`: where compilations and Python's bytecode persist between starts (DSOCR_COMPILE_CACHE_DIR).

The cold start uses the session (engine/session.py) and the engines (engine/variants/); neither knows it.
"""
