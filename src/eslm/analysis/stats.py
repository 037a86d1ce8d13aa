"""Across-seed statistics for reports: Student-t intervals, paired differences (relative ones geometric: the t
interval of log(x / y)), the minimum detectable effect, Holm's adjustment, censored costs, spread and
equivalence (docs/report.md, "Statistics and verdicts"). The distributions are scipy's; the words that say what
the numbers mean are the report's (``eslm.analysis.report.verdicts``).
"""

from __future__ import annotations

import functools
import math
import statistics
from typing import Any

from scipy import stats as st
from scipy.optimize import brentq

LEVEL = 0.95


def finite(values) -> list[float]:
    """The finite numbers of ``values`` (None left out)."""
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def mean_ci(values, level: float = LEVEL) -> dict:
    """{"n", "mean", "std", "lo", "hi", "half_width"} of the finite numbers in ``values``; lo/hi/half_width
    are None when fewer than 2 values (no interval), mean/std None when there is none."""
    nums = finite(values)
    n = len(nums)
    out: dict[str, Any] = {"n": n, "mean": None, "std": None, "lo": None, "hi": None, "half_width": None,
                           "level": level}
    if n == 0:
        return out
    out["mean"] = statistics.fmean(nums)
    if n < 2:
        return out
    sd = statistics.stdev(nums)
    half = float(st.t.ppf(0.5 + level / 2.0, n - 1)) * sd / math.sqrt(n)
    out.update(std=sd, lo=out["mean"] - half, hi=out["mean"] + half, half_width=half)
    return out


def paired(x: dict, y: dict, *, relative: bool = False, level: float = LEVEL) -> dict:
    """Paired differences of two {seed: value} maps over the seeds both have with finite values.

    relative=False: d = x - y. Returns mean_ci of the d's plus ``per_seed`` {seed: d}, ``unpaired`` (seeds
    present in one map only, or with a missing value), ``p`` (the two-sided paired t test of a zero mean) and
    ``mde`` (the smallest true mean difference that test detects with 80% power, from the observed spread).

    relative=True (costs, positive values): the geometric mean of the per-seed ratios x / y, as x / y - 1
    (docs/report.md); the t interval, p and mde of log(x / y) are in ``log``; ``per_seed`` holds x / y - 1, and
    ``arithmetic`` the plain mean of those with its interval."""
    def ok(v):
        return v is not None and math.isfinite(float(v)) and (not relative or float(v) > 0.0)

    seeds = [s for s in x if s in y and ok(x[s]) and ok(y[s])]
    d = {s: float(x[s]) / float(y[s]) - 1.0 if relative else float(x[s]) - float(y[s]) for s in seeds}
    out = mean_ci([math.log(float(x[s]) / float(y[s])) for s in seeds] if relative else list(d.values()), level)
    out.update(p=p_value(out), mde=mde(out["std"], out["n"], level=level))
    if relative:
        logs, back = out, lambda v: None if v is None else math.expm1(v)
        out = {"n": logs["n"], "mean": back(logs["mean"]), "std": logs["std"], "lo": back(logs["lo"]),
               "hi": back(logs["hi"]), "half_width": None, "level": level, "p": logs["p"], "mde": back(logs["mde"]),
               "log": logs, "arithmetic": mean_ci(list(d.values()), level)}
    out["per_seed"] = d
    out["unpaired"] = sorted({*x, *y} - set(seeds), key=str)
    out["relative"] = relative
    return out


def significant(ci: dict, alpha: float = 1.0 - LEVEL) -> int:
    """-1 if the difference is below 0, +1 above 0, 0 if not shown (or no interval). With a Holm-adjusted
    p-value (``p_adjusted``, set by the report for the comparisons of a family) the adjusted p must also be
    below ``alpha``; otherwise the 95% interval must exclude 0."""
    if ci.get("lo") is None or (ci.get("p_adjusted") is not None and not ci["p_adjusted"] < alpha):
        return 0
    return -1 if ci["hi"] < 0 else 1 if ci["lo"] > 0 else 0


# ---------------------------------------------------------------- power: what a comparison could have seen

POWER = 0.8


def _power(ncp: float, df: int, crit: float) -> float:
    """Power of the two-sided t test with critical value ``crit`` at noncentrality ``ncp``. The lower tail
    P(T' < -crit) is written as the upper tail of -T' (noncentrality -ncp): scipy's nct.cdf returns nan far
    in that tail."""
    return float(st.nct.sf(crit, df, ncp) + st.nct.sf(crit, df, -ncp))


