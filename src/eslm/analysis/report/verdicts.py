"""The report's words for the numbers of ``eslm.analysis.stats``: a paired difference of a loss or of a
to-target cost said as a sentence ("lower than clm by ...", "no difference detectable with 5 seeds ..."), the
seeds a censored cost counted at their budget, and an equivalence test's outcome."""

from __future__ import annotations

from eslm.analysis.rundir import shorten
from eslm.analysis.stats import significant


def _verdict(ci: dict, fmt, none: str, below: str, above: str, what: str, baseline: str, unit: str,
             single: bool = False) -> str:
    """The shared skeleton of the verdicts: no pair, one pair, a difference below / above zero, or none
    detectable (with the smallest difference the comparison could have detected, and Holm's adjustment when
    it is what hid a raw interval that excludes 0). ``below`` and ``above`` are templates with {m} {lo} {hi}
    (magnitudes, formatted by ``fmt``). ``single``: the whole report has one seed per group and says once that
    nothing has an interval, so one pair is not followed by "(n=1, no interval)"."""
    n, m = ci["n"], ci["mean"]
    if n == 0:
        return f"{what}: {none}"
    if n == 1:
        return f"{what}: {fmt(m, True)}{unit} vs {baseline}" + ("" if single else " (n=1, no interval)")
    lo, hi = ci["lo"], ci["hi"]
    sign = significant(ci)
    adjusted = ci.get("p_adjusted")
    holm_note = (f" (Holm-adjusted p = {adjusted:.2g} over {ci['family']} comparisons)"
                 if adjusted is not None else "")
    if sign < 0:
        return below.format(m=fmt(-m), lo=fmt(-hi), hi=fmt(-lo)) + holm_note
    if sign > 0:
        return above.format(m=fmt(m), lo=fmt(lo), hi=fmt(hi)) + holm_note
    seen = f"; detectable at 80% power: {fmt(ci['mde'])}{unit}" if ci.get("mde") is not None else ""
    hidden = (f"; the unadjusted interval excludes 0 (p = {ci['p']:.2g}), Holm-adjusted p = {adjusted:.2g} over "
              f"{ci['family']} comparisons" if adjusted is not None and (hi < 0 or lo > 0) else "")
    return (f"{what}: no difference detectable with {n} seeds ({fmt(m, True)} [{fmt(lo, True)}, "
            f"{fmt(hi, True)}]{unit} vs {baseline}{seen}){hidden}")


def cost_verdict(ci: dict, cost: str, baseline: str, group: str | None = None, single: bool = False) -> str:
    """Words for a relative paired difference of a to-target cost (negative = cheaper than the baseline),
    with the censored seeds of ``paired_censored`` said and the direction of the bias they leave (``single``:
    see ``_verdict``)."""
    def fmt(v, signed=False):
        return f"{v:+.1%}" if signed else f"{100.0 * v:.1f}%"

    words = _verdict(ci, fmt, "no seed pair where both reach the target",
                     f"reaches the target with {{m}} [{{lo}}, {{hi}}] less {cost} than {baseline}",
                     f"needs {{m}} [{{lo}}, {{hi}}] more {cost} than {baseline} to reach the target",
                     cost, baseline, "", single)
    return words + censoring_note(ci, group or "the group", baseline)


def censoring_note(ci: dict, group: str, baseline: str) -> str:
    """'' or the censored seeds of a cost comparison and the direction of the bias they leave."""
    parts = []
    for key, who in (("censored_x", group), ("censored_y", baseline)):
        k = len(ci.get(key) or [])
        if k:
            parts.append(f"{k} of {ci['n']} seed{'s' if ci['n'] != 1 else ''} of {who} never reached the target "
                         f"and count{'s' if k == 1 else ''} at {'its' if k == 1 else 'their'} budget")
    both = len(ci.get("both_censored") or [])
    if both:
        parts.append(f"{both} seed{'s' if both != 1 else ''} where neither reached it left out")
    if not parts:
        return ""
    biases: dict[str | None, str] = {"x": f"the difference understates {group}'s cost (biased in its favour)",
            "y": f"the difference understates {baseline}'s cost (biased against {group})",
            "both": "censored on both sides: the bias can go either way"}
    bias = biases.get(ci.get("bias"))
    return " [" + "; ".join(parts + ([bias] if bias else [])) + "]"


