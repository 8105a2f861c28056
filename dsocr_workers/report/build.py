"""Turning ledger rows into report tables: one run, or run B against run A paired per image.

Cold results are left out of every latency statistic and of steady-state throughput unless
`include_cold`; looping ones stay in unless `exclude_loops`. Accuracy and stop reasons count every
result: what a page reads does not depend on warm-up, and a loop is what accuracy must not hide.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import Any

import numpy as np

from dsocr_workers.engine.result import STOP_REASONS
from dsocr_workers.farm.run_options import recorded_prefill
from dsocr_workers.quality.matching import ONE_TO_ONE
from dsocr_workers.report import kernel_tables
from dsocr_workers.report.models_compared import model_differences, page_differences
from dsocr_workers.report.queries import RunData
from dsocr_workers.report.serving import TERMS as SERVING_TERMS
from dsocr_workers.report.serving import (
    batch_steps_pairs_table,
    batch_steps_table,
    serving_pairs_table,
    serving_table,
)
from dsocr_workers.report.stats import Estimate, Summary, paired_difference, paired_ratios, rate_sum
from dsocr_workers.report.tables import NO_DIFFERENCE, Table, in_job_order, verdict
from dsocr_workers.report.throughput import (
    device_busy_share,
    device_idle_ms,
    lane_key,
    service_times_s,
    steady_state_throughput,
    throughput_ratio,
    wall_clock_s,
)
from dsocr_workers.settings import LEASE_SECONDS, read
from dsocr_workers.stages import (
    BY_COLUMN,
    LATENCY_TABLE,
    PARTS,
    PER_IMAGE_TABLE,
    TIMINGS,
    Timing,
    depth,
    shown_in,
    unmeasured,
)
from dsocr_workers.store.models import IN_PROCESS_QUEUE, JobAttempt, Result, WorkerProcess, utcnow

RANDOM_WEIGHTS_WARNING = (
    "RANDOM WEIGHTS: run {run} used the preset {model}; timings are real, the text, boxes and accuracy "
    "are meaningless"
)
NEVER_SENT_WARNING = (
    "NOT SENT: {pending} of {jobs} jobs of run {run} were never sent to the broker ({pending} pending: its "
    "submit could not reach it); run `dsocr reconcile --run {run}` once it is reachable, then a worker on "
    "queue {queue} takes them"
)
NO_RESULT_WARNING = (
    "NO RESULT YET: {open} of {jobs} jobs of run {run} are waiting or running (`dsocr status --run {run}`)"
)
INTERRUPTED_WARNING = (
    "INTERRUPTED: run {run} was interrupted with {open} of {jobs} jobs not finished, handed back; "
    "`dsocr resume {run}` runs them"
)
MIB = 2**20


@dataclass
class Report:
    title: str
    warnings: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    terms: list[tuple[str, str]] = field(default_factory=list)  # (term, meaning): the legend under the tables
    # A comparison of runs that did not compute or run alike: each difference, "what: A ..., B ...".
    differences: list[str] = field(default_factory=list)


# Run parameters that change what a job computes or how it is timed: two runs that differ in one of them
# are not like for like.
COMPARED_PARAMETERS = (
    "mode",
    "max_new_tokens",
    "ignore_eos",
    "engine",
    "dtype",
    "concurrency",
    "prefill",
    "prompt",
    "no_repeat_ngram_size",
    "ngram_window",
    "stop_on_repetition",
    "seed",
)
UNLIKE_WARNING = (
    "NOT LIKE FOR LIKE: runs A and B differ in {differences}; the verdicts below compare unlike runs"
)
UNLIKE_VERDICT = " (unlike runs)"


@dataclass(frozen=True)
class Metric:
    label: str
    values: Callable[[Result], list[float]]  # one job's values: one, none (not measured) or its decode steps
    higher_is_better: bool = False  # TEDS; edit distances and times read better lower


def _column(name: str, scale: float = 1.0) -> Callable[[Result], list[float]]:
    return lambda r: [] if getattr(r, name) is None else [getattr(r, name) * scale]


def timing_metric(timing: Timing) -> Metric:
    """A figure of the stage registry as a row of the latency tables, indented as it nests."""
    return Metric(f"{'  ' * depth(timing)}{timing.label} ms", _column(timing.column))


# Figures of the registry the report reads by name (results rows have every registry figure as a column).
E2E, PAGE_WAIT = BY_COLUMN["e2e_ms"], BY_COLUMN["page_wait_ms"]
# Named: the accuracy table shows them beside the edit distances.
DECODE_PER_TOKEN = Metric("decode ms/token", lambda r: list(r.decode_step_ms))  # kept steps, pooled over jobs
END_TO_END = timing_metric(E2E)
TOKENS_OUT = Metric("tokens out", _column("decode_tokens"))
# Measured by the farm (from the claim), not by the engine's clock: no figure of the registry.
TTFT_FROM_CLAIM = Metric("TTFT from claim ms", _column("ttft_from_claim_ms"))


def beside(
    timings: tuple[Timing, ...], extra: dict[str, list[Metric]], hidden: frozenset[str] = frozenset()
) -> list[Metric]:
    """The registry's figures in its order, each followed by the `extra` metrics named by its column;
    a figure `hidden` (not measured) leaves its row out and keeps its extras (a batched run's decode
    steps beside the decode stage it does not time)."""
    return [
        m
        for t in timings
        for m in ([] if t.column in hidden else [timing_metric(t)]) + extra.get(t.column, [])
    ]


# The registry's latency figures (TTFT: preprocess + from the device start, a prefetched page's too),
# TTFT from the claim after TTFT, the decode steps after decode.
def latency(results: list[Result]) -> list[Metric]:
    """The latency figures of `results`: the stages their model families measured."""
    extra = {"ttft_ms": [TTFT_FROM_CLAIM], "decode_ms": [DECODE_PER_TOKEN]}
    return beside(shown_in(LATENCY_TABLE), extra, unmeasured(results))


def per_image(results: list[Result]) -> list[Metric]:
    return beside(shown_in(PER_IMAGE_TABLE), {"ttft_ms": [TTFT_FROM_CLAIM]}, unmeasured(results))


OUTPUT = [
    TOKENS_OUT,
    Metric("wasted steps", _column("wasted_steps")),  # computed after EOS, discarded
    Metric("boxes per page", _column("box_count")),
]
# Per job, allocator statistics reset at its start; CUDA only, so a CPU run shows none of these rows.
MEMORY = [
    Metric("peak memory MiB", _column("peak_memory_bytes", 1 / MIB)),
    Metric("  weights MiB", _column("weights_bytes", 1 / MIB)),
    Metric("  KV cache MiB", _column("kv_cache_bytes", 1 / MIB)),
    Metric("  activation peak MiB", _column("activation_peak_bytes", 1 / MIB)),
]
# Against the ground truth as OmniDocBench's end-to-end evaluator scores a page (quality/scoring.py):
# normalised edit distances per category and table TEDS.
ACCURACY = [
    Metric("text edit", _column("text_edit")),
    Metric("formula edit", _column("formula_edit")),
    Metric("table edit", _column("table_edit")),
    Metric("table TEDS", _column("table_teds"), higher_is_better=True),
    Metric("table TEDS structure", _column("table_teds_structure"), higher_is_better=True),
    Metric("reading order edit", _column("reading_order_edit")),
]
ACCURACY_READING = "edit distances: lower is better; TEDS: higher is better"
# Counted beside them: the pages quick_match could not match within DSOCR_MATCH_TIME_LIMIT, scored as
# the evaluator scores them then, one-to-one.
ONE_TO_ONE_PAGES = "pages matched one-to-one (quick_match out of time)"
# OmniDocBench's page attributes its figures are broken down by, where the annotation has them.
PAGE_GROUPS = ("data_source", "language", "layout")
# Beside accuracy, per mode: what it cost.
SPEED = [END_TO_END, DECODE_PER_TOKEN, TOKENS_OUT]


# The report's own terms, beside the stage registry's figures (whose meanings the registry states).
FARM_TERMS = [
    (
        "value [low, high]",
        "the statistic with its 95% confidence interval over jobs ([n<2]: one job, [–]: no spread)",
    ),
    (
        "TTFT from claim",
        "from the job's claim (its lease taken) to its first token: TTFT plus the farm's time "
        "before the device starts",
    ),
    (
        "cold",
        "a job that met a compilation, a new cache bucket, …: out of the statistics unless --include-cold",
    ),
    (
        "profiled",
        "a job run under torch.profiler (submit --profile N): its trace and kernels per stage are stored; "
        "out of the statistics unless --include-profiled, and of steady-state throughput; at a concurrency "
        "above 1, every N-th batch step of each kind instead, out of the Batch steps table's step times",
    ),
    (
        "pages/s (steady state)",
        "per worker process 1 / mean service time (from when it was free for the job "
        "to its finish: loading, warm-up and waiting for work left out), summed over processes",
    ),
    (
        "device idle between jobs",
        "from one job's readback to the next one's setup on the same device, while the next job was waiting",
    ),
    (
        "device share of a job between jobs",
        "device time / service time over the jobs that followed another: 1.0 "
        "means the device never waited for the farm",
    ),
    (
        "attempts",
        "claims of a job: more than 1 when a worker died holding it, or an attempt failed and was retried",
    ),
    (
        "process",
        "a worker process: live, stopped (shut down cleanly) or DEAD (stopped beating without stopping: "
        "killed, frozen or cut off; its jobs went to the live ones)",
    ),
    ("attempts lost", "claims of the run's jobs by that process that did not end in its result"),
]


def glossary(results: Iterable[object]) -> list[tuple[str, str]]:
    """The legend of a report: every figure the latency and accounting tables show for `results` (a
    family stage only where one of them measured it), as the stage registry says what it is, then the
    report's own terms."""
    timings = dict.fromkeys(
        [*shown_in(LATENCY_TABLE, results), *PARTS, BY_COLUMN["queue_wait_ms"]]
    )  # the last: Serving's
    return [(t.label, t.doc) for t in timings] + FARM_TERMS + SERVING_TERMS


