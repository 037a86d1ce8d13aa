"""The machine-readable summary of ``eslm report`` (summary.json): loading the runs, the time axis, the
baseline and random-drop comparisons with their verdicts, the FLOPs-convention sentences, load warnings."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from eslm import metrics as M
from eslm.analysis import stats as S
from eslm.analysis.report import comparisons as C
from eslm.analysis.report.curves import aggregate, domains_of, group_final, last_value, series, to_target
from eslm.analysis.report.downstream import group_downstream
from eslm.analysis.rundir import (
    IGNORED_FOR_GROUPING,
    Group,
    Run,
    config_get,
    distinct_names,
    find_group,
    is_number,
    load_run,
)
from eslm.errors import ESLMError
from eslm.methods import baseline, control_of, role_of

FLOPS_KEYS = {"paper": M.FLOPS_PAPER, "executed": M.FLOPS_EXECUTED}
# to-target costs shown side by side: key in summary["groups"][i]["to_target"] -> (metric, words)
COSTS = {M.FLOPS_PAPER: (M.FLOPS_PAPER, "paper-FLOPs"), M.FLOPS_EXECUTED: (M.FLOPS_EXECUTED, "executed FLOPs"),
         "tokens": (M.TOKENS_SEEN, "tokens"), "time_s": (None, "time")}  # time: cpu_s or elapsed_s, see time_key
LOAD_RATIO_WARN = 1.5  # warn when the mean load of compared runs differs by more than this factor
REPORT_FORMAT = "eslm-report-v1"
# a report whose groups all have one run says this once (summary.md, index.html, the printed verdicts) instead of
# "(n=1, no interval)" in each cell and verdict
ONE_SEED_NOTE = ("One seed per group: no number in this report has an interval, and a difference between groups is "
                 "not evidence of an effect; run more seeds (eslm study ... --seeds N).")
INTERPOLATION_NOTE = ("first eval point with val_loss <= target; the crossing between it and the previous eval "
                      "point is interpolated linearly in log(x) (linearly in x if the previous x is 0); "
                      "never reached = null")


class ReportError(ESLMError):
    """Nothing to report on, or report options that cannot be honoured."""


def load_runs(paths: list[str]) -> tuple[list[Run], list[dict], list[str]]:
    """Load every path once (a directory given twice is read once, with a warning); runs without eval lines are
    skipped with a warning (an error if none is left). Runs are known by their directory: two directories
    sharing a run name are both reported, under distinct names (``distinct_names``)."""
    runs, skipped, warnings, seen = [], [], [], set()
    for p in paths:
        where = Path(p).resolve()
        if where in seen:
            warnings.append(f"{p}: given more than once; read once")
            continue
        seen.add(where)
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
    distinct_names(runs)
    return runs, skipped, warnings


def time_key_of(runs: list[Run]) -> tuple[str, str]:
    """(metric, words) of the time axis: process CPU seconds when every run trained on a CPU and logged
    cpu_s (robust to other jobs sharing the machine), else wall-clock seconds."""
    on_cpu = all(str(r.env.get("device", "")).startswith("cpu") for r in runs)
    has_cpu_s = all(any(is_number(rec.get(M.CPU_S)) for rec in r.eval) for r in runs)
    if on_cpu and has_cpu_s:
        return M.CPU_S, "CPU time (s, process user+system, evaluation excluded)"
    return M.ELAPSED_S, "wall-clock time (s, evaluation excluded)"


def find_baseline(groups: list[Group], name: str | None, where: str = "--") -> tuple[Group | None, str | None]:
    """The group ``name`` names (``rundir.find_group``), default the registry's baseline method; (None, reason)
    when there is no group of it and none was named."""
    default = baseline()
    group, why = find_group(groups, name or default, f"{where}baseline")
    if group is not None:
        return group, None
    if name or any(g.method == default for g in groups):
        raise ReportError(why)
    return None, f"no {default} group among the runs: no paired comparisons (set {where}baseline to compare)"


def _control_for(g: Group, groups: list[Group]) -> Group | None:
    """The group of the control that ``g``'s method must beat (its registry line's ``control``: random drop) at
    the same alpha, if any."""
    control = control_of(g.method)
    if control is None:
        return None
    alpha = config_alpha(g)
    same = [c for c in groups if c.method == control and config_alpha(c) == alpha]
    return same[0] if same else None


def config_alpha(g: Group):
    return config_get(g.runs[0].config, "method.alpha")


def schedule_words(runs: list[Run]) -> str:
    """How the runs' learning-rate schedules were set (``train.lr_schedule`` under a FLOPs budget)."""
    kinds = set()
    for r in runs:
        budget = is_number(config_get(r.config, "train.max_flops")) and config_get(r.config, "train.max_flops") > 0
        kinds.add((config_get(r.config, "train.lr_schedule") or "steps") if budget else "none")
    words = {"budget": "under the FLOPs budget each run's warmup and cosine end at its own last step "
                       "(train.lr_schedule=budget: stretched by the steps the run takes to spend the budget)",
             "steps": "under the FLOPs budget every run warms up and decays over the same configured steps "
                      "(train.lr_schedule=steps): a run that takes more steps spends them at min_lr",
             "none": "no FLOPs budget: each run's schedule spans its configured steps"}
    return "; ".join(f"{words.get(k, k)}" for k in sorted(kinds)) + (" (runs differ)" if len(kinds) > 1 else "")


