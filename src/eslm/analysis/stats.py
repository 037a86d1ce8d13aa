"""Across-seed statistics for reports: Student-t intervals, paired differences and plain-words verdicts.

Pure Python (no scipy): the t quantile is found by bisection on the t CDF, which is written with the
regularized incomplete beta function (continued fraction, Numerical Recipes' ``betacf``):

    P(T <= t) = 1 - I_{df / (df + t^2)}(df / 2, 1/2) / 2      for t >= 0.

Interval of a mean over n seeds: mean +- t_{(1+level)/2, n-1} * s / sqrt(n), s the sample standard deviation
(n - 1 in the denominator). With n = 1 there is no interval ("n=1, no interval").

Paired differences: the runs of two groups are matched by seed (same data order and same initial weights for
a seed, see eslm.study), d_i = x_i - y_i (absolute), and the interval is the t interval of the d_i; relative
differences (costs) are geometric: the t interval of log(x_i / y_i), shown as exp(.) - 1. Pairing removes
the between-seed variance that both runs share; how much that is depends on how strongly the seeds' results
are correlated across the two groups (in the confirmatory CPU study, hardly: the paired SD was what
independent runs would give). A branched study (eslm.study) shares the early phase itself.

What a comparison could not see (``mde``): the smallest true mean difference that a two-sided paired t test
at 5% detects with 80% power, given n pairs and their standard deviation s. Power is computed from the
noncentral t distribution (T' = (Z + delta) / sqrt(V / df), V chi-squared with df = n - 1 degrees of
freedom, delta = d sqrt(n) / s), integrated numerically over sqrt(V / df); ``mde`` solves power = 0.8 for d:
1.68 s with 5 pairs, 1.00 s with 10, tending to (z_0.975 + z_0.8) s / sqrt(n) = 2.80 s / sqrt(n). s is the
observed one: a sensitivity analysis of the design that ran, not a claim about the true spread.

Multiplicity (``holm``): Holm's step-down adjustment of the p-values of a family of comparisons; the report
adjusts every comparison except the one the study names as primary.

Costs to a target (``censor``): a run that never reaches the target is censored at its budget (its cost at its
last evaluation, a lower bound on what it would need), not dropped.
"""

from __future__ import annotations

import functools
import math
import statistics
from typing import Any

LEVEL = 0.95


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b) for x in [0, 1]."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbeta = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbeta) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbeta) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (bisection to 1e-12 on the CDF)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"expected 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


def mean_ci(values, level: float = LEVEL) -> dict:
    """{"n", "mean", "std", "lo", "hi", "half_width"} of the finite numbers in ``values``; lo/hi/half_width
    are None when fewer than 2 values (no interval), mean/std None when there is none."""
    nums = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(nums)
    out: dict[str, Any] = {"n": n, "mean": None, "std": None, "lo": None, "hi": None, "half_width": None,
                           "level": level}
    if n == 0:
        return out
    out["mean"] = statistics.fmean(nums)
    if n < 2:
        return out
    sd = statistics.stdev(nums)
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    out.update(std=sd, lo=out["mean"] - half, hi=out["mean"] + half, half_width=half)
    return out