def looping(result: Result) -> bool:
    return result.loop_start is not None


def measured(
    data: RunData, include_cold: bool, exclude_loops: bool = False, include_profiled: bool = False
) -> list[Result]:
    """The results latency statistics are computed over, in job order (see the module docstring; profiled
    ones only with `include_profiled`: the profiler's cost is in their times)."""
    return [
        r
        for r in in_job_order(data)
        if (include_cold or not r.cold)
        and (include_profiled or not r.profiled)
        and not (exclude_loops and looping(r))
    ]


def summarize(metric: Metric, results: list[Result]) -> Summary:
    return Summary.from_jobs([metric.values(r) for r in results])


def run_facts(
    data: RunData, include_cold: bool, exclude_loops: bool = False, include_profiled: bool = False
) -> dict[str, Any]:
    counts = Counter(j.state for j in data.jobs)
    cold = sum(r.cold for r in data.results.values())
    loops = sum(looping(r) for r in data.results.values())
    return {
        "run": data.run.id,
        "name": data.run.name,
        "model": data.run.model_label,
        "created": data.run.created_at.isoformat(sep=" ", timespec="seconds"),
        "file list": data.run.filelist,
        "parameters": ", ".join(f"{k}={v}" for k, v in sorted(data.run.parameters.items()) if v is not None),
        "tags": ", ".join(f"{k}={v}" for k, v in sorted(data.run.tags.items())),
        "ground truth": data.run.ground_truth,
        "jobs": len(data.jobs),
        "ok": counts.get("done", 0),
        "failed": counts.get("failed", 0),
        "poisoned": counts.get("poisoned", 0),
        "not finished": sum(counts.get(s, 0) for s in ("pending", "queued", "running")),
        "attempts": sum(j.attempts for j in data.jobs),
        "jobs retried (attempts > 1)": sum(j.attempts > 1 for j in data.jobs),
        "results": len(data.results),
        "cold results": cold,
        "results in a repetition loop": loops,
        "profiled results": sum(r.profiled for r in data.results.values()),
        "left out of statistics": len(data.results)
        - len(measured(data, include_cold, exclude_loops, include_profiled)),
    }


