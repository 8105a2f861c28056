"""The HTML report's plots stay readable on real-looking runs, as headless Chromium shows them: one slow
decode step does not set the decode plot's y-axis (it is clipped at a high percentile, and the caption
says so), long page names do not crowd the stage breakdown, and a run whose pages finish over a short
stretch after a long warm-up still shows its rate over several bins, not one."""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
from browser import chromium_path, drawn_like, layout, screenshot
from fakes import Page, add_session, make_run, set_times
from PIL import Image
from test_html import embedded_pngs, report

from dsocr_workers.store.db import open_database, upgrade
from dsocr_workers.store.models import Result, job_id_for

T0 = datetime(2026, 11, 26, 8, 0, 0)
BLUE = np.array([31, 119, 180])  # tab:blue, the first run's colour
LONG_NAMES = [f"docstructbench_dianzishu_zhongwenzaixian-o.O-{i:08d}-page-{i:04d}.png" for i in range(12)]


def blue_rows(png: np.ndarray) -> np.ndarray:
    """Rows of the image holding the first run's colour (its scatter points and median line)."""
    near = np.abs(png - BLUE).sum(axis=2) < 60
    return np.flatnonzero(near.any(axis=1))


def make_png(name: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (320, 420), "white").save(folder / name)
    return folder / name


@pytest.fixture(scope="module")
def page_of_a_real_looking_run(tmp_path_factory):
    """The page and its plots, as Chromium drew them, built once for the tests below, which only read it
    (two Chromium starts and a report each, for every test and ledger, cost minutes of CI's CPUs). On
    SQLite: the page is under test here; test_html.py draws reports from both ledgers."""
    chromium_path()  # skips where there is no Chromium
    tmp_path = tmp_path_factory.mktemp("real-looking-run")
    url = f"sqlite:///{tmp_path / 'dsocr.db'}"
    database = open_database(url)
    upgrade(database)
    add_session(database, "s-long", T0, T0 + timedelta(seconds=74))  # a 74 s load and warm-up
    pages = {(name, 0): Page(1.0, steps=40, session="s-long") for name in LONG_NAMES}
    run = make_run(database, tmp_path / "pages", make_png, pages)
    # The pages finish one a second from 80 s on; every step takes 6-9 ms, rising with the position,
    # but one step of one page took 358 ms (a collection, a preemption).
    set_times(database, run, T0, {key: (79.0 + i, 80.0 + i) for i, key in enumerate(pages)})
    with database.transaction() as session:
        for i, name in enumerate(LONG_NAMES):
            result = session.query(Result).filter_by(job_id=job_id_for(run, name, 0)).one()
            steps = list(np.linspace(6.0, 9.0, 40) + 0.05 * i)
            if i == 3:
                steps[17] = 358.0
            result.decode_step_ms = steps
    database.dispose()
    out = tmp_path / "real.html"
    with pytest.MonkeyPatch.context() as monkeypatch:
        report(["--run", run, "--html", str(out)], url, monkeypatch)
    seen = layout(out, tmp_path)
    shot = screenshot(out, seen.height, tmp_path / "real.png", tmp_path)
    pngs = dict(zip([image.alt for image in seen.images], embedded_pngs(out.read_text(encoding="utf-8")), strict=True))
    for image in seen.images:  # what the checks below read is what the browser shows
        assert image.complete and drawn_like(shot, image, pngs[image.alt]) < 2.0, image.alt
    return out.read_text(encoding="utf-8"), pngs


def test_one_slow_step_does_not_flatten_the_decode_plot(page_of_a_real_looking_run):
    page, pngs = page_of_a_real_looking_run
    plot = pngs["Decode ms/token against position (KV growth)"]
    rows = blue_rows(plot)
    # The 6-9 ms steps spread over much of the plot's height, rather than a line on its floor (and one
    # point at the top).
    assert rows.size > 0.15 * plot.shape[0], (rows.size, plot.shape)
    assert "The y-axis stops at" in page and "1 step above it, up to 358 ms, are off the plot." in page


def test_long_page_names_leave_the_bars_their_room(page_of_a_real_looking_run):
    _, pngs = page_of_a_real_looking_run
    plot = pngs["Stage breakdown per image"]
    from dsocr_workers.report.plots import STAGE_COLORS

    decode = np.array([int(STAGE_COLORS["decode"][i : i + 2], 16) for i in (1, 3, 5)])  # "#rrggbb"
    decode_colored = np.abs(plot - decode).sum(axis=2) < 60
    decode_rows = np.flatnonzero(decode_colored.mean(axis=1) > 0.2)  # across the bars, not the legend's patch
    # The bars keep most of the figure's height: slanted names of 60-odd characters took more than half
    # of it, and the bars were squeezed into a third.
    assert decode_rows.max() - decode_rows.min() > 0.45 * plot.shape[0], (decode_rows.min(), decode_rows.max())


def test_a_short_busy_stretch_after_a_long_warmup_shows_its_bins(page_of_a_real_looking_run):
    _, pngs = page_of_a_real_looking_run
    plot = pngs["Throughput over time"]
    outline = np.abs(plot - BLUE).sum(axis=2) < 60  # the bins' outlines, in the run's colour
    columns = np.flatnonzero(outline.any(axis=0))
    top = min(np.flatnonzero(outline[:, c]).min() for c in columns)
    row = outline[top + 10]  # across the bars, just under their tops: each bin's sides
    sides = np.flatnonzero(np.diff(row.astype(int)) == 1)
    assert len(sides) >= 5, sides  # four bins or more, each one seen (a bar outline per bin)
