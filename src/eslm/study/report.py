"""The study's report: marking an earlier report stale when the study continues, and building the report of
the finished runs with the study file's ``report`` section (``eslm.analysis.report``)."""

from __future__ import annotations

import time
from pathlib import Path

from eslm.analysis import report as analysis_report
from eslm.analysis.report import mark_stale
from eslm.errors import ESLMError


def mark_earlier_report_stale(study: dict, study_dir: Path, unfinished: int) -> None:
    """An earlier report no longer describes the study: say so on it until the new one replaces it."""
    if mark_stale(study_dir / "report", f"written before eslm study {study['name']} continued on "
                  f"{time.strftime('%Y-%m-%d %H:%M')} with {unfinished} unfinished run(s); it is replaced "
                  "when the study finishes"):
        print(f"study {study['name']}: the earlier report in {study_dir / 'report'} is marked stale")


def run_report(study: dict, run_dirs: list[Path], report_dir: Path, t0: float) -> int:
    opts = study.get("report") or {}
    try:
        summary = analysis_report.build_report([str(p) for p in run_dirs], str(report_dir),
                                               target_loss=opts.get("target"), baseline=opts.get("baseline"),
                                               where="report.", primary=opts.get("primary"),
                                               equivalence_margin=opts.get("equivalence_margin"),
                                               study=study["name"])
    except ESLMError as e:
        raise ESLMError(f"study {study['name']}: every run finished, but the report failed: {e}; fix the study "
                        "file's report section and run the same command again (finished runs are skipped: "
                        "only the report is written)") from None
    analysis_report.print_summary(summary, report_dir)
    print(f"study {study['name']} done in {time.perf_counter() - t0:.0f}s; report: {report_dir / 'index.html'}")
    return 0


