"""The measured stages of one job, in one place: `StageTimings` is the registry.

Each of its millisecond fields carries a `Timing` that says what the figure is and where it is shown;
the engine's clock (engine/clock.py), the result row and the `results` columns, the report's tables and
plots and `dsocr infer`'s timing table are all derived from it. A new stage is a new field here plus an
Alembic migration adding its nullable column, and the engine's `with clock.stage(name):` around the work.
A figure not measured is None, NULL in the store, which the report reads as not measured, never as 0:
a model family's own stage (its view encoder) in another family's jobs, and a batched page's stages
that run inside launches it shares or that the batch does not split (engine/session.py `BatchFigures`).

A figure is a stage's time (`stage` set: summed over its entries) or computed from the stages. `parent`
nests a figure in another (not a part of e2e: its parent's time holds it); the parts (`part`) sum to
`e2e_ms`. A stage named `vision/...` adds to `vision_ms`. This module imports nothing heavy: the store
and the report, which must not import the engine, read it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

Clock = Literal["cuda_event", "perf_counter"]
# Where a figure is shown beside the CLI's timing table (which shows every figure) and the report's
# accounting table (which shows the parts).
Place = Literal["latency", "per_image", "cdf"]
LATENCY_TABLE: Place = "latency"  # the report's latency table, and its paired B/A table
PER_IMAGE_TABLE: Place = "per_image"  # the report's per-image table
CDF_PLOT: Place = "cdf"  # a panel of the report's latency distributions (CDF) plot
VISION_PREFIX = "vision/"
METADATA_KEY = "timing"


@dataclass(frozen=True)
class Timing:
    """What one millisecond figure of a job is, how it is measured and where it is shown."""

    label: str  # how tables and plots name it; a table adds the unit ("prefill ms")
    doc: str
    stage: str | None = None
    # A stage timed on the host clock on every device: host work (a CUDA event would time the queue).
    host: bool = False
    parent: str | None = None  # the column of the figure that holds it; None: top level
    part: bool = False  # one of the parts whose sum is e2e_ms
    bar: str | None = None  # the bar of the report's stage breakdown it adds to; None: in "setup + gaps"
    shown: frozenset[Place] = frozenset()
    # Its results column holds NULL: in rows written before it was measured, in a batched page's rows
    # where the batch does not time it per page, or (a family stage) in another family's rows.
    nullable: bool = False
    # One model family's stage (its view encoder): None in another family's jobs (`model_stages`), so
    # tables and plots show it only where a run measured it (`unmeasured`).
    family_stage: bool = False
    column: str = ""  # the field's name, which is its results column's: set by `TIMINGS`

    def field(self) -> Any:
        """This figure as a StageTimings field: 0.0 when not timed (e.g. with timing off), None for a family
        stage (the job's model may not have it)."""
        return field(default=None if self.family_stage else 0.0, metadata={METADATA_KEY: self})

    def of(self, row: object) -> float | None:
        """The figure in a row that has it as an attribute (a `results` row, a StageTimings)."""
        value = getattr(row, self.column)
        return None if value is None else float(value)


_LATENCY = frozenset({LATENCY_TABLE})


@dataclass(frozen=True)
class StageTimings:
    """Milliseconds per part of one job. GPU parts are timed with CUDA events on CUDA (perf_counter on
    the CPU); host parts (`preprocess`, `postprocess`) always with perf_counter; `e2e_ms` with the host
    clock from the start of preprocessing to the end of postprocessing, less `page_wait_ms`. The parts
    add up:

        e2e = preprocess + setup + prefill + first_token + decode + wasted_decode + readback
              + postprocess + host_gap

    `host_gap_ms` is what no stage covers (small and non-negative when the accounting is right); a part
    not measured (None: a batched page's decode, in steps it shares) is in it.
    `page_wait_ms`, a page prepared ahead waiting for its job, is no part of it. The fields below, in
    this order, are the registry and the order of every table."""

    clock: Clock
    # One entry per kept decode step (each step produces one token after the first, which comes from
    # the prefill logits).
    decode_step_ms: list[float] = field(default_factory=list)

    ttft_ms: float = Timing(
        "TTFT",
        "preprocess + setup + prefill + first token (from the device start)",
        shown=frozenset({LATENCY_TABLE, PER_IMAGE_TABLE, CDF_PLOT}),
    ).field()
    ttft_from_device_start_ms: float = Timing(
        "TTFT from device start",
        "setup + prefill + first token, from the job's start on the device",
        shown=frozenset({LATENCY_TABLE, PER_IMAGE_TABLE}),
        nullable=True,
    ).field()
    tpot_ms: float = Timing(
        "TPOT",
        "time per output token after the first: (last token - first token) / (tokens - 1)",
        shown=frozenset({LATENCY_TABLE, PER_IMAGE_TABLE, CDF_PLOT}),
        nullable=True,
    ).field()
    preprocess_ms: float = Timing(
        "preprocess",
        "the page read, tiled and tokenised (host); a batched page's runs from its hand-over to the "
        "page-preparing processes to its page back, its wait for a free one included",
        stage="preprocess",
        host=True,
        part=True,
        bar="preprocess",
        shown=_LATENCY,
    ).field()
    setup_ms: float | None = Timing(
        "setup",
        "the page's inputs to the device and the decode state set: before the prefill",
        stage="setup",
        part=True,
        shown=_LATENCY,
        nullable=True,
    ).field()
    prefill_ms: float | None = Timing(
        "prefill",
        "vision and the language model's prefill",
        stage="prefill",
        part=True,
        shown=frozenset({LATENCY_TABLE, PER_IMAGE_TABLE}),
        nullable=True,
    ).field()
    vision_ms: float | None = Timing(
        "vision",
        f"the sum of the `{VISION_PREFIX}*` stages",
        parent="prefill_ms",
        shown=_LATENCY,
        nullable=True,
    ).field()
    sam_ms: float | None = Timing(
        "SAM",
        "the SAM encoder over the global view and the tiles",
        stage="vision/sam",
        parent="vision_ms",
        bar="SAM",
        shown=_LATENCY,
        nullable=True,
    ).field()
    clip_ms: float | None = Timing(
        "CLIP",
        "the CLIP trunk on SAM's features (DeepSeek-OCR)",
        stage="vision/clip",
        parent="vision_ms",
        bar="CLIP",
        shown=_LATENCY,
        nullable=True,
        family_stage=True,
    ).field()
    qwen2_ms: float | None = Timing(
        "Qwen2 encoder",
        "the Qwen2 encoder on SAM's features, whose learned queries' outputs are kept (DeepSeek-OCR-2)",
        stage="vision/qwen2",
        parent="vision_ms",
        bar="Qwen2 encoder",
        shown=_LATENCY,
        nullable=True,
        family_stage=True,
    ).field()
    projector_ms: float | None = Timing(
        "projector",
        "the projector and the image token layout",
        stage="vision/projector",
        parent="vision_ms",
        bar="projector",
        shown=_LATENCY,
        nullable=True,
    ).field()
    lm_prefill_ms: float | None = Timing(
        "LM prefill",
        "the language model over the prompt",
        stage="lm_prefill",
        parent="prefill_ms",
        bar="LM prefill",
        shown=_LATENCY,
        nullable=True,
    ).field()
    first_token_ms: float | None = Timing(
        "first token",
        "choosing the first token from the prefill logits",
        stage="first_token",
        part=True,
        bar="decode",
        nullable=True,
    ).field()
    decode_ms: float | None = Timing(
        "decode",
        "the kept decode steps (the decode stage less its steps after EOS)",
        stage="decode",
        part=True,
        bar="decode",
        shown=_LATENCY,
        nullable=True,
    ).field()
    wasted_decode_ms: float | None = Timing(
        "wasted decode",
        "steps computed after EOS (the loop looks for EOS asynchronously)",
        part=True,
        bar="wasted decode",
        nullable=True,
    ).field()
    readback_ms: float | None = Timing(
        "readback",
        "the generated ids back to the host",
        stage="readback",
        part=True,
        bar="postprocess",
        nullable=True,
    ).field()
    postprocess_ms: float = Timing(
        "postprocess",
        "detokenising and parsing the markup (host)",
        stage="postprocess",
        host=True,
        part=True,
        bar="postprocess",
    ).field()
    host_gap_ms: float = Timing(
        "host gap",
        "end-to-end less every stage: host time between stages (in a farm's batch-1 worker on a GPU, a "
        "finished job's postprocess waits until the next job's prefill is queued)",
        part=True,
        shown=_LATENCY,
    ).field()
    e2e_ms: float = Timing(
        "end-to-end",
        "host time from the first stage's start to the last one's end, less the page wait",
        shown=frozenset({LATENCY_TABLE, PER_IMAGE_TABLE, CDF_PLOT}),
    ).field()
    page_wait_ms: float = Timing(
        "page wait",
        "a page prepared ahead, waiting for its job's setup: outside e2e",
        nullable=True,
    ).field()
    queue_wait_ms: float = Timing(
        "queue wait",
        "a batched job's wait in its worker for a slot of the batch, from its page's hand-over to "
        "its prefill (inside TTFT and e2e; 0 on the batch-1 path; the report's Serving table)",
        nullable=True,
    ).field()

    @property
    def parts_ms(self) -> dict[str, float]:
        """The named parts whose sum is `e2e_ms`, by name (the column less `_ms`): those measured."""
        parts = {t.column.removesuffix("_ms"): t.of(self) for t in PARTS}
        return {name: ms for name, ms in parts.items() if ms is not None}

    def columns(self) -> dict[str, float | None]:
        """Every figure by its results column."""
        return {t.column: getattr(self, t.column) for t in TIMINGS}

    @property
    def decode_step_percentiles(self) -> dict[str, float | None]:
        """p50 / p90 / p99 of the kept decode steps' ms (numpy's linear method); None without steps."""
        if not self.decode_step_ms:
            return {"p50": None, "p90": None, "p99": None}
        import numpy as np

        p50, p90, p99 = np.percentile(np.asarray(self.decode_step_ms, dtype=np.float64), [50, 90, 99])
        return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


TIMINGS: tuple[Timing, ...] = tuple(
    replace(f.metadata[METADATA_KEY], column=f.name)
    for f in fields(StageTimings)
    if METADATA_KEY in f.metadata
)
BY_COLUMN: dict[str, Timing] = {t.column: t for t in TIMINGS}
# StageClock's stage names, in registry order; those timed on the host clock; the top-level ones (the
# job's stages whose times, with the host gap, make up end-to-end); the vision stages.
STAGES: tuple[str, ...] = tuple(t.stage for t in TIMINGS if t.stage is not None)
HOST_STAGES: frozenset[str] = frozenset(t.stage for t in TIMINGS if t.stage is not None and t.host)
JOB_PARTS: tuple[str, ...] = tuple(t.stage for t in TIMINGS if t.stage is not None and t.parent is None)
VISION_STAGES: tuple[str, ...] = tuple(s for s in STAGES if s.startswith(VISION_PREFIX))
PARTS: tuple[Timing, ...] = tuple(t for t in TIMINGS if t.part)


def model_stages(encoder_stage: str) -> tuple[str, ...]:
    """The stages a model whose view encoder is timed as `encoder_stage` has: every stage but the other
    families' encoders."""
    families = {t.stage for t in TIMINGS if t.family_stage}
    return tuple(s for s in STAGES if s not in families or s == encoder_stage)


def depth(timing: Timing) -> int:
    """How deep a figure is nested (0: top level): tables indent it by this."""
    return 0 if timing.parent is None else 1 + depth(BY_COLUMN[timing.parent])


def shown_in(place: Place, rows: Iterable[object] | None = None) -> tuple[Timing, ...]:
    """The figures shown in `place`; with `rows` (results), less those none of them measured (a
    DeepSeek-OCR run has no Qwen2 encoder time, a DeepSeek-OCR-2 run no CLIP time, a batched run no
    SAM time)."""
    hidden = frozenset() if rows is None else unmeasured(rows)
    return tuple(t for t in TIMINGS if place in t.shown and t.column not in hidden)


def unmeasured(rows: Iterable[object]) -> frozenset[str]:
    """The columns of the nullable figures that no row measured (None in every one); none without rows."""
    rows = list(rows)
    if not rows:
        return frozenset()
    return frozenset(t.column for t in TIMINGS if t.nullable and all(t.of(r) is None for r in rows))


def breakdown_bars(hidden: frozenset[str] = frozenset()) -> dict[str, tuple[str, ...]]:
    """The stage breakdown's bars, in the order they happen: each bar's label and the columns it adds;
    none for the columns `hidden` (`unmeasured`). A part measured whose nested bars are all hidden (a
    batched page's prefill, its vision and LM prefill not split) is a bar of its own."""
    out: dict[str, tuple[str, ...]] = {}
    for t in TIMINGS:
        if t.column in hidden:
            continue
        if t.bar is not None:
            out[t.bar] = (*out.get(t.bar, ()), t.column)
        elif (nested := _nested_bars(t)) and set(nested) <= hidden:
            out[t.label] = (t.column,)
    return out


def bar_labels() -> tuple[str, ...]:
    """Every bar `breakdown_bars` can draw, in the order they happen: a part that can stand in for its
    nested bars comes before them."""
    return tuple(dict.fromkeys(t.bar or t.label for t in TIMINGS if t.bar is not None or _nested_bars(t)))


def _nested_bars(part: Timing) -> tuple[str, ...]:
    """The columns of the bars nested in `part`, a part without a bar of its own (none for any other)."""
    if not part.part or part.bar is not None:
        return ()

    def inside(t: Timing) -> bool:
        return t.parent is not None and (t.parent == part.column or inside(BY_COLUMN[t.parent]))

    return tuple(t.column for t in TIMINGS if t.bar is not None and inside(t))


def check(timings: tuple[Timing, ...] = TIMINGS) -> None:
    """The registry's rules, checked at import: a mistake in a new stage's Timing fails loudly."""
    columns = [t.column for t in timings]
    stages = [t.stage for t in timings if t.stage is not None]
    problems = [f"{c} twice" for c in set(columns) if columns.count(c) > 1]
    problems += [f"stage {s} twice" for s in set(stages) if stages.count(s) > 1]
    by_column = {t.column: t for t in timings}
    for t in timings:
        ancestors: list[Timing] = []
        parent = t.parent
        while parent is not None and parent in by_column and len(ancestors) <= len(timings):
            ancestors.append(by_column[parent])
            parent = by_column[parent].parent
        if not t.column.endswith("_ms"):
            problems.append(f"{t.column}: a column of milliseconds ends in _ms")
        if parent is not None:
            problems.append(f"{t.column}: parent {parent} is no figure")
        if t.stage is not None and t.part != (t.parent is None):
            problems.append(f"{t.column}: a stage is a part of e2e exactly when it is top level")
        if t.part and t.parent is not None:
            problems.append(f"{t.column}: a nested figure cannot be a part of e2e (its parent holds it)")
        if t.host and t.stage is None:
            problems.append(f"{t.column}: only a stage has a clock")
        if t.family_stage and not (t.stage is not None and t.nullable):
            problems.append(
                f"{t.column}: a family stage is a stage whose column is nullable (NULL: no such stage)"
            )
        if t.bar is not None and (any(a.bar is not None for a in ancestors) or not (t.part or ancestors)):
            problems.append(f"{t.column}: a bar adds a part or what is nested in one, never both")
    if problems:
        raise ValueError("stage registry: " + "; ".join(problems))


check()