def run_differences(a: RunData, b: RunData) -> list[str]:
    """What differs between two runs that a comparison must say: the model, the parameters above, and what
    their results ran with (engine, dtype, GPU type)."""

    def ran(data: RunData) -> dict[str, str]:
        results = data.results.values()
        gpus = {w.gpu_name or "cpu" for w in data.workers.values()}
        return {
            "engine that ran": ", ".join(sorted({r.engine for r in results})),
            "dtype that ran": ", ".join(sorted({r.dtype or "" for r in results})),
            "GPU type": ", ".join(sorted(gpus)),
        }

    differences = model_differences(a, b)
    batched = max(int(d.run.parameters.get("concurrency", 1)) for d in (a, b)) > 1
    for name in COMPARED_PARAMETERS:
        if name == "prefill" and not batched:  # how a batched engine prefills: no batch-1 job's concern
            continue
        value_a, value_b = (
            recorded_prefill(d.run.parameters) if name == "prefill" else d.run.parameters.get(name)
            for d in (a, b)
        )
        if value_a != value_b:
            differences.append(f"{name} (A {value_a}, B {value_b})")
    ran_a, ran_b = ran(a), ran(b)
    differences += [
        f"{k} (A {ran_a[k]}, B {ran_b[k]})" for k in ran_a if ran_a[k] and ran_b[k] and ran_a[k] != ran_b[k]
    ]
    return differences


def _mark_unlike(tables: list[Table]) -> None:
    """Every verdict of a comparison of unlike runs says so."""
    for table in tables:
        if "verdict" in table.columns:
            at = table.columns.index("verdict")
            for row in table.rows:
                if isinstance(row[at], str) and row[at] not in ("", "–"):
                    row[at] += UNLIKE_VERDICT


def _throughput(data: RunData, include_cold: bool) -> dict[str, Any]:
    wall = wall_clock_s(data)
    done = len(data.results)
    return {
        "pages/s (steady state)": steady_state_throughput(data, include_cold),
        "wall clock s (submit to last result)": wall,
        "pages/s (wall clock)": done / wall if wall else None,
    }


def _warnings(*runs: RunData) -> list[str]:
    return [
        RANDOM_WEIGHTS_WARNING.format(run=d.run.id, model=d.run.model)
        for d in runs
        if d.run.random_weights or any(r.random_weights for r in d.results.values())
    ]


def _progress_warnings(*runs: RunData) -> list[str]:
    """What a report of a run that has not run says first: an interrupted run's jobs handed back, jobs a
    submit left unsent, or no result yet.
    (`dsocr run`'s own jobs are pending until it claims them: never sent, by design.)"""
    warnings = []
    for d in runs:
        pending = sum(j.state == "pending" for j in d.jobs)
        open_jobs = sum(j.state in ("pending", "queued", "running") for j in d.jobs)
        if open_jobs and d.run.interrupted_at is not None:
            warnings.append(INTERRUPTED_WARNING.format(open=open_jobs, jobs=len(d.jobs), run=d.run.id))
        elif pending and d.run.queue != IN_PROCESS_QUEUE:
            warnings.append(
                NEVER_SENT_WARNING.format(pending=pending, jobs=len(d.jobs), run=d.run.id, queue=d.run.queue)
            )
        elif open_jobs and not d.results:
            warnings.append(NO_RESULT_WARNING.format(open=open_jobs, jobs=len(d.jobs), run=d.run.id))
    return warnings


def _accuracy_note(*runs: RunData) -> str | None:
    """Accuracy tables carry the random-weights warning of their runs: scores of noise mean nothing."""
    return " ".join(_warnings(*runs)) or None


