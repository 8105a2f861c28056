"""The pictures of `dsocr report --html`: matplotlib figures rendered to PNG, one function per plot.

Every function takes the runs being reported (`Side`s) and returns a `Plot` (title, caption, PNG
bytes). Figures are `matplotlib.figure.Figure`, never pyplot: no global registry, no GUI backend, and
`savefig` renders with Agg whatever the default backend. Each plot counts what the terminal report
counts; the per-image breakdown and the timeline show every result, cold ones hatched.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dsocr_workers.report.build import DECODE_PER_TOKEN, E2E, measured, timing_metric
from dsocr_workers.report.queries import RunData
from dsocr_workers.report.serving import serving
from dsocr_workers.report.tables import short_kernel_name
from dsocr_workers.report.throughput import services, steady_state_throughput
from dsocr_workers.stages import CDF_PLOT, bar_labels, breakdown_bars, shown_in, unmeasured
from dsocr_workers.store.models import Result

DPI = 100
WIDTH_IN = 12.0
RUN_COLORS = ("tab:blue", "tab:orange")  # A, B
COLD_HATCH = "///"
# Beyond this many jobs a per-job axis cannot carry a readable label per bar: bars stay, labels go.
MAX_LABELLED_JOBS = 40
# The decode scatter draws at most this many steps per run (a fixed random sample); the median line
# uses every step. Millions of points add nothing to the picture but seconds of rendering.
MAX_SCATTER_POINTS = 40_000
SEED = 0
MAX_TIME_BINS = 200  # throughput over time: bins from the submit to the last page
MAX_LABEL_CHARS = 24  # a per-image bar's label: the start and end of a longer name
# The decode plot's y-axis reaches this percentile of the steps (then a margin): one slow step (a
# collection, a preemption) no longer flattens every other point on the axis.
DECODE_Y_PERCENTILE = 99.5


@dataclass(frozen=True)
class Side:
    name: str  # in legends: "A", "B", or "run X" alone
    label: str  # in panel titles: "A: run X (name)"
    data: RunData


def sides_of(*runs: RunData) -> list[Side]:
    """One run, or A and B (--vs) in that order."""
    if len(runs) == 1:
        return [Side(f"run {runs[0].run.id}", f"run {runs[0].run.id} ({runs[0].run.name})", runs[0])]
    return [
        Side(side, f"{side}: run {d.run.id} ({d.run.name})", d) for side, d in zip("AB", runs, strict=True)
    ]


@dataclass(frozen=True)
class Plot:
    title: str  # the figure's heading in the page (and its image's alt text)
    caption: str  # what is drawn, and what is left out
    png: bytes


# The bars of the per-image breakdown, in the order they happen: the stage registry's `bar`s. Their sum
# is e2e: "setup + gaps" is e2e minus every other bar, what no bar names.
BARS: dict[str, tuple[str, ...]] = breakdown_bars()
GAPS = "setup + gaps"
# A colour per bar in order (a new bar takes the next one), then the parts that stand in for their nested
# bars, light grey for the gaps.
BAR_COLORS = (
    "#8c8c8c",
    "#1f77b4",
    "#17becf",
    "#9467bd",
    "#2ca02c",
    "#ff7f0e",
    "#d62728",
    "#bcbd22",
    "#8c564b",
    "#e377c2",
    "#aec7e8",
    "#98df8a",
    "#ffbb78",
    "#c5b0d5",
)
_COLOR_ORDER = [*BARS, *(label for label in bar_labels() if label not in BARS)]
STAGE_COLORS = {label: BAR_COLORS[_COLOR_ORDER.index(label) % len(BAR_COLORS)] for label in bar_labels()} | {
    GAPS: "#c7c7c7"
}
# The distributions drawn: the registry's CDF figures, and the decode steps (as the latency table has them).
CDF_METRICS = [*(timing_metric(t) for t in shown_in(CDF_PLOT)), DECODE_PER_TOKEN]


def stage_ms(result: Result, drawn: dict[str, tuple[str, ...]] = BARS) -> dict[str, float]:
    """Milliseconds of each of the `drawn` bars of one job; they add up to its e2e."""
    # A stage not measured is NULL (no bar): a family's in another family's rows, a batched page's
    # stages inside its shared launches; their time is in the gaps.
    bars = {
        label: sum(getattr(result, column) or 0.0 for column in columns) for label, columns in drawn.items()
    }
    bars[GAPS] = (E2E.of(result) or 0.0) - sum(bars.values())
    return bars


def _png(figure: Figure) -> bytes:
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=DPI)
    return out.getvalue()


def _legend_or_nothing(ax: Axes, nothing: str, **legend: Any) -> None:
    """A legend when something was drawn; otherwise say so in the middle of the panel."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**legend)
    else:
        ax.text(0.5, 0.5, nothing, transform=ax.transAxes, ha="center", color="#666666")


