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
* Costs, side by side: ``flops_paper`` (the paper's convention: backward counted on kept tokens only),
  ``flops_executed`` (what ran), tokens seen, and time. Time is process CPU seconds (``cpu_s``) when every
  run trained on a CPU, wall-clock (``elapsed_s``, device synchronised at step ends) otherwise; evaluation
  is excluded from both.
* Statistics (``eslm.analysis.stats``): every group value has a 95% Student-t interval over seeds ("n=1, no
  interval" for one seed); every group is compared with the baseline group (CLM by default) by paired
  differences per seed, and every selective group with the random-drop control at the same alpha, each
  with a verdict in words.
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
from eslm.analysis import stats as S
from eslm.analysis.rundir import IGNORED_FOR_GROUPING, Group, Run, RunDirError, group_runs, is_number, load_run
from eslm.errors import ESLMError

FLOPS_KEYS = {"paper": M.FLOPS_PAPER, "executed": M.FLOPS_EXECUTED}
# to-target costs shown side by side: key in summary["groups"][i]["to_target"] -> (metric, words)
COSTS = {"flops_paper": (M.FLOPS_PAPER, "paper-FLOPs"), "flops_executed": (M.FLOPS_EXECUTED, "executed FLOPs"),
         "tokens": (M.TOKENS_SEEN, "tokens"), "time_s": (None, "time")}  # time: cpu_s or elapsed_s, see time_key
LOAD_RATIO_WARN = 1.5  # warn when the mean load of compared runs differs by more than this factor
REPORT_FORMAT = "eslm-report-v1"
INTERPOLATION_NOTE = ("first eval point with val_loss <= target; the crossing between it and the previous eval "
                      "point is interpolated linearly in log(x) (linearly in x if the previous x is 0); "
                      "never reached = null")


class ReportError(ESLMError):
    """Nothing to report on, or report options that cannot be honoured."""


def print_summary(summary: dict, out: Path) -> None:
    """Warnings to stderr; the verdicts and where the report is to stdout."""
    for w in summary["warnings"]:
        print(f"eslm report: warning: {w}", file=sys.stderr)
    for c in summary["comparisons"]:
        print(f"{c['group']}: " + "; ".join(c["verdicts"]))
    print(f"wrote {Path(out) / 'index.html'} ({len(summary['groups'])} groups, {len(summary['runs'])} runs)")


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
    out = {"n": len(values), "count": len(nums), "mean": None, "min": None, "max": None, "std": None,
           "ci_lo": None, "ci_hi": None, "ci_half_width": None}
    if nums:
        ci = S.mean_ci(nums)
        out.update(mean=ci["mean"], min=min(nums), max=max(nums), std=ci["std"] if len(nums) > 1 else 0.0,
                   ci_lo=ci["lo"], ci_hi=ci["hi"], ci_half_width=ci["half_width"])
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
    n = len(per_run)
    if n >= 3:  # the across-seed 95% interval of the mean; with 2 seeds it is too wide to read: min..max
        cis = [S.mean_ci(pick(s, 1)) for s in common]
        lo, hi, band = [c["lo"] for c in cis], [c["hi"] for c in cis], "95% CI"
    else:
        lo, hi, band = [min(pick(s, 1)) for s in common], [max(pick(s, 1)) for s in common], "min-max"
    return {"label": group.label, "n": n, "x": [statistics.fmean(pick(s, 0)) for s in common],
            "mean": [statistics.fmean(pick(s, 1)) for s in common], "lo": lo, "hi": hi, "band": band}


def to_target(group: Group, x_key: str, target: float) -> dict:
    """Per-run crossing values and their aggregate (``reached`` = how many seeds reached the target)."""
    per_run, per_seed = {}, {}
    for r in group.runs:
        _, xs, ys = series(r.eval, x_key, M.VAL_LOSS)
        per_run[r.name] = per_seed[str(r.seed)] = crossing(xs, ys, target)
    agg = aggregate(list(per_run.values()))
    return {"key": x_key, "per_run": per_run, "per_seed": per_seed, "reached": agg.pop("count"), **agg}


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


def _best(r: Run):
    ys = series(r.eval, M.STEP, M.VAL_LOSS)[2]
    return min(ys) if ys else None


def find_baseline(groups: list[Group], name: str | None) -> tuple[Group | None, str | None]:
    """The group named ``name`` (a label, or a method with one group), default clm; (None, reason) if none."""
    want = name or "clm"
    by_label = [g for g in groups if g.label == want]
    by_method = [g for g in groups if g.method == want]
    if by_label:
        return by_label[0], None
    if len(by_method) == 1:
        return by_method[0], None
    if by_method:
        labels = ", ".join(g.label for g in by_method)
        raise ReportError(f"expected --baseline to name one group, found {len(by_method)} groups of method "
                          f"{want!r} ({labels}); pass one of those labels")
    if name:
        raise ReportError(f"expected --baseline to name a group or method, found no group {name!r}; "
                          f"groups: {', '.join(g.label for g in groups)}")
    return None, "no clm group among the runs: no paired comparisons (pass --baseline NAME)"


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
    for what, fn in (("final validation loss", _final), ("best validation loss", _best)):
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
        a, b = to_target["flops_paper"], base_tt["flops_paper"]
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


def summarize(runs: list[Run], groups: list[Group], *, target: float, target_source: str,
              flops: str, skipped: list[dict], warnings: list[str], baseline: str | None = None) -> dict:
    """The machine-readable summary written as summary.json."""
    flops_key = FLOPS_KEYS[flops]
    time_key, time_words = time_key_of(runs)
    domains = domains_of(runs)
    group_of = {id(r): g.label for g in groups for r in g.runs}
    gs, tts = [], {}
    for g in groups:
        tt = {key: to_target(g, metric or time_key, target) for key, (metric, _) in COSTS.items()}
        tt["flops"] = tt["flops_paper" if flops == "paper" else "flops_executed"]
        tts[g.label] = tt
        gs.append({
            "label": g.label, "method": g.method, "settings": g.settings,
            "runs": [r.name for r in g.runs], "seeds": [r.seed for r in g.runs],
            "unfinished": [r.name for r in g.runs if not r.finished],
            "to_target": tt, **group_final(g, domains),
            "final_" + M.CPU_S: aggregate([last_value(r.eval, M.CPU_S) for r in g.runs]),
            "load_avg_1m": aggregate([run_load(r) for r in g.runs]),
            # executed FLOPs per dense (plain CLM) FLOPs on the same tokens: what a step of the method costs in
            # CLM steps (GREATS' scoring passes and gradient inner products, ESLM's routes, KD teachers, ...)
            "step_cost_vs_clm": aggregate([_ratio(last_value(r.eval, M.FLOPS_EXECUTED),
                                                  last_value(r.eval, M.FLOPS_DENSE)) for r in g.runs]),
            "downstream": group_downstream(g),
        })
    base, why = find_baseline(groups, baseline)
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
    lw = load_warning(runs)
    if lw:
        warnings.append(lw)
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
                  "device": r.env.get("device"), "load_avg_1m": run_load(r)}
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
        ci = t["ci_lo"] is not None  # whisker: the 95% interval over seeds (min..max would hide n)
        out.append({"label": g["label"], "mean": t["mean"], "lo": t["ci_lo"] if ci else t["min"],
                    "hi": t["ci_hi"] if ci else t["max"], "reached": t["reached"], "n": t["n"]})
    return out


def make_figures(out: Path, groups: list[Group], summary: dict) -> dict[str, str]:
    """Write every PNG; returns {figure id: file name} of those written."""
    colors = figures.color_map([g.label for g in groups])
    flops_key, target, flops = summary["flops_key"], summary["target_loss"], summary["flops_convention"]
    ev = lambda r: r.eval  # noqa: E731
    written = {}
    axes = [("loss_vs_flops", flops_key, f"training FLOPs ({flops} convention)", True),
            ("loss_vs_tokens", M.TOKENS_SEEN, "tokens seen", True),
            ("loss_vs_time", summary["time_key"], summary["time_words"], False)]
    for fig_id, x_key, xlabel, logx in axes:
        s = _curve_set(groups, ev, x_key, M.VAL_LOSS)
        if s:
            figures.curves(out / f"{fig_id}.png", s, colors, xlabel=xlabel, ylabel="validation loss",
                           title=f"Validation loss vs {xlabel.split(' (')[0]}", logx=logx, logy=True, hline=target)
            written[fig_id] = f"{fig_id}.png"
    for fig_id, what, ylabel in (("flops_to_target", "flops_paper", "FLOPs (paper convention)"),
                                 ("executed_to_target", "flops_executed", "FLOPs (executed)"),
                                 ("tokens_to_target", "tokens", "tokens seen"),
                                 ("time_to_target", "time_s", summary["time_words"])):
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
    """'mean ± 95% half-width (n=k)', or 'mean (n=1, no interval)'."""
    if a["count"] == 0:
        return "—"
    s = _fmt(a["mean"], spec)
    if a["count"] > 1 and a.get("ci_half_width") is not None:
        return s + f" ± {_fmt(a['ci_half_width'], spec)} <small>(n={a['count']})</small>"
    return s + " <small>(n=1, no interval)</small>"


def _target_cell(t: dict, spec=".3g") -> str:
    if t["reached"] == 0:
        return "not reached"
    s = _agg_cell({**t, "count": t["reached"]}, spec)
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


def _summary_table(summary: dict) -> str:
    rows = []
    for g in summary["groups"]:
        rows.append([_label(g), str(len(g["runs"])), _agg_cell(g["final_val_loss"], ".4f"),
                     _agg_cell(g["best_val_loss"], ".4f"), _agg_cell(g["final_" + M.STEP], ".4g"),
                     _agg_cell(g["final_" + M.FLOPS_PAPER], ".3g"), _agg_cell(g["final_" + M.FLOPS_EXECUTED], ".3g"),
                     _agg_cell(g["step_cost_vs_clm"], ".3f"), _agg_cell(g["final_" + summary["time_key"]], ".3g")])
    time_head = "CPU s" if summary["time_key"] == M.CPU_S else "wall-clock s"
    return _table(["group", "seeds", "final val loss", "best val loss", "steps", "flops_paper", "flops_executed",
                   "executed per step / CLM step", time_head], rows)


def _costs_table(summary: dict) -> str:
    """To-target costs in both FLOPs conventions, tokens and time, side by side."""
    rows = [[_label(g)] + [_target_cell(g["to_target"][k]) for k in COSTS] for g in summary["groups"]]
    time_head = "CPU s" if summary["time_key"] == M.CPU_S else "wall-clock s"
    return _table(["group", "flops_paper to target", "flops_executed to target", "tokens to target",
                   f"{time_head} to target"], rows)


def _comparison_table(comparisons: list[dict]) -> str:
    """Paired differences per group: final loss (nats) and relative to-target costs, with 95% intervals."""
    def cell(ci, rel):
        if ci["n"] == 0:
            return "—"
        spec = "+.1%" if rel else "+.4f"
        mark = {-1: " ▼", 1: " ▲", 0: ""}[S.significant(ci)]
        if ci["lo"] is None:
            return f"{ci['mean']:{spec}} <small>(n=1)</small>"
        return f"{ci['mean']:{spec}} [{ci['lo']:{spec}}, {ci['hi']:{spec}}]{mark} <small>(n={ci['n']})</small>"

    rows = [[html.escape(c["group"]), html.escape(c["against"]),
             cell(c["losses"]["final validation loss"], False)]
            + [cell(c["to_target"][k], True) for k in COSTS] for c in comparisons]
    return _table(["group", "vs", "Δ final val loss (nats)", "Δ flops_paper", "Δ flops_executed", "Δ tokens",
                   "Δ time"], rows)


def _verdicts_html(summary: dict) -> str:
    parts = []
    if summary["baseline"] is None:
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
        "<h2>Verdicts</h2>", _verdicts_html(s),
        "<p class='note'>Paired by seed: for one seed every run saw the same data order and started from the "
        "same weights. Intervals are 95% Student-t intervals of the mean paired difference over seeds; "
        "\"no difference detectable\" means the interval contains 0. To-target costs are compared relative to "
        "the baseline's (−10% = 10% less).</p>",
        "<h2>Summary</h2>", _summary_table(s),
        "<p class='note'>Mean over the seeds of a group ± the half-width of its 95% Student-t interval. "
        "<i>Executed per step / CLM step</i>: flops_executed / flops_dense, what one step of the method executes "
        "in units of a plain CLM step on the same tokens (e.g. GREATS' scoring and gradient inner products).</p>",
        f"<h2>Cost to reach validation loss {s['target_loss']:.4g}</h2>", _costs_table(s),
        f"<p class='note'>To-target values: {html.escape(s['interpolation'])}. A group mean covers only the "
        f"seeds that reached the target. Time: {html.escape(s['time_words'])}.</p>",
        "<h2>Paired differences</h2>", _comparison_table(s["comparisons"] + s["controls"]),
        "<p class='note'>▼ / ▲: the interval lies below / above zero.</p>",
        "<h2>Groups</h2>",
        f"<p class='note'>Runs are grouped when their resolved config.yaml files are identical except for "
        f"{', '.join('<code>' + k + '</code>' for k in IGNORED_FOR_GROUPING)}; a group is drawn as the mean "
        "curve over its seeds with a shaded band (the 95% interval of the mean with 3 or more seeds, min–max "
        "with 2), on the eval steps every seed has.</p>",
        _groups_table(s),
        "<h2>Validation loss</h2>", _img(written, "loss_vs_flops", "validation loss vs FLOPs (log-log)"),
        _img(written, "loss_vs_tokens", "validation loss vs tokens"),
        _img(written, "loss_vs_time", "validation loss vs wall-clock"),
        "<h2>Cost to reach the target loss (figures)</h2>", _img(written, "flops_to_target", "paper FLOPs to target"),
        _img(written, "executed_to_target", "executed FLOPs to target"),
        _img(written, "tokens_to_target", "tokens to target"), _img(written, "time_to_target", "time to target"),
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


# ---------------------------------------------------------------- Markdown


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


def render_markdown(summary: dict) -> str:
    """The summary as Markdown (summary.md): one table of groups with intervals and paired differences, then
    the verdicts. Paste-able into a README."""
    s = summary
    comp = {c["group"]: c for c in s["comparisons"]}
    ctrl = {c["group"]: c for c in s["controls"]}
    t_words = "CPU s" if s["time_key"] == M.CPU_S else "wall-clock s"
    base = s["baseline"] or "baseline"
    head = (f"| group | n | final val loss | Δ final loss vs {base} | Δ vs random (same alpha) | "
            f"to target, Δ flops_paper vs {base} | Δ flops_executed | Δ {t_words} | reached | step cost / CLM |")
    lines = [head, "|" + "---|" * 10]
    for g in s["groups"]:
        c, r = comp.get(g["label"]), ctrl.get(g["label"])
        tt = g["to_target"]["flops_paper"]
        lines.append("| " + " | ".join([
            g["label"], str(g["final_val_loss"]["count"]), _md_ci(g["final_val_loss"], ".4f"),
            _md_paired(c["losses"]["final validation loss"] if c else None, False),
            _md_paired(r["losses"]["final validation loss"] if r else None, False),
            _md_paired(c["to_target"]["flops_paper"] if c else None, True),
            _md_paired(c["to_target"]["flops_executed"] if c else None, True),
            _md_paired(c["to_target"]["time_s"] if c else None, True),
            f"{tt['reached']}/{tt['n']}", _md_ci(g["step_cost_vs_clm"], ".3f")]) + " |")
    notes = [f"Target validation loss {s['target_loss']:.4f} ({s['target_source']}). Mean ± 95% Student-t "
             f"half-width over seeds; Δ: mean paired (by seed) difference [95% interval], relative for costs; "
             f"**↓**/**↑**: the interval excludes 0. Time: {s['time_words']}."]
    verdicts = [f"- **{c['group']}** vs {c['against']}: " + "; ".join(c["verdicts"])
                for c in s["comparisons"] + s["controls"]]
    gaps = [f"- {x}." for x in s["flops_gaps"]]
    warn = [f"- warning: {w}" for w in s["warnings"]]
    return "\n".join(lines + [""] + notes + [""] + verdicts + [""] + gaps + ([""] + warn if warn else [])) + "\n"


# ---------------------------------------------------------------- entry point


def build_report(run_dirs: list[str], out_dir: str | Path, *, target_loss: float | None = None,
                 flops: str = "paper", baseline: str | None = None) -> dict:
    """Read the runs, write ``out_dir``/index.html, the PNGs and summary.json; return the summary."""
    if flops not in FLOPS_KEYS:
        raise ReportError(f"expected --flops in {sorted(FLOPS_KEYS)}, found {flops!r}; pick one of them")
    if target_loss is not None and target_loss != "baseline" and not (is_number(target_loss) and target_loss > 0):
        raise ReportError(f"expected a positive --target or 'baseline', found {target_loss!r}; pass e.g. --target 3.5")
    runs, skipped, warnings = load_runs(run_dirs)
    groups = group_runs(runs)
    if target_loss == "baseline":
        base, why = find_baseline(groups, baseline)
        if base is None:
            raise ReportError(f"expected a baseline group for --target baseline, found none ({why})")
        target = max(v for r in base.runs if is_number(v := _best(r)))
        source = (f"the loss every seed of the baseline group {base.label} reaches: max over its seeds of the "
                  "best validation loss")
    elif target_loss is not None:
        target, source = float(target_loss), "given"
    else:
        target, source = default_target(runs), "the lowest loss every run reaches: max over runs of min val_loss"
    summary = summarize(runs, groups, target=target, target_source=source, flops=flops,
                        skipped=skipped, warnings=warnings, baseline=baseline)
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
    (out / "summary.md").write_text(render_markdown(summary), encoding="utf-8")
    return summary
