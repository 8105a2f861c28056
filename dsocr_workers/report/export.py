"""A run's outputs for OmniDocBench's own evaluator (`dsocr export`): each page's markdown, the model's
markup rendered as the vendor's result.mmd, in the evaluator's prediction-folder layout."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dsocr_workers.errors import InputError
from dsocr_workers.model.postprocess import render_mmd
from dsocr_workers.quality.omnidocbench import write_predictions
from dsocr_workers.report.queries import load_run
from dsocr_workers.store.db import open_ledger

RANDOM_NOTE = "RANDOM_WEIGHTS.txt"


@dataclass(frozen=True)
class PredictionsWritten:
    run_id: str
    files: list[Path]
    without_result: int  # pages of the repeat that have no result, hence no file
    random_note: Path | None  # where the run's model had random weights: the note saying so, beside the pages


def export_predictions(
    database_url: str, run_ref: str, directory: Path, repeat: int = 0
) -> PredictionsWritten:
    """Write every page of the run (`run_ref`: id, unique prefix or latest) that has a result in repeat
    `repeat` to `directory`/<image name without extension>.md."""
    with open_ledger(database_url).transaction() as tx:
        data = load_run(tx, run_ref)
    if not any(j.repeat == repeat for j in data.jobs):
        raise InputError(f"run {data.run.id} has no repeat {repeat}")
    pages = {
        j.image: render_mmd(data.results[j.id].markup)
        for j in data.jobs
        if j.repeat == repeat and j.id in data.results
    }
    written = write_predictions(pages, directory)
    note = None
    if data.run.random_weights:  # the pages are filler text: whoever opens the folder later must see why
        note = directory / RANDOM_NOTE
        note.write_text(f"Run {data.run.id}: {data.run.model_label}. Its model had RANDOM WEIGHTS: these pages "
                        "are filler text, not OCR, and score as such.\n")
    return PredictionsWritten(data.run.id, written, sum(j.repeat == repeat for j in data.jobs) - len(written), note)