def _seconds(data: RunData, at: datetime) -> float:
    """Seconds after the run was submitted."""
    return (at - data.run.created_at).total_seconds()


def _job_label(image: str, repeat: int, repeats: int) -> str:
    """A bar's label: the image's file name, its middle cut where it is long (slanted at full length,
    long names overlap and run off the figure)."""
    name = image.rsplit("/", 1)[-1]
    if len(name) > MAX_LABEL_CHARS:
        keep = MAX_LABEL_CHARS - 1
        name = f"{name[: keep - keep // 2]}…{name[-(keep // 2) :]}"
    return f"{name} #{repeat}" if repeats > 1 else name


def stage_breakdown(sides: Sequence[Side]) -> Plot:
    title = "Stage breakdown per image"
    figure = Figure(figsize=(WIDTH_IN, 1.2 + 3.4 * len(sides)), layout="constrained")
    axes = figure.subplots(len(sides), 1, squeeze=False, sharey=True)[:, 0]
    # Each side's bars: the stages its run measured (a model family's own stage only where it ran it; a
    # batched run's prefill whole); the legend has every side's.
    drawn = [breakdown_bars(unmeasured(side.data.results.values())) for side in sides]
    colors = {
        label: color
        for label, color in STAGE_COLORS.items()
        if label == GAPS or any(label in d for d in drawn)
    }
    for ax, side, side_bars in zip(axes, sides, drawn, strict=True):
        jobs = [(j, side.data.results[j.id]) for j in side.data.jobs if j.id in side.data.results]
        repeats = 1 + max((j.repeat for j, _ in jobs), default=0)
        x = np.arange(len(jobs))
        bottom = np.zeros(len(jobs))
        per_job = [stage_ms(r, side_bars) for _, r in jobs]
        for label, color in colors.items():
            heights = np.array([bars.get(label, 0.0) for bars in per_job])
            bars = ax.bar(x, heights, bottom=bottom, color=color, edgecolor="white", linewidth=0.3)
            for patch, (_, result) in zip(bars, jobs, strict=True):
                patch.set_hatch(COLD_HATCH if result.cold else None)
            bottom += heights
        ax.set_title(side.label, loc="left", fontsize=10)
        ax.set_ylabel("ms")
        if len(jobs) <= MAX_LABELLED_JOBS:
            ax.set_xticks(
                x,
                [_job_label(j.image, j.repeat, repeats) for j, _ in jobs],
                rotation=30,
                ha="right",
                fontsize=8,
            )
        else:
            ax.set_xlabel("jobs in file-list order")
        if not jobs:
            ax.text(0.5, 0.5, "no results", transform=ax.transAxes, ha="center", color="#666666")
    # Patches of their own: the bars' would carry the first job's hatch into the legend.
    legend = [Patch(color=color, label=label) for label, color in colors.items()]
    legend.append(Patch(facecolor="white", edgecolor="#555555", hatch=COLD_HATCH, label="cold"))
    figure.legend(handles=legend, ncols=len(legend), fontsize=8, loc="outside lower center")
    figure.suptitle(title, x=0.01, ha="left", fontweight="bold")
    caption = (
        "One bar per job (image, repeat) in file-list order; the bars add up to its end-to-end time. "
        "'setup + gaps' is e2e minus the named stages (a stage not measured, "
        "such as a batched run's decode in steps its pages share, is in it). Hatched: cold results (left out of the statistics "
        "unless --include-cold)."
    )
    return Plot(title, caption, _png(figure))


