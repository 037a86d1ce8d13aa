"""The order of the report page (issue 45, item 5), read by parsing index.html (no browser): the header (study,
alpha, model, tokens per step, commit, seeds) and the compact verdict table come before the first figure, the
seeds are said once (no "(n=...)" in a cell), only figures with data are drawn (no placeholder, no panel of a
constant), the training loss and tokens/s are drawn, and the token view is linked or its command given."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from eslm import metrics as M
from eslm.analysis import report
from eslm.analysis.report import figure_table as T
from eslm.analysis.report import render_html, render_markdown

from .test_report import make_run

PAGES = Path(__file__).resolve().parent / "report_pages"


class Page(HTMLParser):
    """The page as a flat list of elements in document order: (tag, attrs, text inside it, id of the enclosing
    table or None); ``cells``: the text of every <td> of the tables other than the header."""

    def __init__(self):
        super().__init__()
        self.items: list[dict] = []
        self.open: list[dict] = []
        self.tables = 0

    def handle_starttag(self, tag, attrs):
        item = {"tag": tag, "attrs": dict(attrs), "text": "", "table": None}
        if tag == "table":
            self.tables += 1
        if self.tables and tag != "table":
            item["table"] = self.tables
        if tag == "table":
            item["table"] = self.tables
        self.items.append(item)
        if tag not in ("img", "br", "meta"):
            self.open.append(item)

    def handle_endtag(self, tag):
        while self.open:
            if self.open.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        for item in self.open:
            item["text"] += data

    def first(self, tag, text=None) -> int:
        return next(i for i, x in enumerate(self.items) if x["tag"] == tag and (text is None or x["text"] == text))


def parse(page: str) -> Page:
    p = Page()
    p.feed(page)
    p.close()
    return p


def _recorded(case: str) -> tuple[dict, dict]:
    data = json.loads((PAGES / f"{case}.json").read_text())
    return data["summary"], data["written"]


def test_the_header_and_the_verdict_table_come_before_the_first_figure():
    s, written = _recorded("five-seeds")
    page = parse(render_html(s, written))
    h1, first_img = page.first("h1"), page.first("img")
    head = page.items[page.first("table")]
    assert head["attrs"].get("class") == "head" and h1 < page.first("table") < first_img
    names = [x["text"] for x in page.items if x["tag"] == "th" and x["table"] == head["table"]]
    assert names == ["runs in", "alpha", "model", "tokens per step", "commit", "seeds", "compared", "token view"]
    rows = {x["text"]: page.items[i + 1]["text"] for i, x in enumerate(page.items)
            if x["tag"] == "th" and x["table"] == head["table"]}
    assert rows["model"] == "tiny (12,345 non-embedding parameters)" and rows["tokens per step"] == "1,000"
    assert "0.1, 0.2" in rows["alpha"] and "abc" in rows["commit"] and "1 to 5 per group" in rows["seeds"]
    verdicts = page.first("h2", "Verdicts")
    table = next(i for i, x in enumerate(page.items) if i > verdicts and x["tag"] == "table")
    assert head["table"] < page.items[table]["table"] and verdicts < table < first_img
    header = [x["text"] for x in page.items if x["tag"] == "th" and x["table"] == page.items[table]["table"]]
    assert header[:5] == ["group", "vs", "Δ final val loss (nats)", "95% interval", "verdict"]
    cells = [x["text"] for x in page.items if x["tag"] == "td" and x["table"] == page.items[table]["table"]]
    assert cells[:8] == ["eslm-entropy (method.alpha=0.1) (primary)", "random", "-0.0500", "[-0.0539, -0.0461]",
                         "lower", "-14.1%", "[-16.9%, -11.3%]", "less"]
    # the sentences (six read-outs each) come after the figures
    assert page.first("h2", "Verdicts in words") > max(i for i, x in enumerate(page.items) if x["tag"] == "img")


def test_the_seeds_are_said_once_and_no_cell_repeats_n():
    for case in ("five-seeds", "one-seed", "no-baseline"):
        s, written = _recorded(case)
        page = parse(render_html(s, written))
        cells = [x["text"] for x in page.items if x["tag"] == "td"]
        assert cells and not any("(n=" in c for c in cells), case
        head = page.items[page.first("table")]["table"]  # the header: one row says the seeds
        assert [x["table"] for x in page.items if x["tag"] == "th" and x["text"] == "seeds"][0] == head, case
        assert sum(x["tag"] == "th" and x["text"] == "seeds" and x["table"] == head for x in page.items) == 1
    s, written = _recorded("one-seed")
    assert "n = 1 per group" in render_html(s, written)


def test_only_drawn_figures_appear_with_their_sections():
    s, written = _recorded("five-seeds")
    page = parse(render_html(s, {k: v for k, v in written.items() if k != "alpha_per_run"}))
    srcs = [x["attrs"]["src"] for x in page.items if x["tag"] == "img"]
    assert srcs == [f"{f.id}.png" for f in T.FIGURES if f.id in written and f.id != "alpha_per_run"]
    text = "".join(x["text"] for x in page.items if x["tag"] == "body")
    assert "no data" not in text
    page = parse(render_html(s, {}))  # nothing drawn: no figure section at all
    headings = {x["text"] for x in page.items if x["tag"] == "h2"}
    assert not headings & {f.section for f in T.FIGURES} and not any(x["tag"] == "img" for x in page.items)


def test_summary_md_mirrors_the_page_order():
    s, _ = _recorded("five-seeds")
    s = {**s, "figures": {"loss_vs_flops": "loss_vs_flops.png", "training_curve": "training_curve.png"}}
    md = render_markdown(s).splitlines()
    at = {k: md.index(k) for k in ("## Verdicts", "## Figures", "## Summary", "## Verdicts in words")}
    assert md[0] == "# eslm report" and md.index("- **model**: tiny (12,345 non-embedding parameters)") < at["## Verdicts"]
    assert at["## Verdicts"] < at["## Figures"] < at["## Summary"] < at["## Verdicts in words"]
    assert md[at["## Verdicts"] + 2].startswith("| group | vs | Δ final val loss (nats) | 95% interval | verdict |")
    images = [x for x in md if x.startswith("![")]
    assert images == ["![validation loss vs FLOPs (log-log)](loss_vs_flops.png)",
                      "![training loss vs tokens](training_curve.png)"]
    assert all(at["## Figures"] < md.index(x) < at["## Summary"] for x in images)


def test_a_constant_selection_panel_is_not_drawn(tmp_path, monkeypatch):
    """A fixed alpha keeps a constant fraction: no selection figure. An alpha that moves draws its panels and the
    kept fraction's, but not a per-domain kept fraction that stayed constant."""
    from eslm.analysis.rundir import group_runs, load_run

    drawn: dict = {}
    monkeypatch.setattr(T.figures, "panels", lambda path, panel, *a, **kw: drawn.update(panel))
    fixed = [load_run(make_run(tmp_path / "fixed", f"eslm-s{s}", "eslm-entropy", s)) for s in (1, 2)]
    assert not T._selection(tmp_path / "a.png", T.Scene(group_runs(fixed), {}, {})) and not drawn
    moving = [load_run(make_run(tmp_path / "ada", f"ada-s{s}", "ada-eslm-entropy", s)) for s in (1, 2)]
    for r in moving:
        for i, rec in enumerate(r.train):
            rec[M.ALPHA] = 0.1 + 0.01 * i
            rec[M.KEPT_FRAC] = 1.0 - rec[M.ALPHA]
    assert T._selection(tmp_path / "b.png", T.Scene(group_runs(moving), {}, {}))
    assert list(drawn) == ["kept fraction", "alpha"]  # "kept fraction: web" is constant in the synthetic runs


