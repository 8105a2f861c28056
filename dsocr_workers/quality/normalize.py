"""What OmniDocBench's evaluator compares: each block normalised per category before edit distances.

- text: inline math whose content has `\\`, `^` or `_` turned into Unicode (pylatexenc, as the
  evaluator does: `$\\frac{1}{3}$` reads "1/3"), then only letters, digits, `_` and CJK kept;
- formulas: delimiters, `\\tag`, `\\hspace`, environments, font and spacing commands and spaces
  dropped, lower-cased;
- tables: HTML re-serialised (th → td, thead and span unwrapped, MathML replaced by its alttext),
  styling attributes, tbody, sup/sub/div/p and colgroups dropped, whitespace runs collapsed.
"""

from __future__ import annotations

import html
import logging
import re
import unicodedata
from functools import lru_cache

from bs4 import BeautifulSoup
from pylatexenc.latex2text import LatexNodes2Text

# pylatexenc warns on every malformed formula it reads (model output has many): not the worker's news.
logging.getLogger("pylatexenc").setLevel(logging.ERROR)

_INLINE = re.compile(r"\$(.*?)\$|\\\((.*?)\\\)")
_ESCAPES = re.compile(r"\\([\\_&%^])")


@lru_cache(maxsize=4096)
def latex_to_unicode(latex: str) -> str:
    return LatexNodes2Text().latex_to_text(latex)


def inline_math_to_unicode(text: str) -> str:
    """Inline formulas that carry a command, a superscript or a subscript, as Unicode text."""
    replaced: list[tuple[int, int, str]] = []
    for match in _INLINE.finditer(text):
        content = match.group(1) if match.group(1) is not None else match.group(2)
        content = _ESCAPES.sub("", content)
        if not any(char in content for char in "\\^_"):
            continue
        if content.endswith("\\"):
            content += " "
        try:
            replaced.append((match.start(), match.end(), latex_to_unicode(content)))
        except Exception:  # noqa: BLE001 - the evaluator leaves a formula pylatexenc cannot read as it is
            continue
    for start, end, unicode in sorted(replaced, reverse=True):
        text = text[:start] + unicode.strip() + text[end:]
    return text


def clean_text(text: str) -> str:
    """Letters, digits, `_` and CJK only (the evaluator's clean_string, literal `\\t`/`/n` dropped first)."""
    for escape in ("\\t", "\\n", "\t", "\n", "/t", "/n"):
        text = text.replace(escape, "")
    return re.sub(r"[^\w\u4e00-\u9fff]", "", text)


def normalize_text(text: str) -> str:
    return clean_text(inline_math_to_unicode(text))


_FORMULA_NOISE = (
    "\\mathbf",
    "\\mathrm",
    "\\mathnormal",
    "\\mathit",
    "\\mathbb",
    "\\mathcal",
    "\\mathscr",
    "\\mathfrak",
    "\\mathsf",
    "\\mathtt",
    "\\textbf",
    "\\text",
    "\\boldmath",
    "\\boldsymbol",
    "\\operatorname",
    "\\bm",
    "\\symbfit",
    "\\mathbfcal",
    "\\symbf",
    "\\scriptscriptstyle",
    "\\notag",
    "\\setlength",
    "\\coloneqq",
    "\\space",
    "\\thickspace",
    "\\thinspace",
    "\\medspace",
    "\\nobreakspace",
    "\\negmedspace",
    "\\quad",
    "\\qquad",
    "\\enspace",
    "\\substackw",
    " ",
    "$$",
    "\\left",
    "\\right",
    "\\displaystyle",
)
_FORMULA_DROPPED = [
    re.compile(p)
    for p in (r"\\tag\{.*?\}", r"\\hspace\{.*?\}", r"\\begin\{.*?\}", r"\\end\{.*?\}", r"\\arraycolsep.*?\}")
]
_BRACKETED = re.compile(r"\\\[(.+?)(?<!\\)\\\]")


def normalize_formula(latex: str) -> str:
    text = latex.strip().strip("$").strip("\n")
    bracketed = _BRACKETED.search(text)
    if bracketed:
        text = bracketed.group(1).strip()
    for pattern in _FORMULA_DROPPED:
        text = pattern.sub("", text)
    text = text.strip(".")
    for noise in _FORMULA_NOISE:  # in this order: "\\text" goes before "\\textbf" could
        text = text.replace(noise, "")
    return text.lower()


def _reserialised(table: str) -> str:
    soup = BeautifulSoup(table, "html.parser")
    for th in soup.find_all("th"):
        th.name = "td"
    for thead in soup.find_all("thead"):
        thead.unwrap()
    for math in soup.find_all("math"):
        math.replace_with(f"${math.get('alttext', '')}$")
    for span in soup.find_all("span"):
        span.unwrap()
    return str(soup)


_TABLE_INNER = re.compile(r"<table\b[^>]*>(.*)</table>", re.DOTALL | re.IGNORECASE)
_STYLING = [re.compile(f'( {name}=".*?")') for name in ("style", "height", "width", "align", "class")]


def normalize_table(table: str) -> str:
    """A table's HTML the evaluator's way, in its fixed wrapper; "" for anything without `<table`."""
    if "<table" not in table.replace(" ", "").replace("'", '"'):
        return ""
    text = unicodedata.normalize("NFKC", html.unescape(_reserialised(table)).replace("\n", "")).strip()
    text = "".join(_TABLE_INNER.findall(text))
    for styling in _STYLING:
        text = styling.sub("", text)
    text = re.sub(r"</?tbody>", "", text)
    text = re.sub(r"\s+", " ", text)
    text = f'<html><body><table border="1" >{text}</table></body></html>'
    for tag in ("sup", "sub", "span", "div", "p"):
        text = text.replace(f"<{tag}>", "").replace(f"</{tag}>", "")
    text = text.replace('<spandata-span-identity="">', "")
    return re.sub("<colgroup>.*?</colgroup>", "", text)
