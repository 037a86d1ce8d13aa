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
import os
import re
import shutil
from pathlib import Path

from eslm.analysis.report.summary import REPORT_FORMAT
from eslm.errors import ESLMError


class ReportDirError(ESLMError):
    """An output directory that eslm report will not write over."""


def is_report_dir(path: Path) -> bool:
    """``path`` holds a report that eslm wrote (its summary.json names the report format)."""
    try:
        return json.loads((Path(path) / "summary.json").read_text()).get("format") == REPORT_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _leftover(name: str, out: Path) -> bool:
    """A temporary or replaced copy of ``out`` left by a killed report (ours by its name)."""
    return re.fullmatch(rf"\.{re.escape(out.name)}\.(tmp|old)\.\d+", name) is not None


def check_report_dir(out: Path) -> None:
    """Refuses (one line) an output directory that is neither new, empty, nor an earlier eslm report."""
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ReportDirError(f"expected the report's output {str(out)!r} to be a directory, found "
                             f"{'a link' if out.is_symlink() else 'a file'}; choose another output directory")
    if out.is_dir() and any(out.iterdir()) and not is_report_dir(out):
        names = sorted(p.name for p in out.iterdir())
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ReportDirError(f"expected the report's output {str(out)!r} to be new, empty or an earlier eslm "
                             f"report, found other files ({shown}); eslm replaces only its own reports: "
                             "choose another output directory")


def write_report_dir(out: Path, write) -> None:
    """``write(tmp_dir)`` fills a temporary directory beside ``out``, which then replaces ``out`` (checked by
    ``check_report_dir`` first). Leftovers of killed reports of the same ``out`` are removed."""
    out = Path(out)
    check_report_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for p in out.parent.iterdir():
        if _leftover(p.name, out) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    tmp.mkdir()
    try:
        write(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old.{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


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
        _replace_text(page, text.replace("<h1>", banner + "<h1>", 1) if "<h1>" in text else banner + text)
    md = out / "summary.md"
    if md.is_file():
        _replace_text(md, f"**{notice}**\n\n" + md.read_text(encoding="utf-8"))
    _replace_text(out / "summary.json", json.dumps({**summary, "stale": why}, indent=2))
    return True
