"""Output a reader can read: kernel names short in text, in full in JSON and the HTML's hover text; wide
tables fit the terminal they print to; options in captions stay whole."""

from __future__ import annotations

import json

from dsocr_workers.report.build import Report
from dsocr_workers.report.html import _table
from dsocr_workers.report.render import render_json, render_table
from dsocr_workers.report.tables import KernelName, Table, short_kernel_name

FILL = ("void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>, "
        "std::array<char*, 1ul> >(int, at::native::FillFunctor<c10::BFloat16>, std::array<char*, 1ul>)")
SOFTMAX = ("void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, float, 10, false, "
           "false>(c10::BFloat16*, c10::BFloat16 const*, int, int, int, bool const*, int, bool)")


def test_a_signature_reads_as_its_base_name_and_first_type_argument():
    assert short_kernel_name(FILL) == "vectorized_elementwise_kernel<FillFunctor>"
    assert short_kernel_name(SOFTMAX) == "softmax_warp_forward<BFloat16>"
    for name in ("aten::mm", "triton_poi_fused_add_0", "Memcpy HtoD (Pinned -> Device)"):
        assert short_kernel_name(name) == name
    assert len(short_kernel_name("x" * 300)) == 60


def kernel_report() -> Report:
    rows = [["decode", KernelName(FILL), 12.0, 0.5], ["decode", KernelName(SOFTMAX), 3.0, 0.25]]
    return Report("kernels", tables=[Table("Kernels per stage", ["stage", "kernel", "calls/job", "ms/job"], rows)])


def test_text_shows_short_names_json_and_html_keep_the_full_ones():
    report = kernel_report()
    text = render_table(report, width=100)
    assert "vectorized_elementwise_kernel<FillFunctor>" in text and "FillFunctor<c10" not in text
    assert max(map(len, text.splitlines())) <= 100
    rows = json.loads(render_json(report))["tables"]["Kernels per stage"]
    assert [row["kernel"] for row in rows] == [FILL, SOFTMAX]
    html = _table(report.tables[0])
    assert '>vectorized_elementwise_kernel&lt;FillFunctor&gt;</td>' in html
    assert 'title="void at::native::vectorized_elementwise_kernel&lt;8,' in html


def test_a_wide_table_of_words_wraps_to_the_terminal_and_keeps_its_figures_whole():
    words = "a warm-up of gundam pages at 1,024 tokens, then the batched engine with its graphs per bucket " * 3
    report = Report("wide", tables=[Table("Worker processes", ["process", "warm-up", "ms"],
                                          [["host:1:child", words, 1234.5678], ["host:2:child", words, 98.25]])])
    natural = render_table(report)
    assert max(map(len, natural.splitlines())) > 200  # redirected: as wide as its content
    fitted = render_table(report, width=100)
    assert max(map(len, fitted.splitlines())) <= 100
    assert "1,234.568" in fitted and "98.25" in fitted


def test_an_option_in_a_caption_never_breaks_at_its_hyphens():
    from dsocr_workers.report.html import _options_whole

    assert _options_whole("left out unless --include-cold).") == "left out unless <code>--include-cold</code>)."