def loss_verdict(ci: dict, what: str, baseline: str, single: bool = False) -> str:
    """Words for an absolute paired difference of a loss (negative = lower loss than the baseline; ``single``:
    see ``_verdict``)."""
    def fmt(v, signed=False):
        return f"{v:+.4f}" if signed else f"{v:.4f}"

    return _verdict(ci, fmt, "no seed pair to compare",
                    f"{what} lower than {baseline} by {{m}} [{{lo}}, {{hi}}] nats",
                    f"{what} higher than {baseline} by {{m}} [{{lo}}, {{hi}}] nats", what, baseline, " nats", single)


def tost_verdict(t: dict | None, unit: str = "nats") -> str:
    """One phrase for ``tost``'s result."""
    if t is None:
        return "equivalence not tested (fewer than 2 pairs)"
    within = f"within +-{t['margin']:g} {unit}"
    interval = f"90% interval [{t['lo90']:+.4f}, {t['hi90']:+.4f}]"
    if t["equivalent"]:
        return f"equivalent {within} (TOST p = {t['p']:.2g}; {interval})"
    return f"equivalence {within} not shown (TOST p = {t['p']:.2g}; {interval} reaches past the margin)"


def verdict_word(ci: dict | None, relative: bool, single: bool = False) -> str:
    """The verdict of one paired difference in a word or two, for the report's verdict table: lower / higher (a
    loss), less / more (a relative cost), no difference detectable, or why there is no verdict (``single``: the
    report has one seed per group and says once that nothing has an interval: '—')."""
    if ci is None or ci["n"] == 0:
        return "no pair"
    if ci["lo"] is None:
        return "—" if single else "no interval"
    sign = significant(ci)
    if sign == 0:
        return "no difference detectable"
    return {(-1, False): "lower", (1, False): "higher", (-1, True): "less", (1, True): "more"}[(sign, relative)]


def difference(ci: dict | None, relative: bool) -> tuple[str, str]:
    """(the mean difference, its 95% interval) as text; '—' where there is none."""
    if ci is None or ci["n"] == 0 or ci["mean"] is None:
        return "—", "—"
    spec = "+.1%" if relative else "+.4f"
    interval = "—" if ci["lo"] is None else f"[{ci['lo']:{spec}}, {ci['hi']:{spec}}]"
    return f"{ci['mean']:{spec}}", interval


def verdict_table(summary: dict) -> tuple[list[str], list[list]]:
    """The report's verdicts as (header, rows of cells): docs/report.md, "The verdict table" (the primary group
    marked). The full sentences stay in each comparison's ``verdicts``."""
    primary = summary.get("primary")
    single = summary["one_seed"]
    rows, seen = [], set()
    for c in ([primary] if primary else []) + summary["comparisons"] + summary["controls"]:
        if (c["group"], c["against"]) in seen:
            continue
        seen.add((c["group"], c["against"]))
        loss = c["losses"]["final validation loss"]
        cost = c["to_target"][summary["flops_key"]]
        group = [shorten(c["group"]) + " ", ("small", "(primary)")] if c.get("primary") else shorten(c["group"])
        rows.append([group, shorten(c["against"]), *difference(loss, False), verdict_word(loss, False, single),
                     *difference(cost, True), verdict_word(cost, True, single)])
    return (["group", "vs", "Δ final val loss (nats)", "95% interval", "verdict",
             f"Δ {summary['flops_key']} to target", "95% interval", "verdict"], rows)