def scored(data: RunData) -> bool:
    """Whether the run has ground truth (its jobs carry references)."""
    return any(j.reference is not None for j in data.jobs)


def single_report(
    data: RunData,
    *,
    per_image: bool = False,
    include_cold: bool = False,
    exclude_loops: bool = False,
    include_profiled: bool = False,
    kernels: int = kernel_tables.KERNEL_ROWS,
) -> Report:
    results = measured(data, include_cold, exclude_loops, include_profiled)
    report = Report(
        f"dsocr report: run {data.run.id} ({data.run.name})", _progress_warnings(data) + _warnings(data)
    )
    facts = run_facts(data, include_cold, exclude_loops, include_profiled)
    report.tables.append(Table("Run", ["field", "value"], [[k, v] for k, v in facts.items()]))
    throughput = _throughput(data, include_cold)
    report.tables.append(Table("Throughput", ["measure", "value"], [[k, v] for k, v in throughput.items()]))
    report.tables.append(serving_table(data, include_cold))
    if data.steps:  # a run at --concurrency above 1
        report.tables.append(batch_steps_table(data))
    rows = []
    for metric in latency(results) + OUTPUT + MEMORY:
        s = summarize(metric, results)
        if s.n or metric not in MEMORY:
            rows.append([metric.label, s.jobs, s.n, s.mean, s.p50, s.p90, s.p99])
    columns = ["metric", "jobs", "n", "mean", "p50", "p90", "p99"]
    report.tables.append(Table("Latency and output", columns, rows))
    if scored(data):
        report.tables.append(_accuracy_by_mode(data, results))
        report.tables.append(_omnidocbench_figures(data))
    report.tables.append(_stop_reasons(data))
    report.tables.append(_accounting(results))
    if facts["cold results"]:
        report.tables.append(_cold(data, include_cold))
    if data.profiles or data.step_profiles:
        report.tables += [
            kernel_tables.kernel_table(data, include_cold, kernels),
            kernel_tables.busy_table(data, include_cold),
            kernel_tables.overhead_table(data, include_cold),
        ]
    report.tables.append(_sessions(data, include_cold))
    report.tables.append(_environment(data))
    failures = [
        [j.image, j.repeat, j.id, j.state, j.attempts, j.last_error_class, j.last_error_message]
        for j in data.jobs
        if j.state in ("failed", "poisoned")
    ]
    if failures:
        columns = ["image", "repeat", "job id", "state", "attempts", "error", "message"]
        report.tables.append(Table("Failures", columns, failures))
    if per_image:
        report.tables.append(_per_image(data))
    report.terms = glossary(data.results.values())
    return report


def _accuracy_by_mode(data: RunData, measured_results: list[Result]) -> Table:
    """Per mode, the edit distances to the ground truth (every result) beside what the pages cost (the
    results the latency statistics use)."""
    everything = in_job_order(data)
    rows: list[list[Any]] = []
    for mode in dict.fromkeys(r.mode for r in everything):
        for metric in ACCURACY:
            s = summarize(metric, [r for r in everything if r.mode == mode])
            rows.append([mode, metric.label, s.jobs, s.mean, s.p50, s.p90])
        fallback = sum(r.mode == mode and r.matched_by == ONE_TO_ONE for r in everything)
        rows.append([mode, ONE_TO_ONE_PAGES, fallback, None, None, None])
        for metric in SPEED:
            s = summarize(metric, [r for r in measured_results if r.mode == mode])
            rows.append([mode, metric.label, s.jobs, s.mean, s.p50, s.p90])
    columns = ["mode", "metric", "jobs", "mean", "p50", "p90"]
    title = f"Accuracy and latency per mode (against the ground truth; {ACCURACY_READING})"
    return Table(title, columns, rows, _accuracy_note(data))


def page_averages(data: RunData, metric: Metric) -> dict[tuple[str, str], float]:
    """Per (mode, image): the metric averaged over the image's results (its repeats); images whose
    results have no value (nothing of the category on the page) are absent."""
    jobs = {j.id: j for j in data.jobs}
    values: dict[tuple[str, str], list[float]] = {}
    for result in in_job_order(data):
        values.setdefault((result.mode, jobs[result.job_id].image), []).extend(metric.values(result))
    return {key: sum(v) / len(v) for key, v in values.items() if v}


def _has_attribute(attributes: dict[str, dict[str, str]], name: str, value: str, image: str) -> bool:
    return attributes[image].get(name) == value


def omnidocbench_figures(data: RunData) -> dict[tuple[str, str], tuple[int, list[float | None]]]:
    """The figures OmniDocBench's leaderboard prints, aggregated as it does: each page's figure (its repeats
    averaged), then the mean over the pages that have the category. By (mode, page group: "all pages" and
    each value of the PAGE_GROUPS attributes): the number of pages and one value per ACCURACY metric."""
    attributes = {j.image: (j.reference or {}).get("attributes") or {} for j in data.jobs}
    averages = [page_averages(data, metric) for metric in ACCURACY]
    groups: list[tuple[str, Callable[[str], bool]]] = [("all pages", lambda image: True)]
    for name in PAGE_GROUPS:
        for value in sorted({a[name] for a in attributes.values() if name in a}):
            groups.append((f"{name}: {value}", partial(_has_attribute, attributes, name, value)))
    jobs = {j.id: j for j in data.jobs}
    figures: dict[tuple[str, str], tuple[int, list[float | None]]] = {}
    for mode in dict.fromkeys(r.mode for r in in_job_order(data)):
        images = {jobs[r.job_id].image for r in in_job_order(data) if r.mode == mode}
        for label, member in groups:
            cells: list[float | None] = []
            for by_page in averages:
                values = [v for (m, image), v in by_page.items() if m == mode and member(image)]
                cells.append(sum(values) / len(values) if values else None)
            figures[(mode, label)] = (sum(member(image) for image in images), cells)
    return figures