def mde(sd: float | None, n: int, power: float = POWER, level: float = LEVEL) -> float | None:
    """The minimum detectable effect: the smallest true mean difference that the two-sided paired t test at
    1 - ``level`` detects with probability ``power``, for n pairs of standard deviation ``sd`` (in sd's unit).
    None with fewer than 2 pairs or no spread. In units of sd it depends on n only: 3.26 sd with
    3 pairs, 1.68 sd with 5, 1.00 sd with 10, 0.66 sd with 20."""
    if sd is None or n < 2 or not sd > 0 or not math.isfinite(sd):
        return None
    return _detectable_ncp(n - 1, power, level) * sd / math.sqrt(n)


@functools.cache
def _detectable_ncp(df: int, power: float, level: float) -> float:
    """The noncentrality at which the two-sided t test with ``df`` degrees of freedom has ``power``."""
    crit = float(st.t.ppf(0.5 + level / 2.0, df))
    hi = 1.0
    while _power(hi, df, crit) < power:
        hi *= 2.0
    return float(brentq(lambda ncp: _power(ncp, df, crit) - power, 0.0, hi, xtol=1e-12, rtol=1e-12))


def p_value(ci: dict) -> float | None:
    """Two-sided p-value of the paired t test that the mean difference is 0 (None below 2 pairs; 1.0 or 0.0
    when the differences have no spread)."""
    n, m, sd = ci.get("n", 0), ci.get("mean"), ci.get("std")
    if n < 2 or m is None or sd is None:
        return None
    if sd == 0.0:
        return 1.0 if m == 0.0 else 0.0
    return min(1.0, 2.0 * float(st.t.sf(abs(m) / (sd / math.sqrt(n)), n - 1)))


def holm(pvalues: list) -> list:
    """Holm's step-down adjusted p-values, in the input order (None entries stay None, outside the family).

    With the m p-values sorted ascending, p_(1) <= ... <= p_(m): adj_(i) = max over j <= i of
    min(1, (m - j + 1) p_(j))."""
    idx = [i for i, p in enumerate(pvalues) if p is not None]
    order = sorted(idx, key=lambda i: pvalues[i])
    m = len(order)
    out: list = [None] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        out[i] = running
    return out


def holm_adjust(cis: list[dict]) -> int:
    """Holm-adjust, in place, the intervals of ``cis`` that have a p-value (``p_adjusted``, and ``family``: how
    many they are); returns that number."""
    members = [ci for ci in cis if ci.get("p") is not None]
    for ci, adj in zip(members, holm([ci["p"] for ci in members])):
        ci["p_adjusted"], ci["family"] = adj, len(members)
    return len(members)


# ---------------------------------------------------------------- censoring of to-target costs


def censor(values: dict, budgets: dict) -> tuple[dict, list]:
    """To-target costs with the runs that never reached the target censored at their budget.

    ``values``: {seed: cost, or None when the run never reached the target}; ``budgets``: {seed: the run's cost
    at its last evaluation}. Returns ({seed: cost or budget}, [censored seeds]); a seed with neither a cost nor a
    budget is left out."""
    censored = [s for s, v in values.items() if not finite([v]) and finite([budgets.get(s)])]
    return {s: float(budgets[s]) if s in censored else next(iter(finite([v])), None)
            for s, v in values.items()}, censored


def paired_censored(x: dict, y: dict, x_budget: dict, y_budget: dict, *, level: float = LEVEL) -> dict:
    """Relative paired differences (x - y) / y of to-target costs, a seed that never reached the target counted
    at its budget (``censor``). Pairs where both runs are censored say nothing about the difference and are
    left out (``both_censored``). Adds ``censored_x`` / ``censored_y`` (seeds censored in the pairs used) and
    ``bias``: "x" when only x has censored seeds (the difference understates x's cost: biased in x's
    favour), "y" the other way, "both", or None."""
    xc, x_cens = censor(x, x_budget)
    yc, y_cens = censor(y, y_budget)
    both = sorted(set(x_cens) & set(y_cens), key=str)
    for s in both:
        xc[s] = yc[s] = None
    out = paired(xc, yc, relative=True, level=level)
    used = set(out["per_seed"])
    out["censored_x"] = sorted((s for s in x_cens if s in used), key=str)
    out["censored_y"] = sorted((s for s in y_cens if s in used), key=str)
    out["both_censored"] = both
    cx, cy = bool(out["censored_x"]), bool(out["censored_y"])
    out["bias"] = "both" if cx and cy else "x" if cx else "y" if cy else None
    return out


# ---------------------------------------------------------------- spread between seeds, equivalence


def sd_ci(values, level: float = LEVEL) -> dict:
    """{"n", "sd", "lo", "hi", "level"}: the sample standard deviation of the finite ``values`` and its
    two-sided interval from the chi-squared distribution of (n - 1) s^2 / sigma^2 (normal values):
    s sqrt((n - 1) / chi2_{(1 + level) / 2}) to s sqrt((n - 1) / chi2_{(1 - level) / 2}). No interval below 2."""
    nums = finite(values)
    n = len(nums)
    out = {"n": n, "sd": None, "lo": None, "hi": None, "level": level}
    if n < 2:
        return out
    s = statistics.stdev(nums)
    out["sd"] = s
    out["lo"] = s * math.sqrt((n - 1) / float(st.chi2.ppf(0.5 + level / 2.0, n - 1)))
    out["hi"] = s * math.sqrt((n - 1) / float(st.chi2.ppf(0.5 - level / 2.0, n - 1)))
    return out


