"""The floor of a worker's start: what importing costs before any model is loaded.

Fresh processes, each timed from launch to exit (`python -X importtime -c "import ..."`), for the import
sets a worker's processes need: the interpreter alone, torch, a farm child's (Celery tasks + the
engine: session, fast engine, cold start), the parent's (CLI + Celery app), and torch with inductor. Each set in two bytecode states:

- `image`: the installation as it is (the GPU image ships torch without writable bytecode: every
  process compiles its sources again);
- `prefix`: after `python -m compileall` of the same packages into PYTHONPYCACHEPREFIX (what `dsocr
  precompile`, or an image build step, can write once), every process reading from it.

Then `dsocr worker --gpus 0 --warmup none` (its own redis-server and SQLite ledger) from launch to
Celery's "ready" and to its child's first log line, in both states: Celery's own start, no model.
`--gpus cpu --states image` measures the same on a machine without a GPU, in the installation's state.

    source benchmarks/device_env.sh && python3 benchmarks/probe_import_floor.py --out $OUT

JSON and markdown into --out (import-floor-<UTC>.{json,md}); `--repeats` runs of each (median, min).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.bench_start import DSOCR, start  # noqa: E402

IMPORT_SETS = {
    "interpreter": "pass",
    "torch": "import torch",
    "farm child": (
        "import dsocr_workers.farm.celery.tasks, dsocr_workers.engine.session, "
        "dsocr_workers.engine.variants.fast, dsocr_workers.engine.coldstart.warmup"
    ),
    "engine session": "import dsocr_workers.engine.session",
    # What `dsocr worker`'s parent imports for its children before it forks them (farm/celery/preimport.py).
    "pre-import": "from dsocr_workers.farm.celery.preimport import import_for_jobs; import_for_jobs()",
    # A lane starts Celery's worker through the app's Worker class (farm/celery/worker.py).
    "farm parent": "import dsocr_workers.cli, dsocr_workers.farm.celery.app, celery.apps.worker",
    # AOTInductor's C++ loader is torch._C's; inductor's Python (its package wrapper) costs this on top.
    "torch._inductor": "import torch, torch._inductor.config, torch._inductor.codecache",
}
PACKAGES = [
    "torch",
    "transformers",
    "triton",
    "celery",
    "kombu",
    "billiard",
    "sqlalchemy",
    "PIL",
    "numpy",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "click",
    "rich",
    "alembic",
    "redis",
    "jinja2",
    "sympy",
    "networkx",
    "filelock",
    "fsspec",
    "dsocr_workers",
    "scipy",
    "regex",
    "yaml",
    "packaging",
    "tqdm",
    "typing_extensions",
    "nvtx",
    "vine",
    "amqp",
    "dateutil",
    "tenacity",
    "greenlet",
    "mpmath",
]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def package_dirs() -> list[str]:
    """Where the packages a worker imports live (each package's folder), plus the standard library's."""
    import importlib.util

    found = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            found.extend(spec.submodule_search_locations)
        elif spec is not None and spec.origin:
            found.append(spec.origin)
    import sysconfig

    found.append(sysconfig.get_paths()["stdlib"])
    return sorted(set(found))


def bytecode_state() -> dict[str, Any]:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    origin = spec.origin if spec else ""
    return {
        "python": sys.version.split()[0],
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "dont_write_bytecode": sys.flags.dont_write_bytecode,
        "torch_source": origin,
        "torch_pyc_present": bool(origin) and os.path.exists(importlib.util.cache_from_source(origin)),
        "torch_dir_writable": bool(origin) and os.access(os.path.dirname(origin), os.W_OK),
        "cpu": next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            "?",
        ),
        "cores": os.cpu_count(),
    }


def timed_import(code: str, env: dict[str, str]) -> tuple[float, str]:
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)  # fmt: skip
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{code!r} failed: {done.stderr[-2000:]}")
    return wall, done.stderr


def top_modules(importtime: str, count: int = 15) -> dict[str, list[tuple[str, float]]]:
    """The top-level imports by cumulative seconds and the modules by self seconds."""
    rows = []
    for line in importtime.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if match:
            rows.append(
                (match.group(4), int(match.group(1)) / 1e6, int(match.group(2)) / 1e6, len(match.group(3)))
            )
    if not rows:
        return {}
    depth = min(r[3] for r in rows)
    cumulative = sorted(((name, round(c, 3)) for name, _, c, d in rows if d == depth), key=lambda r: -r[1])
    own = sorted(((name, round(s, 3)) for name, s, _, _ in rows), key=lambda r: -r[1])
    return {"top_level_cumulative_s": cumulative[:count], "self_s": own[:count],
            "sum_self_s": round(sum(r[1] for r in rows), 3)}  # fmt: skip


def measure_imports(env: dict[str, str], repeats: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, code in IMPORT_SETS.items():
        walls, last = [], ""
        for _ in range(repeats):
            wall, last = timed_import(code, env)
            walls.append(round(wall, 3))
        results[name] = {"wall_s": walls, "median_s": round(statistics.median(walls), 3), "min_s": min(walls),
                         **top_modules(last)}  # fmt: skip
        log(f"  {name}: {walls}")
    return results


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def worker_start(env: dict[str, str], folder: Path, repeats: int, gpus: str = "0") -> dict[str, Any]:
    """`dsocr worker --gpus GPUS --warmup none`: launch → Celery's ready line and the child's first line,
    and the parent's pre-import as the child's line reports it (`parent_import_s`): the rest of the start is
    the CLI, the ledger's check, the lane's Celery start and the child's opening of its device."""
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        return {"skipped": "no redis-server (carry .redis)"}
    port = free_port()
    redis = subprocess.Popen([redis_bin, "--port", str(port), "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    time.sleep(0.5)
    db = folder / "ledger.db"
    env = {**env, "DSOCR_BROKER_URL": f"redis://127.0.0.1:{port}/0", "DSOCR_DATABASE_URL": f"sqlite:///{db}"}
    try:
        subprocess.run(
            [*DSOCR, "db", "upgrade"], env=env, cwd=REPO, check=True, capture_output=True, timeout=120
        )
        runs = []
        for index in range(repeats):
            # A later --gpus overrides start()'s own (click keeps an option's last value).
            marks = start(env, folder, f"floor{index}", ["--gpus", gpus, "--warmup", "none"], 120,
                          until="child_opened_s")  # fmt: skip
            runs.append(marks)
            log(f"  worker start {index}: {marks}")
        return {"runs": runs}
    finally:
        redis.terminate()
        redis.wait()


def markdown(report: dict[str, Any]) -> str:
    lines = ["# Import floor of a worker's start", "", f"`{report['command']}`", "",
             f"{report['gpu']}; {json.dumps(report['bytecode'])}", "",
             f"compileall into PYTHONPYCACHEPREFIX: {report['compileall_s']} s", "",
             "| import set | image: median (min) s | prefix: median (min) s |", "| --- | --- | --- |"]  # fmt: skip
    states = ("image", "prefix")  # a state not measured (--states) is a column of "-"
    for name in IMPORT_SETS:
        cells = [f"{report[state]['imports'][name]['median_s']} ({report[state]['imports'][name]['min_s']})"
                 if state in report else "-" for state in states]  # fmt: skip
        lines.append(f"| {name} | {' | '.join(cells)} |")
    lines += [
        "",
        f"| worker start (--gpus {report['gpus']} --warmup none) | image | prefix |",
        "| --- | --- | --- |",
    ]
    for key in ("parent_import_s", "celery_ready_s", "child_opened_s"):
        cells = []
        for state in states:
            worker = report[state]["worker"] if state in report else {"skipped": "-"}
            cells.append(
                ", ".join(str(r.get(key, "-")) for r in worker.get("runs", [])) or worker.get("skipped", "-")
            )
        lines.append(f"| {key} | {' | '.join(cells)} |")
    last = "prefix" if "prefix" in report else "image"
    lines += ["", f"farm child ({last}), top-level imports by cumulative s: "
              + ", ".join(f"{n} {s}" for n, s in report[last]["imports"]["farm child"].get("top_level_cumulative_s", [])),
              ""]  # fmt: skip
    return "\n".join(lines)


def measure_prefix(
    env: dict[str, str], folder: Path, args: argparse.Namespace
) -> tuple[float, dict[str, Any]]:
    """The import sets and the worker's start after a `compileall` into PYTHONPYCACHEPREFIX; its seconds."""
    prefix_env = {**env, "PYTHONPYCACHEPREFIX": str(folder / "pyc")}
    began = time.perf_counter()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *package_dirs()], env=prefix_env,
                   capture_output=True, timeout=600)  # fmt: skip
    compiled_s = round(time.perf_counter() - began, 1)
    log(f"compileall: {compiled_s} s")
    return compiled_s, {"imports": measure_imports(prefix_env, args.repeats),
                        "worker": worker_start(prefix_env, folder, args.worker_repeats, args.gpus)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker-repeats", type=int, default=2)
    parser.add_argument("--gpus", default="0", help="the worker's --gpus (cpu on a machine without a GPU)")
    parser.add_argument(
        "--states", default="image,prefix", help="the bytecode states measured: image, prefix or both"
    )
    args = parser.parse_args()
    states = [state for state in ("image", "prefix") if state in args.states.split(",")]
    if not states or set(args.states.split(",")) - {"image", "prefix"}:
        parser.error(f"--states {args.states!r}: image, prefix or image,prefix")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip().splitlines()[:1] or ["no GPU"]  # fmt: skip
    except FileNotFoundError:  # a machine without a GPU driver (--gpus cpu)
        gpu = ["no GPU"]
    report: dict[str, Any] = {"command": " ".join(sys.argv), "gpu": gpu[0], "gpus": args.gpus,
                              "bytecode": bytecode_state(), "compileall_s": None}  # fmt: skip
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    base_env.pop("PYTHONPYCACHEPREFIX", None)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        if "image" in states:
            log("image's bytecode")
            report["image"] = {"imports": measure_imports(base_env, args.repeats),
                               "worker": worker_start(base_env, folder, args.worker_repeats, args.gpus)}  # fmt: skip
        if "prefix" in states:
            report["compileall_s"], report["prefix"] = measure_prefix(base_env, folder, args)
    stamp = time.strftime("%Y-%m-%dT%H%M", time.gmtime())
    tag = re.sub(r"[^a-z0-9]+", "-", report["gpu"].lower()).strip("-")[:20]
    (out / f"import-floor-{stamp}-{tag}.json").write_text(json.dumps(report, indent=2))
    (out / f"import-floor-{stamp}-{tag}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