FIGURES_TITLE = "OmniDocBench figures, page averages as its leaderboard aggregates them"


def _omnidocbench_figures(data: RunData) -> Table:
    rows = [
        [mode, group, pages, *cells] for (mode, group), (pages, cells) in omnidocbench_figures(data).items()
    ]
    columns = ["mode", "page group", "pages", *(m.label for m in ACCURACY)]
    return Table(f"{FIGURES_TITLE} ({ACCURACY_READING})", columns, rows, _accuracy_note(data))


def _omnidocbench_figure_pairs(a: RunData, b: RunData) -> Table:
    """Each run's OmniDocBench figures side by side (each over its own pages; the paired differences
    are in "Paired accuracy")."""
    figures_a, figures_b = omnidocbench_figures(a), omnidocbench_figures(b)
    rows = []
    for key in dict.fromkeys([*figures_a, *figures_b]):
        pages_a, cells_a = figures_a.get(key, (0, [None] * len(ACCURACY)))
        pages_b, cells_b = figures_b.get(key, (0, [None] * len(ACCURACY)))
        for metric, value_a, value_b in zip(ACCURACY, cells_a, cells_b, strict=True):
            rows.append([*key, metric.label, pages_a, value_a, pages_b, value_b])
    columns = ["mode", "page group", "metric", "A pages", "A", "B pages", "B"]
    return Table(f"{FIGURES_TITLE} ({ACCURACY_READING})", columns, rows, _accuracy_note(a, b))


def _stop_reasons(data: RunData) -> Table:
    """Why decoding stopped, every result counted, and how many outputs ended in a repetition loop."""
    results = in_job_order(data)
    rows: list[list[Any]] = []
    for reason in STOP_REASONS:
        stopped = [r for r in results if r.stop_reason == reason]
        loops = [r for r in stopped if looping(r)]
        rows.append(
            [
                reason,
                len(stopped),
                100.0 * len(stopped) / len(results) if results else None,
                len(loops),
                Summary.from_values([r.loop_start for r in loops]).p50,
                sum(r.loop_wasted_steps or 0 for r in loops),
            ]
        )
    columns = [
        "stop reason",
        "jobs",
        "share %",
        "in a repetition loop",
        "loop start step p50",
        "loop wasted steps (sum)",
    ]
    return Table("Stop reasons", columns, rows)


def _accounting(results: list[Result]) -> Table:
    """Mean per job of each part of e2e: means add up, so the parts' column sums to the e2e row. A part
    none of them measured (a batched run's decode, in steps its pages share) has no row: its time is
    in the host gap."""
    e2e = Summary.from_values([E2E.of(r) for r in results]).mean
    hidden = unmeasured(results)

    def share(mean: float | None) -> float | None:
        return None if mean is None or not e2e.value else 100 * mean / e2e.value

    parts = [
        (t.label, Summary.from_values([t.of(r) for r in results]).mean)
        for t in PARTS
        if t.column not in hidden
    ]
    total = sum(mean.value for _, mean in parts if mean.value is not None) if results else None
    rows: list[list[Any]] = [[label, mean, share(mean.value)] for label, mean in parts]
    rows.append(["sum of parts", total, share(total)])
    rows.append(["end-to-end", e2e, share(e2e.value)])
    prefetched = [r for r in results if r.prefetched]
    note = None
    if prefetched:
        wait = Summary.from_values([PAGE_WAIT.of(r) for r in prefetched]).mean.value
        note = (
            f"{len(prefetched)} of {len(results)} jobs prefetched: their preprocess ran while the previous job had "
            f"the device, and their pages then waited {wait:.1f} ms on average for their jobs, outside e2e"
        )
    return Table("Accounting: parts of end-to-end", ["part", "mean ms", "share of e2e %"], rows, note)


def _cold(data: RunData, include_cold: bool) -> Table:
    reasons = Counter(r.cold_reason or "(no reason recorded)" for r in data.results.values() if r.cold)
    in_statistics = "yes (--include-cold)" if include_cold else "no (--include-cold puts them back)"
    rows = [[reason, count, in_statistics] for reason, count in reasons.most_common()]
    return Table("Cold results", ["reason", "jobs", "in statistics"], rows)


# One shape a worker session warmed, as farm/job/process.py writes them: "gundam:2x3 (256 tokens)".
_WARMED_SHAPE = re.compile(r"\s*([^,(]+?)\s*\(([^)]*)\)")


