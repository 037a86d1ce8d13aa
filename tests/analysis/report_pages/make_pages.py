"""Writes the report pages that tests/analysis/test_report_html.py renders again and compares: for each case, the
summary ``eslm report`` builds from synthetic run directories (CASE.json, with the figures the page names) and
the index.html that the renderer made of it when it was recorded (CASE.html).

    PYTHONPATH=src python tests/analysis/report_pages/make_pages.py

Run it again only when the page is meant to change (a new section, a new column), and say why in the commit.
``--demo DIR`` instead writes a whole report with its figures (matplotlib) from synthetic runs of a three-seed
study under DIR (DIR/demo/report/index.html): the page docs/report-screenshot.png shows."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/analysis: the synthetic runs of test_report


def cases(root: Path) -> dict:
    """{case: (summary, written figures)}: five seeds (intervals, paired verdicts, controls, spread, primary,
    downstream, an unfinished and a skipped run, warnings), one seed (the note said once), no baseline."""
    import test_report as T

    from eslm.analysis import figures, report
    from eslm.analysis.report.figure_table import FIGURES

    figures.available = lambda: False  # the page, not the drawings: figure files are named below
    noise = {1: 0.1, 2: -0.1, 3: 0.05, 4: -0.05, 5: 0.0}
    jitter = {1: 0.002, 2: -0.001, 3: 0.0, 4: 0.001, 5: -0.002}
    shifts = {"clm": lambda s: noise[s] + 0.1, "eslm-entropy": lambda s: noise[s] + 0.05 + jitter[s],
              "random": lambda s: noise[s] + 0.1 - jitter[s]}
    five = T._study(root / "five", [1, 2, 3, 4, 5], shifts)
    down = {"format": "eslm-eval-v1", "step": 160, "tasks": {
        "arc_easy": {"metric": "acc_norm", "value": 0.40, "stderr": 0.01, "num_fewshot": 0},
        "lambada": {"metric": "perplexity", "value": 31.5, "stderr": 1.2, "num_fewshot": 0}}}
    five.append(T.make_run(root / "five", "eslm-a2-s1", "eslm-entropy", 1, alpha=0.2, downstream=down,
                           finished=False))
    five.append(T.make_run(root / "five", "broken", "clm", 9, evals=False))
    out = {}
    s = report.build_report([str(p) for p in five], root / "rep-five", target_loss="baseline",
                            primary=["eslm-entropy", "random"])
    out["five-seeds"] = (s, {f.id: f"{f.id}.png" for f in FIGURES[::2]})
    one = T._study(root / "one", [1], {m: (lambda s: 0.0) for m in shifts})
    out["one-seed"] = (report.build_report([str(p) for p in one], root / "rep-one"), {})
    alone = [T.make_run(root / "alone", "eslm-s1", "eslm-entropy", 1), T.make_run(root / "alone", "r-s1", "random", 1)]
    out["no-baseline"] = (report.build_report([str(p) for p in alone], root / "rep-alone"), {FIGURES[0].id: "a.png"})
    return {k: (json.loads(json.dumps(s, default=str)), w) for k, (s, w) in out.items()}


def demo(root: Path) -> Path:
    """A report like the demo study's (clm, eslm-entropy, random at alpha 0.1; three seeds), figures drawn, from
    the synthetic runs of test_report; returns its index.html."""
    import test_report as T

    from eslm.analysis import report

    noise = {1: 0.04, 2: -0.03, 3: -0.01}
    shifts = {"clm": lambda s: noise[s] + 0.1, "eslm-entropy": lambda s: noise[s] + 0.04,
              "random": lambda s: noise[s] + 0.09}
    runs = T._study(root / "demo", [1, 2, 3], shifts)
    report.build_report([str(p) for p in runs], root / "demo" / "report", study="demo")
    return root / "demo" / "report" / "index.html"


def main() -> None:
    from eslm.analysis.report import render_html

    if sys.argv[1:2] == ["--demo"]:
        print(f"wrote {demo(Path(sys.argv[2]))}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name, (summary, written) in cases(Path(tmp)).items():
            (HERE / f"{name}.json").write_text(json.dumps({"summary": summary, "written": written}, indent=1) + "\n")
            (HERE / f"{name}.html").write_text(render_html(summary, written), encoding="utf-8")
            print(f"wrote {name}.json, {name}.html")


if __name__ == "__main__":
    main()