def test_the_built_page_draws_training_loss_and_throughput_and_names_the_token_view(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [make_run(tmp_path / "study", f"{m}-s{s}", m, s) for m in ("clm", "eslm-entropy") for s in (1, 2)]
    s = report.build_report([str(p) for p in runs], tmp_path / "study" / "report")
    page = parse((tmp_path / "study" / "report" / "index.html").read_text())
    srcs = [x["attrs"]["src"] for x in page.items if x["tag"] == "img"]
    assert "training_curve.png" in srcs and "throughput.png" in srcs and "selection.png" not in srcs
    assert page.first("h2", "Verdicts") < page.first("img")
    view = next(page.items[i + 1]["text"] for i, x in enumerate(page.items) if x["text"] == "token view")
    assert f"eslm tokens RUN_DIR/checkpoints/step_NNNNNNN.pt --data DATA_DIR --out {tmp_path / 'study' / 'tokens'}" in view
    assert s["header"]["tokens_per_step"] == [1000] and s["header"]["seeds_per_group"] == [2]
    # a token view beside the report (eslm tokens --out STUDY/tokens) is linked, relative to the page
    (tmp_path / "study" / "tokens").mkdir()
    for name in ("index.html", "tokens.json"):
        (tmp_path / "study" / "tokens" / name).write_text("{}")
    report.build_report([str(p) for p in runs], tmp_path / "study" / "report", study="demo<b>")
    text = (tmp_path / "study" / "report" / "index.html").read_text()
    assert "<h1>eslm report: demo&lt;b&gt;</h1>" in text  # the study's name in the title, escaped
    page = parse(text)
    assert [x["attrs"]["href"] for x in page.items if x["tag"] == "a" and "tokens" in x["attrs"].get("href", "")] \
        == ["../tokens/index.html"]
