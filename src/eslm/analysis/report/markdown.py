"""summary.md of ``eslm report``: the summary as one Markdown table plus the verdicts."""

from __future__ import annotations

from eslm import metrics as M
from eslm.analysis import stats as S

def _md_ci(a: dict, spec: str) -> str:
    if a["count"] == 0:
        return "—"
    if a.get("ci_half_width") is None:
        return f"{format(a['mean'], spec)} (n=1)"
    return f"{format(a['mean'], spec)} ± {format(a['ci_half_width'], spec)}"


def _md_paired(ci: dict | None, rel: bool) -> str:
    if ci is None or ci["n"] == 0:
        return "—"
    spec = "+.1%" if rel else "+.4f"
    if ci["lo"] is None:
        return f"{ci['mean']:{spec}} (n=1)"
    mark = {-1: " **↓**", 1: " **↑**", 0: ""}[S.significant(ci)]
    return f"{ci['mean']:{spec}} [{ci['lo']:{spec}}, {ci['hi']:{spec}}]{mark}"


def _md_label(g: dict) -> str:
    if not g["unfinished"]:
        return g["label"]
    return f"{g['label']} (**{len(g['unfinished'])}/{len(g['runs'])} unfinished**)"


def render_markdown(summary: dict) -> str:
    """The summary as Markdown (summary.md): one table of groups with intervals and paired differences, then
    the verdicts. Paste-able into a README."""
    s = summary
    comp = {c["group"]: c for c in s["comparisons"]}
    ctrl = {c["group"]: c for c in s["controls"]}
    t_words = "CPU s" if s["time_key"] == M.CPU_S else "wall-clock s"
    base = s["baseline"] or "baseline"
    head = (f"| group | n | final val loss | Δ final loss vs {base} | Δ vs random (same alpha) | "
            f"Δ equal-token loss vs {base} | to target, Δ flops_paper vs {base} | Δ flops_executed | "
            f"Δ {t_words} | reached | step cost / CLM |")
    lines = [head, "|" + "---|" * 11]
    unfinished = any(g["unfinished"] for g in s["groups"])
    for g in s["groups"]:
        c, r = comp.get(g["label"]), ctrl.get(g["label"])
        tt = g["to_target"][M.FLOPS_PAPER]
        lines.append("| " + " | ".join([
            _md_label(g), str(g["final_val_loss"]["count"]), _md_ci(g["final_val_loss"], ".4f"),
            _md_paired(c["losses"]["final validation loss"] if c else None, False),
            _md_paired(r["losses"]["final validation loss"] if r else None, False),
            _md_paired(c["losses"]["equal-token validation loss"] if c else None, False),
            _md_paired(c["to_target"][M.FLOPS_PAPER] if c else None, True),
            _md_paired(c["to_target"][M.FLOPS_EXECUTED] if c else None, True),
            _md_paired(c["to_target"]["time_s"] if c else None, True),
            f"{tt['reached']}/{tt['n']}", _md_ci(g["step_cost_vs_clm"], ".3f")]) + " |")
    notes = [f"Target validation loss {s['target_loss']:.4f} ({s['target_source']}). Mean ± 95% Student-t "
             f"half-width over seeds; Δ: mean paired (by seed) difference [95% interval], relative for costs, a "
             f"seed that never reached the target counted at its budget (censored); **↓**/**↑**: below / above 0 "
             f"after Holm's adjustment over the {s['holm_family']} comparisons of this report (the primary "
             f"comparison's final loss: its own interval). Equal-token loss: at {base}'s last evaluation. "
             f"Learning-rate schedule: {s['schedule']}. Time: {s['time_words']}."]
    if unfinished:
        notes.append("**unfinished**: runs without result.json (still training, interrupted or crashed): their "
                     "\"final\" values are those of their last evaluation, not of the end of training.")
    verdicts = [f"- **{c['group']}** vs {c['against']}: " + "; ".join(c["verdicts"])
                for c in s["comparisons"] + s["controls"]]
    if s.get("primary"):
        lines = [f"**{s['primary']['primary_verdict']}**", ""] + lines
    gaps = [f"- {x}." for x in s["flops_gaps"]]
    warn = [f"- warning: {w}" for w in s["warnings"]]
    return "\n".join(lines + [""] + notes + [""] + verdicts + [""] + gaps + ([""] + warn if warn else [])) + "\n"