def warmup_summary(warmup: str) -> str:
    """A worker session's warm-up for a table cell: its shapes counted per mode and token budget
    ("gundam: 25 shapes, base (256 tokens)") rather than each crop grid the ledger lists."""
    shapes = _WARMED_SHAPE.findall(warmup)
    if not shapes:
        return warmup
    by_budget: dict[str, Counter[str]] = defaultdict(Counter)
    for shape, budget in shapes:
        by_budget[budget][shape.partition(":")[0]] += 1
    return "; ".join(
        ", ".join(mode if n == 1 else f"{mode}: {n} shapes" for mode, n in modes.items()) + f" ({budget})"
        for budget, modes in by_budget.items()
    )


def _sessions(data: RunData, include_cold: bool) -> Table:
    """One row per worker process (a lane: one device), with what loading and warming its model(s) cost
    (its worker sessions); results older than sessions are grouped by worker fingerprint."""
    grouped: dict[str, list[Result]] = defaultdict(list)
    for r in data.results.values():
        grouped[lane_key(data, r)].append(r)
    times, idle = service_times_s(data, include_cold), device_idle_ms(data)
    rows = []
    for key, results in sorted(grouped.items()):
        ids = dict.fromkeys(r.worker_session_id for r in results if r.worker_session_id in data.sessions)
        sessions = [data.sessions[i] for i in ids if i is not None]
        first, w = (sessions[0] if sessions else None), data.workers.get(results[0].worker_id)
        counted = [r for r in results if include_cold or not r.cold]
        rows.append(
            [
                first.host if first else w.host if w else None,
                first.pid if first else None,
                first.device if first else results[0].device,
                first.engine if first else results[0].engine,
                len(sessions),
                sum(s.load_ms or 0 for s in sessions) / 1000 if sessions else None,
                sum(s.warmup_ms or 0 for s in sessions) / 1000 if sessions else None,
                "; ".join(warmup_summary(s.warmup) for s in sessions if s.warmup) or None,
                len(results),
                sum(r.cold for r in results),
                rate_sum([times.get(key, [])]),
                Summary.from_values([E2E.of(r) for r in counted]).p50,
                sum(r.prefetched for r in results),
                Summary.from_values(idle.get(key, [])).p50,
                device_busy_share(data, key),
            ]
        )
    for holder in _holders_without_results(data, set(grouped)):  # took a job of the run and kept no result
        rows.append(
            [holder.host, holder.pid, holder.device, *[None] * 4, None, 0, 0, None, None, 0, None, None]
        )
    owners = {_lane_of(p): p for p in data.processes.values()}
    lost = Counter(
        _lane_of(data.processes[a.owner]) for a in _lost_attempts(data) if a.owner in data.processes
    )
    for row in rows:
        lane = f"{row[0]}:{row[1]}:{row[2]}"
        process = owners.get(lane)
        row += [process_state(process) if process else None, lost.get(lane, 0)]
    columns = [
        "host",
        "pid",
        "device",
        "engine",
        "sessions",
        "load s",
        "warm-up s",
        "warm-up",
        "jobs",
        "cold jobs",
        "pages/s (steady state)",
        "e2e p50 ms",
        "prefetched",
        "device idle between jobs p50 ms",
        "device share of a job between jobs",
        "process",
        "attempts lost",
    ]
    return Table("Worker processes", columns, rows)


def _lane_of(process: WorkerProcess) -> str:
    return f"{process.host}:{process.pid}:{process.device}"


def _lost_attempts(data: RunData) -> list[JobAttempt]:
    """Claims of the run's jobs that did not end in their holder's result: the holder died, its lease
    ran out, it was killed at the time limit, or the attempt failed and the job was tried again."""
    final = {r.job_id: r.attempt for r in data.results.values()}
    jobs = {j.id: j for j in data.jobs}
    return [
        a
        for a in data.attempts
        if final.get(a.job_id) != a.attempt
        and not (jobs[a.job_id].state == "running" and a.attempt == jobs[a.job_id].attempts)
    ]


def _holders_without_results(data: RunData, lanes: set[str]) -> list[WorkerProcess]:
    """Worker processes that claimed a job of the run but have no result in it, by first claim."""
    owners = dict.fromkeys(a.owner for a in data.attempts)
    held = [data.processes[o] for o in owners if o in data.processes]
    return [p for p in held if _lane_of(p) not in lanes]


def process_state(process: WorkerProcess, now: datetime | None = None) -> str:
    """live, stopped (a clean shutdown), or dead (it stopped beating without stopping)."""
    if process.stopped_at is not None:
        return "stopped"
    silent = ((now or utcnow()) - process.heartbeat_at).total_seconds()
    if silent < read(LEASE_SECONDS):
        return "live"
    return f"DEAD (last beat {process.heartbeat_at.isoformat(sep=' ', timespec='seconds')})"


def _environment(data: RunData) -> Table:
    columns = [
        "worker",
        "host",
        "device",
        "GPU",
        "GPU UUID",
        "driver",
        "CUDA",
        "torch",
        "transformers",
        "python",
        "dsocr",
        "git",
        "model",
    ]
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
        ]
        for w in sorted(data.workers.values(), key=lambda w: w.id)
    ]
    return Table("Environment", columns, rows)


def _loop_cell(r: Result) -> str | None:
    if not looping(r):
        return None
    return f"from step {r.loop_start}, period {r.loop_period}, {r.loop_wasted_steps} steps wasted"


