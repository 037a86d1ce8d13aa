"""index.html of ``eslm report``: one static page, no external resources, images by relative file name."""

from __future__ import annotations

import html
import statistics

from eslm import metrics as M
from eslm.analysis import stats as S
from eslm.analysis.report.downstream import is_percent
from eslm.analysis.report import figure_table
from eslm.analysis.report.markdown import one_seed, since_branch_lines, spread_lines
from eslm.analysis.report.summary import COSTS
from eslm.analysis.rundir import IGNORED_FOR_GROUPING

CSS = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #eee}
.note{color:#555;font-size:0.9em}.warn{color:#a40}code{background:#f5f5f5;padding:0 3px}"""


def _fmt(v, spec=".4g") -> str:
    return "—" if v is None else format(v, spec)


def _agg_cell(a: dict, spec=".4g", single: bool = False) -> str:
    """'mean ± 95% half-width (n=k)', or 'mean (n=1, no interval)'; just the mean when ``single`` (a one-seed
    report says once, above its tables, that nothing has an interval)."""
    if a["count"] == 0:
        return "—"
    s = _fmt(a["mean"], spec)
    if a["count"] > 1 and a.get("ci_half_width") is not None:
        return s + f" ± {_fmt(a['ci_half_width'], spec)} <small>(n={a['count']})</small>"
    return s if single else s + " <small>(n=1, no interval)</small>"


ONE_SEED_NOTE = ("<p class='note warn'>One seed per group: no number below has an interval, and a difference "
                 "between groups is not evidence of an effect; run more seeds (eslm study ... --seeds N).</p>")


def _target_cell(t: dict, spec=".3g", single: bool = False) -> str:
    if t["reached"] == 0:
        return "not reached"
    s = _agg_cell({**t, "count": t["reached"]}, spec, single)
    return s if t["reached"] == t["n"] else f"{s} ({t['reached']}/{t['n']} reached)"


def _table(header: list[str], rows: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _label(g: dict) -> str:
    label = html.escape(g["label"])
    if g["unfinished"]:
        label += f" <small class='warn'>({len(g['unfinished'])}/{len(g['runs'])} unfinished)</small>"
    return label


def _label_of(summary: dict, label: str) -> str:
    """``_label`` of the group called ``label`` (comparisons name their groups by label)."""
    return next((_label(g) for g in summary["groups"] if g["label"] == label), html.escape(label))


def _summary_table(summary: dict) -> str:
    return _table(*_summary_rows(summary))


def _summary_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    rows = []
    one = one_seed(summary)
    for g in summary["groups"]:
        rows.append([_label(g), str(len(g["runs"]))]
                    + [_agg_cell(g[key], spec, one) for key, spec in (
                        ("final_val_loss", ".4f"), ("equal_tokens_val_loss", ".4f"), ("best_val_loss", ".4f"),
                        ("final_" + M.STEP, ".4g"), ("final_" + M.FLOPS_PAPER, ".3g"),
                        ("final_" + M.FLOPS_EXECUTED, ".3g"), ("step_cost_vs_clm", ".3f"),
                        ("final_" + summary["time_key"], ".3g"))])
    time_head = "CPU s" if summary["time_key"] == M.CPU_S else "wall-clock s"
    equal = f"val loss at {summary['baseline']}'s last eval (equal tokens)" if summary["baseline"] else \
        "val loss at the baseline's last eval"
    return (["group", "seeds", "final val loss", equal, "best val loss", "steps", M.FLOPS_PAPER,
             M.FLOPS_EXECUTED, "executed per step / CLM step", time_head], rows)


def _censored_cell(t: dict, spec=".3g") -> str:
    """The mean with every seed, a seed that never reached the target at its budget (a lower bound)."""
    if not t["censored"]:
        return "—"
    a = t["with_censored"]
    return f"≥ {_fmt(a['mean'], spec)} <small>({len(t['censored'])}/{t['n']} censored)</small>"


def _costs_table(summary: dict) -> str:
    return _table(*_costs_rows(summary))


def _costs_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """To-target costs in both FLOPs conventions, tokens and time, side by side; with censored seeds, the
    paper-FLOPs mean that counts them at their budget."""
    one = one_seed(summary)
    rows = [[_label(g)] + [_target_cell(g["to_target"][k], single=one) for k in COSTS]
            + [_censored_cell(g["to_target"][M.FLOPS_PAPER])] for g in summary["groups"]]
    time_head = "CPU s" if summary["time_key"] == M.CPU_S else "wall-clock s"
    return (["group", "flops_paper to target", "flops_executed to target", "tokens to target",
             f"{time_head} to target", "flops_paper, censored seeds at their budget"], rows)


def _comparison_table(summary: dict, comparisons: list[dict]) -> str:
    return _table(*_comparison_rows(summary, comparisons))


def _comparison_rows(summary: dict, comparisons: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Paired differences per group: final loss (nats) and relative to-target costs, with 95% intervals."""
    def cell(ci, rel):
        if ci["n"] == 0:
            return "—"
        spec = "+.1%" if rel else "+.4f"
        mark = {-1: " ▼", 1: " ▲", 0: ""}[S.significant(ci)]
        if ci["lo"] is None:
            return f"{ci['mean']:{spec}} <small>(n=1)</small>"
        return f"{ci['mean']:{spec}} [{ci['lo']:{spec}}, {ci['hi']:{spec}}]{mark} <small>(n={ci['n']})</small>"

    rows = [[_label_of(summary, c["group"]), _label_of(summary, c["against"]),
             cell(c["losses"]["final validation loss"], False), cell(c["losses"]["equal-token validation loss"], False)]
            + [cell(c["to_target"][k], True) for k in COSTS] for c in comparisons]
    return (["group", "vs", "Δ final val loss (nats)", "Δ equal-token val loss", "Δ flops_paper",
             "Δ flops_executed", "Δ tokens", "Δ time"], rows)


def _primary_html(summary: dict) -> str:
    """The pre-registered comparison, first on the page."""
    p = summary.get("primary")
    if not p:
        return ""
    return (f"<h2>Primary comparison</h2><p><b>{html.escape(p['primary_verdict'])}</b></p>"
            "<p class='note'>Named before the runs (the study's <code>report.primary</code>, or "
            "<code>--primary</code>): its final validation loss is read on its own at 5%; every other verdict "
            f"below is Holm-adjusted over the {summary['holm_family']} comparisons of this report.</p>")


def _verdicts_html(summary: dict) -> str:
    parts = []
    if summary["baseline"] is None and not summary.get("primary"):
        return "<p class='warn'>No baseline group: no paired comparisons.</p>"
    for title, comps in (("Against the baseline", summary["comparisons"]),
                         ("Against the random-drop control at the same alpha", summary["controls"])):
        if not comps:
            continue
        items = "".join(f"<li><b>{html.escape(c['group'])}</b> vs {html.escape(c['against'])}: "
                        + "; ".join(html.escape(v) for v in c["verdicts"]) + "</li>" for c in comps)
        parts.append(f"<h3>{title}</h3><ul>{items}</ul>")
    if summary["flops_gaps"]:
        parts.append("<h3>The two FLOPs conventions</h3><ul>"
                     + "".join(f"<li>{html.escape(x)}.</li>" for x in summary["flops_gaps"]) + "</ul>"
                     "<p class='note'>The paper counts the backward pass on kept tokens only; what was executed "
                     "includes the trunk backward of every token (attention mixes positions) and the head work "
                     "of the route taken (docs/flops.md).</p>")
    return "\n".join(parts)


def _groups_table(summary: dict) -> str:
    return _table(*_groups_rows(summary))


def _groups_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    rows = [[_label(g), html.escape(g["method"]),
             html.escape(", ".join(f"{k}={v}" for k, v in g["settings"].items()) or "—"),
             ", ".join(html.escape(r) + (" <small class='warn'>(unfinished)</small>" if r in g["unfinished"] else "")
                       for r in g["runs"]), html.escape(", ".join(str(s) for s in g["seeds"]))]
            for g in summary["groups"]]
    return ["group", "method", "settings that differ", "runs", "seeds"], rows


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
    meta: dict[str, str] = {}
    for g in summary["groups"]:
        for t, d in g["downstream"].items():
            meta.setdefault(t, f"{t}<br><small>{html.escape(str(d['metric']))}, {d['num_fewshot']}-shot</small>")
    rows = []
    for g in summary["groups"]:
        cells = [_downstream_cell(g["downstream"].get(t)) for t in tasks]
        pct = [g["downstream"][t]["value"] * 100 for t in tasks
               if t in g["downstream"] and is_percent(g["downstream"][t]["metric"])]
        avg = f"{statistics.fmean(pct):.1f}" if pct and len(pct) == len(tasks) else "—"
        rows.append([_label(g)] + cells + [avg])
    head = "".join(f"<th>{meta[t]}</th>" for t in tasks)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr><th>group</th>{head}<th>avg</th></tr>{body}</table>"


def _img(written: dict, fig_id: str, alt: str) -> str:
    if fig_id not in written:
        return f"<p class='note'>({html.escape(alt)}: no data)</p>"
    return f"<p><img src='{written[fig_id]}' alt='{html.escape(alt)}'></p>"


def _figures_html(written: dict) -> list[str]:
    """Every figure of ``FIGURES`` in its order, each run of figures of one section under its heading."""
    parts, section = [], None
    for fig in figure_table.FIGURES:
        if fig.section != section:
            section = fig.section
            parts.append(f"<h2>{html.escape(section)}</h2>")
        parts.append(_img(written, fig.id, fig.alt))
    return parts


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
        _primary_html(s),
        "<h2>Verdicts</h2>", _verdicts_html(s),
        "<p class='note'>Paired by seed: for one seed every run saw the same data order and started from the "
        "same weights. Intervals are 95% Student-t intervals of the mean paired difference over seeds; "
        f"a difference is shown when its Holm-adjusted p-value (over the {s['holm_family']} comparisons of this "
        "report, the primary one excepted) is below 5%; \"no difference detectable\" gives the smallest "
        "difference the comparison could have detected with 80% power (two-sided paired t test at 5%, from the "
        "observed spread). To-target costs are compared relative to the other group's (−10% = 10% less); a seed "
        "that never reached the target counts at its budget (censored, said in the verdict). The equal-token "
        "read-out is the loss at the baseline's last evaluation, where every run has seen the same tokens. "
        f"Learning-rate schedule: {html.escape(s['schedule'])}.</p>",
        "<h2>Summary</h2>", ONE_SEED_NOTE if one_seed(s) else "", _summary_table(s),
        "<p class='note'>Mean over the seeds of a group ± the half-width of its 95% Student-t interval. "
        "<i>Executed per step / CLM step</i>: flops_executed / flops_dense, what one step of the method executes "
        "in units of a plain CLM step on the same tokens (e.g. GREATS' scoring and gradient inner products).</p>",
        f"<h2>Cost to reach validation loss {s['target_loss']:.4g}</h2>", _costs_table(s),
        f"<p class='note'>To-target values: {html.escape(s['interpolation'])}. A group mean covers only the "
        "seeds that reached the target; the last column counts the others at their budget (their cost at their "
        f"last evaluation, so the mean is a lower bound). Time: {html.escape(s['time_words'])}.</p>",
        "<h2>Paired differences</h2>", _comparison_table(s, s["comparisons"] + s["controls"]),
        _markdown_table_html("Reproducibility across seeds", spread_lines(s),
                             "Between-seed standard deviation of each group's final validation loss with its "
                             "chi-squared 95% interval; its ratio to random's (same alpha) and CLM's with the "
                             "F interval; p (F): the F test of equal variances (ignores the pairing), p (paired): "
                             "the Pitman-Morgan test over the seeds both groups have."),
        _markdown_table_html("Costs from the branch point", since_branch_lines(s),
                             "A branched study: every run continues its seed's trunk at the branch point; costs "
                             "from there on beside the totals, which include the trunk's share."),
        "<p class='note'>▼ / ▲: below / above zero after Holm's adjustment (the primary comparison's final loss: "
        "its own 95% interval).</p>",
        "<h2>Groups</h2>",
        f"<p class='note'>Runs are grouped when their resolved config.yaml files are identical except for "
        f"{', '.join('<code>' + k + '</code>' for k in IGNORED_FOR_GROUPING)}; a group is drawn as the mean "
        "curve over its seeds with a shaded band (the 95% interval of the mean with 3 or more seeds, min–max "
        "with 2), on the eval steps every seed has.</p>",
        _groups_table(s),
        *_figures_html(written),
        "<h2>Downstream accuracy</h2>", _downstream_table(s),
        "<p class='note'>Latest <code>eval/*.json</code> of each run; accuracy-like metrics x100, ± the "
        "harness standard error (for several seeds: mean over seeds, ± sqrt(sum of squared stderrs)/n).</p>",
        _skipped_html(s), "</body></html>",
    ]
    return "\n".join(p for p in parts if p)


def _markdown_table_html(title: str, lines: list[str], note: str) -> str:
    """A table given as Markdown lines (header, rule, rows) as HTML, with its heading and note; "" if none."""
    if not lines:
        return ""

    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]

    return (f"<h2>{html.escape(title)}</h2>" + _table(cells(lines[0]), [[html.escape(c) for c in cells(x)] for x in lines[2:]])
            + f"<p class='note'>{html.escape(note)}</p>")


def _skipped_html(s: dict) -> str:
    if not s["skipped"]:
        return ""
    items = "".join(f"<li>{html.escape(x['path'])}: {html.escape(x['reason'])}</li>" for x in s["skipped"])
    return f"<h2>Skipped</h2><ul>{items}</ul>"


# ---------------------------------------------------------------- the page from its template


def _figures(written: dict) -> list[dict]:
    """Every figure of ``FIGURES`` in its order: {heading (its section, where one begins), alt, src or None}."""
    out, section = [], None
    for fig in figure_table.FIGURES:
        heading = fig.section if fig.section != section else None
        section = fig.section
        out.append({"heading": heading, "alt": fig.alt, "src": written.get(fig.id)})
    return out


def _downstream(summary: dict) -> tuple[list[str], list[list[str]]] | None:
    """The downstream table's header (HTML) and rows, or None without downstream results."""
    tasks = sorted(set().union(*(g["downstream"] for g in summary["groups"])))
    if not tasks:
        return None
    meta: dict[str, str] = {}
    for g in summary["groups"]:
        for t, d in g["downstream"].items():
            meta.setdefault(t, f"{t}<br><small>{html.escape(str(d['metric']))}, {d['num_fewshot']}-shot</small>")
    rows = []
    for g in summary["groups"]:
        cells = [_downstream_cell(g["downstream"].get(t)) for t in tasks]
        pct = [g["downstream"][t]["value"] * 100 for t in tasks
               if t in g["downstream"] and is_percent(g["downstream"][t]["metric"])]
        avg = f"{statistics.fmean(pct):.1f}" if pct and len(pct) == len(tasks) else "—"
        rows.append([_label(g)] + cells + [avg])
    return ["group"] + [meta[t] for t in tasks] + ["avg"], rows


def _extra_tables(s: dict) -> list[tuple[str, list[str], list[list[str]], str]]:
    """The tables given as Markdown lines (``spread_lines``, ``since_branch_lines``) that have rows:
    (title, header, escaped cells, note)."""
    def cells(line):
        return [c.strip() for c in line.strip().strip("|").split("|")]

    out = []
    for title, lines, note in (
            ("Reproducibility across seeds", spread_lines(s),
             "Between-seed standard deviation of each group's final validation loss with its chi-squared 95% "
             "interval; its ratio to random's (same alpha) and CLM's with the F interval; p (F): the F test of "
             "equal variances (ignores the pairing), p (paired): the Pitman-Morgan test over the seeds both groups "
             "have."),
            ("Costs from the branch point", since_branch_lines(s),
             "A branched study: every run continues its seed's trunk at the branch point; costs from there on "
             "beside the totals, which include the trunk's share.")):
        if lines:
            out.append((title, cells(lines[0]), [[html.escape(c) for c in cells(x)] for x in lines[2:]], note))
    return out


def render_html_from_template(summary: dict, written: dict) -> str:
    """The whole page from templates/index.html.j2 (jinja2, installed with torch): the layout and words live in
    the template, the formatted numbers come from the functions above."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("eslm.analysis.report", "templates"),
                             autoescape=False, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["esc"] = html.escape  # every text from the runs goes through it in the template
    s = summary
    return env.get_template("index.html.j2").render(
        css=CSS, s=s, one_seed=one_seed(s), ignored=IGNORED_FOR_GROUPING,
        verdicts=[("Against the baseline", s["comparisons"]),
                  ("Against the random-drop control at the same alpha", s["controls"])],
        summary_table=_summary_rows(s), costs_table=_costs_rows(s),
        comparison_table=_comparison_rows(s, s["comparisons"] + s["controls"]), groups_table=_groups_rows(s),
        extra_tables=_extra_tables(s), figures=_figures(written), downstream=_downstream(s))