def flops_gap(g: dict, base: dict) -> str | None:
    """One sentence on the two FLOPs conventions of a group against the baseline, per token seen."""
    def per_token(grp, key):
        f, t = grp["final_" + key]["mean"], grp["final_" + M.TOKENS_SEEN]["mean"]
        return f / t if f and t else None

    rel = {}
    for key in (M.FLOPS_PAPER, M.FLOPS_EXECUTED):
        a, b = per_token(g, key), per_token(base, key)
        if a is None or b is None:
            return None
        rel[key] = a / b - 1.0

    p, e = rel[M.FLOPS_PAPER], rel[M.FLOPS_EXECUTED]
    paper = f"counts {abs(100 * p):.1f}% {'fewer' if p < 0 else 'more'} paper-FLOPs per token seen"
    if abs(e) < 5e-4:
        executed, joint = "executes the same FLOPs", "but" if p < 0 else "and"
    else:
        executed = f"executes {abs(100 * e):.1f}% {'fewer' if e < 0 else 'more'} FLOPs"
        joint = "but" if (p < 0) != (e < 0) else "and"
    return f"{g['label']} {paper} {joint} {executed} {'as' if 'same' in executed else 'than'} {base['label']}"


def _ratio(a, b):
    return a / b if is_number(a) and is_number(b) and b > 0 else None


def run_load(r: Run) -> float | None:
    """Mean 1-minute load average over the run's train lines (None if it logged none)."""
    v = [rec[M.LOAD_AVG_1M] for rec in r.train if is_number(rec.get(M.LOAD_AVG_1M))]
    return statistics.fmean(v) if v else None


def load_warning(runs: list[Run]) -> str | None:
    known = [v for r in runs if (v := run_load(r)) is not None]
    if len(known) < 2:
        return None
    lo, hi = min(known), max(known)
    if hi > LOAD_RATIO_WARN * max(lo, 0.5):
        return (f"runs were taken under different machine loads (mean 1-min load average from {lo:.1f} to "
                f"{hi:.1f}): wall-clock comparisons are skewed; CPU seconds much less so")
    return None


def machine_warning(runs: list[Run]) -> str | None:
    """A warning when compared runs trained with different thread counts or devices (their env.json): such
    settings do not split groups (``MACHINE_KEYS``), but time is not comparable across them."""
    parts = []
    for key, words in (("num_threads", "CPU threads"), ("device", "devices")):
        values = Counter(str(r.env[key]) for r in runs if r.env.get(key) is not None)
        if len(values) > 1:
            parts.append(f"{words} " + ", ".join(f"{v} ({n} run{'s' if n > 1 else ''})" for v, n in values.items()))
    if not parts:
        return None
    return (f"the runs trained on different machine settings ({'; '.join(parts)}): they are grouped as seeds of "
            "one experiment all the same, but their times are not comparable (FLOPs and tokens are)")


def spread(groups: list[Group]) -> list[dict]:
    """Reproducibility (docs/report.md): each group's between-seed SD of the final validation loss, and its
    spread against its control (``control_of``) and the baseline (``stats.spread_comparison``)."""
    finals = {g.label: C.per_seed(g, lambda r: last_value(r.eval, M.VAL_LOSS)) for g in groups}
    out = []
    for g in groups:
        control = control_of(g.method)
        refs = [c for c in groups if c is not g and (c.method == baseline() or (
            c.method == control and config_alpha(c) == config_alpha(g)))]
        out.append({"label": g.label, **S.sd_ci(list(finals[g.label].values())),
                    "against": {c.label: S.spread_comparison(finals[g.label], finals[c.label]) for c in refs}})
    return out


def _distinct(values) -> list:
    """The distinct values in first-seen order (None left out)."""
    return list(dict.fromkeys(v for v in values if v is not None))


