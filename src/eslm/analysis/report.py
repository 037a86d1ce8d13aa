"""``eslm report RUN_DIR ... --out DIR``: a static, offline HTML page of figures and tables, plus summary.json.

Reads only run directories (``eslm.analysis.rundir``). What it computes:

* Seed groups: runs whose resolved configs are equal except for run.name / run.seed / run.out_dir /
  run.resume are one group, drawn as the mean curve with a min..max band over seeds. Curves of a group
  are aligned on the eval steps that every seed has.
* Target loss: ``--target-loss`` if given, else the lowest validation loss that every run reaches, i.e.
  ``max over runs of (min over that run's eval points of val_loss)``.
* FLOPs / time / tokens to target (per run): the first eval point with ``val_loss <= target``. Between that
  point (x1, L1) and the eval point before it (x0, L0 > target) the crossing is interpolated linearly in
  log(x): ``log x* = log x0 + (L0 - target) / (L0 - L1) * (log x1 - log x0)`` (linearly in x when x0 <= 0).
  If the first eval point is already at or below the target, x* is its x. A run that never reaches the
  target has no value ("not reached"), never zero. Group values are the mean (and min..max) over the seeds
  that reached it, with the count "k/n reached".
"""

from __future__ import annotations

import html
import json
import math
import statistics
import sys
from pathlib import Path

from eslm import metrics as M
from eslm.analysis import figures
from eslm.analysis.rundir import IGNORED_FOR_GROUPING, Group, Run, RunDirError, group_runs, is_number, load_run
from eslm.errors import ESLMError

FLOPS_KEYS = {"paper": M.FLOPS_PAPER, "executed": M.FLOPS_EXECUTED}
REPORT_FORMAT = "eslm-report-v1"
INTERPOLATION_NOTE = ("first eval point with val_loss <= target; the crossing between it and the previous eval "
                      "point is interpolated linearly in log(x) (linearly in x if the previous x is 0); "
                      "never reached = null")


class ReportError(ESLMError):
    """Nothing to report on, or report options that cannot be honoured."""


# ---------------------------------------------------------------- CLI


def add_arguments(parser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (runs/<name>)")
    parser.add_argument("--out", required=True, help="output directory for index.html, PNGs and summary.json")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="validation loss target for the to-target charts (default: the best loss all runs reach)")
    parser.add_argument("--flops", choices=sorted(FLOPS_KEYS), default="paper",
                        help="FLOPs convention: paper (backward scaled by kept fraction) or executed")


def run(args) -> int:
    summary = build_report(args.run_dirs, args.out, target_loss=args.target_loss, flops=args.flops)
    for w in summary["warnings"]:
        print(f"eslm report: warning: {w}", file=sys.stderr)
    print(f"wrote {Path(args.out) / 'index.html'} ({len(summary['groups'])} groups, {len(summary['runs'])} runs)")
    return 0


# ---------------------------------------------------------------- numbers


def series(records: list[dict], x_key: str, y_key: str) -> tuple[list, list, list]:
    """(steps, xs, ys) of the records that have numeric x and y."""
    pts = [(r[M.STEP], r[x_key], r[y_key]) for r in records if is_number(r.get(x_key)) and is_number(r.get(y_key))]
    return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]


def crossing(xs: list[float], ys: list[float], target: float) -> float | None:
    """x at which the curve first reaches ``y <= target`` (interpolated in log x), or None if never."""
    for i, (x1, y1) in enumerate(zip(xs, ys)):
        if y1 > target:
            continue
        if i == 0:
            return float(x1)
        x0, y0 = xs[i - 1], ys[i - 1]
        t = (y0 - target) / (y0 - y1)
        if x0 > 0 and x1 > 0:
            return float(math.exp(math.log(x0) + t * (math.log(x1) - math.log(x0))))
        return float(x0 + t * (x1 - x0))
    return None


def default_target(runs: list[Run]) -> float:
    """The best (lowest) validation loss every run reaches: max over runs of each run's min val_loss."""
    mins = [min(series(r.eval, M.STEP, M.VAL_LOSS)[2]) for r in runs]
    return max(mins)


