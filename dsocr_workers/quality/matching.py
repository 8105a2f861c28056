"""OmniDocBench's `quick_match`: reference blocks paired with predicted blocks on one page, several
predicted blocks merged where together they read as one reference block, several reference blocks
given one predicted block where it contains them. Reproduced step by step, quirks included, because
every published end-to-end number went through them:

- blocks whose normalised content is empty leave the line lists but not the item lists, so the
  category of a prediction and the reading order of a reference are read at the wrong index after one;
- reference page furniture and captions (IGNORED_TEXT_CATEGORIES) take out of the pool every prediction within 0.25
  of one of them, before the real matching;
- a pair further apart than 0.7 is undone, its reference then re-attached to any prediction that
  contains it (substring distance under 0.4); predictions left over after that are paired with the
  references left over, or else dropped.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rapidfuzz.distance import Levenshtein
from scipy.optimize import linear_sum_assignment

from dsocr_workers.quality.markdown import FORMULA, INLINE_FORMULA, TEXT, PredictedBlock
from dsocr_workers.quality.normalize import normalize_formula, normalize_text
from dsocr_workers.quality.omnidocbench import FORMULA_CATEGORY, IGNORED_TEXT_CATEGORIES
from dsocr_workers.settings import MATCH_TIME_LIMIT

# Which matching scored a page (a result's `matched_by`): quick_match, or the evaluator's fallback
# past quick_match's time limit (settings.MATCH_TIME_LIMIT), `one_to_one_match`.
QUICK_MATCH = "quick_match"
ONE_TO_ONE = "one_to_one"


class OutOfTime(Exception):
    """quick_match ran past its time limit."""


@dataclass(frozen=True)
class ReferenceItem:
    category: str
    content: str  # text, or a formula's LaTeX
    order: float | None


@dataclass
class MatchedEntry:
    """One line of the evaluator's match list: reference blocks and the prediction paired with them."""

    category: str  # the reference side's category; "" when only a prediction
    gt: str
    norm_gt: str
    pred: str
    norm_pred: str
    pred_kind: str  # the first predicted block's kind; "" when no prediction
    gt_orders: list[Any] = field(default_factory=list)  # reading orders ("" where none); [""]: no reference
    pred_position: int | None = None


def edit_ratio(a: str, b: str) -> float:
    return Levenshtein.distance(a, b) / max(len(a), len(b))


def _distances(rows: Sequence[str], columns: Sequence[str]) -> np.ndarray:
    matrix = np.zeros((len(rows), len(columns)))
    for i, a in enumerate(rows):
        for j, b in enumerate(columns):
            matrix[i][j] = 0 if not a and not b else edit_ratio(a, b)
    return matrix


def _order(item: ReferenceItem) -> Any:
    return item.order if item.order else ""


# --- multi-line arrays split into lines ------------------------------------------------------------

_ARRAY = re.compile(r"\\begin\{array\}\{(?P<spec>[^}]*)\}(?P<body>.*?)\\end\{array\}", re.S)


def _one_column(spec: str) -> bool:
    spec = re.sub(r"\s+|\|", "", spec)
    spec = re.sub(r"@{[^}]*}", "", spec)
    spec = re.sub(r"!{[^}]*}", "", spec)
    return spec in {"l", "c", "r"}


def _array_lines(body: str) -> list[str]:
    return [line.strip() for line in re.split(r"\\\\", body) if line.strip()]


def split_reference_arrays(items: Sequence[ReferenceItem]) -> list[ReferenceItem]:
    """A one-column `array` formula as one formula per line, orders 7.1, 7.2, … (7 + k/10, rounded)."""
    out: list[ReferenceItem] = []
    for item in items:
        array = _ARRAY.search(item.content) if item.category == FORMULA_CATEGORY else None
        if array is None or not _one_column(array.group("spec")) or item.order is None:
            out.append(item)
            continue
        for k, line in enumerate(_array_lines(array.group("body")), start=1):
            out.append(ReferenceItem(item.category, f"\\[{line}\\]", round(float(item.order) + k / 10, 1)))
    return out


