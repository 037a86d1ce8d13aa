"""``eslm report``: the default --out."""

from __future__ import annotations

from eslm.cli import main
from eslm.cli import report as cli_report


def test_report_writes_to_report_in_the_working_directory_by_default(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(cli_report, "build_report", lambda run_dirs, out_dir, **kw: seen.append(out_dir) or {})
    monkeypatch.setattr(cli_report, "print_summary", lambda summary, out: None)
    assert main(["report", "runs/a", "runs/b"]) == 0 and seen == ["report"]
    assert main(["report", "runs/a", "--out", "elsewhere"]) == 0 and seen[-1] == "elsewhere"


def test_the_default_output_is_checked_like_a_given_one(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "index.html").write_text("my own page")
    assert main(["report", "runs/a"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "expected the report's output 'report' to be new, empty or an earlier" in err
    assert (tmp_path / "report" / "index.html").read_text() == "my own page"