def paired(x: dict, y: dict, *, relative: bool = False, level: float = LEVEL) -> dict:
    """Paired differences of two {seed: value} maps over the seeds both have with finite values.

    relative=False: d = x - y. Returns mean_ci of the d's plus ``per_seed`` {seed: d}, ``unpaired`` (seeds
    present in one map only, or with a missing value), ``p`` (the two-sided paired t test of a zero mean) and
    ``mde`` (the smallest true mean difference that test detects with 80% power, from the observed spread).

    relative=True (costs, positive values): the geometric mean of the per-seed ratios x / y, as x / y - 1: the
    t interval, p and mde are those of log(x / y) (in ``log``) carried back by exp(.) - 1, so a cost twice as
    high and one half as high cancel; ``per_seed`` holds x / y - 1, and ``arithmetic`` the plain mean of those
    with its interval, shown beside it."""
    def ok(v):
        return v is not None and math.isfinite(float(v)) and (not relative or float(v) > 0.0)

    seeds = [s for s in x if s in y and ok(x[s]) and ok(y[s])]
    if not relative:
        d = {s: float(x[s]) - float(y[s]) for s in seeds}
        out = mean_ci(list(d.values()), level)
        out["p"] = p_value(out)
        out["mde"] = mde(out["std"], out["n"], level=level)
    else:
        d = {s: float(x[s]) / float(y[s]) - 1.0 for s in seeds}
        logs = mean_ci([math.log(float(x[s]) / float(y[s])) for s in seeds], level)
        logs["p"] = p_value(logs)
        logs["mde"] = mde(logs["std"], logs["n"], level=level)

        def back(v):
            return None if v is None else math.expm1(v)

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
    if ci.get("lo") is None:
        return 0
    adjusted = ci.get("p_adjusted")
    if adjusted is not None and not adjusted < alpha:
        return 0
    if ci["hi"] < 0:
        return -1
    if ci["lo"] > 0:
        return 1
    return 0


def _pct(v: float) -> str:
    return f"{100.0 * v:.1f}%"


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
        return f"{v:+.1%}" if signed else _pct(v)

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


# ---------------------------------------------------------------- power: what a comparison could have seen

POWER = 0.8


def normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def nct_cdf(t: float, df: float, ncp: float) -> float:
    """P(T' <= t) for the noncentral t with ``df`` degrees of freedom and noncentrality ``ncp``.

    T' = (Z + ncp) / S with S = sqrt(V / df), V chi-squared(df): P(T' <= t) = E[Phi(t S - ncp)], integrated
    by Simpson's rule over the density of S, f(s) = 2 (df/2)^(df/2) s^(df-1) exp(-df s^2 / 2) / Gamma(df/2),
    on the range that holds all but ~1e-30 of its mass."""
    if df <= 0:
        raise ValueError(f"expected df > 0, got {df}")
    spread = 1.0 / math.sqrt(2.0 * df)  # S's standard deviation for large df
    lo, hi = max(0.0, 1.0 - 14.0 * spread), max(10.0, 1.0 + 14.0 * spread)
    log_c = math.log(2.0) + (df / 2.0) * math.log(df / 2.0) - math.lgamma(df / 2.0)

    def f(s: float) -> float:
        if s <= 0.0:
            return normal_cdf(-ncp) * (math.exp(log_c) if df == 1 else 0.0)
        dens = math.exp(log_c + (df - 1.0) * math.log(s) - df * s * s / 2.0)
        return normal_cdf(t * s - ncp) * dens

    m = 800  # even; within 5e-9 of scipy.stats.nct.cdf for df 1..200 (tests/analysis/test_stats.py)
    h = (hi - lo) / m
    total = f(lo) + f(hi)
    for i in range(1, m):
        total += (4.0 if i % 2 else 2.0) * f(lo + i * h)
    return min(1.0, max(0.0, total * h / 3.0))


def mde(sd: float | None, n: int, power: float = POWER, level: float = LEVEL) -> float | None:
    """The minimum detectable effect: the smallest true mean difference that the two-sided paired t test at
    1 - ``level`` detects with probability ``power``, for n pairs of standard deviation ``sd`` (in sd's unit).
    None with fewer than 2 pairs or no spread. In units of sd it depends on n only: 3.26 sd with
    3 pairs, 1.68 sd with 5, 1.00 sd with 10, 0.66 sd with 20 (tests/analysis/test_stats.py checks it against
    scipy's noncentral t)."""
    if sd is None or n < 2 or not sd > 0 or not math.isfinite(sd):
        return None
    return _detectable_ncp(n - 1, power, level) * sd / math.sqrt(n)