def split_predicted_arrays(blocks: Sequence[PredictedBlock]) -> list[PredictedBlock]:
    out: list[PredictedBlock] = []
    for block in blocks:
        array = _ARRAY.search(block.content) if block.category == FORMULA else None
        if array is None or not _one_column(array.group("spec")):
            out.append(block)
            continue
        body, searched = array.group("body"), 0
        for line in _array_lines(body):
            found = body.find(line, searched)
            at = searched if found == -1 else found
            searched = at + len(line)
            out.append(
                PredictedBlock(
                    block.category,
                    f"\\[{line.strip()}\\]",
                    block.position + array.start("body") + at,
                    block.fine,
                )
            )
    return out


# --- merging predictions that together read as one reference block ----------------------------------


def _window_distance(long: str, short: str) -> float:
    """The smallest distance of `short` to a same-length window of `long`, per character of `short`."""
    return min(
        Levenshtein.distance(long[i : i + len(short)], short) / len(short)
        for i in range(len(long) - len(short) + 1)
    )


def _pred_within(gt: str, pred: str) -> float | None:
    return _window_distance(gt, pred) if len(gt) >= len(pred) > 0 else None


def _gt_within(pred: str, gt: str) -> float:
    return _window_distance(pred, gt) if len(pred) >= len(gt) > 0 else 1.0


def _merge_verdict(gt: str, preds: list[str], threshold: float = 0.6) -> tuple[bool, bool]:
    """(take the last prediction into the merge, try one more)."""
    if len(preds) == 1:
        return False, False
    current, merged = " ".join(preds[:-1]), " ".join(preds)
    if edit_ratio(gt, merged) > edit_ratio(gt, current):
        return False, False
    inside = [_pred_within(gt, p) for p in preds[:-1]]
    if any(d is None or d > threshold for d in inside):
        return False, False
    last = _pred_within(gt, preds[-1])
    if last is None:
        return False, False
    return last < threshold, len(merged) <= len(gt)


def _chosen_runs(runs: list[list[int]], costs: list[float]) -> list[list[int]]:
    """Among candidate runs of predictions, overlapping ones grouped; per group the compatible set with
    the lowest mean cost (the evaluator's path search, walked exactly as it walks it)."""
    if not runs:
        return []
    pairs = sorted(zip(runs, costs, strict=True), key=lambda pair: pair[0][0])
    groups: list[list[tuple[list[int], float]]] = [[pairs[0]]]
    for pair in pairs[1:]:
        if any(k in run for run, _ in groups[-1] for k in pair[0]):
            groups[-1].append(pair)
        else:
            groups.append([pair])
    chosen: list[list[int]] = []
    for group in groups:
        if len(group) == 1:
            chosen.append(group[0][0])
            continue
        paths: dict[int, list[tuple[list[int], float]]] = defaultdict(list)
        paths[0].append(group[0])
        for candidate in group[1:]:
            new_path = True
            for key, path in list(paths.items()):
                duplicate = same = False
                for member in path:  # the list may change under the walk, as in the evaluator
                    if member[0] == candidate[0]:
                        duplicate = same = True
                        if member[1] > candidate[1]:
                            path.pop(path.index(member))
                            path.append(candidate)
                    elif any(a == b for a in member[0] for b in candidate[0]):
                        duplicate = True
                if not duplicate:
                    path.append(candidate)
                    new_path = False
                if same:
                    new_path = False
                paths[key] = path
            if new_path:
                paths[len(paths)].append(candidate)
        best: list[list[int]] = []
        best_cost = float("inf")
        for path in paths.values():
            mean = sum(cost for _, cost in path) / len(path)
            if mean < best_cost:
                best, best_cost = [run for run, _ in path], mean
        chosen += best
    return chosen


