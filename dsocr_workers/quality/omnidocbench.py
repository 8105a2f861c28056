"""OmniDocBench's ground truth: its annotation file (`OmniDocBench.json`) read into one typed reference
per page, and the file names its evaluator expects for predictions.

The annotation is a JSON list of pages; each page has `page_info.image_path` (the image's file name)
and `layout_dets`, blocks with a `category_type`, an `order` (reading order) and their content: `text`
for text blocks, `latex` for display formulas, `html` (and `latex`) for tables. `extra.relation`
links the parts of a text block split across columns or pages (`relation_type` "truncated"); they are
scored as one block, their texts joined in reading order, as OmniDocBench's end-to-end evaluation does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsocr_workers.errors import InputError

# Text blocks scored by OmniDocBench's end-to-end text metric.
TEXT_CATEGORIES = ("text_block", "title", "code_txt", "code_txt_caption", "reference")
# Text it matches against the prediction (so that a predicted header does not count as extra text) but
# leaves out of the score: page furniture, captions and footnotes.
IGNORED_TEXT_CATEGORIES = (
    "figure_caption",
    "figure_footnote",
    "table_caption",
    "table_footnote",
    "code_algorithm",
    "code_algorithm_caption",
    "header",
    "footer",
    "page_footnote",
    "page_number",
    "equation_caption",
)
_TEXT = frozenset(TEXT_CATEGORIES + IGNORED_TEXT_CATEGORIES)
FORMULA_CATEGORY = "equation_isolated"
TABLE_CATEGORY = "table"
# Where each kept category's content lives in a block.
_CONTENT_FIELD = {
    **dict.fromkeys(_TEXT, "text"),
    FORMULA_CATEGORY: "latex",
    TABLE_CATEGORY: "html",
}


@dataclass(frozen=True)
class ReferenceBlock:
    category: str  # OmniDocBench's category_type
    content: str  # text, a formula's LaTeX or a table's HTML
    order: int | None  # reading order (None where the annotation gives none)


@dataclass(frozen=True)
class PageReference:
    """What one page should read: its scored blocks, truncated parts already joined."""

    image: str  # the file name in `page_info.image_path`
    blocks: tuple[ReferenceBlock, ...]
    # `page_info.page_attribute`'s single-valued attributes (data_source, language, layout, …): the
    # groups OmniDocBench breaks its figures down by.
    attributes: Mapping[str, str] = field(default_factory=dict)

    def of(self, categories: Iterable[str]) -> list[ReferenceBlock]:
        wanted = set(categories)
        return [block for block in self.blocks if block.category in wanted]

    def to_json(self) -> dict[str, Any]:
        """The form stored with each job (jobs.reference)."""
        return {
            "image": self.image,
            "blocks": [[b.category, b.content, b.order] for b in self.blocks],
            "attributes": dict(self.attributes),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PageReference:
        blocks = tuple(ReferenceBlock(c, text, order) for c, text, order in data["blocks"])
        return cls(data["image"], blocks, dict(data.get("attributes") or {}))  # older references stored none


def prediction_filename(image: str) -> str:
    """The file OmniDocBench's evaluator reads a page's prediction from: the image's file name without
    its extension, plus `.md`."""
    return os.path.splitext(os.path.basename(image))[0] + ".md"


def _order(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _anno_id(value: Any) -> int | str | None:
    """A block's id as the relations name it; anything else (a malformed id) links nothing."""
    return value if isinstance(value, int | str) else None


def _truncated_groups(relations: Any) -> list[list[int | str]]:
    """anno_ids joined by "truncated" relations, as the evaluator groups them: a relation touching an
    existing group adds both its ends to every group it touches, so a block split in three parts
    (a-b, b-c) makes the group [a, b, b, c] and its middle part is read twice. The quirk is in every
    published number, so it is kept."""
    groups: list[list[int | str]] = []
    for relation in relations if isinstance(relations, list) else []:
        if not isinstance(relation, dict) or relation.get("relation_type") != "truncated":
            continue
        source, target = _anno_id(relation.get("source_anno_id")), _anno_id(relation.get("target_anno_id"))
        if source is None or target is None:
            continue
        touched = [group for group in groups if source in group or target in group]
        for group in touched:
            group += [source, target]
        if not touched:
            groups.append([source, target])
    return groups


