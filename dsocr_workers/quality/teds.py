"""TEDS, tree-edit-distance similarity of two HTML tables (Zhong et al., 2020), as OmniDocBench's
evaluator computes it beside the table edit distance: 1 - APTED distance / the larger node count.
Renaming a node costs 1 where tag, colspan or rowspan differ; two cells cost the normalised edit
distance of their token lists (tags and characters). Structure-only TEDS compares cells without
content."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from apted import APTED, Config
from lxml import html as lxml_html
from rapidfuzz.distance import Levenshtein


@dataclass
class _Node:
    tag: str
    colspan: int | None = None
    rowspan: int | None = None
    tokens: list[str] = field(default_factory=list)
    children: list[_Node] = field(default_factory=list)


class _Costs(Config):  # type: ignore[misc]
    def rename(self, a: _Node, b: _Node) -> float:
        if a.tag != b.tag or a.colspan != b.colspan or a.rowspan != b.rowspan:
            return 1.0
        if a.tag == "td" and (a.tokens or b.tokens):
            return Levenshtein.distance(a.tokens, b.tokens) / max(len(a.tokens), len(b.tokens))
        return 0.0

    def children(self, node: _Node) -> list[_Node]:
        return node.children


def _tokens(element: Any, out: list[str]) -> None:
    out.append(f"<{element.tag}>")
    if element.text is not None:
        out += list(element.text)
    for child in element:
        _tokens(child, out)
    if element.tag != "unk":
        out.append(f"</{element.tag}>")
    if element.tag != "td" and element.tail is not None:
        out += list(element.tail)


def _tree(element: Any, structure_only: bool) -> _Node:
    if element.tag == "td":
        tokens: list[str] = []
        if not structure_only:
            _tokens(element, tokens)
            tokens = tokens[1:-1]
        return _Node(
            "td", int(element.attrib.get("colspan", "1")), int(element.attrib.get("rowspan", "1")), tokens
        )
    return _Node(element.tag, children=[_tree(child, structure_only) for child in element])


def teds(prediction: str, reference: str, structure_only: bool = False) -> float:
    """1.0 for equal tables, 0.0 where either side is empty, has no body/table, or cannot be read."""
    if not prediction or not reference:
        return 0.0
    try:
        parser = lxml_html.HTMLParser(remove_comments=True, encoding="utf-8")
        pred_root = lxml_html.fromstring(prediction, parser=parser)
        true_root = lxml_html.fromstring(reference, parser=parser)
        pred_tables, true_tables = pred_root.xpath("body/table"), true_root.xpath("body/table")
        if not pred_tables or not true_tables:
            return 0.0
        pred, true = pred_tables[0], true_tables[0]
        nodes = max(len(pred.xpath(".//*")), len(true.xpath(".//*")))
        distance = APTED(
            _tree(pred, structure_only), _tree(true, structure_only), _Costs()
        ).compute_edit_distance()
        return 1.0 - float(distance) / nodes
    except Exception:  # noqa: BLE001 - the evaluator scores a table it cannot read 0
        return 0.0