def aggregate(values: list) -> dict:
    """mean / min / max / std over the numeric values (None entries ignored), with counts."""
    nums = [float(v) for v in values if is_number(v)]
    out = {"n": len(values), "count": len(nums), "mean": None, "min": None, "max": None, "std": None}
    if nums:
        out.update(mean=statistics.fmean(nums), min=min(nums), max=max(nums),
                   std=statistics.stdev(nums) if len(nums) > 1 else 0.0)
    return out


def group_curve(group: Group, records_of, x_key: str, y_key: str) -> dict | None:
    """Mean curve and min..max band of a group, on the steps that every seed has (x = mean x at that step)."""
    per_run = []
    for r in group.runs:
        steps, xs, ys = series(records_of(r), x_key, y_key)
        per_run.append({s: (x, y) for s, x, y in zip(steps, xs, ys)})
    common = sorted(set.intersection(*(set(d) for d in per_run))) if per_run else []
    if not common:
        return None
    pick = lambda s, j: [d[s][j] for d in per_run]  # noqa: E731
    return {"label": group.label, "n": len(per_run), "x": [statistics.fmean(pick(s, 0)) for s in common],
            "mean": [statistics.fmean(pick(s, 1)) for s in common],
            "lo": [min(pick(s, 1)) for s in common], "hi": [max(pick(s, 1)) for s in common]}


def to_target(group: Group, x_key: str, target: float) -> dict:
    """Per-run crossing values and their aggregate (``reached`` = how many seeds reached the target)."""
    per_run = {}
    for r in group.runs:
        _, xs, ys = series(r.eval, x_key, M.VAL_LOSS)
        per_run[r.name] = crossing(xs, ys, target)
    agg = aggregate(list(per_run.values()))
    return {"per_run": per_run, "reached": agg.pop("count"), **agg}


def domains_of(runs: list[Run]) -> list[str]:
    """Domain names that appear in any eval line as val_loss/<domain>, in first-seen order."""
    seen: dict[str, None] = {}
    for r in runs:
        for rec in r.eval:
            for k in rec:
                if k.startswith(M.VAL_LOSS_DOMAIN_PREFIX):
                    seen.setdefault(k[len(M.VAL_LOSS_DOMAIN_PREFIX):], None)
    return list(seen)


def last_value(records: list[dict], key: str):
    """The value of ``key`` in the last record that has it (None if none)."""
    for rec in reversed(records):
        if is_number(rec.get(key)):
            return rec[key]
    return None


def group_final(group: Group, domains: list[str]) -> dict:
    """Final and best validation losses, final counters, per-domain final losses: aggregated over seeds."""
    runs = group.runs
    out = {
        "final_val_loss": aggregate([last_value(r.eval, M.VAL_LOSS) for r in runs]),
        "best_val_loss": aggregate([min(series(r.eval, M.STEP, M.VAL_LOSS)[2]) for r in runs]),
        "final_val_loss_domain": {d: aggregate([last_value(r.eval, M.val_loss_key(d)) for r in runs])
                                  for d in domains},
    }
    for key in (M.STEP, M.TOKENS_SEEN, M.FLOPS_PAPER, M.FLOPS_EXECUTED, M.ELAPSED_S):
        out["final_" + key] = aggregate([last_value(r.eval, key) for r in runs])
    return out


# ---------------------------------------------------------------- downstream


PERCENT_METRICS = ("acc", "exact_match", "em", "f1")


def is_percent(metric: str) -> bool:
    """Accuracy-like metrics (shown x100 in the table); perplexities etc. are shown as they are."""
    return str(metric).split(",")[0].startswith(PERCENT_METRICS)


def run_downstream(run: Run) -> dict:
    """task -> {metric, value, stderr, num_fewshot} of the run's latest downstream result file."""
    if not run.downstream:
        return {}
    out = {}
    for task, res in run.downstream[-1]["results"].items():
        if isinstance(res, dict) and is_number(res.get("value")):
            out[task] = {"metric": res.get("metric", "?"), "value": float(res["value"]),
                         "stderr": float(res["stderr"]) if is_number(res.get("stderr")) else None,
                         "num_fewshot": res.get("num_fewshot")}
    return out


