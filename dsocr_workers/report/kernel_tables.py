"""The report's kernel tables: a run's profiled jobs or batch steps, their kernels per stage aggregated,
how busy the device was inside each stage, the cross-check of the summed kernel time against the stage's
clock, what the profiler cost, and, with --vs, which kernels got faster or slower.

Each profile's summary (dsocr_workers/kernels.py, stored in `profiles.summary`) lists its top kernels per
stage and the rest as one row; a stage's figures here are means per profiled job, with the interval
over those jobs (report/stats.py), so a kernel that ran in some jobs only counts 0 in the others.
The decode's row is the sampled steps' (engine/profiling.py DecodeSample), not the whole decode.
A batched run's profiles are its sampled steps' (engine/profiling.py StepSample), one stage each: its
rows are batch steps by kind and occupancy band ("batch decode step, occupancy 2-7"), their figures
means per profiled step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dsocr_workers.kernels import Activity, KernelSummary, StageKernels
from dsocr_workers.report.queries import RunData, StepProfile
from dsocr_workers.report.serving import OCCUPANCY_BANDS, band_of
from dsocr_workers.report.stats import Estimate, Summary, paired_ratios
from dsocr_workers.report.tables import KernelName, Table, in_job_order, verdict
from dsocr_workers.stages import BY_COLUMN

E2E = BY_COLUMN["e2e_ms"]

KERNEL_ROWS = 8  # kernels shown per stage by default, the longest first (`dsocr report --kernels`)
TITLE = "Kernels per stage"
BUSY_TITLE = "Device busy and idle per stage"
OVERHEAD_TITLE = "Profiler overhead"
UNPAIRED = "no interval (unpaired steps)"
TRACE_HINTS = 5  # sampled steps' indices the kernel table's note names
PAIRS_TITLE = "Kernels per stage, B vs A"
WHAT = {
    "cuda": "CUDA kernels, memcpys and memsets, on the GPU's clock",
    "cpu": "CPU operators, their self time",
}


@dataclass
class StageRuns:
    """One stage over a run's profiled jobs: each job's row (in job order), and each kernel's total µs
    per job (0 where a job did not list it)."""

    stage: str
    jobs: list[StageKernels] = field(default_factory=list)
    kernel_us: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def per_job(self, figure: Callable[[StageKernels], float]) -> Summary:
        return Summary.from_values([figure(s) for s in self.jobs])


def profiled(data: RunData, include_cold: bool = False) -> list[tuple[str, KernelSummary]]:
    """(job id, summary) of the run's profiled jobs, in job order: warm ones unless `include_cold` (a cold
    job's kernels hold its compilation, its first use of a cache bucket, ...)."""
    return [
        (j.id, data.profiles[j.id])
        for j in data.jobs
        if j.id in data.profiles and j.id in data.results and (include_cold or not data.results[j.id].cold)
    ]


# A page's prefill steps in the order they run: whole, or split in two.
PREFILL_KINDS = ("prefill", "sam", "join")


def step_stage(step: StepProfile) -> str:
    """A sampled batch step's row: its kind, and a decode step's occupancy band (a prefill or a part of
    one serves one page)."""
    if step.kind != "decode":
        return f"batch {step.kind} step"
    return f"batch decode step, occupancy {band_of(step.occupancy)}"


def profiled_steps(data: RunData) -> list[KernelSummary]:
    """The run's sampled batch steps, their one stage named `step_stage`: the prefills (whole, then the
    sam and join parts), then the decode steps by occupancy band, each group in the order its steps ran."""
    bands = [label for label, _, _ in OCCUPANCY_BANDS]

    def order(step: StepProfile) -> tuple[int, int]:
        if step.kind != "decode":
            return (PREFILL_KINDS.index(step.kind) if step.kind in PREFILL_KINDS else len(PREFILL_KINDS), 0)
        return (len(PREFILL_KINDS) + 1, bands.index(band_of(step.occupancy)))

    ordered = sorted(data.step_profiles, key=order)
    return [
        replace(
            step.summary, stages=[replace(stage, stage=step_stage(step)) for stage in step.summary.stages]
        )
        for step in ordered
    ]


def summaries(data: RunData, include_cold: bool = False) -> list[KernelSummary]:
    """Every profile the kernel tables aggregate: the profiled jobs' (`profiled`), then the sampled batch
    steps' (`profiled_steps`)."""
    return [summary for _, summary in profiled(data, include_cold)] + profiled_steps(data)


def unit(data: RunData) -> str:
    """What one profile is: a job, or a batch step (a batched run's)."""
    return "step" if data.step_profiles and not data.profiles else "job"