def _per_image(data: RunData) -> Table:
    figures = per_image(list(data.results.values()))
    job_columns = ["image", "repeat", "job id", "state", "attempts"]
    columns = [
        *job_columns,
        "worker",
        "device",
        *(m.label.strip() for m in figures),
        "tokens",
        "wasted steps",
        "ms/token p50",
        "peak MiB",
        "boxes",
        "cold",
        "text edit",
        "formula edit",
        "table edit",
        "table TEDS",
        "reading order edit",
        "repetition loop",
        "stop / error",
    ]
    rows = []
    for j in data.jobs:
        r = data.results.get(j.id)
        peak = r.peak_memory_bytes if r else None
        # A job without a result shows its error in the last column.
        result_cells = (
            [
                lane_key(data, r),
                r.device,
                *(next(iter(m.values(r)), None) for m in figures),
                r.decode_tokens,
                r.wasted_steps,
                r.decode_ms_per_token_p50,
                None if peak is None else peak / MIB,
                r.box_count,
                r.cold_reason if r.cold else None,
                r.text_edit,
                r.formula_edit,
                r.table_edit,
                r.table_teds,
                r.reading_order_edit,
                _loop_cell(r),
                r.stop_reason,
            ]
            if r
            else [None] * (len(columns) - len(job_columns) - 1) + [j.last_error_class]
        )
        rows.append([j.image, j.repeat, j.id, j.state, j.attempts, *result_cells])
    return Table("Per image", columns, rows, _accuracy_note(data) if scored(data) else None)


def _by_image(data: RunData, results: list[Result]) -> dict[tuple[str, int], Result]:
    jobs = {j.id: j for j in data.jobs}
    return {(jobs[r.job_id].image, jobs[r.job_id].repeat): r for r in results}


def comparison_report(
    a: RunData,
    b: RunData,
    *,
    per_image: bool = False,
    include_cold: bool = False,
    exclude_loops: bool = False,
    include_profiled: bool = False,
    kernels: int = kernel_tables.KERNEL_ROWS,
) -> Report:
    """B against A. Latency over the (image, repeat) pairs measured in both runs, ratios B/A with the
    interval of a paired bootstrap; accuracy as paired differences B − A; throughput from each run's
    steady state."""
    report = Report(
        f"dsocr report: run {b.run.id} (B) vs {a.run.id} (A)", _progress_warnings(a, b) + _warnings(a, b)
    )
    facts_a = run_facts(a, include_cold, exclude_loops, include_profiled)
    facts_b = run_facts(b, include_cold, exclude_loops, include_profiled)
    report.tables.append(Table("Runs", ["field", "A", "B"], [[k, facts_a[k], facts_b[k]] for k in facts_a]))
    throughput_a, throughput_b = _throughput(a, include_cold), _throughput(b, include_cold)
    rows = [[k, throughput_a[k], throughput_b[k], None, None] for k in throughput_a]
    ratio = throughput_ratio(b, a, include_cold)
    rows[0][3:] = [ratio, verdict(ratio)]  # only the steady state is compared: wall clock includes loading
    report.tables.append(Table("Throughput", ["measure", "A", "B", "B/A", "verdict"], rows))
    report.tables.append(serving_pairs_table(a, b, include_cold))
    if a.steps or b.steps:
        report.tables.append(batch_steps_pairs_table(a, b))

    by_a, by_b = (_by_image(d, measured(d, include_cold, exclude_loops, include_profiled)) for d in (a, b))
    pairs = sorted(set(by_a) & set(by_b))
    paired_a, paired_b = [by_a[k] for k in pairs], [by_b[k] for k in pairs]
    rows = []
    # A figure that only one run measured (CLIP against the Qwen2 encoder, SAM against a batched run's
    # whole vision): shown on the side that measured it, without a ratio.
    hidden_a, hidden_b = unmeasured(paired_a), unmeasured(paired_b)
    one_sided = {timing_metric(t).label: t for t in TIMINGS if t.column in hidden_a ^ hidden_b}
    for metric in latency(paired_a + paired_b) + MEMORY[:1]:
        sa, sb = summarize(metric, paired_a), summarize(metric, paired_b)
        if not (sa.n or sb.n):
            continue
        if metric.label in one_sided:
            only_a = one_sided[metric.label].column in hidden_b
            why = "one model's stage" if one_sided[metric.label].family_stage else "measured by one run"
            for statistic, in_a, in_b in (("mean", sa.mean, sb.mean), ("p50", sa.p50, sb.p50)):
                rows.append([metric.label, statistic, len(pairs), in_a if only_a else None,
                             None if only_a else in_b, None, why])  # fmt: skip
            continue
        ratios = paired_ratios([metric.values(r) for r in paired_b], [metric.values(r) for r in paired_a])
        rows.append([metric.label, "mean", len(pairs), sa.mean, sb.mean, ratios.mean, verdict(ratios.mean)])
        rows.append([metric.label, "p50", len(pairs), sa.p50, sb.p50, ratios.p50, verdict(ratios.p50)])
    columns = ["metric", "statistic", "pairs", "A", "B", "B/A", "verdict"]
    report.tables.append(Table("Paired latency", columns, rows))

    all_a, all_b = _by_image(a, list(a.results.values())), _by_image(b, list(b.results.values()))
    if scored(a) and scored(b):
        report.tables.append(_paired_accuracy(all_a, all_b, _accuracy_note(a, b)))
        report.tables.append(_omnidocbench_figure_pairs(a, b))
    report.tables.append(_stop_reason_pairs(a, b))
    if (a.profiles and b.profiles) or (a.step_profiles and b.step_profiles):
        report.tables.append(kernel_tables.kernel_pairs_table(a, b, include_cold, kernels))
    report.tables.append(_agreement(all_a, all_b))
    if a.run.model != b.run.model:
        report.tables.append(page_differences(a, b, all_a, all_b))
    if per_image:
        report.tables.append(_per_image_pairs(all_a, all_b))
    report.differences = run_differences(a, b)
    if report.differences:
        report.warnings.insert(0, UNLIKE_WARNING.format(differences="; ".join(report.differences)))
        _mark_unlike(report.tables)
    report.terms = glossary([*all_a.values(), *all_b.values()])
    return report


