"""A page of predicted markdown cut into the blocks OmniDocBench's end-to-end evaluator scores, the way
its `md_tex_filter` cuts them (quirks included: they are in every published number).

Order of extraction, each found piece blanked out of the page before the next step looks:
1. images and markdown/html/latex fences dropped, runs of `_` and spaces shortened, html/body tags off;
2. LaTeX `table` environments, then `tabular` ones (nested, matched by a stack), then HTML tables;
3. math: `$$…$$` and `\\[…\\]` are display formulas (blanked); every `$…$` and `\\(…\\)` is also a
   formula candidate ("equation_inline") but stays in the text as well;
4. pipe tables (when the page has at least two `|…|` lines): the whole page goes through the
   evaluator's markdown-to-HTML conversion, which rewrites every `|…|` line;
5. fenced code blocks; LaTeX `\\title`/`\\text`/`\\section` wrappers unwrapped;
6. the rest split at blank lines (at single line breaks when there is no blank line): a piece that is
   an HTML table is a table, one wrapped in `$` a formula, anything else text.
Positions are kept as the evaluator keeps them: the reading order and the matching's tie-breaks read them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Categories, as the evaluator names them.
TEXT = "text_all"
FORMULA = "equation_isolated"
HTML_TABLE = "html_table"
LATEX_TABLE = "latex_table"
# Finer kinds (the evaluator's fine_category_type) that change how a block is scored.
INLINE_FORMULA = "equation_inline"
PIPE_TABLE = "md2html_table"


@dataclass(frozen=True)
class PredictedBlock:
    category: str  # TEXT, FORMULA, HTML_TABLE or LATEX_TABLE
    content: str
    position: int  # where the block starts, in the evaluator's reckoning
    fine: str = ""  # "text_block", "code", INLINE_FORMULA, PIPE_TABLE or ""

    @property
    def kind(self) -> str:
        """The fine kind where there is one, else the category (the evaluator's pred_category_type)."""
        return self.fine or self.category


_IMAGE = re.compile(r"!\[.*?\]\(.*?\)")
_FENCES = [
    re.compile(p, re.MULTILINE) for p in (r"^```markdown\n?", r"^```html\n?", r"^```latex\n?", r"```\n?$")
]
_DISPLAY_OR_INLINE = re.compile(r"\$\$(.*?)\$\$|\\\[(.*?)\\\]|\$(.*?)\$|\\\((.*?)\\\)", re.DOTALL)
_DOLLARS = re.compile(r"\$\$(.*?)\$\$|\$(.*?)\$|\\\((.*?)\\\)", re.DOTALL)
_PIPE_ROW = re.compile(r"\|\s*.*?\s*\|\n", re.DOTALL)
_CONVERTED_TABLE = re.compile(r"(<table.*?</table>)", re.DOTALL)
_CODE_BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.DOTALL)
_LATEX_WRAPPERS = [
    (re.compile(r"\\title\{(.*?)\}"), r"\1"),
    (re.compile(r"\\title\s*\{\s*(.*?)\s*\}", re.DOTALL), r"\1"),
    (re.compile(r"\\text\s*\{\s*(.*?)\s*\}", re.DOTALL), r"\1"),
    (re.compile(r"\\section\*?\{(.*?)\}"), r"\1"),
    (re.compile(r"\\section\*?\{\s*(.*?)\s*\}", re.DOTALL), r"\1"),
]


def _blank(text: str, start: int, end: int) -> str:
    return text[:start] + " " * (end - start) + text[end:]


def _nested(text: str, begin: str, end: str) -> list[tuple[int, int]]:
    """Outermost begin…end spans, nesting tracked by a stack. As the evaluator does it, the scan steps
    past a begin by the length of the *end* pattern's source text, an end is taken as long as its
    pattern's source text (for `\\\\end{tabular}` one character more than the match), and an unclosed
    begin restarts the scan just after it (by the begin pattern's source length)."""
    spans: list[tuple[int, int]] = []
    stack: list[int] = []
    at = 0
    while at < len(text):
        opened, closed = re.search(begin, text[at:]), re.search(end, text[at:])
        if not opened and not closed:
            break
        if opened and (not closed or opened.start() < closed.start()):
            stack.append(at + opened.start())
            at += opened.start() + len(end)
        elif closed:
            if stack:
                start = stack.pop()
                if not stack:
                    spans.append((start, at + closed.start() + len(end)))
            at += closed.start() + len(end)
    if stack:
        restart = stack[0] + len(begin)
        spans += [(s + restart, e + restart) for s, e in _nested(text[restart:], begin, end)]
    return spans


def _latex_tables(content: str) -> list[tuple[int, str]]:
    found = []
    for match in re.finditer(r"\\begin{table}(.*?)\\end{table}", content, re.DOTALL):
        found.append((match.start(), match.group(0)))
        content = _blank(content, match.start(), match.end())
    found += [(s, content[s:e]) for s, e in _nested(content, r"\\begin{tabular}", r"\\end{tabular}")]
    return sorted(found, key=lambda item: item[0])


# --- the evaluator's markdown-table conversion (whole page) ------------------------------------------


def _pipe_row_html(rows_text: str) -> str:
    rows = [row.strip() for row in rows_text.strip().split("\n")]
    out = "<table>\n  <thead>\n    <tr>\n"
    for cell in (c.strip() for c in rows[0].split("|")[1:-1]):
        out += f"      <th>{cell}</th>\n"
    out += "    </tr>\n  </thead>\n  <tbody>\n"
    for row in rows[2:]:
        out += (
            "    <tr>\n"
            + "".join(f"      <td>{c.strip()}</td>\n" for c in row.split("|")[1:-1])
            + "    </tr>\n"
        )
    return out + "  </tbody>\n</table>\n"


