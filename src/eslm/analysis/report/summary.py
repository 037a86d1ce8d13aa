"""The machine-readable summary of ``eslm report`` (summary.json): loading the runs, the time axis, the
baseline and random-drop comparisons with their verdicts, the FLOPs-convention sentences, load warnings."""

from __future__ import annotations

import statistics
from pathlib import Path

from eslm import metrics as M
from eslm.analysis import stats as S
from eslm.analysis.report.curves import aggregate, domains_of, group_final, last_value, series, to_target
from eslm.analysis.report.downstream import group_downstream
from eslm.analysis.rundir import IGNORED_FOR_GROUPING, Group, Run, distinct_names, find_group, is_number, load_run
from eslm.errors import ESLMError

FLOPS_KEYS = {"paper": M.FLOPS_PAPER, "executed": M.FLOPS_EXECUTED}
# to-target costs shown side by side: key in summary["groups"][i]["to_target"] -> (metric, words)
COSTS = {M.FLOPS_PAPER: (M.FLOPS_PAPER, "paper-FLOPs"), M.FLOPS_EXECUTED: (M.FLOPS_EXECUTED, "executed FLOPs"),
         "tokens": (M.TOKENS_SEEN, "tokens"), "time_s": (None, "time")}  # time: cpu_s or elapsed_s, see time_key
LOAD_RATIO_WARN = 1.5  # warn when the mean load of compared runs differs by more than this factor
REPORT_FORMAT = "eslm-report-v1"
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


def _per_seed(group: Group, value_of) -> dict:
    return {str(r.seed): value_of(r) for r in group.runs}


def _final(r: Run, key: str = M.VAL_LOSS):
    return last_value(r.eval, key)


def best_val_loss(r: Run):
    ys = series(r.eval, M.STEP, M.VAL_LOSS)[2]
    return min(ys) if ys else None


def find_baseline(groups: list[Group], name: str | None, where: str = "--") -> tuple[Group | None, str | None]:
    """The group ``name`` names (``eslm.analysis.rundir.find_group``: a label, a study's grid point, or a method
    with one group), default clm; (None, reason) when there is no clm group and none was named. Errors name
    the option as ``{where}baseline`` (``--baseline`` on the command line, ``report.baseline`` in a study)."""
    group, why = find_group(groups, name or "clm", f"{where}baseline")
    if group is not None:
        return group, None
    if name or any(g.method == "clm" for g in groups):
        raise ReportError(why)
    return None, f"no clm group among the runs: no paired comparisons (set {where}baseline to compare)"


def _control_for(g: Group, groups: list[Group]) -> Group | None:
    """The random-drop group at the same alpha (the control a selective method must beat), if any."""
    if g.method in ("clm", "random"):
        return None
    alpha = config_alpha(g)
    same = [c for c in groups if c.method == "random" and config_alpha(c) == alpha]
    return same[0] if same else None


def config_alpha(g: Group):
    from eslm.analysis.rundir import config_get

    return config_get(g.runs[0].config, "method.alpha")


