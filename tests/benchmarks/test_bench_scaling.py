"""benchmarks/bench_scaling.py at its edges: a ledger it cannot use is refused before Redis or a worker
starts, the --keep-logs folder is made up front, and the results say which dsocr_workers ran."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_scaling.py"
PG_ADMIN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"


@pytest.fixture(scope="module")
def bench(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("bench_scaling")


def run_script(database_url: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # --gpus cpu: without it a machine with no GPU stops at the GPU count, before the ledger is looked at.
    command = [sys.executable, str(SCRIPT), "--gpus", "cpu", "--database-url", database_url,
               "--out", str(tmp_path / "out")]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=60)


def assert_refused_early(result: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    # Nothing started: the results folder is made, and redis-server started, only after the check.
    assert "redis-server" not in result.stdout
    assert not (tmp_path / "out").exists()


def test_unmigrated_sqlite_is_refused_with_the_upgrade_command(tmp_path: Path) -> None:
    result = run_script(f"sqlite:///{tmp_path / 'empty.db'}", tmp_path)
    assert result.returncode == 2, result.stderr
    assert "dsocr db upgrade" in result.stderr
    assert_refused_early(result, tmp_path)


@pytest.fixture
def empty_postgres_url() -> Iterator[str]:
    import psycopg

    name = f"dsocr_bench_{uuid.uuid4().hex[:10]}"
    try:
        with psycopg.connect(PG_ADMIN, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE DATABASE {name}")
    except psycopg.Error as exc:
        pytest.skip(f"no PostgreSQL to create a scratch database on: {exc}")
    yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.mark.postgres
def test_unmigrated_postgres_is_refused_with_the_upgrade_command(empty_postgres_url: str, tmp_path: Path) -> None:
    result = run_script(empty_postgres_url, tmp_path)
    assert result.returncode == 2, result.stderr
    assert "dsocr db upgrade" in result.stderr
    assert_refused_early(result, tmp_path)


def test_unreachable_database_exits_3(tmp_path: Path) -> None:
    result = run_script("postgresql+psycopg://nobody@127.0.0.1:1/x", tmp_path)  # port 1: refused at once
    assert result.returncode == 3, result.stderr
    assert "database unavailable" in result.stderr
    assert_refused_early(result, tmp_path)


def test_environment_names_the_imported_package(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    import dsocr_workers

    monkeypatch.setenv("DSOCR_GIT_SHA", "0123abc")
    env = bench.environment()
    assert env["dsocr_workers"] == str(Path(dsocr_workers.__file__).resolve().parent)
    assert env["git_sha"] == "0123abc"


def test_output_folders_creates_the_keep_logs_folder(bench: ModuleType, tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "not" / "yet" / "logs"
    assert bench.output_folders(out, logs) == out
    assert out.is_dir() and logs.is_dir()


def test_gap_split_parts_the_idle_time_between_consecutive_jobs_of_a_session():
    from benchmarks.bench_scaling import gap_split

    def job(session, claimed, started, device_finished, finished):
        return {"session": session, "claimed_s": claimed, "device_started_s": started,
                "device_finished_s": device_finished, "finished_s": finished}  # fmt: skip

    rows = [job("a", 0.000, 0.001, 0.100, 0.102), job("b", 0.000, 0.002, 0.300, 0.301),
            job("a", 0.106, 0.107, 0.200, 0.203), job("a", 0.209, 0.2085, 0.300, 0.302)]  # fmt: skip
    split = gap_split(rows)
    # Lane a only has consecutive pairs: (0.100 → 0.102, 0.102 → 0.106, 0.106 → 0.107) and
    # (0.200 → 0.203, 0.203 → 0.209, 0.209 → 0.2085: a device start before the claim's start).
    assert [round(split[name]["p50"], 3) for name in split] == [2.5, 5.0, 0.25]


def test_prefetch_verdict_says_whether_the_busy_share_is_shown_or_only_estimated():
    from benchmarks.bench_scaling import prefetch_verdict

    def verdict(value, interval):
        low, high = interval or (None, None)
        return prefetch_verdict({"device_idle_ms": {"p90": 7.2},
                                 "device_busy_share": {"value": value, "low": low, "high": high}})  # fmt: skip

    assert "share of a job between jobs 0.954 ≥ 0.95 by the estimate, not shown" in verdict(0.954, [0.934, 0.967])
    assert "≥ 0.95 shown (95% interval 0.951-0.970)" in verdict(0.96, [0.951, 0.970])
    assert "between jobs 0.948 < 0.95" in verdict(0.948, [0.93, 0.96])
    assert verdict(0.96, None).endswith("(no interval: not shown)")
    assert verdict(0.96, None).startswith("idle p90 7.2 ms ≤ 10; ")
    assert prefetch_verdict({"device_idle_ms": {"p90": 7.2}}) == "not measured"


def test_docs_get_the_runs_tables_command_and_curves_as_their_newest_section(bench: ModuleType, tmp_path: Path) -> None:
    import json

    results = SCRIPT.parent / "results"
    report = json.loads((results / "scaling-2026-11-27T0451-h200x2-c128-8-threads.json").read_text())
    report["plots"] = ["scaling-2026-11-27T0451-sweep-k1.png"]
    # A run's Batch steps figures (step_stats; this older result has none).
    report["runs"][-1]["stats"]["steps"] = {
        "prefill_steps": 900, "split_prefills": 0, "decode_steps": 8000, "prefill_p50_ms": 16.94, "prefill_p90_ms": 30.2,
        "prefill_mean_ms": 28.04, "decode_64_p50_ms": 6.992, "prefill_share": 0.3268, "step_share_of_span": 0.9619}  # fmt: skip
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.parent.mkdir()
    docs.write_text("# Benchmarks\n\nPreamble.\n\n## An older section\n\nIts text.\n")
    out = tmp_path / "benchmarks" / "results"
    bench.publish(docs, report, out / "scaling-2026-11-27T0451.md", out)
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nPreamble.\n\n## bench_scaling on NVIDIA H200 x 2, 2026-11-27 04:51 UTC\n")
    newest = text[: text.index("## An older section")]
    assert "| fast | 2 | 128 | 900 (900 / 0) |" in newest  # the scaling table
    assert "Serving (the report's Serving table" in newest and report["command"] in newest
    assert "| fast | 2 | 128 | 900 / 0 | 16.9 / 30.2 / 28.0 | 6.99 | 32.7% | 96.2 |" in newest  # its Batch steps
    assert "](../benchmarks/results/scaling-2026-11-27T0451-sweep-k1.png)" in newest
    assert "Raw: `../benchmarks/results/scaling-2026-11-27T0451.md`" in newest
    assert text.endswith("## An older section\n\nIts text.\n")


def test_best_level_is_the_first_ks_level_with_the_most_output_tokens():
    from benchmarks.bench_scaling import best_level

    def run(k, concurrency, tokens_per_s):
        serving = None if tokens_per_s is None else {"output_tokens_per_s": tokens_per_s}
        return {"engine": "fast", "k": k, "concurrency": concurrency, "stats": {"serving": serving}}

    runs = [run(1, 64, 8_000.0), run(1, 128, 14_000.0), run(1, 256, 13_500.0), run(2, 64, 30_000.0),
            run(1, 512, None)]  # fmt: skip
    assert best_level(runs, "fast", 1) == 128
    assert best_level(runs, "fast", 2) == 64
    assert best_level(runs, "fast", 4) is None
    assert best_level(runs, "eager", 1) is None


def test_the_worker_starts_the_first_levels_batched_engine_before_it_is_ready(bench: ModuleType) -> None:
    args = bench.argparse.Namespace(gpus="cpu", worker_loglevel="INFO", warmup="small", model="tiny",
                                    max_new_tokens=8)  # fmt: skip
    options = {"--warmup", "--model", "--engine", "--max-new-tokens", "--concurrency"}
    batched = bench.worker_command(args, "fast", 1, "q", options, 128)
    assert batched[batched.index("--concurrency") + 1] == "128"
    assert "--concurrency" not in bench.worker_command(args, "fast", 1, "q", options, 1)
    # A checkout's worker without the option is started as before.
    assert "--concurrency" not in bench.worker_command(args, "fast", 1, "q", options - {"--concurrency"}, 128)


def test_a_sweep_continued_runs_only_what_its_earlier_calls_did_not_complete(bench: ModuleType, tmp_path: Path) -> None:
    settings = {"filelist": "demo-18.txt", "model": "full", "mode": "gundam", "warmup": "gundam",
                "max_new_tokens": 1024, "ignore_eos": True, "generations": 5}  # fmt: skip
    assert bench.earlier_sweep(tmp_path, settings) == []  # its first call
    runs = [
        {"engine": "fast", "k": 1, "concurrency": 256, "status": "complete", "run_id": "a"},
        {"engine": "fast", "k": 1, "concurrency": 64, "status": "timed out after 80 s with 90/324 final",
         "run_id": "b"},
        {"engine": "fast", "k": 1, "concurrency": 32, "status": "skipped: out of --budget-s"},
        {"engine": "fast", "k": 2, "concurrency": 256, "status": "complete", "run_id": "c"},
    ]  # fmt: skip
    (tmp_path / "sweep.json").write_text(bench.json.dumps({"settings": settings, "runs": runs}))
    done = bench.earlier_sweep(tmp_path, settings)
    assert [r["run_id"] for r in done] == ["a", "c"]
    # The level cut short and the one skipped run again; K = 2 at 256 is done, K = 4 is not.
    assert bench.levels_left(done, "fast", 1, [1, 32, 64, 256]) == [1, 32, 64]
    assert bench.levels_left(done, "fast", 2, [256]) == []
    assert bench.levels_left(done, "fast", 4, [256]) == [256]
    assert bench.levels_left(done, "eager", 1, [256]) == [256]
    with pytest.raises(ValueError, match="max_new_tokens 1024 there, 512 here"):
        bench.earlier_sweep(tmp_path, {**settings, "max_new_tokens": 512})


def test_a_compacted_sweep_ledger_keeps_what_a_later_call_reads_and_shrinks(
    bench: ModuleType, tmp_path: Path, make_png, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep's ledger after its call: the per-token parts of its results go (their statistics are in
    sweep.json), the figures a later call reads back from it (the serving figures its curve draws, the job
    times a K > 1 ratio bootstraps) stay as they were, and the file gets smaller."""
    from dsocr_workers.report.serving import serving
    from dsocr_workers.report.throughput import steady_state_throughput
    from dsocr_workers.store.db import open_database

    spec = importlib.util.spec_from_file_location("report_fakes", SCRIPT.parents[1] / "tests/report/fakes.py")
    assert spec is not None and spec.loader is not None
    fakes = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, fakes)  # its dataclasses look their module up
    spec.loader.exec_module(fakes)
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    bench.prepare_ledger(url, create=True)
    db = open_database(url)
    pages = {(f"p{i}.png", repeat): fakes.Page(scale=1 + i / 10, steps=1024) for i in range(6) for repeat in range(2)}
    run_id = fakes.make_run(db, tmp_path, make_png, pages)
    before = bench.load(db, run_id)
    db.dispose()
    size = (tmp_path / "ledger.db").stat().st_size

    bench.compact_sweep_ledger(url, [run_id])

    db = open_database(url)
    after = bench.load(db, run_id)
    db.dispose()
    assert (tmp_path / "ledger.db").stat().st_size < size / 2
    assert all((r.decode_step_ms, r.token_ids, r.markup, r.boxes) == ([], [], "", []) for r in after.results.values())
    assert len(after.results) == len(before.results) == 12
    drawn = [(s.output_tokens_per_s, s.tpot_ms.p50.value, s.ttft_ms.p50.value, s.pages_per_s.value)
             for s in (serving(before), serving(after))]  # fmt: skip
    assert drawn[0] == drawn[1] and None not in drawn[0]
    assert steady_state_throughput(after).value == steady_state_throughput(before).value
