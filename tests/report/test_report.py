"""Reports over runs written through the farm's own claim → complete path, with given inference results."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
from click.testing import CliRunner
from fakes import SOURCE, WORKER, Page, make_run

from dsocr_workers.cli import main
from dsocr_workers.farm.run_options import PREFILLS
from dsocr_workers.store.db import Database
from dsocr_workers.store.models import job_id_for


@pytest.fixture
def two_runs(database, tmp_path, make_png):
    a = make_run(
        database, tmp_path / "a", make_png,
        {("p1.png", 0): Page(1.0, "same", 2), ("p2.png", 0): Page(1.0, "x", 3), ("p3.png", 0): None},
    )  # fmt: skip
    b = make_run(
        database, tmp_path / "b", make_png,
        {("p1.png", 0): Page(2.0, "same", 2), ("p2.png", 0): Page(2.0, "y", 1), ("p4.png", 0): Page(2.0, "z", 0)},
    )  # fmt: skip
    return database, a, b


def invoke(database: Database, args: list[str], monkeypatch) -> str:
    monkeypatch.setenv("DSOCR_DATABASE_URL", database.url)
    result = CliRunner().invoke(main, ["report", *args])
    assert result.exit_code == 0, result.output
    return result.output


def report_json(database: Database, args: list[str], monkeypatch) -> dict:
    return json.loads(invoke(database, [*args, "--format", "json"], monkeypatch))


def by(rows: list[dict], *keys: str) -> dict:
    return {tuple(row[k] for k in keys) if len(keys) > 1 else row[keys[0]]: row for row in rows}


def test_single_run_counts_percentiles_and_label(two_runs, monkeypatch):
    database, a, _ = two_runs
    document = report_json(database, ["--run", a, "--per-image"], monkeypatch)
    facts = {row["field"]: row["value"] for row in document["tables"]["Run"]}
    assert (facts["jobs"], facts["ok"], facts["failed"], facts["results"], facts["cold results"]) == (
        3,
        2,
        1,
        2,
        0,
    )
    throughput = {row["measure"]: row for row in document["tables"]["Throughput"]}
    assert throughput["pages/s (wall clock)"]["value"] > 0
    assert any("RANDOM WEIGHTS" in w for w in document["warnings"])
    latency = by(document["tables"]["Latency and output"], "metric")
    assert latency["TTFT ms"]["jobs"] == 2 and latency["TTFT ms"]["p50"] == 12.0
    assert latency["decode ms/token"]["n"] == 8 and latency["decode ms/token"]["p99"] == 2.0
    assert latency["boxes per page"]["mean"] == 2.5
    assert not any("MiB" in metric for metric in latency)  # CPU results have no CUDA memory
    lanes = document["tables"]["Worker processes"]
    # results without a worker session (older ledgers) are grouped by worker fingerprint
    assert [(row["host"], row["jobs"], row["pid"], row["sessions"]) for row in lanes] == [(WORKER["host"], 2, None, 0)]
    assert document["tables"]["Environment"][0]["model"] == SOURCE.label
    failures = document["tables"]["Failures"]
    assert [(f["image"], f["state"], f["attempts"], f["error"]) for f in failures] == [
        ("p3.png", "failed", 1, "InputError")
    ]
    assert len(document["tables"]["Per image"]) == 3


def test_accounting_parts_add_up_to_end_to_end(two_runs, monkeypatch):
    database, a, _ = two_runs
    parts = by(
        report_json(database, ["--run", a], monkeypatch)["tables"]["Accounting: parts of end-to-end"], "part"
    )
    named = ["preprocess", "setup", "prefill", "first token", "decode", "wasted decode", "readback", "postprocess",
             "host gap"]  # fmt: skip
    assert list(parts) == [*named, "sum of parts", "end-to-end"]
    assert sum(parts[p]["mean ms"] for p in named) == pytest.approx(parts["end-to-end"]["mean ms"])
    assert parts["sum of parts"]["mean ms"] == pytest.approx(parts["end-to-end"]["mean ms"]) == 20.6
    assert parts["end-to-end"]["share of e2e %"] == 100.0 and parts["decode"]["share of e2e %"] > 30


def test_vs_pairs_images_in_both_runs(two_runs, monkeypatch):
    database, a, b = two_runs
    document = report_json(database, ["--run", a, "--vs", b, "--per-image"], monkeypatch)
    rows = by(document["tables"]["Paired latency"], "metric", "statistic")
    assert rows[("end-to-end ms", "p50")]["pairs"] == 2
    assert rows[("end-to-end ms", "p50")]["B/A"] == 2.0 and rows[("TTFT ms", "mean")]["B/A"] == 2.0
    agreement = {row["measure"]: row["value"] for row in document["tables"]["Output agreement"]}
    assert agreement["paired images"] == 2 and agreement["only in A"] == 0 and agreement["only in B"] == 1
    assert agreement["identical markup %"] == 50.0
    assert (
        agreement["box count delta B-A (mean)"] == -1.0
        and agreement["images with a different box count"] == 1
    )
    assert [r["image"] for r in document["tables"]["Per image"]] == ["p1.png", "p2.png"]


def test_formats_table_csv_markdown_and_out_file(two_runs, monkeypatch, tmp_path):
    database, a, b = two_runs
    table = invoke(database, ["--run", a[:6], "--vs", b], monkeypatch)
    assert "WARNING" in table and "Output agreement" in table and "B/A" in table and "verdict" in table
    csv_text = invoke(database, ["--run", a, "--format", "csv", "--table", "latency and output"], monkeypatch)
    rows = list(csv.reader(io.StringIO(csv_text)))
    header = ["metric", "jobs", "n"] + [
        f"{s}{x}" for s in ("mean", "p50", "p90", "p99") for x in ("", "_ci_low", "_ci_high")
    ]
    assert rows[0][0].startswith("# RANDOM WEIGHTS") and ["# Latency and output"] in rows
    assert [r for r in rows if not r[0].startswith("#")][0] == header  # one table: its header, its rows
    # csv without a table names the tables; with a folder, one file per table.
    monkeypatch.setenv("DSOCR_DATABASE_URL", database.url)
    refused = CliRunner().invoke(main, ["report", "--run", a, "--format", "csv"])
    assert refused.exit_code == 2 and "--table NAME" in refused.output and "Per image" not in refused.output
    folder = tmp_path / "tables"
    invoke(database, ["--run", a, "--per-image", "--format", "csv", "--out", str(folder)], monkeypatch)
    files = sorted(p.name for p in folder.iterdir())
    assert {"run.csv", "latency-and-output.csv", "per-image.csv", "worker-processes.csv", "environment.csv"} <= set(files)
    per_image = [r for r in csv.reader(io.StringIO((folder / "per-image.csv").read_text())) if not r[0].startswith("#")]
    assert per_image[0][:6] == ["image", "repeat", "job id", "state", "attempts", "worker"]
    assert {row[2] for row in per_image[1:]} == {job_id_for(a, row[0], int(row[1])) for row in per_image[1:]}
    out = tmp_path / "report.md"
    invoke(database, ["--run", "latest", "--format", "md", "--out", str(out)], monkeypatch)
    markdown = out.read_text()
    assert markdown.startswith(f"# dsocr report: run {b}")
    assert "| metric | jobs | n | mean | p50 | p90 | p99 |" in markdown


def test_unknown_run_is_an_input_error(database, monkeypatch):
    monkeypatch.setenv("DSOCR_DATABASE_URL", database.url)
    result = CliRunner().invoke(main, ["report", "--run", "nope"])
    assert result.exit_code == 2 and "no run 'nope'" in result.output


def noisy_pages(
    seed: int, factor: float = 1.0, pages: int = 10, repeats: int = 2
) -> dict[tuple[str, int], Page]:
    """Pages of different sizes (a base scale each), every job ±5% noise around factor × its base."""
    rng = np.random.default_rng(seed)
    base = np.random.default_rng(0).uniform(0.5, 3.0, size=pages)  # the same pages in every run
    return {
        (f"p{i}.png", r): Page(float(factor * base[i] * rng.lognormal(0, 0.05)), steps=3 + i % 4)
        for i in range(pages)
        for r in range(repeats)
    }


def test_intervals_in_json_and_csv_are_numbers_around_the_value(database, tmp_path, make_png, monkeypatch):
    run = make_run(database, tmp_path, make_png, noisy_pages(seed=1))
    document = report_json(database, ["--run", run], monkeypatch)
    latency = document["tables"]["Latency and output"]
    for row in latency:
        for stat in ("mean", "p50", "p90", "p99"):
            value, low, high = row[stat], row[f"{stat}_ci_low"], row[f"{stat}_ci_high"]
            if row["metric"] in ("wasted steps", "boxes per page"):  # the same in every job: no interval
                assert isinstance(value, float) and (low, high) == (None, None)
                continue
            assert all(isinstance(x, float) for x in (value, low, high)), (row["metric"], stat)
            assert low <= value <= high and low < high, (row["metric"], stat, low, value, high)
    steady = by(document["tables"]["Throughput"], "measure")["pages/s (steady state)"]
    assert {"value", "value_ci_low", "value_ci_high"} <= set(steady)

    csv_text = invoke(database, ["--run", run, "--format", "csv", "--table", "Latency and output"], monkeypatch)
    rows = list(csv.reader(io.StringIO(csv_text)))
    start = rows.index(["# Latency and output"])
    header, first = rows[start + 1], rows[start + 2]
    cells = dict(zip(header, first, strict=True))
    assert cells["metric"] == "TTFT ms"
    low, value, high = (float(cells[k]) for k in ("mean_ci_low", "mean", "mean_ci_high"))
    assert low < value < high

    table = invoke(database, ["--run", run], monkeypatch)
    ttft = next(line for line in table.splitlines() if line.strip().startswith("TTFT ms"))
    assert ttft.count("[") == 4 and ", " in ttft  # "value [low, high]" for mean, p50, p90, p99


def test_one_job_has_no_interval_and_says_so(database, tmp_path, make_png, monkeypatch):
    run = make_run(database, tmp_path, make_png, {("p.png", 0): Page(1.0)})
    ttft = by(report_json(database, ["--run", run], monkeypatch)["tables"]["Latency and output"], "metric")[
        "TTFT ms"
    ]
    assert (ttft["mean"], ttft["mean_ci_low"], ttft["mean_ci_high"]) == (12.0, None, None)
    assert "12 [n<2]" in invoke(database, ["--run", run], monkeypatch)


def test_cold_results_are_left_out_counted_and_put_back_on_request(database, tmp_path, make_png, monkeypatch):
    pages = {(f"p{i}.png", 0): Page(1.0 + 0.1 * i) for i in range(4)}
    pages[("p0.png", 0)] = Page(500.0, cold_reason="compile: gundam 2x3")
    pages[("p1.png", 0)] = Page(300.0, cold_reason="new cache bucket 4096")
    pages[("p2.png", 0)] = Page(400.0, cold_reason="compile: gundam 2x3")
    run = make_run(database, tmp_path, make_png, pages)

    document = report_json(database, ["--run", run], monkeypatch)
    facts = {row["field"]: row["value"] for row in document["tables"]["Run"]}
    assert (facts["results"], facts["cold results"], facts["left out of statistics"]) == (4, 3, 3)
    cold = by(document["tables"]["Cold results"], "reason")
    assert {reason: row["jobs"] for reason, row in cold.items()} == {
        "compile: gundam 2x3": 2,
        "new cache bucket 4096": 1,
    }
    assert all(row["in statistics"].startswith("no") for row in cold.values())
    latency = by(document["tables"]["Latency and output"], "metric")
    assert latency["end-to-end ms"]["jobs"] == 1 and latency["end-to-end ms"]["p99"] == pytest.approx(
        1.3 * 20.6
    )
    assert latency["decode ms/token"]["n"] == 4
    assert by(document["tables"]["Worker processes"], "pid").popitem()[1]["cold jobs"] == 3

    document = report_json(database, ["--run", run, "--include-cold"], monkeypatch)
    facts = {row["field"]: row["value"] for row in document["tables"]["Run"]}
    assert facts["left out of statistics"] == 0
    latency = by(document["tables"]["Latency and output"], "metric")
    assert latency["end-to-end ms"]["jobs"] == 4 and latency["end-to-end ms"]["p99"] > 300 * 20.6
    assert all(row["in statistics"].startswith("yes") for row in document["tables"]["Cold results"])


def test_vs_says_no_significant_difference_only_when_there_is_none(database, tmp_path, make_png, monkeypatch):
    a = make_run(database, tmp_path / "a", make_png, noisy_pages(seed=1))
    same = make_run(database, tmp_path / "same", make_png, noisy_pages(seed=2))
    slower = make_run(database, tmp_path / "slower", make_png, noisy_pages(seed=3, factor=1.15))

    rows = by(report_json(database, ["--run", a, "--vs", same], monkeypatch)["tables"]["Paired latency"],
              "metric", "statistic")  # fmt: skip
    for key in [("end-to-end ms", "mean"), ("TTFT ms", "p50"), ("decode ms/token", "mean")]:
        ratio = rows[key]
        assert (
            ratio["B/A_ci_low"] <= 1 <= ratio["B/A_ci_high"]
            and ratio["verdict"] == "no significant difference"
        )
        assert ratio["pairs"] == 20
    rows = by(report_json(database, ["--run", a, "--vs", slower], monkeypatch)["tables"]["Paired latency"],
              "metric", "statistic")  # fmt: skip
    for key in [("end-to-end ms", "mean"), ("TTFT ms", "p50"), ("decode ms/token", "mean")]:
        ratio = rows[key]
        assert (
            1 < ratio["B/A_ci_low"] <= ratio["B/A"] <= ratio["B/A_ci_high"] and ratio["verdict"] == "B higher"
        )
    table = invoke(database, ["--run", a, "--vs", same], monkeypatch)
    assert "no significant difference" in table and "NOT LIKE FOR LIKE" not in table
    assert "unlike_runs" not in report_json(database, ["--run", a, "--vs", same], monkeypatch)


def test_vs_of_unlike_runs_opens_with_a_banner_naming_each_difference(database, tmp_path, make_png, monkeypatch):
    a = make_run(database, tmp_path / "a", make_png, noisy_pages(seed=1), max_new_tokens=32, mode="gundam")
    b = make_run(database, tmp_path / "b", make_png, noisy_pages(seed=2), max_new_tokens=64, mode="base")
    document = report_json(database, ["--run", a, "--vs", b], monkeypatch)
    assert document["unlike_runs"] == ["mode (A gundam, B base)", "max_new_tokens (A 32, B 64)"]
    assert document["warnings"][0].startswith("NOT LIKE FOR LIKE: runs A and B differ in mode (A gundam, B base); "
                                              "max_new_tokens (A 32, B 64)")
    verdicts = [row["verdict"] for row in document["tables"]["Paired latency"]]
    assert verdicts and all(v.endswith("(unlike runs)") for v in verdicts), verdicts
    text = invoke(database, ["--run", a, "--vs", b], monkeypatch)
    assert text.index("NOT LIKE FOR LIKE") < text.index("Paired latency")


def test_vs_names_a_prefill_difference_only_where_a_batched_engine_ran(database, tmp_path, make_png, monkeypatch):
    """Two runs at concurrency 2 that prefill their pages differently are unlike; two batch-1 runs are not,
    whatever they recorded (a batch-1 job has no batched engine to prefill)."""
    pages = noisy_pages(seed=1)
    split = make_run(database, tmp_path / "a", make_png, pages, concurrency=2)
    whole = make_run(database, tmp_path / "b", make_png, pages, concurrency=2, prefill="whole")
    document = report_json(database, ["--run", split, "--vs", whole], monkeypatch)
    assert document["unlike_runs"] == ["prefill (A split, B whole)"]
    alone = [make_run(database, tmp_path / f"c{i}", make_png, pages, prefill=p) for i, p in enumerate(PREFILLS)]
    assert "unlike_runs" not in report_json(database, ["--run", alone[0], "--vs", alone[1]], monkeypatch)


def test_per_job_memory_and_its_split(database, tmp_path, make_png, monkeypatch):
    small = Page(1.0, memory_mib=(6000, 100, 200))
    large = Page(1.5, memory_mib=(6000, 400, 900))
    run = make_run(database, tmp_path, make_png, {("small.png", 0): small, ("large.png", 0): large})
    latency = by(
        report_json(database, ["--run", run, "--per-image"], monkeypatch)["tables"]["Latency and output"],
        "metric",
    )
    assert (latency["peak memory MiB"]["p50"], latency["peak memory MiB"]["jobs"]) == (6800.0, 2)
    assert latency["  weights MiB"]["mean"] == 6000.0 and latency["  weights MiB"]["mean_ci_low"] is None
    assert latency["  KV cache MiB"]["mean"] == 250.0 and latency["  activation peak MiB"][
        "p99"
    ] == pytest.approx(893.0)
    per_image = report_json(database, ["--run", run, "--per-image"], monkeypatch)["tables"]["Per image"]
    assert {row["image"]: row["peak MiB"] for row in per_image} == {"small.png": 6300.0, "large.png": 7300.0}


def test_the_serving_table_reads_as_a_serving_benchmark_and_says_what_a_day_makes(two_runs, monkeypatch):
    database, a, b = two_runs
    tables = report_json(database, ["--run", a], monkeypatch)["tables"]
    assert "Batch steps" not in tables  # the batch-1 path: no engine steps (tests/farm/test_batch_steps.py)
    serving = by(tables["Serving"], "measure")
    steady = serving["request throughput pages/s"]["value"]
    assert steady > 0
    assert serving["concurrency (jobs in flight per GPU)"]["value"] == 1
    assert serving["prefill (split or whole)"]["value"] == "whole (batch-1)"  # not --prefill's
    assert serving["GPUs (devices that finished its jobs)"]["value"] == 1
    assert serving["mean tokens out per page"]["value"] == 5  # 4 decode steps + the prefill's token
    assert serving["output tokens/s"]["value"] == pytest.approx(steady * 5, rel=1e-3)
    assert serving["p50 TPOT ms"]["value"] == 2.0 and serving["p99 ITL ms"]["value"] == 2.0
    assert serving["p50 TTFT ms"]["value"] == 12.0
    assert serving["mean batch occupancy"]["value"] == 1.0  # the batch-1 path
    assert serving["pages/day (the run's GPUs)"]["value"] == pytest.approx(steady * 86_400, rel=1e-3)
    assert serving["pages/day per GPU"]["value"] == pytest.approx(steady * 86_400, rel=1e-3)
    pair_tables = report_json(database, ["--run", a, "--vs", b], monkeypatch)["tables"]
    assert "Batch steps" not in pair_tables
    pairs = by(pair_tables["Serving"], "measure")
    assert pairs["p50 TPOT ms"]["A"] == 2.0 and pairs["p50 TPOT ms"]["B"] == 4.0  # B's pages are twice as slow
    assert pairs["request throughput pages/s"]["verdict"]