def page_reference(page: Any, where: str) -> PageReference:
    """One annotation entry as a PageReference; InputError (naming `where`) when it is malformed.
    Blocks keep the annotation's order, empty ones included (the evaluator counts them when it looks
    blocks up by index); truncated parts are joined into one block placed after all others."""
    if not isinstance(page, dict):
        raise InputError(f"{where}: expected an object with page_info and layout_dets")
    info = page.get("page_info")
    image = info.get("image_path") if isinstance(info, dict) else None
    if not isinstance(image, str) or not image:
        raise InputError(f"{where}: no page_info.image_path")
    blocks = page.get("layout_dets")
    if not isinstance(blocks, list):
        raise InputError(f"{where} ({image}): layout_dets is not a list")
    kept: list[dict[str, Any]] = []
    for k, block in enumerate(blocks):
        if not isinstance(block, dict) or not isinstance(block.get("category_type"), str):
            raise InputError(f"{where} ({image}): layout_dets[{k}] has no category_type")
        content_field = _CONTENT_FIELD.get(block["category_type"])
        if content_field is None:
            continue  # figures, masks, abandoned regions: nothing to read
        content = block.get(content_field)
        if content is not None and not isinstance(content, str):
            raise InputError(f"{where} ({image}): layout_dets[{k}].{content_field} is not a string")
        kept.append(block)
    extra = page.get("extra")
    groups = _truncated_groups(extra.get("relation") if isinstance(extra, dict) else None)
    in_groups = {anno for group in groups for anno in group}
    by_anno = {_anno_id(b.get("anno_id")): b for b in kept if _anno_id(b.get("anno_id")) in in_groups}
    result = [_block(b) for b in kept if _anno_id(b.get("anno_id")) not in in_groups]
    for group in groups:
        parts = [by_anno[anno] for anno in group if anno in by_anno]
        if parts:
            result.append(_joined(parts))
    attributes = info.get("page_attribute") if isinstance(info, dict) else None
    scalar = (
        {k: v for k, v in attributes.items() if isinstance(v, str)} if isinstance(attributes, dict) else {}
    )
    return PageReference(image, tuple(result), scalar)


def _block(block: dict[str, Any]) -> ReferenceBlock:
    category = block["category_type"]
    return ReferenceBlock(category, block.get(_CONTENT_FIELD[category]) or "", _order(block.get("order")))


def _joined(blocks: list[dict[str, Any]]) -> ReferenceBlock:
    """Truncated parts as one block: texts joined in reading order, category and order of the first."""
    ordered = sorted(blocks, key=lambda b: _order(b.get("order")) or 0)
    first = _block(ordered[0])
    return ReferenceBlock(first.category, "".join(_block(b).content for b in ordered), first.order)


def load_annotation(path: str | os.PathLike) -> dict[str, PageReference]:
    """Every page of an OmniDocBench annotation file, by image file name. A file that cannot be read,
    is not JSON or not in OmniDocBench's layout is an InputError naming the file and the first fault."""
    path = Path(path)
    try:
        with path.open(encoding="utf-8") as handle:
            pages = json.load(handle)
    except FileNotFoundError:
        raise InputError(f"{path}: no such ground-truth file") from None
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{path}: the ground truth is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the ground truth: {exc}") from None
    if not isinstance(pages, list):
        raise InputError(f"{path}: expected OmniDocBench's layout, a JSON list of pages")
    references: dict[str, PageReference] = {}
    first_index: dict[str, int] = {}
    for index, page in enumerate(pages):
        reference = page_reference(page, f"{path}: page {index}")
        name = os.path.basename(reference.image)
        if name in first_index:
            raise InputError(
                f"{path}: image {name} is annotated twice (pages {first_index[name]} and {index})"
            )
        first_index[name] = index
        references[name] = reference
    return references


def reference_for(references: Mapping[str, PageReference], image: str) -> PageReference | None:
    """The reference of a listed image (a path relative to the run's root), matched by file name."""
    return references.get(os.path.basename(image))


def write_predictions(pages: Mapping[str, str], directory: Path) -> list[Path]:
    """Each page's markdown (by image) into `directory` under `prediction_filename`, the layout of
    OmniDocBench's prediction folder. Two images with one file name would overwrite each other: an
    InputError, before anything is written."""
    owners: dict[str, str] = {}
    for image in pages:
        name = prediction_filename(image)
        if name in owners:
            raise InputError(
                f"{owners[name]} and {image} would both be written to {name}: OmniDocBench "
                "names predictions by image file name alone"
            )
        owners[name] = image
    written = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, image in owners.items():
            (directory / name).write_text(pages[image], encoding="utf-8")
            written.append(directory / name)
    except OSError as exc:
        raise InputError(f"{directory}: cannot write the predictions: {exc}") from exc
    return written