def _looks_like_rule(line: str) -> bool:
    # The evaluator's test for a `|---|` line; any line with a colon or three dashes passes it.
    return ":" in line or "---" in line


def _merged_table(block: str) -> str:
    """Consecutive one-row tables as one: table/thead/tbody lines dropped, th made td."""
    block = re.sub(r"<!--[\s\S]*?-->", "", block)
    lines: list[str] = []
    for table in re.findall(r"<table>[\s\S]*?</table>", block):
        rows = [
            line.replace("<th>", "<td>").replace("</th>", "</td>") if "<th>" in line else line
            for line in table.split("\n")
        ]
        rows = [line for line in rows if not re.search(r"</?t(able|head|body)>", line)]
        if len(rows) > 2:
            lines += rows
    return "\n\n<table>\n{}\n</table>\n\n".format("\n".join(lines))


def _tables_merged(text: str) -> str:
    """The evaluator's pass over the converted page that joins a table's lines, one line behind."""
    out: list[str] = []
    in_table = False
    block = previous = ""
    for line in text.split("\n"):
        if "<table>" in line:
            in_table = True
            block += previous
        elif in_table:
            if not _looks_like_rule(previous) and "</thead>" not in previous:
                block += "\n" + previous
            if "</table>" in previous and "<table>" not in line:
                in_table = False
                out.append(_merged_table(block))
                block = ""
        else:
            out.append(previous)
        previous = line
    if previous:
        if in_table or "</table>" in previous:
            block += "\n" + previous
            out.append(_merged_table(block))
        else:
            out.append(previous)
    return "\n".join(out)


def pipe_tables_to_html(content: str) -> str:
    """The page with its `|…|` lines turned into HTML tables as the evaluator turns them: each match of
    its row pattern becomes a one-row table, neighbours are merged, every cell gets colspan/rowspan 1."""
    content = content.replace("\r", "") + "\n"
    for rows in _PIPE_ROW.findall(content):
        content = content.replace(rows, _pipe_row_html(rows), 1)
    content = _tables_merged(content)
    return content.replace("<table>", '<table border="1" >').replace("<td>", '<td colspan="1" rowspan="1">')


# --- the page ---------------------------------------------------------------------------------------


def split_markdown(markdown: str) -> list[PredictedBlock]:
    """The page's blocks, ordered by position (ties in the order they were found)."""
    content = _IMAGE.sub("", markdown)
    for fence in _FENCES:
        content = fence.sub("", content)
    content = re.sub(r"_{4,}", "____", content)
    content = re.sub(r" {4,}", "    ", content)
    for tag in ("<html>", "</html>", "<body>", "</body>"):
        content = content.replace(tag, "")
    found: list[PredictedBlock] = []

    for start, table in _latex_tables(content):
        found.append(PredictedBlock(LATEX_TABLE, table, start))
        content = _blank(content, start, start + len(table))
    for start, end in _nested(content, r"<table(?:[^>]*)>", r"</table>"):
        found.append(PredictedBlock(HTML_TABLE, content[start:end], start))
        content = _blank(content, start, end)

    for match in _DISPLAY_OR_INLINE.finditer(content):
        if not match.group(0):
            continue
        line = " ".join(match.group(0).strip().split("\n"))
        dollars = _DOLLARS.search(line)
        if dollars is None or dollars.group(1):
            if dollars is not None:
                line = _DOLLARS.sub(lambda m: "\\[" + (m.group(1) or "") + "\\]", line)
            content = _blank(content, match.start(), match.end())
            found.append(PredictedBlock(FORMULA, line, match.start()))
        else:  # inline math: a formula candidate, and still part of its text
            line = _DOLLARS.sub(lambda m: "\\[" + (m.group(2) or "") + (m.group(3) or "") + "\\]", line)
            found.append(PredictedBlock(FORMULA, line, match.start(), INLINE_FORMULA))

    if len(_PIPE_ROW.findall(content + "\n")) >= 2:
        content = pipe_tables_to_html(content)
        for match in _CONVERTED_TABLE.finditer(content):
            content = _blank(content, match.start(), match.end())
            found.append(PredictedBlock(HTML_TABLE, match.group(0).strip(), match.start(), PIPE_TABLE))

    for match in _CODE_BLOCK.finditer(content):
        content = _blank(content, match.start(), match.end())
        found.append(PredictedBlock(TEXT, match.group(2).strip(), match.start(), "code"))

    for pattern, replacement in _LATEX_WRAPPERS:
        content = pattern.sub(replacement, content)

    pieces = content.split("\n\n")
    if len(pieces) == 1:
        pieces = content.split("\n")
    position = 0
    for piece in pieces:
        start = position
        position += len(piece)  # the evaluator does not count the separators
        text = "\n".join(line.strip() for line in piece.strip().strip("\n").split("\n") if line.strip())
        if not text:
            continue
        if text.startswith("<table") and text.endswith("</table>"):
            found.append(PredictedBlock(HTML_TABLE, text, start))
        elif text.startswith("$") and text.endswith("$"):
            if text.replace("$", "").strip():
                found.append(PredictedBlock(FORMULA, text.strip(), start))
        else:
            found.append(PredictedBlock(TEXT, text, start, "text_block"))
    return sorted(found, key=lambda block: block.position)
