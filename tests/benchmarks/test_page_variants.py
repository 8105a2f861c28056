"""benchmarks/page_variants.py: distinct pages of the sizes the list's pages have, in a list the farm
reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from PIL import Image, ImageChops

from dsocr_workers.farm.filelist import read_filelist


@pytest.fixture(scope="module")
def variants(load_script: Callable[[str], ModuleType]) -> ModuleType:
    return load_script("page_variants")


def asymmetric_page(path: Path, size: tuple[int, int], dark_corner: tuple[int, int]) -> None:
    page = Image.new("RGB", size, "white")
    page.paste((0, 0, 0), (dark_corner[0], dark_corner[1], dark_corner[0] + 40, dark_corner[1] + 30))
    page.save(path)


def test_each_page_gives_eight_distinct_variants_of_its_size(variants: ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    asymmetric_page(source / "tall.png", (300, 500), (10, 20))
    asymmetric_page(source / "wide.png", (640, 200), (500, 150))
    (source / "list.txt").write_text("# two pages\ntall.png\nwide.png\n")

    listed = variants.write_variants(source / "list.txt", 8, tmp_path / "out")

    pages = read_filelist(listed)
    assert not pages.bad and len(pages.images) == 16
    for stem, size in (("tall", (300, 500)), ("wide", (640, 200))):
        images = [Image.open(p.path).convert("L") for p in pages.images if p.path.name.startswith(stem)]
        assert len(images) == 8 and {image.size for image in images} == {size}
        for i, first in enumerate(images):
            for second in images[i + 1 :]:
                # JPEG blurs the edges a little; a variant's dark block lies elsewhere or inverted.
                assert ImageChops.difference(first, second).getextrema()[1] > 128


def test_a_variant_count_outside_one_to_eight_is_refused(variants: ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "list.txt"
    asymmetric_page(tmp_path / "page.png", (100, 100), (0, 0))
    source.write_text("page.png\n")
    with pytest.raises(ValueError, match="variants: 1 … 8, not 9"):
        variants.write_variants(source, 9, tmp_path / "out")