def activity_of(data: RunData) -> Activity | None:
    kinds = {summary.activity for summary in summaries(data, include_cold=True)}
    return kinds.pop() if len(kinds) == 1 else None


def by_stage(summaries: list[KernelSummary]) -> dict[str, StageRuns]:
    """The stages in the order the jobs ran them, each over the jobs that had it."""
    stages: dict[str, StageRuns] = {}
    for summary in summaries:
        for row in summary.stages:
            stage = stages.setdefault(row.stage, StageRuns(row.stage))
            listed = {k.name: k for k in row.kernels}
            for name in (
                listed.keys() - stage.kernel_us.keys()
            ):  # a kernel first seen here: 0 in the jobs before
                stage.kernel_us[name] = [0.0] * len(stage.jobs)
            for name, values in stage.kernel_us.items():
                values.append(listed[name].total_us if name in listed else 0.0)
                stage.calls[name] += listed[name].calls if name in listed else 0
            stage.jobs.append(row)
    return stages


def _what(data: RunData) -> str:
    activity = activity_of(data)
    return WHAT[activity] if activity else "CUDA kernels and CPU operators: the run's jobs ran on both"


def kernel_table(data: RunData, include_cold: bool = False, rows_per_stage: int = KERNEL_ROWS) -> Table:
    jobs, each = profiled(data, include_cold), unit(data)
    rows: list[list[Any]] = []
    for stage in by_stage(summaries(data, include_cold)).values():
        clock_ms = sum(s.event_ms for s in stage.jobs)
        ranked = sorted(stage.kernel_us, key=lambda k: -sum(stage.kernel_us[k]))[:rows_per_stage]
        for name in ranked:
            total_ms = sum(stage.kernel_us[name]) / 1e3
            calls = stage.calls[name]
            rows.append(
                [
                    stage.stage,
                    KernelName(name),
                    calls / len(stage.jobs),
                    Summary.from_values([v / 1e3 for v in stage.kernel_us[name]]).mean,
                    total_ms * 1e3 / calls if calls else None,
                    100 * total_ms / clock_ms if clock_ms else None,
                ]
            )
    cold = (
        " (cold ones too: --include-cold)" if include_cold else " (warm ones: cold ones with --include-cold)"
    )
    said = []
    if data.profiles:
        said.append(
            f"{len(jobs)} profiled job(s){cold}. decode: the sampled steps only. `dsocr trace --job ID` writes a "
            "job's trace for Perfetto"
        )
    if data.step_profiles:
        indices = ", ".join(str(s.step_index) for s in data.step_profiles[:TRACE_HINTS])
        indices += ", …" if len(data.step_profiles) > TRACE_HINTS else ""
        said.append(
            f"{len(data.step_profiles)} profiled batch step(s) (every N-th of each kind: --profile N), by kind and "
            f"occupancy band (pages in the step). `dsocr trace --run {data.run.id} --step N` writes a step's trace "
            f"for Perfetto (N: {indices})"
        )
    note = (
        f"{'; '.join(said)}. A kernel is what ran: {_what(data)}. ms/{each}: its time per profiled {each}; share of "
        "stage: its time over the stage's clock time (CUDA events on a GPU)."
    )
    columns = ["stage", "kernel", f"calls/{each}", f"ms/{each}", "mean µs/call", "share of stage %"]
    return Table(TITLE, columns, rows, note)


def busy_table(data: RunData, include_cold: bool = False) -> Table:
    """Per stage: its clock, the kernels' sum, busy (their union) and idle time, and the cross-check."""
    activity = activity_of(data) or "cuda"
    rows: list[list[Any]] = []
    for stage in by_stage(summaries(data, include_cold)).values():
        mean = StageKernels.mean(stage.jobs)
        rows.append(
            [
                stage.stage,
                len(stage.jobs),
                stage.per_job(lambda s: s.event_ms).mean,
                stage.per_job(lambda s: s.kernel_ms).mean,
                stage.per_job(lambda s: s.busy_ms).mean,
                stage.per_job(lambda s: s.idle_ms).mean,
                100 * mean.busy_ms / mean.event_ms if mean.event_ms else None,
                mean.kernel_ms / mean.event_ms if mean.event_ms else None,
                mean.crosscheck(activity),
            ]
        )
    idle = "the GPU waiting for the host" if activity == "cuda" else "Python between the operators"
    note = (
        f"clock ms: the stage's own timing (CUDA events on a GPU, perf_counter on a CPU) per profiled {unit(data)}; "
        f"kernels ms: the sum of its kernels; busy: their union; idle = clock - busy ({idle}). Cross-check: "
        "the kernels' sum within 5% of the clock (PASS), or the gap is idle time between kernels whose span "
        "matches the clock (explained); stages under 1 ms are not judged."
    )
    columns = [
        "stage",
        f"{unit(data)}s",
        "clock ms",
        "kernels ms",
        "busy ms",
        "idle ms",
        "busy %",
        "kernels / clock",
        "cross-check",
    ]
    return Table(BUSY_TITLE, columns, rows, note)


