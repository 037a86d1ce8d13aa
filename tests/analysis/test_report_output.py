"""The report's directory (eslm.analysis.report.output): replaced whole, never over files eslm did not write,
marked stale while its runs train further; error messages that name the options of the caller."""

from __future__ import annotations

import json

import pytest

from eslm.analysis import report
from eslm.errors import ESLMError

from .test_report import make_run


@pytest.fixture(autouse=True)
def _no_figures(monkeypatch):  # the figures are not what these tests are about, and they take seconds each
    from eslm.analysis import figures

    monkeypatch.setattr(figures, "available", lambda: False)


@pytest.fixture
def two_runs(tmp_path):
    return [str(make_run(tmp_path / "r", "clm-s1", "clm", 1)),
            str(make_run(tmp_path / "r", "eslm-s1", "eslm-entropy", 1))]


def test_a_report_replaces_an_earlier_report_whole(tmp_path, two_runs):
    out = tmp_path / "rep"
    report.build_report(two_runs, out)
    (out / "left_from_an_older_report.png").write_bytes(b"x")
    report.build_report(two_runs[:1], out)
    assert not (out / "left_from_an_older_report.png").exists()  # the whole directory was replaced
    assert json.loads((out / "summary.json").read_text())["runs"][0]["name"] == "clm-s1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "rep"]  # no temporary or old copy left


def test_a_failing_report_leaves_the_earlier_one_intact(tmp_path, two_runs, monkeypatch):
    import eslm.analysis.report as package

    out = tmp_path / "rep"
    report.build_report(two_runs, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(summary):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(package, "render_markdown", broken)
    with pytest.raises(OSError):
        report.build_report(two_runs[:1], out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "rep"]


def test_a_directory_eslm_did_not_write_is_refused(tmp_path, two_runs):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "index.html").write_text("my own page")
    with pytest.raises(ESLMError, match=r"new, empty or an earlier eslm report, found other files \('index.html'\)"):
        report.build_report(two_runs, out)
    assert (out / "index.html").read_text() == "my own page" and len(list(out.iterdir())) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    report.build_report(two_runs, empty)  # an empty directory is fine
    assert (empty / "index.html").is_file()


def test_mark_stale_writes_a_notice_into_every_file_until_the_report_is_rebuilt(tmp_path, two_runs):
    out = tmp_path / "rep"
    assert report.mark_stale(out, "why") is False  # nothing there: nothing marked
    report.build_report(two_runs, out)
    assert report.mark_stale(out, "3 runs trained since") is True
    assert "<p class='warn' id='stale'><b>STALE: 3 runs trained since</b></p><h1>" in (out / "index.html").read_text()
    md = (out / "summary.md").read_text()  # the notice, then the report: its header, the one-seed note, the tables
    assert md.startswith("**STALE: 3 runs trained since**\n\n# eslm report\n")
    assert md.index("**One seed per group**") < md.index("\n\n| group |")
    assert json.loads((out / "summary.json").read_text())["stale"] == "3 runs trained since"
    report.mark_stale(out, "again")  # marked once
    assert (out / "index.html").read_text().count("STALE") == 1
    report.build_report(two_runs, out)
    assert "STALE" not in (out / "index.html").read_text() + (out / "summary.md").read_text()


def test_errors_name_the_options_of_the_caller(tmp_path, two_runs):
    with pytest.raises(ESLMError, match=r"^--baseline: no group 'nope' among the runs"):
        report.build_report(two_runs, tmp_path / "a", baseline="nope")
    with pytest.raises(ESLMError) as e:
        report.build_report(two_runs, tmp_path / "b", baseline="nope", target_loss="baseline", where="report.")
    assert str(e.value).startswith("report.baseline: no group 'nope'") and "--" not in str(e.value)
    runs = [str(make_run(tmp_path / "r2", "e1", "eslm-entropy", 1))]
    s = report.build_report(runs, tmp_path / "c", where="report.")
    assert "no clm group among the runs: no paired comparisons (set report.baseline to compare)" in s["warnings"]
    assert not any("--" in w for w in s["warnings"])