def _merge_truncated(
    cost: np.ndarray, gts: list[str], preds: list[str], deadline: float
) -> tuple[np.ndarray, list[Any]]:
    """Runs of neighbouring predictions joined where they read as one reference block: the new cost
    matrix and, per column, a prediction index or a run (list) of them."""
    close = np.argwhere(cost < 0.25)
    masked_gt = [int(r) for r, _ in close]
    masked_pred = [int(c) for _, c in close]
    free_preds = [j for j in range(cost.shape[1]) if j not in masked_pred]
    runs, run_costs = [], []
    for g in (i for i in range(cost.shape[0]) if i not in masked_gt):
        candidates, distances = [], []
        for p in free_preds:
            if time.monotonic() > deadline:
                raise OutOfTime
            step, merged = 1, [preds[p]]
            while p + step not in masked_pred and p + step < len(preds):
                merged.append(preds[p + step])
                take, go_on = _merge_verdict(gts[g], merged)
                if not take:
                    break
                step += 1
                if not go_on:
                    break
            candidates.append(list(range(p, p + step)))
            distances.append(edit_ratio(gts[g], " ".join(preds[p:p + step])))
        if distances:
            best = distances.index(min(distances))
            runs.append(candidates[best])
            run_costs.append(distances[best])
    chosen = _chosen_runs(runs, run_costs)
    if not chosen:
        return cost, list(range(len(preds)))
    columns: list[Any] = list(range(len(preds)))
    for run in chosen:
        at = columns.index(run[0])
        del columns[at:at + len(run)]
        columns.insert(at, run)
    joined = [" ".join(preds[c[0]:c[-1] + 1]) if isinstance(c, list) else preds[c] for c in columns]
    return _distances(gts, joined), columns


# --- the page -------------------------------------------------------------------------------------


def _norm_lines(
    gt_items: Sequence[ReferenceItem], pred_items: Sequence[PredictedBlock]
) -> tuple[list[str], list[str], list[str], list[str], list[str]]:
    """(gt raw, gt normalised, gt categories, pred raw, pred normalised), empty ones dropped."""
    gts = []
    for item in gt_items:
        norm = (
            normalize_formula(item.content)
            if item.category == FORMULA_CATEGORY
            else normalize_text(item.content)
        )
        if item.content and norm:
            gts.append((item.content, norm, item.category))
    preds = []
    for block in pred_items:
        if block.category == TEXT:
            norm = normalize_text(block.content)
        elif block.category == FORMULA:
            norm = normalize_formula(block.content)
        else:
            norm = block.content
        if block.content and norm:
            preds.append((block.content, norm))
    return (
        [g[0] for g in gts],
        [g[1] for g in gts],
        [g[2] for g in gts],
        [p[0] for p in preds],
        [p[1] for p in preds],
    )


def _array_joined(lines: list[str]) -> str:
    """Several formulas matched as one, written as the evaluator writes them: a one-column array."""
    # (the evaluator's strip("$$") strips any run of "$", as strip("$") does)
    return "\\begin{array}{l} " + " \\\\ ".join("{" + line.strip("$").strip("\n") + "}" for line in lines) \
        + " \\end{array}"


