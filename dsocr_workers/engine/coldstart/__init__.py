"""A process's cold start: what it does once, when it opens a model, so that no job meets a compilation,
a graph capture or a first use of a cache bucket. One mechanism: the build step (`dsocr precompile`) makes
what a start needs ahead, and a start loads it and captures its CUDA graphs.

- `build.py`: the build step; `aoti.py` its AOTInductor packages (every region the fast engine compiles,
  the batched engine's step included); `artifacts.py` their manifest, its key and the refusal of
  artifacts built for something else, and the host lock by which one process compiles a plan at a time;
- `warmup.py`: the warm-up (`warm(session, ...)`, the one entry point, called when a process opens a
  model) and the batched engine's start (`start_batched`); `passes.py` the warm-up's pages; `plan.py`
  what a warm-up depends on;
- `cache.py`: where compilations and Python's bytecode persist between starts (DSOCR_COMPILE_CACHE_DIR).

The cold start uses the session (engine/session.py), the engines (engine/variants/) and the batched engine
(engine/batched/); none of them knows it.
"""