def sd_upper(sd: float, n: int, confidence: float = 0.8) -> float:
    """The one-sided upper ``confidence`` limit of a standard deviation ``sd`` measured over ``n`` values:
    sd sqrt((n - 1) / chi2_{1 - confidence, n - 1}). A study planned from it is planned for a spread the
    pilot does not rule out, not for the pilot's point estimate (with 5 values the upper 80% limit is 1.56 sd)."""
    return sd * math.sqrt((n - 1) / float(st.chi2.ppf(1.0 - confidence, n - 1)))


def pairs_for_mde(sd: float, target: float, power: float = 0.8, level: float = LEVEL, most: int = 10000) -> int:
    """The fewest pairs whose two-sided paired t test detects a mean difference ``target`` with ``power``
    when the differences' standard deviation is ``sd`` (``mde(sd, n) <= target``)."""
    n = 2
    while n < most:
        m = mde(sd, n, power, level)
        assert m is not None, "pairs_for_mde needs a finite sd > 0"
        if m <= target:
            break
        n += 1
    return n


def spread_comparison(x: dict, y: dict, level: float = LEVEL) -> dict:
    """Whether two groups' final values spread differently across seeds, {seed: value} each.

    ``ratio``: s_x / s_y with its interval from F(n_x - 1, n_y - 1); ``p_f``: the two-sided F test of equal
    variances (independent samples: it ignores the pairing by seed); ``p_paired``: the Pitman-Morgan test,
    which uses it (equal variances iff x - y and x + y are uncorrelated; t with n - 2 degrees of freedom over
    the seeds both groups have). None where a group has fewer than 2 values (3 pairs for Pitman-Morgan)."""
    xs, ys = finite(x.values()), finite(y.values())
    out = {"n_x": len(xs), "n_y": len(ys), "ratio": None, "lo": None, "hi": None, "p_f": None, "p_paired": None,
           "n_pairs": 0, "level": level}
    if len(xs) < 2 or len(ys) < 2:
        return out
    vx, vy = statistics.variance(xs), statistics.variance(ys)
    d1, d2 = len(xs) - 1, len(ys) - 1
    if vy > 0 and vx > 0:
        f = vx / vy
        out["ratio"] = math.sqrt(f)
        out["lo"] = math.sqrt(f / float(st.f.ppf(0.5 + level / 2.0, d1, d2)))
        out["hi"] = math.sqrt(f / float(st.f.ppf(0.5 - level / 2.0, d1, d2)))
        out["p_f"] = min(1.0, 2.0 * float(min(st.f.cdf(f, d1, d2), st.f.sf(f, d1, d2))))
    seeds = [s for s in x if s in y and len(finite([x[s], y[s]])) == 2]
    out["n_pairs"] = n = len(seeds)
    if n >= 3:
        sums = [float(x[s]) + float(y[s]) for s in seeds]
        diffs = [float(x[s]) - float(y[s]) for s in seeds]
        if statistics.pstdev(sums) > 0 and statistics.pstdev(diffs) > 0:
            out["p_paired"] = float(st.pearsonr(sums, diffs).pvalue)  # its t test with n - 2 degrees of freedom
    return out


def tost(ci: dict, margin: float, alpha: float = 1.0 - LEVEL) -> dict | None:
    """Two one-sided paired t tests of equivalence within +-``margin`` for the mean difference of ``ci``
    (``paired``): H0 mean <= -margin against mean > -margin, and H0 mean >= margin against mean < margin.
    ``p`` is the larger one-sided p; ``equivalent`` when it is below ``alpha``, the same as the (1 - 2 alpha)
    interval (``lo90``, ``hi90`` at alpha 5%) lying inside (-margin, margin). None below 2 pairs."""
    n, m, sd = ci.get("n", 0), ci.get("mean"), ci.get("std")
    if n < 2 or m is None or sd is None or not margin > 0:
        return None
    df = n - 1
    se = sd / math.sqrt(n)
    if se == 0.0:
        p_low, p_high = (0.0 if m > -margin else 1.0), (0.0 if m < margin else 1.0)
    else:
        p_low = float(st.t.sf((m + margin) / se, df))
        p_high = float(st.t.cdf((m - margin) / se, df))
    half = float(st.t.ppf(1.0 - alpha, df)) * se
    p = max(p_low, p_high)
    return {"margin": margin, "p_lower": p_low, "p_upper": p_high, "p": p, "equivalent": p < alpha,
            "lo90": m - half, "hi90": m + half, "alpha": alpha}
