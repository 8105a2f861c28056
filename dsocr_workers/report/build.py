"""Turning ledger rows into report tables: one run, or run B against run A paired per image."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np

from dsocr_workers.report.queries import RunData
from dsocr_workers.store.models import FINAL_STATES, Result

RANDOM_WEIGHTS_WARNING = (
    "RANDOM WEIGHTS: run {run} used the preset {model}; timings are real, the text and boxes are meaningless"
)


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass
class Report:
    title: str
    warnings: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None


def summarize(values: Iterable[float | None]) -> Summary:
    data = np.asarray([v for v in values if v is not None], dtype=float)
    if data.size == 0:
        return Summary(0, None, None, None, None)
    p50, p90, p99 = np.percentile(data, [50, 90, 99])
    return Summary(int(data.size), float(data.mean()), float(p50), float(p90), float(p99))


# (label, how to get the values from a list of results): per-token decode times pool every step.
Metric = tuple[str, Callable[[list[Result]], list[float]]]


def _per_result(column: str) -> Callable[[list[Result]], list[float]]:
    return lambda results: [getattr(r, column) for r in results]


METRICS: list[Metric] = [
    ("TTFT ms", _per_result("ttft_ms")),
    ("preprocess ms", _per_result("preprocess_ms")),
    ("prefill ms", _per_result("prefill_ms")),
    ("vision ms", _per_result("vision_ms")),
    ("  sam ms", _per_result("sam_ms")),
    ("  clip ms", _per_result("clip_ms")),
    ("  projector ms", _per_result("projector_ms")),
    ("lm prefill ms", _per_result("lm_prefill_ms")),
    ("decode ms/token", lambda results: [step for r in results for step in r.decode_step_ms]),
    ("decode ms", _per_result("decode_ms")),
    ("end-to-end ms", _per_result("e2e_ms")),
    ("tokens out", _per_result("decode_tokens")),
    ("boxes per page", _per_result("box_count")),
]


def _round(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def wall_seconds(data: RunData) -> float | None:
    """From the start of the first inference to the end of the last job (model loading excluded: a job's
    inference starts `e2e_ms` before it finished)."""
    ends = [j.finished_at for j in data.jobs if j.finished_at is not None and j.state in FINAL_STATES]
    starts = [
        j.finished_at - timedelta(milliseconds=data.results[j.id].e2e_ms)
        for j in data.jobs
        if j.id in data.results and j.finished_at is not None
    ]
    if not starts or not ends:
        return None
    return max((max(ends) - min(starts)).total_seconds(), 1e-6)


def run_facts(data: RunData) -> dict[str, Any]:
    counts = Counter(j.state for j in data.jobs)
    wall = wall_seconds(data)
    done = counts.get("done", 0)
    return {
        "run": data.run.id,
        "name": data.run.name,
        "model": data.run.model_label,
        "created": data.run.created_at.isoformat(sep=" ", timespec="seconds"),
        "file list": data.run.filelist,
        "parameters": ", ".join(f"{k}={v}" for k, v in sorted(data.run.parameters.items()) if v is not None),
        "tags": ", ".join(f"{k}={v}" for k, v in sorted(data.run.tags.items())),
        "jobs": len(data.jobs),
        "ok": done,
        "failed": counts.get("failed", 0),
        "poisoned": counts.get("poisoned", 0),
        "not finished": sum(counts.get(s, 0) for s in ("pending", "queued", "running")),
        "results": len(data.results),
        "wall s": _round(wall, 3),
        "pages/s": _round(done / wall, 3) if wall else None,
    }


def _warnings(*runs: RunData) -> list[str]:
    return [
        RANDOM_WEIGHTS_WARNING.format(run=d.run.id, model=d.run.model)
        for d in runs
        if d.run.random_weights or any(r.random_weights for r in d.results.values())
    ]


def single_report(data: RunData, *, per_image: bool = False) -> Report:
    results = list(data.results.values())
    report = Report(f"dsocr report: run {data.run.id} ({data.run.name})", _warnings(data))
    report.tables.append(Table("Run", ["field", "value"], [[k, v] for k, v in run_facts(data).items()]))
    rows = []
    for label, values in METRICS:
        s = summarize(values(results))
        rows.append([label, s.n, _round(s.mean), _round(s.p50), _round(s.p90), _round(s.p99)])
    report.tables.append(Table("Latency and output", ["metric", "n", "mean", "p50", "p90", "p99"], rows))
    report.tables.append(_by_worker(data))
    report.tables.append(_environment(data))
    failures = [
        [j.image, j.repeat, j.state, j.attempts, j.last_error_class, j.last_error_message]
        for j in data.jobs
        if j.state in ("failed", "poisoned")
    ]
    if failures:
        report.tables.append(
            Table("Failures", ["image", "repeat", "state", "attempts", "error", "message"], failures)
        )
    if per_image:
        report.tables.append(_per_image(data))
    return report


def _by_worker(data: RunData) -> Table:
    grouped: dict[str, list[Result]] = defaultdict(list)
    for r in data.results.values():
        grouped[r.worker_id].append(r)
    rows = []
    for worker_id, results in sorted(grouped.items()):
        w = data.workers.get(worker_id)
        rows.append(
            [
                worker_id[:12],
                w.host if w else None,
                results[0].device,
                w.gpu_name if w else None,
                len(results),
                _round(summarize(r.e2e_ms for r in results).p50),
                _round(summarize(r.ttft_ms for r in results).p50),
                _round(summarize(s for r in results for s in r.decode_step_ms).p50),
            ]
        )
    columns = ["worker", "host", "device", "GPU", "jobs", "e2e p50 ms", "TTFT p50 ms", "decode ms/token p50"]
    return Table("By worker", columns, rows)


def _environment(data: RunData) -> Table:
    columns = ["worker", "host", "device", "GPU", "GPU UUID", "driver", "CUDA", "torch", "transformers", "python",
               "dsocr", "git", "model"]  # fmt: skip
    rows = [
        [
            w.id[:12],
            w.host,
            w.device,
            w.gpu_name,
            w.gpu_uuid,
            w.driver,
            w.cuda,
            w.torch,
            w.transformers,
            w.python,
            w.project_version,
            (w.git_sha or "")[:12],
            w.model_label,
        ]  # fmt: skip
        for w in sorted(data.workers.values(), key=lambda w: w.id)
    ]
    return Table("Environment", columns, rows)


def _per_image(data: RunData) -> Table:
    rows = []
    for j in data.jobs:
        r = data.results.get(j.id)
        rows.append(
            [
                j.image,
                j.repeat,
                j.state,
                j.attempts,
                r.device if r else None,
                _round(r.ttft_ms) if r else None,
                _round(r.prefill_ms) if r else None,
                r.decode_tokens if r else None,
                _round(r.decode_ms_per_token_p50) if r else None,
                _round(r.e2e_ms) if r else None,
                r.box_count if r else None,
                r.stop_reason if r else j.last_error_class,
            ]
        )
    columns = ["image", "repeat", "state", "attempts", "device", "TTFT ms", "prefill ms", "tokens",
               "ms/token p50", "e2e ms", "boxes", "stop / error"]  # fmt: skip
    return Table("Per image", columns, rows)


def _by_image(data: RunData) -> dict[tuple[str, int], Result]:
    jobs = {j.id: j for j in data.jobs}
    return {(jobs[r.job_id].image, jobs[r.job_id].repeat): r for r in data.results.values()}


def _ratio(b: float | None, a: float | None) -> float | None:
    return None if a is None or b is None or a == 0 else round(b / a, 3)


def comparison_report(a: RunData, b: RunData, *, per_image: bool = False) -> Report:
    """B against A over the (image, repeat) pairs that have a result in both runs."""
    report = Report(f"dsocr report: run {b.run.id} (B) vs {a.run.id} (A)", _warnings(a, b))
    facts_a, facts_b = run_facts(a), run_facts(b)
    rows = [[k, facts_a[k], facts_b[k]] for k in facts_a]
    rows.append(["B/A pages/s", None, _ratio(facts_b["pages/s"], facts_a["pages/s"])])
    report.tables.append(Table("Runs", ["field", "A", "B"], rows))

    by_a, by_b = _by_image(a), _by_image(b)
    pairs = sorted(set(by_a) & set(by_b))
    paired_a, paired_b = [by_a[k] for k in pairs], [by_b[k] for k in pairs]
    rows = []
    for label, values in METRICS:
        sa, sb = summarize(values(paired_a)), summarize(values(paired_b))
        rows.append(
            [
                label,
                _round(sa.p50),
                _round(sb.p50),
                _ratio(sb.p50, sa.p50),
                _round(sa.p90),
                _round(sb.p90),
                _ratio(sb.p90, sa.p90),
                _round(sa.p99),
                _round(sb.p99),
                _ratio(sb.p99, sa.p99),
            ]  # fmt: skip
        )
    columns = [
        "metric",
        "A p50",
        "B p50",
        "B/A p50",
        "A p90",
        "B p90",
        "B/A p90",
        "A p99",
        "B p99",
        "B/A p99",
    ]
    report.tables.append(Table(f"Paired latency ({len(pairs)} images in both runs)", columns, rows))

    identical = sum(by_a[k].markup == by_b[k].markup for k in pairs)
    deltas = [by_b[k].box_count - by_a[k].box_count for k in pairs]
    agreement: list[list[Any]] = [
        ["paired images", len(pairs)],
        ["only in A", len(set(by_a) - set(by_b))],
        ["only in B", len(set(by_b) - set(by_a))],
        ["identical markup %", _round(100.0 * identical / len(pairs)) if pairs else None],
        ["box count delta B-A (mean)", _round(float(np.mean(deltas))) if deltas else None],
        ["box count |delta| (mean)", _round(float(np.mean(np.abs(deltas)))) if deltas else None],
        ["images with a different box count", sum(d != 0 for d in deltas)],
    ]
    report.tables.append(Table("Output agreement", ["measure", "value"], agreement))
    if per_image:
        rows = [
            [
                image,
                repeat,
                _round(by_a[(image, repeat)].e2e_ms),
                _round(by_b[(image, repeat)].e2e_ms),
                _ratio(by_b[(image, repeat)].e2e_ms, by_a[(image, repeat)].e2e_ms),
                by_a[(image, repeat)].decode_tokens,
                by_b[(image, repeat)].decode_tokens,
                by_a[(image, repeat)].markup == by_b[(image, repeat)].markup,
                by_a[(image, repeat)].box_count,
                by_b[(image, repeat)].box_count,
            ]  # fmt: skip
            for image, repeat in pairs
        ]
        columns = ["image", "repeat", "A e2e ms", "B e2e ms", "B/A", "A tokens", "B tokens", "same markup",
                   "A boxes", "B boxes"]  # fmt: skip
        report.tables.append(Table("Per image", columns, rows))
    return report