def overhead_table(data: RunData, include_cold: bool) -> Table:
    """What profiling cost: end-to-end of a page's profiled jobs over its unprofiled ones (warm unless
    `include_cold`), paired by page; a batched run's, its sampled steps' time over its other steps'."""
    if unit(data) == "step":
        return _step_overhead_table(data)
    results = [r for r in in_job_order(data) if include_cold or not r.cold]
    images = {j.id: j.image for j in data.jobs}
    profiled_e2e: dict[str, list[float]] = defaultdict(list)
    plain_e2e: dict[str, list[float]] = defaultdict(list)
    for r in results:
        value = E2E.of(r)
        if value is not None:
            (profiled_e2e if r.profiled else plain_e2e)[images[r.job_id]].append(value)
    pages = sorted(profiled_e2e.keys() & plain_e2e.keys())
    ratio = paired_ratios([profiled_e2e[p] for p in pages], [plain_e2e[p] for p in pages]).mean
    rows: list[list[Any]] = [
        ["profiled jobs", sum(r.profiled for r in data.results.values())],
        ["pages with profiled and unprofiled jobs", len(pages)],
        ["e2e ms, profiled", Summary.from_values([v for p in pages for v in profiled_e2e[p]]).mean],
        ["e2e ms, not profiled", Summary.from_values([v for p in pages for v in plain_e2e[p]]).mean],
        ["e2e profiled / not profiled", ratio],
    ]
    note = (
        "profiled jobs run under torch.profiler: their timings hold its cost, so they are left out of the "
        "latency statistics unless --include-profiled, and always out of steady-state throughput"
    )
    return Table(OVERHEAD_TITLE, ["measure", "value"], rows, note)


def _step_overhead_table(data: RunData) -> Table:
    """Per row of the kernel tables (kind, occupancy band): the sampled steps' mean time against the mean
    of the steps not profiled of the same kind and occupancy, over the sampled steps that have such."""
    plain: dict[tuple[str, int], list[float]] = defaultdict(list)
    for step in data.steps:
        if not step.profiled:
            plain[(step.kind, step.occupancy)].append(step.duration_ms)
    groups: dict[str, list[tuple[float, float]]] = {}  # (profiled ms, unprofiled mean ms)
    for profiled_step in sorted(data.step_profiles, key=lambda s: (s.kind != "prefill", s.kind, s.occupancy)):
        alike = plain.get((profiled_step.kind, profiled_step.occupancy))
        label = step_stage(profiled_step)
        groups.setdefault(label, [])
        if alike:
            groups[label].append((profiled_step.duration_ms, sum(alike) / len(alike)))
    rows: list[list[Any]] = []
    for label, pairs in groups.items():
        traced, baseline = sum(p for p, _ in pairs), sum(b for _, b in pairs)
        n = len(pairs)
        rows.append([label, n, traced / n if n else None, baseline / n if n else None,
                     traced / baseline if baseline else None])  # fmt: skip
    note = (
        "profiled batch steps run under torch.profiler: their times hold its cost, so the Batch steps table's "
        "step times leave them out; each is set against the mean of the run's unprofiled steps of its kind and "
        "occupancy (steps with none are not counted). The pages that shared a profiled step carry its cost in "
        "their latencies and the run's throughput: measure those on a run without --profile"
    )
    columns = ["stage", "profiled steps", "ms, profiled", "ms, not profiled", "profiled / not profiled"]
    return Table(OVERHEAD_TITLE, columns, rows, note)


def change(ratio: Any) -> str:
    """A kernel's B/A in plain words: faster (B lower), slower (B higher), or no significant difference."""
    said = verdict(ratio)
    return {"B lower": "faster in B", "B higher": "slower in B"}.get(said, said)