def latency_distributions(sides: Sequence[Side], include_cold: bool, include_profiled: bool = False) -> Plot:
    title = "Latency distributions (CDF)"
    figure = Figure(figsize=(WIDTH_IN, 3.8), layout="constrained")
    axes = figure.subplots(1, len(CDF_METRICS))
    for ax, metric in zip(axes, CDF_METRICS, strict=True):
        for side, color in zip(sides, RUN_COLORS, strict=False):
            values = [
                v
                for r in measured(side.data, include_cold, include_profiled=include_profiled)
                for v in metric.values(r)
            ]
            if values:
                ax.ecdf(values, color=color, label=f"{side.name} (n={len(values)})")
        ax.set_xlabel(metric.label)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        _legend_or_nothing(ax, "no measured results", fontsize=7, loc="lower right")
    axes[0].set_ylabel("fraction of jobs (steps for ms/token)")
    figure.suptitle(title, x=0.01, ha="left", fontweight="bold")
    cold = (
        "cold results included (--include-cold)"
        if include_cold
        else "cold results left out, as in the statistics"
    )
    caption = f"Empirical CDFs over every measured job (decode ms/token: every kept step); {cold}."
    return Plot(title, caption, _png(figure))


def decode_steps(sides: Sequence[Side], include_cold: bool, include_profiled: bool = False) -> Plot:
    title = "Decode ms/token against position (KV growth)"
    figure = Figure(figsize=(WIDTH_IN, 4.2), layout="constrained")
    ax = figure.subplots()
    rng = np.random.default_rng(SEED)
    every_step: list[np.ndarray] = []
    for side, color in zip(sides, RUN_COLORS, strict=False):
        positions, times = [], []
        for r in measured(side.data, include_cold, include_profiled=include_profiled):
            # Step i feeds token i back at position prompt + i: it attends over prompt + i + 1 positions.
            positions.append(r.prompt_tokens + 1 + np.arange(len(r.decode_step_ms)))
            times.append(np.asarray(r.decode_step_ms, dtype=float))
        if not positions:
            continue
        x, y = np.concatenate(positions), np.concatenate(times)
        every_step.append(y)
        shown = (
            rng.choice(x.size, MAX_SCATTER_POINTS, replace=False)
            if x.size > MAX_SCATTER_POINTS
            else slice(None)
        )
        ax.scatter(x[shown], y[shown], s=4, alpha=0.25, color=color, linewidths=0, rasterized=True)
        edges = np.unique(np.linspace(x.min(), x.max() + 1, 41).astype(int))
        which = np.digitize(x, edges)
        centres = [(edges[i - 1] + edges[i]) / 2 for i in range(1, len(edges)) if np.any(which == i)]
        medians = [float(np.median(y[which == i])) for i in range(1, len(edges)) if np.any(which == i)]
        ax.plot(centres, medians, color=color, linewidth=2, label=f"{side.name}: median ({y.size} steps)")
    ax.set_xlabel("KV length (positions attended: prompt + tokens fed back)")
    ax.set_ylabel("decode ms/token")
    ax.set_ylim(bottom=0)
    clipped = ""
    if every_step:
        steps = np.concatenate(every_step)
        top = float(np.percentile(steps, DECODE_Y_PERCENTILE)) * 1.15
        above = steps[steps > top]
        if above.size:
            ax.set_ylim(0, top)
            clipped = (
                f" The y-axis stops at {top:.3g} ms (p{DECODE_Y_PERCENTILE:g} of the steps + 15%): "
                f"{above.size} step{'s' if above.size > 1 else ''} above it, up to {above.max():.4g} ms, "
                "are off the plot."
            )
            ax.text(
                0.99,
                0.98,
                f"{above.size} step(s) above, max {above.max():.4g} ms",
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=8,
                color="#b00000",
            )
    ax.grid(alpha=0.3)
    _legend_or_nothing(ax, "no measured decode steps", fontsize=8, loc="upper left")
    figure.suptitle(title, x=0.01, ha="left", fontweight="bold")
    caption = (
        "Every kept decode step (points) against the cache length it attended over, and the median per "
        f"position bin (line); a growing KV cache shows as a rising line. At most {MAX_SCATTER_POINTS:,} "
        f"points per run are drawn; the median uses every step. Cold results follow the statistics.{clipped}"
    )
    return Plot(title, caption, _png(figure))


