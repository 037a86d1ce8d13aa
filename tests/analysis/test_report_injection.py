"""A hostile report input (issue 47, item 1): script planted in every field a user controls (task names, the
values of an eval JSON, config values, run and method names, a warning's path) is text on the rendered page,
never markup: the page is parsed and has no script element, no event-handler attribute and no element the
input named; summary.md keeps no raw HTML either. Long values are shortened on the page; a ``$...$`` in a
config value is text in the figures, not matplotlib mathtext."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest
import yaml

from eslm.analysis import report

from .test_report import make_run

SCRIPT = "<script>document.title=1337</script>"
IMG = "t<img src=x onerror=document.title=1337>"


class Tags(HTMLParser):
    """Every start tag of a page and its attributes."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    handle_startendtag = handle_starttag


def parse(page: str) -> list[tuple[str, dict]]:
    p = Tags()
    p.feed(page)
    p.close()
    return p.tags


def _plant(d, method_name=None, extra_config=None):
    """Rewrite a run directory's config with planted values (method name, a config value, the run name)."""
    cfg = yaml.safe_load((d / "config.yaml").read_text())
    if method_name:
        cfg["method"]["name"] = method_name
    cfg["run"]["name"] = d.name + SCRIPT
    cfg["data"]["source"] = SCRIPT
    cfg.update(extra_config or {})
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    return d


@pytest.fixture
def hostile_runs(tmp_path):
    down = {"format": "eslm-eval-v1", "step": 160, "tasks": {
        IMG: {"metric": "acc<svg onload=alert(1)>", "value": 0.4, "stderr": 0.01, "num_fewshot": SCRIPT},
        "piqa": {"metric": SCRIPT, "value": 0.6, "stderr": 0.02, "num_fewshot": "<b onmouseover=alert(2)>"}}}
    runs = []
    for s in (1, 2):
        runs.append(_plant(make_run(tmp_path, f"clm-s{s}", "clm", s, downstream=down)))
        runs.append(_plant(make_run(tmp_path, f"e-s{s}", "eslm-entropy", s, downstream=down),
                           method_name="eslm-entropy" + IMG))
    runs.append(_plant(make_run(tmp_path, "unfinished" + "<i onclick=x>", "clm", 3, finished=False,
                                downstream=down)))
    broken = make_run(tmp_path, "broken" + SCRIPT.replace("/", ""), "clm", 9, evals=False)  # skipped: its path
    return [str(r) for r in runs] + [str(broken)]


def test_script_planted_in_every_user_field_is_text_on_the_page(hostile_runs, tmp_path):
    out = tmp_path / "rep"
    s = report.build_report(hostile_runs, out, baseline="clm")
    page = (out / "index.html").read_text(encoding="utf-8")
    tags = parse(page)
    names = {t for t, _ in tags}
    assert "script" not in names and "svg" not in names
    assert [t for t, a in tags if t == "img" and a.get("src") == "x"] == []
    assert [(t, k) for t, a in tags for k in a if k.lower().startswith("on")] == []
    assert [t for t, a in tags if t == "b" and "onmouseover" in json.dumps(a)] == []
    # the planted text is there, as text
    for text in ("&lt;script&gt;document.title=1337&lt;/script&gt;", "t&lt;img src=x onerror=document.title=1337&gt;",
                 "acc&lt;svg onload=alert(1)&gt;"):
        assert text in page
    assert s["skipped"], "the planted broken run is listed as skipped (its path on the page)"
    md = (out / "summary.md").read_text(encoding="utf-8")
    assert "<script" not in md and "<img" not in md and "<i " not in md
    assert "&lt;script&gt;" in md


def test_a_long_value_is_shortened_on_the_page(tmp_path):
    long = "v" * 200_000
    runs = [_plant(make_run(tmp_path, f"clm-s{s}", "clm", s)) for s in (1, 2)]
    runs += [_plant(make_run(tmp_path, f"e-s{s}", "eslm-entropy", s), method_name="eslm-entropy" + long)
             for s in (1, 2)]
    out = tmp_path / "rep"
    report.build_report([str(r) for r in runs], out, baseline="clm")
    page = (out / "index.html").read_text(encoding="utf-8")
    md = (out / "summary.md").read_text(encoding="utf-8")
    assert long not in page and long not in md
    assert "characters)" in page and len(page) < 150_000


def test_mathtext_in_a_config_value_is_drawn_as_text(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [_plant(make_run(tmp_path, f"clm-s{s}", "clm", s)) for s in (1, 2)]
    runs += [_plant(make_run(tmp_path, f"e-s{s}", "eslm-entropy", s), method_name="eslm $x^{$")
             for s in (1, 2)]
    out = tmp_path / "rep"
    s = report.build_report([str(r) for r in runs], out, baseline="clm")
    assert s["figures"] and all((out / f).is_file() for f in s["figures"].values())