def kernel_pairs_table(
    a: RunData, b: RunData, include_cold: bool = False, rows_per_stage: int = KERNEL_ROWS
) -> Table:
    """Per stage and kernel, its time per job in A and in B over the pages profiled in both, B/A with the
    interval of a paired bootstrap; kernels of one run only are named so. Two batched runs: per batch step
    row, B/A of the means over the profiled steps."""
    if unit(a) == unit(b) == "step":
        return _step_pairs_table(a, b, rows_per_stage)
    pages_a, pages_b = _by_page(a, include_cold), _by_page(b, include_cold)
    pages = sorted(pages_a.keys() & pages_b.keys())
    stages_a = by_stage([s for p in pages for s in pages_a[p]])
    stages_b = by_stage([s for p in pages for s in pages_b[p]])

    def paired(name: str, kernel: str, ms_a: float, ms_b: float) -> tuple[Estimate, str]:
        ratio = paired_ratios(
            _page_values(pages_b, pages, name, kernel), _page_values(pages_a, pages, name, kernel)
        ).mean
        return ratio, change(ratio)

    rows = _kernel_pair_rows(stages_a, stages_b, paired, rows_per_stage)
    note = (
        f"{len(pages)} page(s) profiled in both runs; ms/job: the kernel's time per profiled job of those pages; "
        "B/A with a 95% interval over the pages (paired bootstrap). decode: the sampled steps only."
    )
    return Table(PAIRS_TITLE, ["stage", "kernel", "A ms/job", "B ms/job", "B/A", "change"], rows, note)


def _step_pairs_table(a: RunData, b: RunData, rows_per_stage: int) -> Table:
    """Per batch step row and kernel, its time per profiled step in A and in B, B/A of the means: no
    interval, as a run's steps pair with none of the other's."""
    rows = _kernel_pair_rows(
        by_stage(profiled_steps(a)),
        by_stage(profiled_steps(b)),
        lambda name, kernel, ms_a, ms_b: (Estimate(ms_b / ms_a), UNPAIRED),
        rows_per_stage,
    )
    note = (
        f"{len(a.step_profiles)} and {len(b.step_profiles)} profiled batch steps in A and B; ms/step: the kernel's "
        "time per profiled step of the row; B/A of the means, without an interval (steps of two runs are no pairs)."
    )
    return Table(PAIRS_TITLE, ["stage", "kernel", "A ms/step", "B ms/step", "B/A", "change"], rows, note)


def _kernel_pair_rows(
    stages_a: dict[str, StageRuns],
    stages_b: dict[str, StageRuns],
    ratio_of: Callable[[str, str, float, float], tuple[Estimate, str]],
    rows_per_stage: int,
) -> list[list[Any]]:
    """Per stage, its kernels longest first (in A or B): A's and B's mean ms, and `ratio_of(stage, kernel,
    ms_a, ms_b)`, its B/A and change, where both ran it."""
    rows: list[list[Any]] = []
    for name in dict.fromkeys([*stages_a, *stages_b]):
        in_a, in_b = stages_a.get(name), stages_b.get(name)
        kernels = dict.fromkeys([*(in_a.kernel_us if in_a else {}), *(in_b.kernel_us if in_b else {})])
        mean_ms = {k: (_mean_ms(in_a, k), _mean_ms(in_b, k)) for k in kernels}
        ranked = sorted(kernels, key=lambda k: -max(v or 0.0 for v in mean_ms[k]))[:rows_per_stage]
        for kernel in ranked:
            ms_a, ms_b = mean_ms[kernel]
            if not ms_a or not ms_b:
                rows.append(
                    [name, KernelName(kernel), ms_a, ms_b, None, "only in B" if ms_b else "only in A"]
                )
                continue
            rows.append([name, KernelName(kernel), ms_a, ms_b, *ratio_of(name, kernel, ms_a, ms_b)])
    return rows


def _by_page(data: RunData, include_cold: bool) -> dict[str, list[KernelSummary]]:
    images = {j.id: j.image for j in data.jobs}
    pages: dict[str, list[KernelSummary]] = defaultdict(list)
    for job_id, summary in profiled(data, include_cold):
        pages[images[job_id]].append(summary)
    return pages


def _mean_ms(stage: StageRuns | None, kernel: str) -> float | None:
    values = stage.kernel_us.get(kernel) if stage is not None else None
    return sum(values) / len(values) / 1e3 if values else None


def _page_values(
    by_page: dict[str, list[KernelSummary]], pages: list[str], stage: str, kernel: str
) -> list[list[float]]:
    """Per page, the kernel's ms in each of its profiled jobs (0 where a job's stage did not list it)."""
    out = []
    for page in pages:
        values = []
        for summary in by_page[page]:
            row = summary.stage(stage)
            if row is not None:
                values.append(next((k.total_us / 1e3 for k in row.kernels if k.name == kernel), 0.0))
        out.append(values)
    return out
