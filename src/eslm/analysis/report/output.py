"""The report's directory: written whole, replaced in one step, marked stale when its runs moved on.

``write_report_dir`` builds every file in a temporary directory beside the output (``.NAME.tmp.PID``) and then
puts it in place: a report that fails half-way leaves the previous one as it was, and a reader never sees a
mixture of two reports (or figures left over from an older one). It replaces only a directory it can prove is
an eslm report (its summary.json has ``format: REPORT_FORMAT``), or an empty one; any other directory is
refused in one line. ``mark_stale`` writes a visible notice into an existing report (index.html, summary.md,
summary.json) when the runs it describes are being trained further (``eslm study`` continuing).
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from eslm.analysis.report.summary import REPORT_FORMAT
from eslm.files import atomic_write, check_output_dir, read_marker, replace_dir


def is_report_dir(path: Path) -> bool:
    """``path`` holds a report that eslm wrote (its summary.json names the report format)."""
    return read_marker(Path(path) / "summary.json", REPORT_FORMAT) is not None


WHAT, EARLIER = "the report's output", "an earlier eslm report"


def check_report_dir(out: Path) -> None:
    """Refuses (one line, an OwnershipError) an output directory that is neither new, empty, nor an earlier eslm
    report."""
    check_output_dir(Path(out), WHAT, is_report_dir, EARLIER)


def write_report_dir(out: Path, write) -> None:
    """``write(tmp_dir)`` fills a temporary directory beside ``out``, which then replaces ``out`` (checked by
    ``check_report_dir`` first): ``eslm.files.replace_dir``, under the output's lock (a second report to the same
    ``out`` at the same time is refused). Leftovers of killed reports of the same ``out`` are removed."""
    replace_dir(Path(out), write, what=WHAT, is_ours=is_report_dir, earlier=EARLIER)


def mark_stale(out: Path, why: str) -> bool:
    """Write ``why`` as a notice at the top of the eslm report in ``out`` (index.html, summary.md) and as
    ``stale`` in its summary.json; False when ``out`` holds no eslm report. Marking twice keeps the first."""
    out = Path(out)
    if not is_report_dir(out):
        return False
    summary = json.loads((out / "summary.json").read_text())
    if summary.get("stale"):
        return True
    notice = f"STALE: {why}"
    page = out / "index.html"
    if page.is_file():
        text = page.read_text(encoding="utf-8")
        banner = f"<p class='warn' id='stale'><b>{html.escape(notice)}</b></p>"
        atomic_write(page, (text.replace("<h1>", banner + "<h1>", 1) if "<h1>" in text else banner + text).encode())
    md = out / "summary.md"
    if md.is_file():
        atomic_write(md, (f"**{notice}**\n\n" + md.read_text(encoding="utf-8")).encode())
    atomic_write(out / "summary.json", json.dumps({**summary, "stale": why}, indent=2).encode())
    return True
