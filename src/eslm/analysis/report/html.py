"""index.html of ``eslm report``: the template ``templates/index.html.j2`` (layout, style and words; autoescaped)
filled with table cells formatted here. A cell is a string or a list of parts, each a string or a pair (kind,
text) with kind ``small``, ``warn`` or ``br``, which the template's ``cell`` macro turns into markup."""

from __future__ import annotations

import statistics

from eslm import metrics as M
from eslm.analysis.report import figure_table
from eslm.analysis.report.downstream import is_percent
from eslm.analysis.report.markdown import agg_cell, header_rows, paired_cell, since_branch_table, spread_table
from eslm.analysis.report.summary import COSTS, ONE_SEED_NOTE
from eslm.analysis.report.verdicts import verdict_table
from eslm.analysis.rundir import IGNORED_FOR_GROUPING, MAX_MESSAGE, shorten

Table = tuple[list, list[list]]  # (header cells, rows of cells); a cell: a text or a list of parts (above)


def _target_cell(t: dict, spec=".3g", single: bool = False):
    if t["reached"] == 0:
        return "not reached"
    s, part = agg_cell({**t, "count": t["reached"]}, spec, single), f" ({t['reached']}/{t['n']} reached)"
    return s if t["reached"] == t["n"] else ([s] if isinstance(s, str) else s) + [part]


def _label(g: dict):
    if g["unfinished"]:
        return [shorten(g["label"]) + " ", ("warn", f"({len(g['unfinished'])}/{len(g['runs'])} unfinished)")]
    return shorten(g["label"])


def _label_of(summary: dict, label: str):
    """``_label`` of the group called ``label`` (comparisons name their groups by label)."""
    return next((_label(g) for g in summary["groups"] if g["label"] == label), shorten(label))


def _summary_rows(summary: dict) -> Table:
    rows = []
    for g in summary["groups"]:
        rows.append([_label(g), str(len(g["runs"]))]
                    + [agg_cell(g[key], spec, summary["one_seed"]) for key, spec in (
                        ("final_val_loss", ".4f"), ("equal_tokens_val_loss", ".4f"), ("best_val_loss", ".4f"),
                        ("final_" + M.STEP, ".4g"), ("final_" + M.FLOPS_PAPER, ".3g"),
                        ("final_" + M.FLOPS_EXECUTED, ".3g"), ("step_cost_vs_clm", ".3f"),
                        ("final_" + summary["time_key"], ".3g"))])
    time_head = "CPU s" if summary["time_key"] == M.CPU_S else "wall-clock s"
    equal = f"val loss at {summary['baseline']}'s last eval (equal tokens)" if summary["baseline"] else \
        "val loss at the baseline's last eval"
    return (["group", "seeds", "final val loss", equal, "best val loss", "steps", M.FLOPS_PAPER,
             M.FLOPS_EXECUTED, "executed per step / CLM step", time_head], rows)


def _censored_cell(t: dict, spec=".3g"):
    """The mean with every seed, a seed that never reached the target at its budget (a lower bound)."""
    if not t["censored"]:
        return "—"
    a = t["with_censored"]
    return [f"≥ {format(a['mean'], spec)} ", ("small", f"({len(t['censored'])}/{t['n']} censored)")]


def _costs_rows(summary: dict) -> Table:
    """To-target costs in both FLOPs conventions, tokens and time, side by side; with censored seeds, the
    paper-FLOPs mean that counts them at their budget."""
    rows = [[_label(g)] + [_target_cell(g["to_target"][k], single=summary["one_seed"]) for k in COSTS]
            + [_censored_cell(g["to_target"][M.FLOPS_PAPER])] for g in summary["groups"]]
    time_head = "CPU s" if summary["time_key"] == M.CPU_S else "wall-clock s"
    return (["group", "flops_paper to target", "flops_executed to target", "tokens to target",
             f"{time_head} to target", "flops_paper, censored seeds at their budget"], rows)


def _comparison_rows(summary: dict, comparisons: list[dict]) -> Table:
    """Paired differences per group: final loss (nats) and relative to-target costs, with 95% intervals (a
    one-seed report: the means alone, the page says once that nothing has an interval; the number of pairs is
    the seeds per group of the header)."""
    def cell(ci, rel):
        return paired_cell(ci, rel, summary["one_seed"], (" ▼", " ▲"))

    rows = [[_label_of(summary, c["group"]), _label_of(summary, c["against"]),
             cell(c["losses"]["final validation loss"], False), cell(c["losses"]["equal-token validation loss"], False)]
            + [cell(c["to_target"][k], True) for k in COSTS] for c in comparisons]
    return (["group", "vs", "Δ final val loss (nats)", "Δ equal-token val loss", "Δ flops_paper",
             "Δ flops_executed", "Δ tokens", "Δ time"], rows)


