"""summary.md of ``eslm report``: the summary as one Markdown table plus the verdicts."""

from __future__ import annotations

import html

from eslm import metrics as M
from eslm.analysis import stats as S
from eslm.analysis.report import figure_table
from eslm.analysis.report.summary import ONE_SEED_NOTE
from eslm.analysis.report.verdicts import difference, verdict_table
from eslm.analysis.rundir import MAX_MESSAGE, shorten


def md_text(text) -> str:
    """A text from the runs (a label, a warning, a verdict naming groups) as Markdown that shows it as it is:
    shortened, HTML escaped (a renderer of summary.md runs no markup from a config value), ``|`` escaped (a table
    cell stays one cell), on one line."""
    return html.escape(shorten(text, MAX_MESSAGE), quote=False).replace("|", "\\|").replace("\n", " ").replace("\r", " ")


def _count(n) -> str:
    return f"{n:,}" if isinstance(n, int) else str(n)


def header_rows(s: dict) -> list[tuple[str, str]]:
    """The header of the page and of summary.md, (name, text) rows each said once for the whole report: study,
    alpha, model, tokens per step, commit, seeds, what was compared (``summary.header``). Texts from the runs are
    shortened; escaping is the caller's."""
    h = s["header"]
    rows: list[tuple[str, str]] = []
    if h.get("study"):
        rows.append(("study", shorten(h["study"])))
    elif len(h["directories"]) == 1:
        rows.append(("runs in", shorten(h["directories"][0])))
    rows.append(("alpha", ", ".join(shorten(str(a)) for a in h["alphas"]) + " (the runs that select tokens)"
                 if h["alphas"] else "— (no run selects tokens)"))
    model = ", ".join(shorten(str(p)) for p in h["presets"]) or "—"
    params = ", ".join(_count(p) for p in h["params"])
    rows.append(("model", f"{model} ({params} non-embedding parameters)" if params else model))
    rows.append(("tokens per step", ", ".join(_count(t) for t in h["tokens_per_step"]) or "—"))
    unknown = h["commit_unknown"]
    commits = ", ".join(shorten(c) for c in h["commits"]) or "—"
    rows.append(("commit", commits + (f" ({unknown} run{'s' if unknown > 1 else ''} without one)"
                                      if unknown and h["commits"] else "")))
    counts = h["seeds_per_group"]
    seeds = ", ".join(shorten(str(x)) for x in h["seeds"])
    rows.append(("seeds", f"n = {counts[0]} per group (seeds {seeds}); every interval is over these seeds"
                 if len(counts) == 1 else
                 f"{counts[0]} to {counts[-1]} per group (each group's in the groups table; seeds {seeds})"))
    rows.append(("compared", f"{len(s['runs'])} runs in {len(s['groups'])} groups; FLOPs convention "
                 f"{s['flops_convention']}; target validation loss {s['target_loss']:.4g}"))
    return rows


def plain(cell) -> str:
    """A table cell (a text, or parts: texts and (kind, text) pairs, see html.py) as plain text."""
    return cell if isinstance(cell, str) else "".join(p if isinstance(p, str) else p[1] for p in cell)


def agg_cell(a: dict, spec: str = ".4g", single: bool = False):
    """'mean ± 95% half-width'; one seed: 'mean (no interval)', just the mean when ``single`` (a one-seed report
    says once, above its tables, that nothing has an interval; the seeds per group are said in the header)."""
    if a["count"] == 0:
        return "—"
    if a.get("ci_half_width") is not None:
        return f"{format(a['mean'], spec)} ± {format(a['ci_half_width'], spec)}"
    return format(a["mean"], spec) if single else [format(a["mean"], spec) + " ", ("small", "(no interval)")]