@functools.lru_cache(maxsize=None)
def _detectable_ncp(df: int, power: float, level: float) -> float:
    """The noncentrality at which the two-sided t test with ``df`` degrees of freedom has ``power`` (bisection)."""
    crit = t_quantile(0.5 + level / 2.0, df)

    def pw(ncp: float) -> float:
        return 1.0 - nct_cdf(crit, df, ncp) + nct_cdf(-crit, df, ncp)

    lo, hi = 0.0, 1.0
    while pw(hi) < power:
        hi *= 2.0
    while hi - lo > 1e-9 * hi:
        mid = 0.5 * (lo + hi)
        if pw(mid) < power:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def p_value(ci: dict) -> float | None:
    """Two-sided p-value of the paired t test that the mean difference is 0 (None below 2 pairs; 1.0 or 0.0
    when the differences have no spread)."""
    n, m, sd = ci.get("n", 0), ci.get("mean"), ci.get("std")
    if n < 2 or m is None or sd is None:
        return None
    if sd == 0.0:
        return 1.0 if m == 0.0 else 0.0
    t = abs(m) / (sd / math.sqrt(n))
    return min(1.0, 2.0 * (1.0 - t_cdf(t, n - 1)))


def holm(pvalues: list) -> list:
    """Holm's step-down adjusted p-values, in the input order (None entries stay None, outside the family).

    With the m p-values sorted ascending, p_(1) <= ... <= p_(m): adj_(i) = max over j <= i of
    min(1, (m - j + 1) p_(j)). Rejecting where adj < 5% keeps the chance of any false rejection in the family
    at most 5%, whatever the dependence between the comparisons."""
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
    at its last evaluation}. Returns ({seed: cost or budget}, [censored seeds]). A censored value is a lower
    bound on what the run would need, so a group's censored mean understates its cost. A seed with neither a
    cost nor a budget is left out (None)."""
    out: dict[Any, float | None] = {}
    censored: list = []
    for s, v in values.items():
        if v is not None and math.isfinite(float(v)):
            out[s] = float(v)
        elif budgets.get(s) is not None and math.isfinite(float(budgets[s])):
            out[s] = float(budgets[s])
            censored.append(s)
        else:
            out[s] = None
    return out, censored


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


def gammainc(a: float, x: float) -> float:
    """Regularized lower incomplete gamma P(a, x): its power series below x = a + 1, else 1 minus the
    continued fraction of the upper one (modified Lentz)."""
    if x <= 0.0:
        return 0.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        ap = a
        for _ in range(1000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 3e-16:
                break
        return min(1.0, total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        if abs(d * c - 1.0) < 3e-16:
            break
    return max(0.0, 1.0 - math.exp(log_front) * h)


def chi2_cdf(x: float, df: float) -> float:
    return gammainc(df / 2.0, x / 2.0)


def f_cdf(f: float, d1: float, d2: float) -> float:
    """P(F <= f) for Fisher's F with (d1, d2) degrees of freedom."""
    return 0.0 if f <= 0.0 else betainc(d1 / 2.0, d2 / 2.0, d1 * f / (d1 * f + d2))