def worker_timeline(sides: Sequence[Side]) -> Plot:
    title = "Worker timeline"
    lanes_per_side = [services(side.data) for side in sides]
    heights = [max(1, len(lanes)) for lanes in lanes_per_side]
    figure = Figure(figsize=(WIDTH_IN, 1.2 + sum(1.5 + 0.45 * h for h in heights)), layout="constrained")
    axes = figure.subplots(len(sides), 1, squeeze=False, height_ratios=[1.5 + 0.45 * h for h in heights])[
        :, 0
    ]
    finishes = [
        _seconds(side.data, s.finished)
        for side, lanes in zip(sides, lanes_per_side, strict=True)
        for lane in lanes.values()
        for s in lane
    ]
    left, span = 0.0, max(finishes, default=1.0)
    for ax, side, lanes in zip(axes, sides, lanes_per_side, strict=True):
        data = side.data
        for y, (_, lane) in enumerate(sorted(lanes.items())):
            ids = dict.fromkeys(s.result.worker_session_id for s in lane)
            for worker_session in (data.sessions[i] for i in ids if i in data.sessions):
                start = _seconds(data, worker_session.started_at)
                load, warm = (worker_session.load_ms or 0) / 1000, (worker_session.warmup_ms or 0) / 1000
                ax.broken_barh([(start, load)], (y - 0.4, 0.8), color="#7f7f7f")
                ax.broken_barh([(start + load, warm)], (y - 0.4, 0.8), color="#c5b0d5")
                # A worker up long before the submit would squash the run: show at most a quarter of
                # the run's span before it.
                left = min(left, max(start, -0.25 * span))
            for s in lane:
                began = _seconds(data, s.began)
                ax.broken_barh(
                    [(began, _seconds(data, s.finished) - began)],
                    (y - 0.4, 0.8),
                    facecolor="#1f77b4",
                    edgecolor="white",
                    linewidth=0.5,
                    hatch=COLD_HATCH if s.result.cold else None,
                )
        ax.set_yticks(range(len(lanes)), sorted(lanes), fontsize=8)
        ax.set_ylim(-0.7, max(1, len(lanes)) - 0.3)
        ax.invert_yaxis()
        ax.set_title(side.label, loc="left", fontsize=10)
        ax.set_xlabel("seconds after submit")
        ax.grid(axis="x", alpha=0.3)
        if not lanes:
            ax.text(0.5, 0.5, "no finished jobs", transform=ax.transAxes, ha="center", color="#666666")
    for ax in axes:  # one time scale for both runs of a comparison: their lengths read side by side
        ax.set_xlim(left - 0.01 * span, span * 1.01)
    legend = [
        Patch(color="#7f7f7f", label="model load"),
        Patch(color="#c5b0d5", label="warm-up"),
        Patch(facecolor="#1f77b4", label="job"),
        Patch(facecolor="#1f77b4", hatch=COLD_HATCH, label="cold job"),
        Patch(facecolor="white", edgecolor="#bbbbbb", label="idle"),
    ]
    figure.legend(handles=legend, ncols=len(legend), fontsize=8, loc="outside lower center")
    figure.suptitle(title, x=0.01, ha="left", fontweight="bold")
    caption = (
        "One lane per worker process (host:pid:device). Grey: model load, lilac: warm-up (its worker "
        "sessions), blue: a job from when its worker could begin it to its finish (the service interval "
        "of steady-state throughput); white space is idle time. Hatched: cold jobs."
    )
    return Plot(title, caption, _png(figure))