def paired_cell(ci: dict | None, rel: bool, single: bool = False, marks: tuple = (" **↓**", " **↑**")):
    """A paired difference, 'mean [95% interval]' (relative for costs) with ``marks`` (below 0, above 0) where it
    is shown (``stats.significant``); one pair: as ``agg_cell``."""
    mean, interval = difference(ci, rel)
    if ci is None or interval == "—":
        return mean if single or mean == "—" else [mean + " ", ("small", "(no interval)")]
    return f"{mean} {interval}" + {-1: marks[0], 1: marks[1], 0: ""}[S.significant(ci)]


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a Markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def spread_table(summary: dict) -> tuple[list[str], list[list[str]]] | None:
    """The reproducibility table (``summary.spread``) as (header, rows), or None when no group has a spread; the
    caller escapes the cells."""
    rows = summary.get("spread") or []
    if not any(r["sd"] is not None for r in rows):
        return None

    def fmt(x, spec):
        return "—" if x is None else format(x, spec)

    out = []
    for r in rows:
        sd = "—" if r["sd"] is None else f"{r['sd']:.4f} [{r['lo']:.4f}, {r['hi']:.4f}]"
        against = list(r["against"].items()) or [(None, None)]
        for i, (other, c) in enumerate(against):
            ratio = "—" if not c or c["ratio"] is None else f"{c['ratio']:.2f} [{c['lo']:.2f}, {c['hi']:.2f}]"
            out.append([r["label"] if i == 0 else "", str(r["n"]) if i == 0 else "", sd if i == 0 else "",
                        other or "—", ratio, fmt(c and c["p_f"], ".2g"), fmt(c and c["p_paired"], ".2g")])
    return ["group", "n", "SD of final val loss [95%]", "SD ratio vs", "ratio [95%]", "p (F)", "p (paired)"], out


def since_branch_table(summary: dict) -> tuple[list[str], list[list[str]]] | None:
    """A branched study: each group's costs from the branch point on, beside its totals (as ``spread_table``)."""
    rows = [g for g in summary["groups"] if g.get("since_branch")]
    if not rows:
        return None
    out = []
    for g in rows:
        b = g["since_branch"]

        def pair(key, spec, b=b, g=g):
            since, total = b[key]["mean"], g.get("final_" + key, {}).get("mean")
            return "—" if since is None else f"{since:{spec}} / {'—' if total is None else format(total, spec)}"

        out.append([g["label"], f"{b['step']['mean']:.0f}", pair(M.TOKENS_SEEN, ".4g"),
                    pair(M.FLOPS_PAPER, ".3g"), pair(M.FLOPS_EXECUTED, ".3g"), pair(M.CPU_S, ".0f")])
    return ["group", "branch step", "tokens since / total", "paper-FLOPs since / total",
            "executed FLOPs since / total", "CPU s since / total"], out


def _verdict_lines(s: dict) -> list[str]:
    """The verdict table in Markdown: one row per comparison."""
    header, rows = verdict_table(s)
    if not rows:
        return ["No baseline group: no paired comparisons."]
    return md_table(header, [[md_text(plain(c)) for c in r] for r in rows])