def _quantile(cdf, p: float) -> float:
    """The p-quantile of a distribution on (0, inf) with CDF ``cdf`` (bisection in log space)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"expected 0 < p < 1, got {p}")
    lo, hi = 1e-12, 1.0
    while cdf(hi) < p:
        hi *= 2.0
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if cdf(mid) < p:
            lo = mid
        else:
            hi = mid
        if hi / lo - 1.0 < 1e-13:
            break
    return math.sqrt(lo * hi)


def chi2_quantile(p: float, df: float) -> float:
    return _quantile(lambda x: chi2_cdf(x, df), p)


def f_quantile(p: float, d1: float, d2: float) -> float:
    return _quantile(lambda f: f_cdf(f, d1, d2), p)


def sd_ci(values, level: float = LEVEL) -> dict:
    """{"n", "sd", "lo", "hi", "level"}: the sample standard deviation of the finite ``values`` and its
    two-sided interval from the chi-squared distribution of (n - 1) s^2 / sigma^2 (normal values):
    s sqrt((n - 1) / chi2_{(1 + level) / 2}) to s sqrt((n - 1) / chi2_{(1 - level) / 2}). No interval below 2."""
    nums = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(nums)
    out = {"n": n, "sd": None, "lo": None, "hi": None, "level": level}
    if n < 2:
        return out
    s = statistics.stdev(nums)
    out["sd"] = s
    out["lo"] = s * math.sqrt((n - 1) / chi2_quantile(0.5 + level / 2.0, n - 1))
    out["hi"] = s * math.sqrt((n - 1) / chi2_quantile(0.5 - level / 2.0, n - 1))
    return out


def sd_upper(sd: float, n: int, confidence: float = 0.8) -> float:
    """The one-sided upper ``confidence`` limit of a standard deviation ``sd`` measured over ``n`` values:
    sd sqrt((n - 1) / chi2_{1 - confidence, n - 1}). A study planned from it is planned for a spread the
    pilot does not rule out, not for the pilot's point estimate (with 5 values the upper 80% limit is 1.56 sd)."""
    return sd * math.sqrt((n - 1) / chi2_quantile(1.0 - confidence, n - 1))


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
    xs = [float(v) for v in x.values() if v is not None and math.isfinite(float(v))]
    ys = [float(v) for v in y.values() if v is not None and math.isfinite(float(v))]
    out = {"n_x": len(xs), "n_y": len(ys), "ratio": None, "lo": None, "hi": None, "p_f": None, "p_paired": None,
           "n_pairs": 0, "level": level}
    if len(xs) < 2 or len(ys) < 2:
        return out
    vx, vy = statistics.variance(xs), statistics.variance(ys)
    d1, d2 = len(xs) - 1, len(ys) - 1
    if vy > 0 and vx > 0:
        f = vx / vy
        out["ratio"] = math.sqrt(f)
        out["lo"] = math.sqrt(f / f_quantile(0.5 + level / 2.0, d1, d2))
        out["hi"] = math.sqrt(f / f_quantile(0.5 - level / 2.0, d1, d2))
        out["p_f"] = min(1.0, 2.0 * min(f_cdf(f, d1, d2), 1.0 - f_cdf(f, d1, d2)))
    seeds = [s for s in x if s in y and x[s] is not None and y[s] is not None
             and math.isfinite(float(x[s])) and math.isfinite(float(y[s]))]
    out["n_pairs"] = n = len(seeds)
    if n >= 3:
        sums = [float(x[s]) + float(y[s]) for s in seeds]
        diffs = [float(x[s]) - float(y[s]) for s in seeds]
        if statistics.pstdev(sums) > 0 and statistics.pstdev(diffs) > 0:
            r = statistics.correlation(sums, diffs)
            t = abs(r) * math.sqrt((n - 2) / max(1e-300, 1.0 - r * r))
            out["p_paired"] = min(1.0, 2.0 * (1.0 - t_cdf(t, n - 2)))
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
        p_low = 1.0 - t_cdf((m + margin) / se, df)
        p_high = t_cdf((m - margin) / se, df)
    half = t_quantile(1.0 - alpha, df) * se
    p = max(p_low, p_high)
    return {"margin": margin, "p_lower": p_low, "p_upper": p_high, "p": p, "equivalent": p < alpha,
            "lo90": m - half, "hi90": m + half, "alpha": alpha}


def tost_verdict(t: dict | None, unit: str = "nats") -> str:
    """One phrase for ``tost``'s result."""
    if t is None:
        return "equivalence not tested (fewer than 2 pairs)"
    within = f"within +-{t['margin']:g} {unit}"
    interval = f"90% interval [{t['lo90']:+.4f}, {t['hi90']:+.4f}]"
    if t["equivalent"]:
        return f"equivalent {within} (TOST p = {t['p']:.2g}; {interval})"
    return f"equivalence {within} not shown (TOST p = {t['p']:.2g}; {interval} reaches past the margin)"
