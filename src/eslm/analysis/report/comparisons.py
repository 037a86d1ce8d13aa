"""The paired comparisons of ``eslm report`` and their verdicts, Holm's adjustment over the report's family of
read-outs, and the paired differences over training (docs/report.md, "Statistics and verdicts")."""

from __future__ import annotations

from typing import Any

from eslm import metrics as M
from eslm.analysis import stats as S
from eslm.analysis.report import verdicts as V
from eslm.analysis.report.curves import best_val_loss, last_value, series
from eslm.analysis.rundir import Group, Run, is_number

FINAL, BEST, EQUAL = "final validation loss", "best validation loss", "equal-token validation loss"
ADJUSTED_LOSSES = (FINAL, EQUAL)  # the loss read-outs with verdicts (best is shown, not tested)


def per_seed(group: Group, value_of) -> dict:
    return {str(r.seed): value_of(r) for r in group.runs}


def equal_token_losses(group: Group, base: Group | None) -> dict:
    """{seed: validation loss at the tokens the baseline's run of that seed had seen at its last evaluation}
    (None where the run has no evaluation at exactly that many tokens, or the seed no baseline run)."""
    last = {str(r.seed): last_value(r.eval, M.TOKENS_SEEN) for r in base.runs} if base is not None else {}
    out = {}
    for r in group.runs:
        t = last.get(str(r.seed))
        at = [rec[M.VAL_LOSS] for rec in r.eval
              if t is not None and rec.get(M.TOKENS_SEEN) == t and is_number(rec.get(M.VAL_LOSS))]
        out[str(r.seed)] = at[-1] if at else None
    return out


def compare(g: Group, other: Group, tt: dict, other_tt: dict, eq: dict, other_eq: dict, costs: dict) -> dict:
    """Paired (by seed) differences of ``g`` against ``other``: losses in nats, to-target costs relative with
    censored seeds (``tt[key]["budget_per_seed"]``); ``eq``: equal-token losses. Verdicts come later
    (``write_verdicts``), once the family's p-values are adjusted."""
    out: dict[str, Any] = {"group": g.label, "against": other.label, "losses": {}, "to_target": {}, "verdicts": [],
                           "primary": False}
    out["losses"][FINAL] = S.paired(per_seed(g, lambda r: last_value(r.eval, M.VAL_LOSS)),
                                    per_seed(other, lambda r: last_value(r.eval, M.VAL_LOSS)))
    out["losses"][BEST] = S.paired(per_seed(g, best_val_loss), per_seed(other, best_val_loss))
    out["losses"][EQUAL] = S.paired(eq, other_eq)
    for key in costs:
        a, b = tt[key], other_tt[key]
        out["to_target"][key] = S.paired_censored(a["per_seed"], b["per_seed"], a["budget_per_seed"],
                                                  b["budget_per_seed"])
    return out


def _quantity(ci: dict):
    """What an interval measures, by its per-seed values: two read-outs with equal per-seed differences are one
    quantity (ESLM against random at one alpha: the same tokens, paper-FLOPs and executed FLOPs per step, so the
    three to-target costs are one number), tested once."""
    seeds = ci.get("per_seed") or {}
    if not seeds:
        return id(ci)
    return (ci.get("relative"), tuple(sorted((str(k), round(float(v), 12)) for k, v in seeds.items())))


def adjust(comparisons: list[dict]) -> int:
    """Holm-adjust in place (``p_adjusted``, ``family``: its size, the distinct quantities with a p-value) the
    intervals that carry a verdict: every loss of ``ADJUSTED_LOSSES`` and every to-target cost of every
    comparison, except the primary final loss. An interval equal per seed to one already in the family
    (``_quantity``) takes that one's adjusted p (``same_quantity_as_earlier``). Returns the size."""
    first: dict = {}
    again = []
    family = [c["losses"][what] for c in comparisons for what in ADJUSTED_LOSSES
              if not (c["primary"] and what == FINAL)]
    for ci in family + [ci for c in comparisons for ci in c["to_target"].values()]:
        key = _quantity(ci)
        if key in first:
            again.append((ci, first[key]))
        else:
            first[key] = ci
    size = S.holm_adjust(list(first.values()))
    for ci, same in again:
        if same.get("p_adjusted") is not None:
            ci["p_adjusted"], ci["family"], ci["same_quantity_as_earlier"] = same["p_adjusted"], size, True
    return size


