"""The report's directory: replaced whole, in one step, only where it is provably an eslm report (summary.json's
``format``) or empty; ``mark_stale`` writes a notice into a report whose runs are being trained further."""

from __future__ import annotations

import html
import json
from pathlib import Path

from eslm.analysis.report.summary import REPORT_FORMAT
from eslm.files import atomic_write, check_output_dir, read_marker


def is_report_dir(path: Path) -> bool:
    """``path`` holds a report that eslm wrote (its summary.json names the report format)."""
    return read_marker(Path(path) / "summary.json", REPORT_FORMAT) is not None


WHAT, EARLIER = "the report's output", "an earlier eslm report"


def check_report_dir(out: Path) -> None:
    """Refuses (one line, an OwnershipError) an output directory that is neither new, empty, nor an earlier eslm
    report."""
    check_output_dir(Path(out), WHAT, is_report_dir, EARLIER)


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
