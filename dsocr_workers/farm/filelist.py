"""Reading and validating an image file list, the input of `dsocr submit` and `dsocr run`.

A file list holds one image path per line; blank lines and lines starting with `#` are skipped.
Relative paths resolve against the root: `--root`, else for a list under `datasets/<name>/subsets/` the
sibling `datasets/<name>/source-data/` when it exists, else the list's own folder.

Every line is checked before anything is written: a relative path must lie inside the root (also
after following symlinks; an absolute path is taken as written), and the image must exist, be a
readable regular file, and be an allowed image by its bytes within the pixel limit. A path listed twice (the same file after resolution) is a bad line, "duplicate of line N":
one run measures each image once per repeat, and `--repeats N` is how to measure it more often.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dsocr_workers.errors import InputError
from dsocr_workers.model.images import NO_SUCH_FILE, probe_image

SHOWN_CHARS = 120  # of a listed line, in an error message


@dataclass(frozen=True)
class ListedImage:
    line: int
    image: str  # relative to the root, posix separators: the image's name in the ledger and reports
    path: Path  # absolute, as the worker will open it


@dataclass(frozen=True)
class BadLine:
    line: int
    text: str
    reason: str


@dataclass(frozen=True)
class FileList:
    path: Path
    root: Path
    images: list[ListedImage]
    bad: list[BadLine]

    def describe_bad(self) -> str:
        lines = [f"{self.path}:{b.line}: {_shown(b.text)}: {b.reason}" for b in self.bad]
        if any(b.reason == NO_SUCH_FILE for b in self.bad):
            # A dataset list whose images were never downloaded: say where they belong and how to get them.
            readme = self.root / "README.md"
            how = f"; {readme} says how to get them" if readme.is_file() else ""
            lines.append(f"images are looked for under {self.root}/{how} (--root DIR to look elsewhere)")
        return "\n".join(lines)


def _shown(text: str) -> str:
    """A listed line as an error message quotes it: a line of any length stays one readable line."""
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}… ({len(text)} characters)"


def default_root(list_path: Path) -> Path:
    parent = list_path.resolve().parent
    if parent.name == "subsets" and (parent.parent / "source-data").is_dir():
        return parent.parent / "source-data"
    return parent


def _name_under(base: Path, real_base: Path, candidate: Path, real: Path) -> str:
    """The image's name relative to the root: as listed when that stays inside the root lexically
    (a symlink inside the root keeps its own name), else its resolved location under the real root."""
    lexical = Path(os.path.normpath(candidate))
    if lexical.is_relative_to(base):
        return lexical.relative_to(base).as_posix()
    return real.relative_to(real_base).as_posix()


def read_filelist(list_path: str | os.PathLike, root: str | os.PathLike | None = None) -> FileList:
    list_path = Path(list_path)
    try:
        lines = list_path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"{list_path}: no such file list") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{list_path}: cannot read the file list: {exc}") from None
    base = Path(root).absolute() if root is not None else default_root(list_path)
    if not base.is_dir():
        raise InputError(f"{base}: the image root is not a directory")
    real_base = base.resolve()

    images: list[ListedImage] = []
    bad: list[BadLine] = []
    first_line_of: dict[Path, int] = {}
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        try:
            listed = _listed_image(number, text, base, real_base, first_line_of)
        except OSError as exc:  # a name the file system refuses (too long, a NUL byte, ...)
            listed = BadLine(number, text, f"cannot be opened: {exc.strerror or exc}")
        if isinstance(listed, BadLine):
            bad.append(listed)
        else:
            images.append(listed)
    return FileList(list_path, base, images, bad)


def _listed_image(
    number: int, text: str, base: Path, real_base: Path, first_line_of: dict[Path, int]
) -> ListedImage | BadLine:
    """One line checked. A relative path must stay inside the root; an absolute one is taken as the user
    wrote it (lists made with `find` or `ls $PWD/*`), named relative to the root where it lies inside."""
    listed = Path(text)
    candidate = listed if listed.is_absolute() else base / listed
    real = candidate.resolve()
    inside = real.is_relative_to(real_base)
    if not inside and not listed.is_absolute():
        through_link = Path(os.path.normpath(candidate)).is_relative_to(base)
        why = "resolves outside the root through a symlink" if through_link else "is outside the root"
        return BadLine(number, text, f"{why} {base} (--root DIR sets the root; absolute paths are taken as they are)")
    if real in first_line_of:
        return BadLine(number, text, f"duplicate of line {first_line_of[real]}")
    first_line_of[real] = number
    try:
        probe_image(real)
    except InputError as exc:
        # probe_image names the file first; the line already says which file it is.
        return BadLine(number, text, str(exc).removeprefix(f"{real}: "))
    name = _name_under(base, real_base, candidate, real) if inside else real.as_posix()
    return ListedImage(number, name, real)
