"""The per-stage kernel plot of `dsocr report --html` (issue 33) for real CPU runs with --profile, as
headless Chromium draws it, alone and with --vs; a batched run's, of its sampled batch steps."""

from __future__ import annotations

import json
import re

from browser import chromium_path, drawn_like, layout, screenshot
from test_html import TITLES, assert_plotted, dsocr_run, embedded_pngs, report

KERNEL_PLOT = "Kernels per stage (profiled jobs)"
BATCH_KERNEL_PLOT = "Kernels per stage (profiled batch steps)"


def test_a_profiled_run_draws_its_kernels_per_stage_in_chromium(tmp_path, make_png, subprocess_env, monkeypatch):
    chromium_path()  # skips here, before the runs, where there is no Chromium
    folder = tmp_path / "pages"
    for name, size in {"letter.png": (320, 420), "wide.png": (900, 500)}.items():
        make_png(name, size, folder=folder)
    listing = folder / "pages.txt"
    listing.write_text("letter.png\nwide.png\n")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**subprocess_env, "DSOCR_DATABASE_URL": url}
    a = dsocr_run(listing, env, "--max-new-tokens", "8", "--repeats", "2", "--profile", "2", "--name", "cpu-a")
    b = dsocr_run(listing, env, "--max-new-tokens", "12", "--profile", "1", "--name", "cpu-b")

    tables = {"single": "Device busy and idle per stage", "vs": "Kernels per stage, B vs A"}
    for name, args in {"single": ["--run", a], "vs": ["--run", a, "--vs", b]}.items():
        page = tmp_path / f"{name}.html"
        text = report([*args, "--html", str(page)], url, monkeypatch)
        assert tables[name] in text
        seen = layout(page, tmp_path)
        assert [image.alt for image in seen.images] == [*TITLES, KERNEL_PLOT]
        assert all(image.complete and image.width >= 1000 for image in seen.images), seen.images
        shot = screenshot(page, seen.height, tmp_path / f"{name}.png", tmp_path)
        image, png = seen.images[-1], embedded_pngs(page.read_text(encoding="utf-8"))[-1]
        assert_plotted(png)
        assert (image.width, image.height) == (png.shape[1], png.shape[0])
        assert drawn_like(shot, image, png) < 2.0, name


def test_a_batched_profiled_runs_kernels_are_its_batch_steps_in_the_text_json_and_html_reports(
    tmp_path, make_png, subprocess_env, monkeypatch
):  # fmt: skip
    """`dsocr run --concurrency 2 --profile 2`: the kernel tables and the kernel plot hold its sampled batch
    steps, by kind and occupancy band, drawn without a browser too."""
    folder = tmp_path / "pages"
    for name, size in {"letter.png": (320, 420), "wide.png": (900, 500)}.items():
        make_png(name, size, folder=folder)
    listing = folder / "pages.txt"
    listing.write_text("letter.png\nwide.png\n")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {**subprocess_env, "DSOCR_DATABASE_URL": url}
    run = dsocr_run(
        listing, env, "--max-new-tokens", "8", "--repeats", "2", "--concurrency", "2", "--profile", "2"
    )

    tables = json.loads(report(["--run", run, "--format", "json"], url, monkeypatch))["tables"]
    stages = [row["stage"] for row in tables["Device busy and idle per stage"]]
    assert stages[0] == "batch prefill step" and "batch decode step, occupancy 2-7" in stages
    assert {row["stage"] for row in tables["Kernels per stage"]} == set(stages)
    text = report(["--run", run], url, monkeypatch)
    assert "batch decode step, occupancy 2-7" in text and "ms/step" in text
    page = tmp_path / "batched.html"
    report(["--run", run, "--html", str(page)], url, monkeypatch)
    html = page.read_text(encoding="utf-8")
    alts = re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,', html)
    assert alts[-1] == BATCH_KERNEL_PLOT and "Kernels per stage (profiled jobs)" not in alts
    assert_plotted(embedded_pngs(html)[-1])
