"""Headless Chromium (Debian's `chromium`, installed by .ci/run) for the HTML report tests, through its
command line only: no driver, no download.

Two runs per page. The first opens a copy of the page with a probe script appended: after the load
event it writes, into the DOM that `--dump-dom` prints, what the browser made of every image (decoded
size, layout box), the text of the warnings and the page height. The second screenshots the page
itself in a window that tall, one CSS pixel per screenshot pixel, so each image's box can be cut out
of the screenshot and compared with the PNG the page embeds.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

WIDTH = 1280
NAMES = ("chromium", "chromium-browser", "google-chrome")
PROBE = """<script>
addEventListener("load", () => {
  const images = [...document.images].map(img => {
    const box = img.getBoundingClientRect();
    return {alt: img.alt, complete: img.complete, width: img.naturalWidth, height: img.naturalHeight,
            left: box.left + scrollX + img.clientLeft, top: box.top + scrollY + img.clientTop};
  });
  const warnings = [...document.querySelectorAll(".warning")].map(w => w.innerText);
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({images, warnings, height: document.documentElement.scrollHeight});
  document.body.append(out);
});
</script>"""


def chromium_path() -> str:
    for name in NAMES:
        path = shutil.which(name)
        if path:
            return path
    pytest.skip(
        "headless Chromium is not installed here: `apt-get install -y --no-install-recommends chromium` "
        "(.ci/run installs it where apt-get is available)"
    )


@dataclass(frozen=True)
class PageImage:
    alt: str
    complete: bool
    width: int  # decoded (natural) size, 0 when the browser could not decode it
    height: int
    left: float  # content box in page coordinates, CSS pixels
    top: float


@dataclass(frozen=True)
class Layout:
    images: list[PageImage]
    warnings: list[str]
    height: int


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess:
    command = [
        chromium_path(), "--headless", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
        "--force-device-scale-factor=1", f"--user-data-dir={profile}",
        # Chromium refuses to run as root with its sandbox; CI containers run as root. The page is ours.
        "--no-sandbox", *args,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def layout(page: Path, work: Path) -> Layout:
    probed = work / f"{page.stem}-probe.html"
    probed.write_text(
        page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"), encoding="utf-8"
    )
    dom = _chromium(
        f"--window-size={WIDTH},900", "--dump-dom", probed.as_uri(), profile=work / "profile"
    ).stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, "the probe did not run: the page did not finish loading"
    facts = json.loads(html.unescape(found.group(1)))
    return Layout([PageImage(**image) for image in facts["images"]], facts["warnings"], facts["height"])


def screenshot(page: Path, height: int, out: Path, work: Path) -> np.ndarray:
    """The whole page (a window `height` CSS pixels tall) as an RGB array; also saved at `out`."""
    _chromium(
        f"--window-size={WIDTH},{height}", f"--screenshot={out}", page.as_uri(), profile=work / "profile"
    )
    return np.asarray(Image.open(out).convert("RGB"), dtype=np.int16)


def drawn_like(shot: np.ndarray, image: PageImage, png: np.ndarray) -> float:
    """Mean absolute difference (0–255) between the embedded PNG and the screenshot where the browser laid
    it out, at the best of the pixel offsets around the sub-pixel position."""
    best = 255.0
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            top, left = round(image.top) + dy, round(image.left) + dx
            crop = shot[top : top + png.shape[0], left : left + png.shape[1]]
            if crop.shape == png.shape:
                best = min(best, float(np.abs(crop - png).mean()))
    return best
