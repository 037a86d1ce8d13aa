"""Per-run series and per-group numbers of ``eslm report``: curves over seeds, the to-target crossing, final
values. Everything here is a pure function of loaded runs (``eslm.analysis.rundir``)."""

from __future__ import annotations

import math
import statistics
from typing import Any

from eslm import metrics as M
from eslm.analysis import stats as S
from eslm.analysis.rundir import Group, Run, is_number


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


def aggregate(values: list) -> dict:
    """mean / min / max / std over the numeric values (None entries ignored), with counts."""
    nums = [float(v) for v in values if is_number(v)]
    out: dict[str, Any] = {"n": len(values), "count": len(nums), "mean": None, "min": None, "max": None,
                           "std": None, "ci_lo": None, "ci_hi": None, "ci_half_width": None}
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
    """Per-run crossing values and their aggregate over the seeds that reached the target (``reached`` = how
    many); ``budget_per_seed``: each run's x at its last evaluation, where a run that never reached the target
    is censored (``censored``: those seeds; ``with_censored``: the aggregate with them at their budget, a lower
    bound on the group's mean cost)."""
    per_run, per_seed, budget = {}, {}, {}
    for r in group.runs:
        _, xs, ys = series(r.eval, x_key, M.VAL_LOSS)
        per_run[r.name] = per_seed[str(r.seed)] = crossing(xs, ys, target)
        budget[str(r.seed)] = float(xs[-1]) if xs else None
    agg = aggregate(list(per_run.values()))
    censored_values, censored = S.censor(per_seed, budget)
    return {"key": x_key, "per_run": per_run, "per_seed": per_seed, "reached": agg.pop("count"), **agg,
            "budget_per_seed": budget, "censored": censored,
            "with_censored": aggregate(list(censored_values.values()))}


def best_val_loss(r: Run):
    """The lowest validation loss of a run's evaluations (None if it has none)."""
    ys = series(r.eval, M.STEP, M.VAL_LOSS)[2]
    return min(ys) if ys else None


def domains_of(runs: list[Run], prefix: str = M.VAL_LOSS_DOMAIN_PREFIX, records_of=lambda r: r.eval) -> list[str]:
    """Domain names that appear in any record (``records_of(run)``: eval lines by default) as ``prefix``<domain>
    (val_loss/<domain> by default), in first-seen order."""
    return list(dict.fromkeys(k[len(prefix):] for r in runs for rec in records_of(r) for k in rec
                              if k.startswith(prefix)))


def last_value(records: list[dict], key: str):
    """The value of ``key`` in the last record that has it (None if none)."""
    return next((rec[key] for rec in reversed(records) if is_number(rec.get(key))), None)


def group_final(group: Group, domains: list[str]) -> dict:
    """Final and best validation losses, final counters, per-domain final losses: aggregated over seeds."""
    runs = group.runs
    out = {
        "final_val_loss": aggregate([last_value(r.eval, M.VAL_LOSS) for r in runs]),
        "best_val_loss": aggregate([best_val_loss(r) for r in runs]),
        "final_val_loss_domain": {d: aggregate([last_value(r.eval, M.val_loss_key(d)) for r in runs])
                                  for d in domains},
    }
    for key in (M.STEP, M.TOKENS_SEEN, M.FLOPS_PAPER, M.FLOPS_EXECUTED, M.ELAPSED_S):
        out["final_" + key] = aggregate([last_value(r.eval, key) for r in runs])
    return out
