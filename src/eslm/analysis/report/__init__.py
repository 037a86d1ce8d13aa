"""``eslm report RUN_DIR ... --out DIR``: a static, offline HTML page of figures and tables, plus summary.json
(what it computes: docs/report.md). ``build_report`` runs the package's modules in order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eslm import metrics as M
from eslm.analysis import figures
from eslm.analysis.report.curves import best_val_loss, crossing
from eslm.analysis.report.figure_table import FIGURES, make_figures
from eslm.analysis.report.html import render_html
from eslm.analysis.report.markdown import render_markdown
from eslm.analysis.report.output import EARLIER, WHAT, check_report_dir, is_report_dir, mark_stale
from eslm.analysis.report.summary import (
    FLOPS_KEYS,
    ONE_SEED_NOTE,
    ReportError,
    find_baseline,
    load_runs,
    summarize,
)
from eslm.analysis.rundir import comparable_sets_problem, config_get, group_runs, is_number, one_run_per_seed
from eslm.files import replace_dir

__all__ = ["FIGURES", "FLOPS_KEYS", "ReportError", "build_report", "crossing", "load_runs", "make_figures",
           "mark_stale", "print_summary", "render_html", "render_markdown", "summarize"]


def print_summary(summary: dict, out: Path) -> None:
    """Warnings to stderr; the verdicts and where the report is to stdout."""
    for w in summary["warnings"]:
        print(f"eslm report: warning: {w}", file=sys.stderr)
    if summary.get("primary"):
        print(summary["primary"]["primary_verdict"])
    if summary["one_seed"]:  # once, instead of "(n=1, no interval)" after every verdict
        print(ONE_SEED_NOTE)
    for c in summary["comparisons"] + summary["controls"]:
        print(f"{c['group']} vs {c['against']}: " + "; ".join(c["verdicts"]))
    print(f"wrote {Path(out) / 'index.html'} ({len(summary['groups'])} groups, {len(summary['runs'])} runs)")


TOKEN_VIEW_DIR = "tokens"  # the token view (eslm tokens --out) the page links to: a directory beside the report


def token_view(out: Path, runs: list) -> dict:
    """The token view the page links to: ``{"link": ...}`` when ``out``'s sibling ``tokens/`` holds one
    (``eslm tokens``' index.html and tokens.json), else ``{"command": ...}``, the command that makes it from the
    last checkpoint of a run that selects tokens (one that logs alpha), placeholders where none is known."""
    where = Path(out).resolve().parent / TOKEN_VIEW_DIR
    if (where / "index.html").is_file() and (where / "tokens.json").is_file():
        return {"link": f"../{TOKEN_VIEW_DIR}/index.html"}
    checkpoint, data = "RUN_DIR/checkpoints/step_NNNNNNN.pt", "--data DATA_DIR"
    for r in runs:
        found = sorted((r.path / "checkpoints").glob("step_*.pt")) if any(M.ALPHA in rec for rec in r.train) else []
        if found:
            checkpoint = str(found[-1])
            d = config_get(r.config, "data.dir")
            data = f"--data {d}" if d else "--text FILE"
            break
    return {"command": f"eslm tokens {checkpoint} {data} --out {where}"}


def build_report(run_dirs: list[str], out_dir: str | Path, *, target_loss: float | None = None,
                 flops: str = "paper", baseline: str | None = None, where: str = "--",
                 primary: list[str] | None = None, equivalence_margin: float | None = None,
                 study: str | None = None) -> dict:
    """Read the runs, write ``out_dir``/index.html, the PNGs and summary.json; return the summary. Errors name
    the options as ``{where}baseline`` etc. (``--`` on the command line, ``report.`` in a study file);
    ``equivalence_margin``: the primary comparison's pre-registered margin in nats (TOST)."""
    if primary is not None and (len(primary) != 2 or primary[0] == primary[1]):
        raise ReportError(f"expected {where}primary to name two different groups, found {list(primary)!r}; "
                          "give the group and the one it is compared with, e.g. eslm-entropy random")
    if flops not in FLOPS_KEYS:
        raise ReportError(f"expected {where}flops in {sorted(FLOPS_KEYS)}, found {flops!r}; pick one of them")
    if target_loss is not None and target_loss != "baseline" and not (is_number(target_loss) and target_loss > 0):
        raise ReportError(f"expected a positive {where}target or 'baseline', found {target_loss!r}; "
                          "give a validation loss such as 3.5")
    if equivalence_margin is not None and not (is_number(equivalence_margin) and equivalence_margin > 0):
        raise ReportError(f"expected a positive {where}equivalence_margin (nats), found {equivalence_margin!r}")
    if equivalence_margin is not None and primary is None:
        raise ReportError(f"{where}equivalence_margin applies to the primary comparison; name it with {where}primary")
    check_report_dir(Path(out_dir))  # before the runs are read: a directory it would refuse to replace
    runs, skipped, warnings = load_runs(run_dirs)
    groups = group_runs(runs)
    for removed, kept in one_run_per_seed(groups):  # a seed counts once in its group
        runs.remove(removed)
        skipped.append({"path": str(removed.path), "reason": f"repeats seed {removed.seed} of its group "
                        f"(read from {kept.path})"})
        warnings.append(f"{removed.path}: repeats seed {removed.seed} of its group, already read from {kept.path} "
                        "(the same settings and seed: a copied run, or two studies of the same settings); left "
                        "out so that no seed counts twice: pass one directory per seed to choose")
    if (why := comparable_sets_problem(groups)) is not None:
        raise ReportError(why)
    if target_loss == "baseline":
        base, why = find_baseline(groups, baseline, where)
        if base is None:
            raise ReportError(f"expected a baseline group for {where}target baseline, found none ({why})")
        target = max(v for r in base.runs if is_number(v := best_val_loss(r)))
        source = (f"the loss every seed of the baseline group {base.label} reaches: max over its seeds of the "
                  "best validation loss")
    elif target_loss is not None:
        target, source = float(target_loss), "given"
    else:
        target = max(best_val_loss(r) for r in runs)
        source = "the lowest loss every run reaches: max over runs of min val_loss"
    summary = summarize(runs, groups, target=target, target_source=source, flops=flops,
                        skipped=skipped, warnings=warnings, baseline=baseline, where=where, primary=primary,
                        margin=equivalence_margin, study=study)
    summary["token_view"] = token_view(Path(out_dir), runs)
    replace_dir(Path(out_dir), lambda out: _write(out, groups, summary), what=WHAT, is_ours=is_report_dir,
                earlier=EARLIER)
    return summary


def _write(out: Path, groups, summary: dict) -> None:
    if figures.available():
        written = make_figures(out, groups, summary)
    else:  # the numbers and tables do not need matplotlib: write them, say why the figures are missing
        written = {}
        summary["warnings"].append("figures skipped: matplotlib is not installed; fix: pip install 'eslm[plot]' "
                                   "and run eslm report again")
    summary["figures"] = written
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "index.html").write_text(render_html(summary, written), encoding="utf-8")
    (out / "summary.md").write_text(render_markdown(summary), encoding="utf-8")
