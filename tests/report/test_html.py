"""`dsocr report --html`: the page's plots, tables and label from runs in the real store, and the page as
headless Chromium draws it for a real CPU run of the tiny preset."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
from datetime import datetime, timedelta
from html import escape
from pathlib import Path

import numpy as np
import pytest
from browser import chromium_path, drawn_like, layout, screenshot
from click.testing import CliRunner
from fakes import Page, add_session, make_run, set_times
from PIL import Image

from dsocr_workers.cli import main
from dsocr_workers.report.build import RANDOM_WEIGHTS_WARNING
from dsocr_workers.store.db import Database

# What a reader looks for, in page order (the list).
TITLES = [
    "Stage breakdown per image",
    "Latency distributions (CDF)",
    "Decode ms/token against position (KV growth)",
    "Worker timeline",
    "Throughput over time",
    "Throughput against latency",
]
T0 = datetime(2026, 11, 23, 8, 0, 0)


def report(args: list[str], database_url: str, monkeypatch) -> str:
    monkeypatch.setenv("DSOCR_DATABASE_URL", database_url)
    result = CliRunner().invoke(main, ["report", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def embedded_pngs(page: str) -> list[np.ndarray]:
    sources = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([^"]+)">', page)
    return [
        np.asarray(Image.open(io.BytesIO(base64.b64decode(s))).convert("RGB"), dtype=np.int16)
        for s in sources
    ]


def assert_plotted(png: np.ndarray) -> None:
    """Not blank, and not bare axes: data is drawn in colour, axes and text in black and grey."""
    height, width, _ = png.shape
    assert width >= 1000 and height >= 250, png.shape
    assert png.std() > 20
    coloured = (png.max(axis=2) - png.min(axis=2)) > 60
    assert coloured.mean() > 0.002, f"only {coloured.mean():.2%} of the pixels are coloured"


def run_with_sessions(database: Database, folder: Path, make_png, scale: float, pages: dict) -> str:
    """A run on one worker session (2 s of load and warm-up), its jobs back to back after it."""
    session = f"s-{folder.name}"
    add_session(database, session, T0, T0 + timedelta(seconds=2))
    run = make_run(
        database, folder, make_png,
        {key: page and Page(scale * page.scale, steps=page.steps, cold_reason=page.cold_reason, session=session)
         for key, page in pages.items()},
    )  # fmt: skip
    at, times = 2.0, {}
    for key, page in pages.items():
        if page is not None:
            times[key] = (at, at + page.scale * scale)
            at += page.scale * scale
    set_times(database, run, T0, times)
    return run


def test_page_holds_every_plot_every_table_and_the_label_and_needs_no_network(
    database, tmp_path, make_png, monkeypatch
):
    pages = {
        ("p0.png", 0): Page(5.0, cold_reason="compile: gundam 2x3"),
        ("p1.png", 0): Page(1.0, steps=6),
        ("p2.png", 0): Page(1.5, steps=12),
        ("p3.png", 0): None,  # fails: no result, still counted in the tables
    }
    a = run_with_sessions(database, tmp_path / "a", make_png, 1.0, pages)
    b = run_with_sessions(database, tmp_path / "b", make_png, 0.8, {k: v for k, v in pages.items() if v})
    out = tmp_path / "report.html"
    document = json.loads(
        report(["--run", a, "--vs", b, "--format", "json", "--html", str(out)], database.url, monkeypatch)
    )
    page = out.read_text(encoding="utf-8")

    # Self-contained: every image inline, nothing to fetch, no script.
    references = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert references and all(r.startswith(("data:image/png;base64,", "#")) for r in references), references
    assert not re.search(r"<script|<link|url\(|https?://", page)

    for run in (a, b):
        assert escape(RANDOM_WEIGHTS_WARNING.format(run=run, model="tiny")) in page
    assert re.findall(r'<img alt="([^"]*)"', page) == TITLES
    assert all(f">{escape(title)}</h2>" in page for title in TITLES)
    pngs = embedded_pngs(page)
    assert len(pngs) == len(TITLES)
    for png in pngs:
        assert_plotted(png)

    # The terminal report's tables, with its cell text; columns of numbers right-aligned.
    assert all(f">{escape(title)}</h3>" in page for title in document["tables"])
    assert (
        "<tr><td>jobs</td><td>4</td><td>3</td></tr>" in page
        and "<tr><td>cold results</td><td>1</td><td>1</td></tr>" in page
    )
    assert '<tr><td>paired images</td><td class="number">3</td></tr>' in page


def test_stage_bars_add_up_to_end_to_end(database, tmp_path, make_png):
    from dsocr_workers.report.plots import stage_ms
    from dsocr_workers.report.queries import load_run

    run = make_run(database, tmp_path, make_png, {("p.png", 0): Page(2.0, steps=4, wasted=1)})
    with database.transaction() as session:
        (result,) = load_run(session, run).results.values()
    bars = stage_ms(result)
    # fakes.py: preprocess 1, setup 0.5, sam 3, clip 2, projector 1, lm prefill 4 (prefill 10 = vision 6 +
    # lm 4), first token 0.5, 2 per step, readback 0.2, postprocess 0.3, host gap 0.1; all × scale 2.
    # A DeepSeek-OCR job: its Qwen2 encoder bar (DeepSeek-OCR-2's stage) is 0.
    assert bars == pytest.approx({
        "preprocess": 2.0, "SAM": 6.0, "CLIP": 4.0, "Qwen2 encoder": 0.0, "projector": 2.0, "LM prefill": 8.0,
        "decode": 17.0,
        "wasted decode": 4.0, "postprocess": 1.0, "setup + gaps": 1.2,
    })  # fmt: skip
    assert sum(bars.values()) == pytest.approx(result.e2e_ms)


def test_only_html_needs_matplotlib_and_says_which_extra_brings_it(database, tmp_path, make_png, monkeypatch):
    run = make_run(database, tmp_path, make_png, {("p.png", 0): Page(1.0)})
    for name in [
        m for m in sys.modules if m.startswith("matplotlib") or m.startswith("dsocr_workers.report.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it now raises ModuleNotFoundError
    monkeypatch.setenv("DSOCR_DATABASE_URL", database.url)

    plain = CliRunner().invoke(main, ["report", "--run", run])
    assert plain.exit_code == 0 and "Latency and output" in plain.output, plain.output
    html = CliRunner().invoke(main, ["report", "--run", run, "--html", str(tmp_path / "r.html")])
    assert html.exit_code == 2
    assert "--html needs matplotlib: pip install 'dsocr-workers[report]'" in html.output
    assert not (tmp_path / "r.html").exists()


def dsocr_run(listing: Path, env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "dsocr_workers", "run", str(listing), "--mode", "tiny", "--format", "json", *args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {row["field"]: row["value"] for row in json.loads(done.stdout)["tables"]["Run"]}["run"]


def test_html_report_of_a_cpu_run_draws_every_plot_in_chromium(
    tmp_path, make_png, subprocess_env, monkeypatch
):
    chromium_path()  # skips here, before the runs, where there is no Chromium
    folder = tmp_path / "pages"
    for name, size in {"letter.png": (320, 420), "wide.png": (900, 500), "tall.png": (400, 1300)}.items():
        make_png(name, size, folder=folder)
    listing = folder / "pages.txt"
    listing.write_text("letter.png\nwide.png\ntall.png\n")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**subprocess_env, "DSOCR_DATABASE_URL": url}
    a = dsocr_run(listing, env, "--max-new-tokens", "16", "--repeats", "2", "--name", "cpu-a")
    b = dsocr_run(listing, env, "--max-new-tokens", "24", "--name", "cpu-b")

    for name, args in {"single": ["--run", a], "vs": ["--run", a, "--vs", b]}.items():
        page = tmp_path / f"{name}.html"
        report([*args, "--html", str(page)], url, monkeypatch)
        seen = layout(page, tmp_path)
        assert [image.alt for image in seen.images] == TITLES
        assert all(image.complete and image.width >= 1000 for image in seen.images), seen.images
        assert any(
            w.startswith(f"WARNING: RANDOM WEIGHTS: run {a} used the preset tiny") for w in seen.warnings
        )

        shot = screenshot(page, seen.height, tmp_path / f"{name}.png", tmp_path)
        assert shot.shape[:2] == (seen.height, 1280) and shot.std() > 20
        for image, png in zip(seen.images, embedded_pngs(page.read_text(encoding="utf-8")), strict=True):
            assert_plotted(png)
            assert (image.width, image.height) == (png.shape[1], png.shape[0])
            # The plot is on screen, pixel for pixel, where the browser laid it out.
            assert drawn_like(shot, image, png) < 2.0, (name, image.alt)