def quick_match(
    gt_items: Sequence[ReferenceItem],
    pred_items: Sequence[PredictedBlock],
    time_limit_s: float | None = MATCH_TIME_LIMIT.default,
) -> list[MatchedEntry]:
    """The evaluator's match list for one page's mixed text and formula blocks (entries it never fills
    in are left out); OutOfTime past `time_limit_s` (None: no limit)."""
    deadline = math.inf if time_limit_s is None else time.monotonic() + time_limit_s
    gt_items = split_reference_arrays(gt_items)
    pred_items = split_predicted_arrays(
        sorted(pred_items, key=lambda b: (b.fine == INLINE_FORMULA, b.position))
    )
    gt_raw, gt_norm, gt_cats, pred_raw, pred_norm = _norm_lines(gt_items, pred_items)

    if not gt_norm:
        return []
    if not pred_norm:
        return [
            MatchedEntry(gt_cats[i], gt_raw[i], gt_norm[i], "", "", "", [_order(gt_items[i])])
            for i in range(len(gt_norm))
        ]
    if len(gt_norm) == 1 and len(pred_norm) == 1:
        return [
            MatchedEntry(
                gt_cats[0],
                gt_raw[0],
                gt_norm[0],
                pred_raw[0],
                pred_norm[0],
                pred_items[0].kind,
                [_order(gt_items[0])],
                pred_items[0].position,
            )
        ]

    kept_gt = [i for i in range(len(gt_norm)) if gt_cats[i] not in IGNORED_TEXT_CATEGORIES]
    ignored_gt = [i for i in range(len(gt_norm)) if gt_cats[i] in IGNORED_TEXT_CATEGORIES]
    taken_by_ignored: set[int] = set()
    if ignored_gt:
        close = np.argwhere(_distances([gt_norm[i] for i in ignored_gt], pred_norm) < 0.25)
        taken_by_ignored = {int(c) for _, c in close}
    kept_pred = [j for j in range(len(pred_norm)) if j not in taken_by_ignored]

    gts = [gt_norm[i] for i in kept_gt]
    preds = [pred_norm[j] for j in kept_pred]
    # Items looked up by the position in the filtered lists: the evaluator's misalignment.
    gt_item_at = [gt_items[i] for i in kept_gt]
    pred_item_at = [pred_items[j] for j in kept_pred]

    cost, columns = _merge_truncated(_distances(gts, preds), gts, preds, deadline)
    rows, cols = linear_sum_assignment(cost)
    row_list = list(rows)
    matches: dict[int, list[int]] = {}
    unmatched_gt: list[int] = []
    for i in range(len(gts)):
        if i not in row_list:
            unmatched_gt.append(i)
            continue
        k = row_list.index(i)
        column = columns[cols[k]]
        run = list(range(column[0], column[-1] + 1)) if isinstance(column, list) else [column]
        if cost[i][cols[k]] > 0.7:
            unmatched_gt.append(i)
        else:
            matches[i] = run
    contained: dict[int, list[int]] = {}
    for j, pred in enumerate(preds):
        if time.monotonic() > deadline:  # the evaluator's limit covers the whole match, this search too
            raise OutOfTime
        inside = [g for g in unmatched_gt if _gt_within(pred, gts[g]) < 0.4]
        if inside:
            contained[j] = inside

    final: dict[tuple[int, ...], list[int]] = {}
    done: set[int] = set()
    for g, run in matches.items():
        key = tuple(sorted(run))
        if key in final:
            if g not in done:
                final[key].append(g)
                done.add(g)
        else:
            final[key] = [g]
            done.add(g)
    for j, inside in contained.items():
        key = (j,)
        if key in final:
            for g in inside:
                if g not in done:
                    final[key].append(g)
                    done.add(g)
        else:
            final[key] = [g for g in inside if g not in done]
            done.update(final[key])

    # (gt index or "", pred indices or "") in the evaluator's order
    converted: list[tuple[Any, Any]] = [
        (g, list(key)) for key, group in final.items() for g in sorted(set(group))
    ]
    all_gt, all_pred = set(range(len(gts))), set(range(len(preds)))
    matched_gt = set().union(*[set(group) for group in final.values()])
    left_gt = all_gt - matched_gt
    left_pred = all_pred - {j for key in final for j in key}
    if left_pred:
        if left_gt:
            gt_list, pred_list = list(left_gt), list(left_pred)
            r, c = linear_sum_assignment([[edit_ratio(gts[g], preds[p]) for p in pred_list] for g in gt_list])
            converted += [(gt_list[a], [pred_list[b]]) for a, b in zip(r, c, strict=True)]
        else:
            converted.append(("", list(left_pred)))
    else:
        converted += [(g, "") for g in left_gt]

    merged: list[tuple[list[Any], Any]] = []
    seen_pred: set[tuple[Any, ...]] = set()
    seen_gt: set[Any] = set()
    for g, pred_key in converted:
        key = tuple(pred_key) if isinstance(pred_key, list) else (pred_key,)
        if key in seen_pred or key == ("",):
            continue
        group = [g] + [
            other
            for other, other_key in converted
            if (tuple(other_key) if isinstance(other_key, list) else (other_key,)) == key and other != g
        ]
        merged.append((group, pred_key))
        seen_gt.update(group)
        seen_pred.add(key)
    merged += [([g], [""]) for g in range(len(gts)) if g not in seen_gt]

    entries: list[MatchedEntry] = []
    for group, pred_key in merged:
        if group == [""]:
            continue  # predictions with no reference: scored nowhere (the list's last entry, if any)
        pred_idx = pred_key if isinstance(pred_key, list) else [pred_key]
        has_pred = pred_idx != [""]
        pred_kind = pred_item_at[pred_idx[0]].kind if has_pred else ""
        categories = [gt_cats[kept_gt[g]] for g in group]
        category = Counter(categories).most_common(1)[0][0]
        raw_gt = [gt_raw[kept_gt[g]] for g in group]
        raw_pred = [pred_raw[kept_pred[j]] for j in pred_idx] if has_pred else []
        entries.append(
            MatchedEntry(
                category=category,
                gt=_array_joined(raw_gt)
                if category == FORMULA_CATEGORY and len(group) > 1
                else "".join(raw_gt),
                norm_gt="".join(gts[g] for g in group),
                pred=_array_joined(raw_pred)
                if "equation" in pred_kind and len(pred_idx) > 1
                else "".join(raw_pred),
                norm_pred="".join(preds[j] for j in pred_idx) if has_pred else "",
                pred_kind=pred_kind,
                gt_orders=[_order(gt_item_at[g]) for g in group],
                pred_position=pred_item_at[pred_idx[0]].position if has_pred else None,
            )
        )
    return entries