def _groups_rows(summary: dict) -> Table:
    def runs(g):
        out: list = []
        for i, r in enumerate(g["runs"]):
            out += ([", "] if i else []) + [shorten(r)] + ([" ", ("warn", "(unfinished)")] if r in g["unfinished"]
                                                            else [])
        return out

    rows = [[_label(g), shorten(g["method"]),
             ", ".join(shorten(f"{k}={v}") for k, v in g["settings"].items()) or "—",
             runs(g), shorten(", ".join(str(s) for s in g["seeds"]))]
            for g in summary["groups"]]
    return ["group", "method", "settings that differ", "runs", "seeds"], rows


def _downstream_cell(d: dict | None, runs: int):
    """A task's value ± standard error; '(k of n seeds)' where fewer seeds than the group's have results."""
    if d is None:
        return "—"
    k = 100.0 if is_percent(d["metric"]) else 1.0
    s = f"{d['value'] * k:.1f}" if k == 100.0 else f"{d['value']:.4g}"
    if d["stderr"] is not None:
        s += f" ± {d['stderr'] * k:.1f}" if k == 100.0 else f" ± {d['stderr']:.2g}"
    return [s + " ", ("small", f"({d['k']} of {runs} seeds)")] if d["k"] != runs else s


# ---------------------------------------------------------------- the page from its template


def _downstream(summary: dict) -> Table | None:
    """The downstream table's header and rows (cells), or None without downstream results."""
    tasks = sorted(set().union(*(g["downstream"] for g in summary["groups"])))
    if not tasks:
        return None
    meta: dict[str, list] = {}
    for g in summary["groups"]:
        for t, d in g["downstream"].items():
            meta.setdefault(t, [shorten(t), ("br", ""), ("small", shorten(f"{d['metric']}, {d['num_fewshot']}-shot"))])
    rows = []
    for g in summary["groups"]:
        cells = [_downstream_cell(g["downstream"].get(t), len(g["runs"])) for t in tasks]
        pct = [g["downstream"][t]["value"] * 100 for t in tasks
               if t in g["downstream"] and is_percent(g["downstream"][t]["metric"])]
        avg = f"{statistics.fmean(pct):.1f}" if pct and len(pct) == len(tasks) else "—"
        rows.append([_label(g)] + cells + [avg])
    return ["group"] + [meta[t] for t in tasks] + ["avg"], rows


def _extra_tables(s: dict) -> list[tuple[str, list, list[list], str]]:
    """The tables shared with summary.md (``spread_table``, ``since_branch_table``) that have rows:
    (title, header, cells, note)."""
    out = []
    for title, table, note in (
            ("Reproducibility across seeds", spread_table(s),
             "Between-seed standard deviation of each group's final validation loss with its chi-squared 95% "
             "interval; its ratio to random's (same alpha) and CLM's with the F interval; p (F): the F test of "
             "equal variances (ignores the pairing), p (paired): the Pitman-Morgan test over the seeds both groups "
             "have."),
            ("Costs from the branch point", since_branch_table(s),
             "A branched study: every run continues its seed's trunk at the branch point; costs from there on "
             "beside the totals, which include the trunk's share.")):
        if table:
            out.append((title, table[0], [[shorten(c) for c in row] for row in table[1]], note))
    return out


def render_html(summary: dict, written: dict) -> str:
    """The whole page from templates/index.html.j2 (jinja2, installed with torch): the layout and words live in
    the template, the formatted numbers come from the functions above."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("eslm.analysis.report", "templates"),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters["short"] = shorten  # a name or value from the runs
    env.filters["msg"] = lambda text: shorten(text, MAX_MESSAGE)  # a message that names them
    s = summary
    return env.get_template("index.html.j2").render(
        s=s, one_seed_note=ONE_SEED_NOTE if s["one_seed"] else None, ignored=IGNORED_FOR_GROUPING,
        header=header_rows(s), verdict_table=verdict_table(s), token_view=s.get("token_view"),
        verdicts=[("Against the baseline", s["comparisons"]),
                  ("Against the random-drop control at the same alpha", s["controls"])],
        summary_table=_summary_rows(s), costs_table=_costs_rows(s),
        comparison_table=_comparison_rows(s, s["comparisons"] + s["controls"]), groups_table=_groups_rows(s),
        extra_tables=_extra_tables(s), figures=figure_table.drawn(written), downstream=_downstream(s))