def tokens_per_step(r: Run):
    """Tokens one optimizer step of ``r`` consumed, from its logged counters (the last train line's tokens seen
    over its step: every micro-batch and process included); None without them."""
    return next((round(rec[M.TOKENS_SEEN] / rec[M.STEP]) for rec in reversed(r.train)
                 if is_number(rec.get(M.TOKENS_SEEN)) and is_number(rec.get(M.STEP)) and rec[M.STEP] > 0), None)


def header(runs: list[Run], groups: list[Group], study: str | None) -> dict:
    """What the report's header says once, read from the run directories (``study``: the name ``eslm study``
    gives); the alphas are those of the runs that log alpha, "adaptive" where it moved."""
    def alpha_of(r: Run) -> str | None:
        logged = [rec[M.ALPHA] for rec in r.train if is_number(rec.get(M.ALPHA))]
        if not logged:
            return None
        return "adaptive" if len(set(logged)) > 1 else f"{config_get(r.config, 'method.alpha', logged[0]):g}"

    parents = _distinct(str(r.path.parent) for r in runs)
    commits = _distinct((str(r.env["git_commit"])[:10] + (" (uncommitted changes)" if r.env.get("git_dirty") else ""))
                        if r.env.get("git_commit") else None for r in runs)
    counts = _distinct(len(g.runs) for g in groups)
    return {
        "study": study, "directories": parents,
        "alphas": _distinct(alpha_of(r) for r in runs),
        "presets": _distinct(config_get(r.config, "model.preset") for r in runs),
        "params": _distinct(r.env.get("model_params_non_embedding") for r in runs),
        "tokens_per_step": _distinct(tokens_per_step(r) for r in runs),
        "commits": commits, "commit_unknown": sum(not r.env.get("git_commit") for r in runs),
        "seeds_per_group": sorted(counts),
        "seeds": sorted(_distinct(r.seed for r in runs), key=str),
    }


def branch_costs(g: Group) -> dict | None:
    """A branched group (``train.branch_from``): the branch step and its runs' costs from the branch point on
    (final minus the first evaluation, the trunk's at the branch point), beside their totals."""
    if not all(config_get(r.config, "train.branch_from") for r in g.runs):
        return None
    out = {"step": aggregate([r.eval[0].get(M.STEP) if r.eval else None for r in g.runs])}
    for key in (M.TOKENS_SEEN, M.FLOPS_PAPER, M.FLOPS_EXECUTED, M.CPU_S):
        out[key] = aggregate([last_value(r.eval, key) - r.eval[0][key] if r.eval and is_number(r.eval[0].get(key))
                              and is_number(last_value(r.eval, key)) else None for r in g.runs])
    return out


