"""quality/scoring.py against the official OmniDocBench end-to-end evaluator (quick_match): on every
page of every prediction set (OmniDocBench's demo predictions and sets derived from its demo ground
truth, tests/quality/omnidocbench_sets.py), each figure within 0.005 of the evaluator's stored output
(tests/quality/data/omnidocbench/official.json)."""

from __future__ import annotations

import json

import pytest

from dsocr_workers.quality.omnidocbench import load_annotation, prediction_filename
from dsocr_workers.quality.scoring import PageScores, score_page
from tests.quality.omnidocbench_sets import DATA, DEMO, SETS, write_set

OFFICIAL = json.loads((DATA / "official.json").read_text(encoding="utf-8"))
if not (DEMO / "ground_truth.json").exists():
    pytest.skip(f"OmniDocBench's demo data is not in {DEMO} (shared/data/omnidocbench-demo; see "
                "tests/quality/data/omnidocbench/README.md)", allow_module_level=True)  # fmt: skip
TOLERANCE = 0.005


def _mean(values: list[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, PageScores]]:
    references = load_annotation(DEMO / "ground_truth.json")
    pages = json.loads((DEMO / "ground_truth.json").read_text(encoding="utf-8"))
    out: dict[str, dict[str, PageScores]] = {}
    for name in SETS:
        directory = tmp_path_factory.mktemp(name)
        write_set(name, pages, directory)
        out[name] = {image: score_page((directory / prediction_filename(image)).read_text(encoding="utf-8"), ref)
                     for image, ref in references.items()}  # fmt: skip
    return out


@pytest.mark.parametrize("prediction_set", SETS)
def test_every_page_agrees_with_the_official_evaluator(scored, prediction_set: str) -> None:
    official = OFFICIAL[prediction_set]["pages"]
    disagreements = []
    for image, ours in scored[prediction_set].items():
        theirs = official.get(image, {})
        expected = {"text": theirs.get("text"), "formula": theirs.get("formula"), "table": theirs.get("table"),
                    "reading_order": theirs.get("reading_order"), "table_teds": _mean(theirs.get("teds")),
                    "table_teds_structure": _mean(theirs.get("teds_structure"))}  # fmt: skip
        for metric, value in expected.items():
            got = getattr(ours, metric)
            if (got is None) != (value is None) or (got is not None and abs(got - value) > TOLERANCE):
                disagreements.append(f"{image} {metric}: ours {got}, official {value}")
    assert not disagreements, "\n".join(disagreements)


@pytest.mark.parametrize("prediction_set", SETS)
def test_overall_figures_agree_with_the_official_evaluator(scored, prediction_set: str) -> None:
    """The leaderboard's figures: edit distances averaged over the pages that have the category (the
    evaluator's ALL_page_avg, what `dsocr report` prints as OmniDocBench figures); TEDS over all tables."""
    overall = OFFICIAL[prediction_set]["overall"]
    pages = scored[prediction_set].values()
    for metric, element in [("text", "text_block"), ("formula", "display_formula"), ("table", "table"),
                            ("reading_order", "reading_order")]:  # fmt: skip
        values = [getattr(p, metric) for p in pages if getattr(p, metric) is not None]
        assert sum(values) / len(values) == pytest.approx(overall[element]["Edit_dist"]["ALL_page_avg"], abs=1e-3)
    # Per table (the evaluator's `all`): a page's mean weighted by its number of tables.
    tables = {image: len(v["teds"]) for image, v in OFFICIAL[prediction_set]["pages"].items() if "teds" in v}
    for metric, key in [("table_teds", "TEDS"), ("table_teds_structure", "TEDS_structure_only")]:
        per_table = [getattr(scored[prediction_set][image], metric) for image, n in tables.items() for _ in range(n)]
        assert sum(per_table) / len(per_table) == pytest.approx(overall["table"][key]["all"], abs=1e-3)