def one_to_one_match(
    gt_items: Sequence[ReferenceItem], pred_items: Sequence[PredictedBlock]
) -> list[MatchedEntry]:
    """The evaluator's fallback when quick_match runs out of time (its `match_gt2pred_simple`): the
    Hungarian method on normalised edit distance, one prediction per reference block. Its quirks: items
    read at the filtered lines' indices, and the first prediction (index 0) taken for "none" when its
    kind and position are looked up."""
    gt_raw, gt_norm, gt_cats, pred_raw, pred_norm = _norm_lines(gt_items, pred_items)
    if not gt_norm:
        return []
    pairs, _ = simple_match(gt_norm, pred_norm)
    entries = []
    for i, j in pairs:
        truthy = bool(j)  # index 0 reads as "no prediction" there
        entries.append(
            MatchedEntry(
                category=gt_cats[i],
                gt=gt_raw[i],
                norm_gt=gt_norm[i],
                pred=pred_raw[j] if j is not None else "",
                norm_pred=pred_norm[j] if j is not None else "",
                pred_kind=pred_items[j].kind if truthy and j is not None else "",
                gt_orders=[_order(gt_items[i])],
                pred_position=pred_items[j].position if truthy and j is not None else None,
            )
        )
    return entries


def simple_match(
    gts: Sequence[str], preds: Sequence[str], distance: Callable[[str, str], float] = edit_ratio
) -> tuple[list[tuple[int, int | None]], list[int]]:
    """One-to-one by the Hungarian method: (reference index, prediction index or None) per reference,
    and the predictions left over."""
    if not gts or not preds:
        return [(i, None) for i in range(len(gts))], list(range(len(preds)))
    cost = np.array([[distance(g, p) for p in preds] for g in gts])
    rows, cols = linear_sum_assignment(cost)
    partner = dict(zip(rows.tolist(), cols.tolist(), strict=True))
    return [(i, partner.get(i)) for i in range(len(gts))], [
        j for j in range(len(preds)) if j not in set(cols.tolist())
    ]