def summarize(runs: list[Run], groups: list[Group], *, target: float, target_source: str,
              flops: str, skipped: list[dict], warnings: list[str], baseline: str | None = None,
              where: str = "--", primary: list[str] | None = None, margin: float | None = None,
              study: str | None = None) -> dict:
    """The machine-readable summary written as summary.json. ``primary``: the two groups of the comparison named
    in advance (``--primary A B``, a study's ``report.primary``): read unadjusted and shown first; ``margin``:
    its pre-registered equivalence margin (nats), tested by TOST (``stats.tost``); ``study``: the study's name for
    the header (``header``)."""
    flops_key = FLOPS_KEYS[flops]
    time_key, time_words = time_key_of(runs)
    domains = domains_of(runs)
    group_of = {id(r): g.label for g in groups for r in g.runs}
    gs, tts = [], {}
    for g in groups:
        tt = {key: to_target(g, metric or time_key, target) for key, (metric, _) in COSTS.items()}
        tt["flops"] = tt[M.FLOPS_PAPER if flops == "paper" else M.FLOPS_EXECUTED]
        tts[g.label] = tt
        gs.append({
            "label": g.label, "method": g.method, "settings": g.settings,
            "runs": [r.name for r in g.runs], "seeds": [r.seed for r in g.runs],
            "unfinished": [r.name for r in g.runs if not r.finished],
            "to_target": tt, **group_final(g, domains),
            "final_" + M.CPU_S: aggregate([last_value(r.eval, M.CPU_S) for r in g.runs]),
            M.LOAD_AVG_1M: aggregate([run_load(r) for r in g.runs]),
            # executed FLOPs per dense (plain CLM) FLOPs on the same tokens: what a step of the method costs in
            # CLM steps (GREATS' scoring passes and gradient inner products, ESLM's routes, KD teachers, ...)
            "step_cost_vs_clm": aggregate([_ratio(last_value(r.eval, M.FLOPS_EXECUTED),
                                                  last_value(r.eval, M.FLOPS_DENSE)) for r in g.runs]),
            "downstream": group_downstream(g),
            "since_branch": branch_costs(g),
        })
    single = all(len(g["runs"]) <= 1 for g in gs)  # no number has an interval: said once (ONE_SEED_NOTE)
    base, why = find_baseline(groups, baseline, where)
    comparisons, controls, gaps = [], [], []
    if why:
        warnings.append(why)
    by_label = {g["label"]: g for g in gs}
    eq = {g.label: C.equal_token_losses(g, base) for g in groups}
    for entry in gs:
        entry["equal_tokens_val_loss"] = aggregate(list(eq[entry["label"]].values()))
    def compare(g, o) -> dict:
        return C.compare(g, o, tts[g.label], tts[o.label], eq[g.label], eq[o.label], COSTS)

    pairs = []  # (comparison, group, other) in the order shown
    differences: dict[str, list] = {"baseline": [], "control": []}  # the paired difference over training of each pair
    for g in groups:
        if base is not None and g is not base:
            comparisons.append(compare(g, base))
            pairs.append((comparisons[-1], g, base))
            differences["baseline"].append(C.difference_curve(g, base))
            gap = flops_gap(by_label[g.label], by_label[base.label])
            if gap and role_of(g.method) != "baseline":
                gaps.append(gap)
        ctrl = _control_for(g, groups)
        by_label[g.label]["control"] = ctrl.label if ctrl is not None else None
        if ctrl is not None and ctrl is not base:  # a control that is the baseline: compared above, once
            controls.append(compare(g, ctrl))
            pairs.append((controls[-1], g, ctrl))
            differences["control"].append(C.difference_curve(g, ctrl))
    differences = {kind: [d for d in curves if d is not None] for kind, curves in differences.items()}
    primary_entry = None
    if primary:
        a, why_a = find_group(groups, primary[0], f"{where}primary")
        b, why_b = find_group(groups, primary[1], f"{where}primary")
        if a is None or b is None:
            raise ReportError(why_a or why_b)
        primary_entry = next((c for c, g, o in pairs if g is a and o is b), None)
        if primary_entry is None:
            primary_entry = compare(a, b)
            pairs.insert(0, (primary_entry, a, b))
        primary_entry["primary"] = True
    family = C.adjust([c for c, _, _ in pairs])
    equal_words = (f"validation loss at {base.label}'s last evaluation (equal tokens)" if base is not None
                   else C.EQUAL)
    for c, g, o in pairs:
        c["verdicts"] = C.write_verdicts(c, COSTS, tts[g.label], tts[o.label], equal_words, single)
    if primary_entry is not None:
        if margin is not None:
            primary_entry["tost"] = S.tost(primary_entry["losses"][C.FINAL], margin)
        primary_entry["primary_verdict"] = C.primary_verdict(primary_entry, single)
    warnings += [w for w in (load_warning(runs), machine_warning(runs)) if w]
    return {
        "format": REPORT_FORMAT, "header": header(runs, groups, study), "flops_convention": flops, "flops_key": flops_key,
        "time_key": time_key, "time_words": time_words, "one_seed": single,
        "target_loss": target, "target_source": target_source, "interpolation": INTERPOLATION_NOTE,
        "grouping": "same resolved config except " + ", ".join(IGNORED_FOR_GROUPING),
        "statistics": ("mean over seeds with a 95% Student-t interval (n=1: no interval); comparisons are "
                       "paired by seed (same data order and initial weights), relative for costs (geometric "
                       "mean of the per-seed ratios, the arithmetic mean beside it); a 'no "
                       "difference detectable' verdict states the smallest difference detectable at 80% power "
                       "(two-sided paired t at 5%, from the observed spread); to-target costs count a seed that "
                       "never reached the target at its budget (censored); the verdicts are Holm-adjusted over "
                       "every distinct read-out of the report except the primary one (read-outs with equal "
                       "per-seed values count once); spread: each group's between-seed SD of the final loss with "
                       "its chi-squared 95% interval, against random at the same alpha and CLM by the F test and "
                       "the paired Pitman-Morgan test"),
        "baseline": base.label if base is not None else None,
        "primary": primary_entry, "holm_family": family, "schedule": schedule_words(runs),
        "domains": domains, "groups": gs, "comparisons": comparisons, "controls": controls,
        "differences_over_training": differences, "flops_gaps": gaps, "spread": spread(groups),
        "runs": [{"name": r.name, "path": str(r.path), "method": r.method, "seed": r.seed,
                  "group": group_of[id(r)], "finished": r.finished, "git_commit": r.env.get("git_commit"),
                  "device": r.env.get("device"), M.LOAD_AVG_1M: run_load(r)}
                 for r in runs],
        "skipped": skipped, "warnings": warnings,
    }