def throughput_over_time(sides: Sequence[Side], include_cold: bool) -> Plot:
    title = "Throughput over time"
    figure = Figure(figsize=(WIDTH_IN, 3.8), layout="constrained")
    rate_ax = figure.subplots()
    done_ax = rate_ax.twinx()
    for side, color in zip(sides, RUN_COLORS, strict=False):
        data = side.data
        finished = np.sort(
            [
                _seconds(data, j.finished_at)
                for j in data.jobs
                if j.id in data.results and j.finished_at is not None
            ]
        )
        if finished.size == 0:
            continue
        # Bins of about two pages each, laid back from the last page to the submit: a long load reads as
        # empty bins rather than one wide bin hiding the rate. At least three bins where there are pages.
        busy_bins = max(1, int(np.clip(finished.size // 2, min(3, finished.size - 1), 60)))
        width = max((finished[-1] - finished[0]) / busy_bins, finished[-1] / MAX_TIME_BINS) or 1.0
        bins = max(1, int(np.ceil(finished[-1] / width)))
        edges = np.maximum(finished[-1] - width * np.arange(bins, -1, -1), 0.0)
        counts, _ = np.histogram(finished, edges)
        # Bars, each bin outlined: at a steady rate an outline alone reads as one bin.
        rate_ax.bar(
            edges[:-1],
            counts / np.diff(edges),
            width=np.diff(edges),
            align="edge",
            facecolor=color,
            alpha=0.3,
            edgecolor="none",
        )
        rate_ax.bar(
            edges[:-1],
            counts / np.diff(edges),
            width=np.diff(edges),
            align="edge",
            fill=False,
            edgecolor=color,
            linewidth=1.2,
            label=f"{side.name}: pages/s per bin",
        )
        steady = steady_state_throughput(data, include_cold).value
        if steady is not None:
            rate_ax.axhline(
                steady,
                color=color,
                linestyle="--",
                linewidth=1,
                label=f"{side.name}: steady state {steady:.3g} pages/s",
            )
        done_ax.step(
            finished,
            np.arange(1, finished.size + 1),
            where="post",
            color=color,
            alpha=0.45,
            linestyle=":",
            label=f"{side.name}: pages done",
        )
    rate_ax.set_xlabel("seconds after submit")
    rate_ax.set_ylabel("pages/s (finished per bin)")
    done_ax.set_ylabel("pages done")
    rate_ax.set_xlim(left=0)
    rate_ax.set_ylim(bottom=0)
    done_ax.set_ylim(bottom=0)
    rate_ax.grid(alpha=0.3)
    handles = [h for ax in (rate_ax, done_ax) for h in ax.get_legend_handles_labels()[0]]
    if handles:
        rate_ax.legend(handles=handles, fontsize=8, loc="upper left")
    else:
        rate_ax.text(0.5, 0.5, "no finished pages", transform=rate_ax.transAxes, ha="center", color="#666666")
    figure.suptitle(title, x=0.01, ha="left", fontweight="bold")
    caption = (
        "Pages finished per time bin (bars, each bin outlined), pages done so far (dotted, right axis) and the "
        "steady-state rate of the report (dashed): loading and warm-up show as the delay before the first page."
    )
    return Plot(title, caption, _png(figure))


KERNELS_PER_PANEL = 6  # the longest kernels of a stage drawn, the rest summed
MAX_KERNEL_CHARS = 48
IDLE_COLOR = "#c7c7c7"


def _short(name: str, limit: int) -> str:
    """A long name cut in its middle (templated kernel names run to hundreds of characters)."""
    if len(name) <= limit:
        return name
    keep = limit - 1
    return f"{name[: keep - keep // 2]}…{name[-(keep // 2) :]}"


PROFILED = {"job": "jobs", "step": "batch steps", "profile": "jobs and batch steps"}


def kernel_breakdown(sides: Sequence[Side], include_cold: bool = False) -> Plot:
    """Per stage, its longest kernels and its idle time, in ms per profiled job or batch step
    (report/kernel_tables.py)."""
    from dsocr_workers.kernels import OTHER
    from dsocr_workers.report.kernel_tables import by_stage, summaries, unit

    units = {unit(side.data) for side in sides if side.data.profiles or side.data.step_profiles}
    each = units.pop() if len(units) == 1 else "profile"
    title = f"Kernels per stage (profiled {PROFILED[each]})"
    stages = [by_stage(summaries(side.data, include_cold)) for side in sides]
    names = list(dict.fromkeys(name for per_side in stages for name in per_side))
    columns = 2 if len(names) > 1 else 1
    rows = -(-len(names) // columns)
    figure = Figure(
        figsize=(WIDTH_IN, 0.8 + rows * (1.0 + 0.32 * (KERNELS_PER_PANEL + 2) * len(sides))),
        layout="constrained",
    )
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    height = 0.8 / len(sides)
    for ax, name in zip(axes, names, strict=False):
        per_side = [per.get(name) for per in stages]
        means = [
            {k: sum(v) / len(v) / 1e3 for k, v in stage.kernel_us.items()} if stage else {}
            for stage in per_side
        ]
        ranked = sorted({k for m in means for k in m}, key=lambda k: -max(m.get(k, 0.0) for m in means))
        shown = [k for k in ranked if k != OTHER][:KERNELS_PER_PANEL]
        labels = [*(_short(short_kernel_name(k), MAX_KERNEL_CHARS) for k in shown), "other kernels", "idle"]
        y = np.arange(len(labels))
        heading = []
        for i, (side, stage, mean) in enumerate(zip(sides, per_side, means, strict=True)):
            if stage is None:
                continue
            jobs = len(stage.jobs)
            idle = sum(s.idle_ms for s in stage.jobs) / jobs
            clock = sum(s.event_ms for s in stage.jobs) / jobs
            values = [
                *(mean.get(k, 0.0) for k in shown),
                sum(v for k, v in mean.items() if k not in shown),
                idle,
            ]
            colors = [RUN_COLORS[i]] * (len(values) - 1) + [IDLE_COLOR]
            ax.barh(
                y + (i - (len(sides) - 1) / 2) * height,
                values,
                height=height,
                color=colors,
                edgecolor=RUN_COLORS[i],
                linewidth=0.8,
                label=side.name,
            )
            heading.append(
                f"{side.name}: {clock:.3g} ms, busy {100 * (1 - idle / clock) if clock else 0:.0f}%"
            )
        ax.set_yticks(y, labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"ms per profiled {each}", fontsize=8)
        ax.set_title(f"{name}\n" + "; ".join(heading), loc="left", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    legend = [Patch(color=color, label=side.name) for side, color in zip(sides, RUN_COLORS, strict=False)]
    legend.append(Patch(facecolor=IDLE_COLOR, label="idle (clock − busy)"))
    figure.legend(handles=legend, ncols=len(legend), fontsize=8, loc="outside lower center")
    figure.suptitle(title, x=0.01, ha="left", fontweight="bold")
    caption = (
        f"Per stage, its {KERNELS_PER_PANEL} longest kernels (CUDA kernels on a GPU, CPU operators' self time on a "
        "CPU), the rest summed, and its idle time (the stage's clock time less the union of its kernels), in ms "
        f"per profiled {each} (warm ones, as the statistics); the heading gives the stage's clock time and how busy "
        "the device was. decode: the sampled steps only; a batched run's rows are its sampled batch steps by kind "
        "and occupancy band (pages in the step)."
    )
    return Plot(title, caption, _png(figure))


def throughput_vs_latency(sides: Sequence[Side], include_cold: bool) -> Plot:
    """Serving's trade-off (report/serving.py): each run a point, throughput per GPU against latency,
    labelled with its concurrency, the points joined in the order of their concurrency (with --vs, runs
    at two concurrencies: two points of the curve; benchmarks/bench_scaling.py draws a whole sweep)."""
    title = "Throughput against latency"
    figure = Figure(figsize=(WIDTH_IN, 4.2), layout="constrained")
    tokens_ax, pages_ax = figure.subplots(1, 2)
    panels = (
        (tokens_ax, "TPOT p50 ms", "output tokens/s per GPU"),
        (pages_ax, "TTFT p50 ms", "pages/s per GPU"),
    )
    points: list[tuple[int, float | None, float | None, float | None, float | None]] = []
    colors = RUN_COLORS if len(sides) <= len(RUN_COLORS) else [f"C{i % 10}" for i in range(len(sides))]
    for side, color in zip(sides, colors, strict=False):
        figures = serving(side.data, include_cold)
        gpus = figures.gpus or 1
        tokens = None if figures.output_tokens_per_s is None else figures.output_tokens_per_s / gpus
        pages = None if figures.pages_per_s.value is None else figures.pages_per_s.value / gpus
        point = (figures.concurrency, figures.tpot_ms.p50.value, tokens, figures.ttft_ms.p50.value, pages)
        points.append(point)
        for ax, (x, y) in ((tokens_ax, point[1:3]), (pages_ax, point[3:])):
            if x is None or y is None:
                continue
            ax.scatter(
                [x],
                [y],
                color=color,
                s=200,
                zorder=3,
                label=f"{side.name}: concurrency {figures.concurrency}"
                + (f", {figures.prefill} prefills" if figures.concurrency > 1 else ""),
            )
            ax.annotate(
                f"c={figures.concurrency}", (x, y), textcoords="offset points", xytext=(6, 6), fontsize=9
            )
    ordered = sorted(points, key=lambda point: point[0])
    for ax, offset in ((tokens_ax, 1), (pages_ax, 3)):
        line = [(x, y) for point in ordered if None not in (x := point[offset], y := point[offset + 1])]
        if len(line) > 1:
            ax.plot([x for x, _ in line], [y for _, y in line], color="#888888", linewidth=1, zorder=2)
    for (ax, xlabel, ylabel), offset in zip(panels, (1, 3), strict=True):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        xs = [x for point in points if (x := point[offset]) is not None]
        ys = [y for point in points if (y := point[offset + 1]) is not None]
        # From zero, with room above and right of the farthest point for its label.
        ax.set_xlim(0, 1.2 * max(xs) if xs and max(xs) > 0 else None)
        ax.set_ylim(0, 1.2 * max(ys) if ys and max(ys) > 0 else None)
        ax.grid(alpha=0.3)
        _legend_or_nothing(ax, "no finished pages", fontsize=8, loc="lower right")
    figure.suptitle(title, x=0.01, ha="left", fontweight="bold")
    caption = (
        "Each run one point (the report's Serving table): steady-state throughput per GPU against the median time "
        "per output token (left) and to the first token (right), labelled with the run's --concurrency. Runs of "
        "one job set at several concurrencies trace the curve a fleet is sized on (--vs: two of them)."
    )
    return Plot(title, caption, _png(figure))


def all_plots(sides: Sequence[Side], include_cold: bool, include_profiled: bool = False) -> list[Plot]:
    plots = [
        stage_breakdown(sides),
        latency_distributions(sides, include_cold, include_profiled),
        decode_steps(sides, include_cold, include_profiled),
        worker_timeline(sides),
        throughput_over_time(sides, include_cold),
        throughput_vs_latency(sides, include_cold),
    ]
    if any(side.data.profiles or side.data.step_profiles for side in sides):
        plots.append(kernel_breakdown(sides, include_cold))
    return plots
