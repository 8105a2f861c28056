"""`dsocr report --run A --vs B` across two models: what differs between the runs' models, and page by
page (paired by image and repeat, as every paired table is) what each model made of it: its visual
tokens (the image placeholders its preprocessing gives the page) and its output tokens."""

from __future__ import annotations

from typing import Any

from dsocr_workers.report.queries import RunData
from dsocr_workers.report.tables import Table
from dsocr_workers.store.models import Result

Paired = dict[tuple[str, int], Result]


def model_differences(a: RunData, b: RunData) -> list[str]:
    """The banner's model entries: the family first where it differs, then the model."""
    found = []
    if a.run.model_family != b.run.model_family:
        found.append(f"model family (A {a.run.model_family}, B {b.run.model_family})")
    if a.run.model != b.run.model:
        found.append(f"model (A {a.run.model}, B {b.run.model})")
    return found


def page_differences(a: RunData, b: RunData, by_a: Paired, by_b: Paired) -> Table:
    """Per paired page: each run's model, visual tokens and output tokens, and which of them differ."""
    rows: list[list[Any]] = []
    for key in sorted(set(by_a) & set(by_b)):
        ra, rb = by_a[key], by_b[key]
        differs = [
            name
            for name, value_a, value_b in (
                ("model", a.run.model, b.run.model),
                ("visual tokens", ra.image_tokens, rb.image_tokens),
                ("output tokens", ra.decode_tokens, rb.decode_tokens),
            )
            if value_a != value_b
        ]
        rows.append([
            *key, a.run.model_label, b.run.model_label, ra.image_tokens, rb.image_tokens, ra.decode_tokens,
            rb.decode_tokens, ", ".join(differs) or "nothing",
        ])  # fmt: skip
    columns = [
        "image", "repeat", "A model", "B model", "A visual tokens", "B visual tokens", "A tokens out",
        "B tokens out", "differs",
    ]  # fmt: skip
    note = (
        f"A is {a.run.model_family}, B {b.run.model_family}: each model's own preprocessing decides a "
        "page's visual tokens, so the paired latencies above compare different work per page."
        if a.run.model_family != b.run.model_family
        else None
    )
    return Table("Per page across models", columns, rows, note)