def render_markdown(summary: dict) -> str:
    """The report as Markdown (summary.md), in the page's order (docs/report.md). Paste-able into a README."""
    s = summary
    comp = {c["group"]: c for c in s["comparisons"]}
    ctrl = {c["group"]: c for c in s["controls"]}
    t_words = "CPU s" if s["time_key"] == M.CPU_S else "wall-clock s"
    base = md_text(s["baseline"] or "baseline")
    unfinished = any(g["unfinished"] for g in s["groups"])
    one = s["one_seed"]
    rows = []
    for g in s["groups"]:
        c, r = comp.get(g["label"]), ctrl.get(g["label"])
        if r is None and c is not None and g.get("control") == c["against"]:  # its control is the baseline
            r = c
        tt = g["to_target"][M.FLOPS_PAPER]
        rows.append([
            md_text(g["label"]) + (f" (**{len(g['unfinished'])}/{len(g['runs'])} unfinished**)" if g["unfinished"]
                                   else ""), str(g["final_val_loss"]["count"]),
            plain(agg_cell(g["final_val_loss"], ".4f", one)),
            plain(paired_cell(c["losses"]["final validation loss"] if c else None, False, one)),
            plain(paired_cell(r["losses"]["final validation loss"] if r else None, False, one)),
            plain(paired_cell(c["losses"]["equal-token validation loss"] if c else None, False, one)),
            plain(paired_cell(c["to_target"][M.FLOPS_PAPER] if c else None, True, one)),
            plain(paired_cell(c["to_target"][M.FLOPS_EXECUTED] if c else None, True, one)),
            plain(paired_cell(c["to_target"]["time_s"] if c else None, True, one)),
            f"{tt['reached']}/{tt['n']}", plain(agg_cell(g["step_cost_vs_clm"], ".3f", one))])
    table = md_table(["group", "n", "final val loss", f"Δ final loss vs {base}", "Δ vs random (same alpha)",
                      f"Δ equal-token loss vs {base}", f"to target, Δ flops_paper vs {base}", "Δ flops_executed",
                      f"Δ {t_words}", "reached", "step cost / CLM"], rows)
    notes = [f"Target validation loss {s['target_loss']:.4f} ({md_text(s['target_source'])}). Mean ± 95% Student-t "
             f"half-width over seeds; Δ: mean paired (by seed) difference [95% interval], relative for costs, a "
             f"seed that never reached the target counted at its budget (censored); **↓**/**↑**: below / above 0 "
             f"after Holm's adjustment over the {s['holm_family']} comparisons of this report (the primary "
             f"comparison's final loss: its own interval). Equal-token loss: at {base}'s last evaluation. "
             f"Learning-rate schedule: {md_text(s['schedule'])}. Time: {s['time_words']}."]
    if unfinished:
        notes.append("**unfinished**: runs without result.json (still training, interrupted or crashed): their "
                     "\"final\" values are those of their last evaluation, not of the end of training.")
    verdicts = [f"- **{md_text(c['group'])}** vs {md_text(c['against'])}: " + "; ".join(map(md_text, c["verdicts"]))
                for c in s["comparisons"] + s["controls"]]
    study = s["header"].get("study")
    top = [f"# eslm report{': ' + md_text(study) if study else ''}", ""]
    top += [f"- **{name}**: {md_text(text)}" for name, text in header_rows(s)]
    if tv := s.get("token_view"):
        top.append(f"- **token view**: [which tokens are kept and dropped]({tv['link']}) (eslm tokens)"
                   if tv.get("link") else f"- **token view**: not made; make it with {md_text(tv['command'])}")
    top += [f"- warning: {md_text(w)}" for w in s["warnings"]] + [""]
    if one:
        head_words, rest = ONE_SEED_NOTE.split(": ", 1)
        top += [f"**{head_words}**: {rest}", ""]
    if s.get("primary"):
        top += [f"**{md_text(s['primary']['primary_verdict'])}**", ""]
    figs: list[str] = []  # the drawn figures, in the page's order and sections
    for f in figure_table.drawn(s.get("figures") or {}):
        figs += ([f"### {f['heading']}", ""] if f["heading"] else []) + [f"![{f['alt']}]({f['src']})", ""]
    gaps = [f"- {md_text(x)}." for x in s["flops_gaps"]]
    extra = []
    for t in (spread_table(s), since_branch_table(s)):
        extra += md_table(t[0], [[md_text(c) for c in row] for row in t[1]]) + [""] if t else []
    return "\n".join(top + ["## Verdicts", ""] + _verdict_lines(s) + [""]
                     + (["## Figures", ""] + figs if figs else [])
                     + ["## Summary", ""] + table + [""] + notes + [""] + extra
                     + (["## Verdicts in words", ""] + verdicts + [""] if verdicts else []) + gaps) + "\n"