def group_downstream(group: Group) -> dict:
    """task -> mean value over the seeds that have it; stderr = sqrt(sum stderr_i^2) / k (mean of k
    independent estimates); min/max over seeds."""
    per_run = [run_downstream(r) for r in group.runs]
    tasks = sorted(set().union(*per_run)) if per_run else []
    out = {}
    for t in tasks:
        rows = [d[t] for d in per_run if t in d]
        errs = [r["stderr"] for r in rows]
        se = math.sqrt(sum(e * e for e in errs)) / len(rows) if all(e is not None for e in errs) else None
        vals = [r["value"] for r in rows]
        out[t] = {"metric": rows[0]["metric"], "num_fewshot": rows[0]["num_fewshot"], "k": len(rows),
                  "value": statistics.fmean(vals), "stderr": se, "min": min(vals), "max": max(vals)}
    return out


# ---------------------------------------------------------------- loading


def load_runs(paths: list[str]) -> tuple[list[Run], list[dict], list[str]]:
    """Load every path; runs without eval lines are skipped with a warning (an error if none is left)."""
    runs, skipped, warnings = [], [], []
    for p in paths:
        r = load_run(p)
        warnings.extend(r.warnings)
        if not series(r.eval, M.STEP, M.VAL_LOSS)[0]:
            skipped.append({"path": str(p), "reason": "no eval lines with val_loss"})
            warnings.append(f"{p}: no eval lines with val_loss; skipped")
            continue
        runs.append(r)
    if not runs:
        raise ReportError(f"expected at least one run with eval lines (val_loss) among {len(paths)} run "
                          "directories, found none; train longer or lower eval.interval")
    names = [r.name for r in runs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise RunDirError(f"expected distinct run names, found {dup[0]!r} more than once; pass each run once")
    return runs, skipped, warnings


# ---------------------------------------------------------------- summary


def summarize(runs: list[Run], groups: list[Group], *, target: float, target_source: str,
              flops: str, skipped: list[dict], warnings: list[str]) -> dict:
    """The machine-readable summary written as summary.json."""
    flops_key = FLOPS_KEYS[flops]
    domains = domains_of(runs)
    group_of = {id(r): g.label for g in groups for r in g.runs}
    gs = []
    for g in groups:
        gs.append({
            "label": g.label, "method": g.method, "settings": g.settings,
            "runs": [r.name for r in g.runs], "seeds": [r.seed for r in g.runs],
            "unfinished": [r.name for r in g.runs if not r.finished],
            "to_target": {"flops": to_target(g, flops_key, target), "time_s": to_target(g, M.ELAPSED_S, target),
                          "tokens": to_target(g, M.TOKENS_SEEN, target)},
            **group_final(g, domains),
            "downstream": group_downstream(g),
        })
    return {
        "format": REPORT_FORMAT, "flops_convention": flops, "flops_key": flops_key,
        "target_loss": target, "target_source": target_source, "interpolation": INTERPOLATION_NOTE,
        "grouping": "same resolved config except " + ", ".join(IGNORED_FOR_GROUPING),
        "domains": domains, "groups": gs,
        "runs": [{"name": r.name, "path": str(r.path), "method": r.method, "seed": r.seed,
                  "group": group_of[id(r)], "finished": r.finished, "git_commit": r.env.get("git_commit"), "device": r.env.get("device")}
                 for r in runs],
        "skipped": skipped, "warnings": warnings,
    }


# ---------------------------------------------------------------- figures


def _curve_set(groups, records_of, x_key, y_key) -> list[dict]:
    return [c for g in groups if (c := group_curve(g, records_of, x_key, y_key)) is not None]


def _bars(summary: dict, what: str) -> list[dict]:
    out = []
    for g in summary["groups"]:
        t = g["to_target"][what]
        out.append({"label": g["label"], "mean": t["mean"], "lo": t["min"], "hi": t["max"],
                    "reached": t["reached"], "n": t["n"]})
    return out


def make_figures(out: Path, groups: list[Group], summary: dict) -> dict[str, str]:
    """Write every PNG; returns {figure id: file name} of those written."""
    colors = figures.color_map([g.label for g in groups])
    flops_key, target, flops = summary["flops_key"], summary["target_loss"], summary["flops_convention"]
    ev = lambda r: r.eval  # noqa: E731
    written = {}
    axes = [("loss_vs_flops", flops_key, f"training FLOPs ({flops} convention)", True),
            ("loss_vs_tokens", M.TOKENS_SEEN, "tokens seen", True),
            ("loss_vs_time", M.ELAPSED_S, "wall-clock training time (s)", False)]
    for fig_id, x_key, xlabel, logx in axes:
        s = _curve_set(groups, ev, x_key, M.VAL_LOSS)
        if s:
            figures.curves(out / f"{fig_id}.png", s, colors, xlabel=xlabel, ylabel="validation loss",
                           title=f"Validation loss vs {xlabel.split(' (')[0]}", logx=logx, logy=True, hline=target)
            written[fig_id] = f"{fig_id}.png"
    for fig_id, what, ylabel in (("flops_to_target", "flops", f"FLOPs ({flops} convention)"),
                                 ("time_to_target", "time_s", "wall-clock training time (s)")):
        figures.target_bars(out / f"{fig_id}.png", _bars(summary, what), colors, ylabel=ylabel,
                            title=f"{ylabel.split(' (')[0]} to reach validation loss {target:.4g}")
        written[fig_id] = f"{fig_id}.png"
    written.update(_domain_figures(out, groups, summary, colors))
    written.update(_selection_figure(out, groups, colors))
    return written


def _min_max(a: dict):
    """(min, max) of an aggregate over several seeds, else None (no whisker for a single run)."""
    return (a["min"], a["max"]) if a["count"] > 1 else None


def _domain_figures(out: Path, groups, summary, colors) -> dict[str, str]:
    domains = summary["domains"]
    if not domains:
        return {}
    values = {g["label"]: [g["final_val_loss_domain"][d]["mean"] for d in domains] for g in summary["groups"]}
    spread = {g["label"]: [_min_max(g["final_val_loss_domain"][d]) for d in domains] for g in summary["groups"]}
    figures.category_points(out / "domain_final.png", domains, values, colors, spread=spread,
                            ylabel="final validation loss", title="Final validation loss per domain (own y range each)")
    ev = lambda r: r.eval  # noqa: E731
    panel = {d: _curve_set(groups, ev, summary["flops_key"], M.val_loss_key(d)) for d in domains}
    figures.panels(out / "domain_curves.png", panel, colors, xlabel=f"FLOPs ({summary['flops_convention']})",
                   ylabel="val loss", title="Validation loss per domain vs FLOPs", logx=True, logy=True)
    return {"domain_final": "domain_final.png", "domain_curves": "domain_curves.png"}


def _train_domains(runs: list[Run]) -> list[str]:
    """Domains with a kept_frac/<domain> metric in any train line, first seen first."""
    seen: dict[str, None] = {}
    for r in runs:
        for rec in r.train:
            for k in rec:
                if k.startswith(M.KEPT_FRAC_DOMAIN_PREFIX):
                    seen.setdefault(k[len(M.KEPT_FRAC_DOMAIN_PREFIX):], None)
    return list(seen)


def _selection_figure(out: Path, groups, colors) -> dict[str, str]:
    tr = lambda r: r.train  # noqa: E731
    keys = [("kept fraction", M.KEPT_FRAC), ("alpha", M.ALPHA)]
    keys += [(f"kept fraction: {d}", M.kept_frac_key(d)) for d in _train_domains([r for g in groups for r in g.runs])]
    panel = {name: _curve_set(groups, tr, M.STEP, key) for name, key in keys}
    panel = {k: v for k, v in panel.items() if v}
    if not panel:
        return {}
    figures.panels(out / "selection.png", panel, colors, xlabel="optimizer step", ylabel="value",
                   title="Token selection over training (selective methods)", logx=False, logy=False,
                   ylim=(0.0, 1.02))
    return {"selection": "selection.png"}


# ---------------------------------------------------------------- HTML


CSS = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #eee}
.note{color:#555;font-size:0.9em}.warn{color:#a40}code{background:#f5f5f5;padding:0 3px}"""


def _fmt(v, spec=".4g") -> str:
    return "—" if v is None else format(v, spec)


def _agg_cell(a: dict, spec=".4g") -> str:
    if a["count"] == 0:
        return "—"
    s = _fmt(a["mean"], spec)
    if a["count"] > 1:
        s += f" [{_fmt(a['min'], spec)}, {_fmt(a['max'], spec)}]"
    return s


def _target_cell(t: dict, spec=".3g") -> str:
    if t["reached"] == 0:
        return "not reached"
    s = _agg_cell({**t, "count": t["reached"]}, spec)
    return s if t["reached"] == t["n"] else f"{s} ({t['reached']}/{t['n']} reached)"


def _table(header: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _summary_table(summary: dict) -> str:
    rows = []
    for g in summary["groups"]:
        tt = g["to_target"]
        label = html.escape(g["label"])
        if g["unfinished"]:
            label += f" <small class='warn'>({len(g['unfinished'])}/{len(g['runs'])} unfinished)</small>"
        rows.append([label, str(len(g["runs"])), _agg_cell(g["final_val_loss"]),
                     _agg_cell(g["best_val_loss"]), _target_cell(tt["flops"]), _target_cell(tt["time_s"]),
                     _target_cell(tt["tokens"]), _agg_cell(g["final_" + summary["flops_key"]], ".3g")])
    return _table(["group", "seeds", "final val loss", "best val loss", "FLOPs to target", "time to target (s)",
                   "tokens to target", "final FLOPs"], rows)


def _groups_table(summary: dict) -> str:
    rows = [[html.escape(g["label"]), html.escape(g["method"]),
             html.escape(", ".join(f"{k}={v}" for k, v in g["settings"].items()) or "—"),
             html.escape(", ".join(g["runs"])), html.escape(", ".join(str(s) for s in g["seeds"]))]
            for g in summary["groups"]]
    return _table(["group", "method", "settings that differ", "runs", "seeds"], rows)


def _downstream_cell(d: dict | None) -> str:
    if d is None:
        return "—"
    k = 100.0 if is_percent(d["metric"]) else 1.0
    s = f"{d['value'] * k:.1f}" if k == 100.0 else f"{d['value']:.4g}"
    if d["stderr"] is not None:
        s += f" ± {d['stderr'] * k:.1f}" if k == 100.0 else f" ± {d['stderr']:.2g}"
    return s + (f" <small>(n={d['k']})</small>" if d["k"] > 1 else "")


def _downstream_table(summary: dict) -> str:
    tasks = sorted(set().union(*(g["downstream"] for g in summary["groups"])))
    if not tasks:
        return "<p class='note'>No downstream results (run <code>eslm eval RUN_DIR</code> to add them).</p>"
    meta = {}
    for g in summary["groups"]:
        for t, d in g["downstream"].items():
            meta.setdefault(t, f"{t}<br><small>{html.escape(str(d['metric']))}, {d['num_fewshot']}-shot</small>")
    rows = []
    for g in summary["groups"]:
        cells = [_downstream_cell(g["downstream"].get(t)) for t in tasks]
        pct = [g["downstream"][t]["value"] * 100 for t in tasks
               if t in g["downstream"] and is_percent(g["downstream"][t]["metric"])]
        avg = f"{statistics.fmean(pct):.1f}" if pct and len(pct) == len(tasks) else "—"
        rows.append([html.escape(g["label"])] + cells + [avg])
    head = "".join(f"<th>{meta[t]}</th>" for t in tasks)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr><th>group</th>{head}<th>avg</th></tr>{body}</table>"


def _img(written: dict, fig_id: str, alt: str) -> str:
    if fig_id not in written:
        return f"<p class='note'>({html.escape(alt)}: no data)</p>"
    return f"<p><img src='{written[fig_id]}' alt='{html.escape(alt)}'></p>"


def render_html(summary: dict, written: dict) -> str:
    """The whole page: no external resources, images by relative file name."""
    s = summary
    warn = "".join(f"<li class='warn'>{html.escape(w)}</li>" for w in s["warnings"])
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>eslm report</title><style>{CSS}</style></head><body>",
        "<h1>eslm report</h1>",
        f"<p>{len(s['runs'])} runs in {len(s['groups'])} groups. FLOPs convention: <b>{s['flops_convention']}</b> "
        f"(<code>{s['flops_key']}</code>). Target validation loss: <b>{s['target_loss']:.4g}</b> "
        f"({html.escape(s['target_source'])}).</p>",
        f"<ul>{warn}</ul>" if warn else "",
        "<h2>Summary</h2>", _summary_table(s),
        "<p class='note'>Values are the mean over the seeds of a group; [min, max] over seeds in brackets. "
        f"To-target values: {html.escape(s['interpolation'])}. A group mean covers only the seeds that reached "
        "the target. Time is training wall-clock (elapsed_s), evaluation excluded.</p>",
        "<h2>Groups</h2>",
        f"<p class='note'>Runs are grouped when their resolved config.yaml files are identical except for "
        f"{', '.join('<code>' + k + '</code>' for k in IGNORED_FOR_GROUPING)}; a group is drawn as the mean "
        "curve over its seeds with a shaded min–max band, on the eval steps every seed has.</p>",
        _groups_table(s),
        "<h2>Validation loss</h2>", _img(written, "loss_vs_flops", "validation loss vs FLOPs (log-log)"),
        _img(written, "loss_vs_tokens", "validation loss vs tokens"),
        _img(written, "loss_vs_time", "validation loss vs wall-clock"),
        "<h2>Cost to reach the target loss</h2>", _img(written, "flops_to_target", "FLOPs to target"),
        _img(written, "time_to_target", "time to target"),
        "<h2>Per-domain validation loss</h2>", _img(written, "domain_final", "final loss per domain"),
        _img(written, "domain_curves", "per-domain curves"),
        "<h2>Token selection</h2>", _img(written, "selection", "kept fraction and alpha over training"),
        "<h2>Downstream accuracy</h2>", _downstream_table(s),
        "<p class='note'>Latest <code>eval/*.json</code> of each run; accuracy-like metrics x100, ± the "
        "harness standard error (for several seeds: mean over seeds, ± sqrt(sum of squared stderrs)/n).</p>",
        _skipped_html(s), "</body></html>",
    ]
    return "\n".join(p for p in parts if p)


def _skipped_html(s: dict) -> str:
    if not s["skipped"]:
        return ""
    items = "".join(f"<li>{html.escape(x['path'])}: {html.escape(x['reason'])}</li>" for x in s["skipped"])
    return f"<h2>Skipped</h2><ul>{items}</ul>"


# ---------------------------------------------------------------- entry point


def build_report(run_dirs: list[str], out_dir: str | Path, *, target_loss: float | None = None,
                 flops: str = "paper") -> dict:
    """Read the runs, write ``out_dir``/index.html, the PNGs and summary.json; return the summary."""
    if flops not in FLOPS_KEYS:
        raise ReportError(f"expected --flops in {sorted(FLOPS_KEYS)}, found {flops!r}; pick one of them")
    if target_loss is not None and not (is_number(target_loss) and target_loss > 0):
        raise ReportError(f"expected a positive --target-loss, found {target_loss}; pass e.g. --target-loss 3.5")
    runs, skipped, warnings = load_runs(run_dirs)
    groups = group_runs(runs)
    target = target_loss if target_loss is not None else default_target(runs)
    source = "given" if target_loss is not None else "the lowest loss every run reaches: max over runs of min val_loss"
    summary = summarize(runs, groups, target=target, target_source=source, flops=flops,
                        skipped=skipped, warnings=warnings)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if figures.available():
        written = make_figures(out, groups, summary)
    else:  # the numbers and tables do not need matplotlib: write them, say why the figures are missing
        written = {}
        summary["warnings"].append("figures skipped: matplotlib is not installed; fix: pip install 'eslm[plot]' "
                                   "and run eslm report again")
    summary["figures"] = written
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "index.html").write_text(render_html(summary, written), encoding="utf-8")
    return summary