def difference_verdict(difference: Estimate, higher_is_better: bool = False) -> str:
    """What a B − A difference of an accuracy figure says, plainly (edit distances read better lower,
    TEDS higher)."""
    if difference.value is None:
        return "–"
    if difference.low is None or difference.high is None:
        return "no interval (n<2)" if difference.n < 2 else "no interval (no spread)"
    if difference.high < 0:
        return "B lower: reads worse" if higher_is_better else "B lower: reads better"
    if difference.low > 0:
        return "B higher: reads better" if higher_is_better else "B higher: reads worse"
    return NO_DIFFERENCE


def _paired_accuracy(
    by_a: dict[tuple[str, int], Result], by_b: dict[tuple[str, int], Result], note: str | None
) -> Table:
    """Every result, cold or looping or not: B − A of each edit distance over the pages scored in both."""
    rows = []
    for metric in ACCURACY:
        pairs = [
            (by_a[k], by_b[k])
            for k in sorted(set(by_a) & set(by_b))
            if metric.values(by_a[k]) and metric.values(by_b[k])
        ]
        values_a = [metric.values(ra)[0] for ra, _ in pairs]
        values_b = [metric.values(rb)[0] for _, rb in pairs]
        difference = paired_difference(values_b, values_a)
        rows.append(
            [
                metric.label,
                len(pairs),
                Summary.from_values(values_a).mean,
                Summary.from_values(values_b).mean,
                difference,
                difference_verdict(difference, metric.higher_is_better),
            ]
        )
    columns = ["metric", "pairs", "A mean", "B mean", "B-A", "verdict"]
    return Table(f"Paired accuracy ({ACCURACY_READING})", columns, rows, note)


def _stop_reason_pairs(a: RunData, b: RunData) -> Table:
    results_a, results_b = in_job_order(a), in_job_order(b)
    rows = [
        [
            reason,
            sum(r.stop_reason == reason for r in results_a),
            sum(r.stop_reason == reason for r in results_b),
            sum(r.stop_reason == reason and looping(r) for r in results_a),
            sum(r.stop_reason == reason and looping(r) for r in results_b),
        ]
        for reason in STOP_REASONS
    ]
    return Table("Stop reasons", ["stop reason", "A jobs", "B jobs", "A in a loop", "B in a loop"], rows)


def _agreement(by_a: dict[tuple[str, int], Result], by_b: dict[tuple[str, int], Result]) -> Table:
    """Every result, cold or not: outputs do not depend on warm-up."""
    pairs = sorted(set(by_a) & set(by_b))
    identical = sum(by_a[k].markup == by_b[k].markup for k in pairs)
    deltas = [by_b[k].box_count - by_a[k].box_count for k in pairs]
    rows: list[list[Any]] = [
        ["paired images", len(pairs)],
        ["only in A", len(set(by_a) - set(by_b))],
        ["only in B", len(set(by_b) - set(by_a))],
        ["identical markup %", 100.0 * identical / len(pairs) if pairs else None],
        ["box count delta B-A (mean)", float(np.mean(deltas)) if deltas else None],
        ["box count |delta| (mean)", float(np.mean(np.abs(deltas))) if deltas else None],
        ["images with a different box count", sum(d != 0 for d in deltas)],
    ]
    return Table("Output agreement", ["measure", "value"], rows)


def _per_image_pairs(by_a: dict[tuple[str, int], Result], by_b: dict[tuple[str, int], Result]) -> Table:
    rows = []
    for key in sorted(set(by_a) & set(by_b)):
        ra, rb = by_a[key], by_b[key]
        e2e_a, e2e_b = E2E.of(ra), E2E.of(rb)
        rows.append(
            [
                *key,
                e2e_a,
                e2e_b,
                e2e_b / e2e_a if e2e_a and e2e_b is not None else None,
                ra.cold,
                rb.cold,
                ra.decode_tokens,
                rb.decode_tokens,
                ra.markup == rb.markup,
                ra.box_count,
                rb.box_count,
                ra.text_edit,
                rb.text_edit,
                ra.stop_reason,
                rb.stop_reason,
            ]
        )
    columns = [
        "image",
        "repeat",
        "A e2e ms",
        "B e2e ms",
        "B/A",
        "A cold",
        "B cold",
        "A tokens",
        "B tokens",
        "same markup",
        "A boxes",
        "B boxes",
        "A text edit",
        "B text edit",
        "A stop",
        "B stop",
    ]
    return Table("Per image", columns, rows)