def write_verdicts(c: dict, costs: dict, tt: dict, other_tt: dict, equal_words: str,
                   single: bool = False) -> list[str]:
    """The verdicts of one comparison in words: final loss, equal-token loss, then each to-target cost.
    ``single``: a one-seed report, which says once that nothing has an interval (not in each verdict)."""
    against = c["against"]
    out = [V.loss_verdict(c["losses"][FINAL], FINAL, against, single)]
    eq = c["losses"][EQUAL]
    if eq["n"]:
        out.append(V.loss_verdict(eq, equal_words, against, single))
    cost_lines, said = [], None
    for key, (_, words) in costs.items():
        ci = c["to_target"][key]
        if ci["n"] == 0:
            a, b = tt[key], other_tt[key]
            cost_lines.append(f"{words}: {c['group']} reaches the target in {a['reached']}/{a['n']} seeds, "
                              f"{against} in {b['reached']}/{b['n']}: no pair to compare")
            continue
        line = V.cost_verdict(ci, words, against, c["group"], single)
        note = V.censoring_note(ci, c["group"], against)
        if note and note == said:  # every cost crosses the target at the same evaluation: say it once
            line = line[:-len(note)] + " [censored as above]"
        said = note or said
        cost_lines.append(line)
    if all(c["to_target"][k]["n"] == 0 for k in costs):  # one line instead of four identical ones
        a, b = tt[M.FLOPS_PAPER], other_tt[M.FLOPS_PAPER]
        cost_lines = [f"reaches the target in {a['reached']}/{a['n']} seeds ({against}: {b['reached']}/{b['n']}), "
                      "so no to-target cost can be compared"]
    return out + cost_lines


def primary_verdict(c: dict, single: bool = False) -> str:
    """The one line of the pre-registered primary comparison (its final validation loss, unadjusted;
    ``single``: as in ``write_verdicts``)."""
    ci = c["losses"][FINAL]
    words = V.loss_verdict(ci, FINAL, c["against"], single)
    mde = f"; smallest difference detectable at 80% power: {ci['mde']:.4f} nats" \
        if ci.get("mde") is not None and S.significant(ci) != 0 else ""
    p = f", p = {ci['p']:.2g}" if ci.get("p") is not None else ""
    tost = f"; {V.tost_verdict(c['tost'])}" if "tost" in c else ""
    return f"PRIMARY (named in advance, not adjusted{p}): {c['group']} vs {c['against']}: {words}{mde}{tost}"


def difference_curve(g: Group, other: Group) -> dict | None:
    """The paired difference g - other of the validation loss at every evaluation step that every paired seed of
    both groups has: mean and 95% interval per step, x = mean tokens seen there."""
    by_seed = {str(r.seed): r for r in other.runs}
    pairs = [(r, by_seed[str(r.seed)]) for r in g.runs if str(r.seed) in by_seed]
    if len(pairs) < 2:
        return None

    def points(r: Run) -> dict:
        steps, xs, ys = series(r.eval, M.TOKENS_SEEN, M.VAL_LOSS)
        return {s: (x, y) for s, x, y in zip(steps, xs, ys)}

    per_pair = [(points(a), points(b)) for a, b in pairs]
    common = sorted(set.intersection(*(set(pa) & set(pb) for pa, pb in per_pair)))
    if not common:
        return None
    out: dict[str, Any] = {"label": g.label, "against": other.label, "n": len(pairs), "step": common, "x": [],
                           "mean": [], "lo": [], "hi": []}
    for s in common:
        ci = S.mean_ci([pa[s][1] - pb[s][1] for pa, pb in per_pair])
        out["x"].append(sum(pa[s][0] for pa, _ in per_pair) / len(per_pair))
        out["mean"].append(ci["mean"])
        out["lo"].append(ci["lo"] if ci["lo"] is not None else ci["mean"])
        out["hi"].append(ci["hi"] if ci["hi"] is not None else ci["mean"])
    return out
