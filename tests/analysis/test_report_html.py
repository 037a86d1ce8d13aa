"""index.html of ``eslm report`` from its Jinja2 template: the same page, byte for byte, as the renderer made of
the recorded summaries in tests/analysis/report_pages/ (five seeds with a primary comparison, controls,
downstream results, an unfinished and a skipped run; one seed; no baseline). make_pages.py there records them
again when the page is meant to change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eslm.analysis.report import render_html

PAGES = Path(__file__).resolve().parent / "report_pages"
CASES = sorted(p.stem for p in PAGES.glob("*.json"))


def test_the_recorded_cases_are_there():
    assert CASES == ["five-seeds", "no-baseline", "one-seed"]


@pytest.mark.parametrize("case", CASES)
def test_the_page_from_the_template_is_the_recorded_page(case):
    data = json.loads((PAGES / f"{case}.json").read_text())
    page = render_html(data["summary"], data["written"])
    assert page == (PAGES / f"{case}.html").read_text(encoding="utf-8")


def test_text_from_the_runs_is_escaped_in_the_page():
    data = json.loads((PAGES / "five-seeds.json").read_text())
    s = data["summary"]
    s["warnings"] = ["<script>alert(1)</script> & 'x'"]
    s["groups"][0]["label"] = "<b>g</b>"
    page = render_html(s, data["written"])
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &#39;x&#39;" in page
    assert "&lt;b&gt;g&lt;/b&gt;" in page and "<b>g</b>" not in page