def compare(g: Group, base: Group, to_target: dict, base_tt: dict) -> dict:
    """Paired (by seed) differences of ``g`` against ``base``: losses in nats, to-target costs relative."""
    out = {"group": g.label, "against": base.label, "losses": {}, "to_target": {}, "verdicts": []}
    for what, fn in (("final validation loss", _final), ("best validation loss", best_val_loss)):
        ci = S.paired(_per_seed(g, fn), _per_seed(base, fn))
        out["losses"][what] = ci
    out["verdicts"].append(S.loss_verdict(out["losses"]["final validation loss"], "final validation loss",
                                          base.label))
    for key, (_, words) in COSTS.items():
        ci = S.paired(to_target[key]["per_seed"], base_tt[key]["per_seed"], relative=True)
        out["to_target"][key] = ci
        if ci["n"] == 0:
            a, b = to_target[key], base_tt[key]
            out["verdicts"].append(f"{words}: {g.label} reaches the target in {a['reached']}/{a['n']} seeds, "
                                   f"{base.label} in {b['reached']}/{b['n']}: no pair to compare")
        else:
            out["verdicts"].append(S.cost_verdict(ci, words, base.label))
    if all(out["to_target"][k]["n"] == 0 for k in COSTS):  # one line instead of four identical ones
        a, b = to_target[M.FLOPS_PAPER], base_tt[M.FLOPS_PAPER]
        out["verdicts"] = out["verdicts"][:1] + [
            f"reaches the target in {a['reached']}/{a['n']} seeds ({base.label}: {b['reached']}/{b['n']}), "
            "so no to-target cost can be compared"]
    return out


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
    loads = {r.name: run_load(r) for r in runs}
    known = {k: v for k, v in loads.items() if v is not None}
    if len(known) < 2:
        return None
    lo, hi = min(known.values()), max(known.values())
    if hi > LOAD_RATIO_WARN * max(lo, 0.5):
        return (f"runs were taken under different machine loads (mean 1-min load average from {lo:.1f} to "
                f"{hi:.1f}): wall-clock comparisons are skewed; CPU seconds much less so")
    return None


def machine_warning(runs: list[Run]) -> str | None:
    """A warning when compared runs trained with different thread counts or devices (their env.json): such
    settings do not split groups (``MACHINE_KEYS``), but time is not comparable across them."""
    parts = []
    for key, words in (("num_threads", "CPU threads"), ("device", "devices")):
        values: dict[str, int] = {}
        for r in runs:
            if r.env.get(key) is not None:
                values[str(r.env[key])] = values.get(str(r.env[key]), 0) + 1
        if len(values) > 1:
            parts.append(f"{words} " + ", ".join(f"{v} ({n} run{'s' if n > 1 else ''})" for v, n in values.items()))
    if not parts:
        return None
    return (f"the runs trained on different machine settings ({'; '.join(parts)}): they are grouped as seeds of "
            "one experiment all the same, but their times are not comparable (FLOPs and tokens are)")


def summarize(runs: list[Run], groups: list[Group], *, target: float, target_source: str,
              flops: str, skipped: list[dict], warnings: list[str], baseline: str | None = None,
              where: str = "--") -> dict:
    """The machine-readable summary written as summary.json."""
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
        })
    base, why = find_baseline(groups, baseline, where)
    comparisons, controls, gaps = [], [], []
    if why:
        warnings.append(why)
    by_label = {g["label"]: g for g in gs}
    for g in groups:
        if base is not None and g is not base:
            comparisons.append(compare(g, base, tts[g.label], tts[base.label]))
            gap = flops_gap(by_label[g.label], by_label[base.label])
            if gap and g.method != "clm":
                gaps.append(gap)
        ctrl = _control_for(g, groups)
        if ctrl is not None:
            controls.append(compare(g, ctrl, tts[g.label], tts[ctrl.label]))
    warnings += [w for w in (load_warning(runs), machine_warning(runs)) if w]
    return {
        "format": REPORT_FORMAT, "flops_convention": flops, "flops_key": flops_key,
        "time_key": time_key, "time_words": time_words,
        "target_loss": target, "target_source": target_source, "interpolation": INTERPOLATION_NOTE,
        "grouping": "same resolved config except " + ", ".join(IGNORED_FOR_GROUPING),
        "statistics": ("mean over seeds with a 95% Student-t interval (n=1: no interval); comparisons are "
                       "paired by seed (same data order and initial weights), relative for costs"),
        "baseline": base.label if base is not None else None,
        "domains": domains, "groups": gs, "comparisons": comparisons, "controls": controls,
        "flops_gaps": gaps,
        "runs": [{"name": r.name, "path": str(r.path), "method": r.method, "seed": r.seed,
                  "group": group_of[id(r)], "finished": r.finished, "git_commit": r.env.get("git_commit"),
                  "device": r.env.get("device"), M.LOAD_AVG_1M: run_load(r)}
                 for r in runs],
        "skipped": skipped, "warnings": warnings,
    }
