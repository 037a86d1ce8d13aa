"""Across-seed statistics for reports: Student-t intervals, paired differences and plain-words verdicts.

Pure Python (no scipy): the t quantile is found by bisection on the t CDF, which is written with the
regularized incomplete beta function (continued fraction, Numerical Recipes' ``betacf``):

    P(T <= t) = 1 - I_{df / (df + t^2)}(df / 2, 1/2) / 2      for t >= 0.

Interval of a mean over n seeds: mean +- t_{(1+level)/2, n-1} * s / sqrt(n), s the sample standard deviation
(n - 1 in the denominator). With n = 1 there is no interval ("n=1, no interval").

Paired differences: the runs of two groups are matched by seed (same data order and same initial weights for
a seed, see eslm.study), d_i = x_i - y_i (absolute) or (x_i - y_i) / y_i (relative), and the interval is the
t interval of the d_i. Pairing removes the between-seed variance that both runs share, which is most of it.

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
    out = {"n": n, "mean": None, "std": None, "lo": None, "hi": None, "half_width": None, "level": level}
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

    relative=False: d = x - y; relative=True: d = (x - y) / y. Returns mean_ci of the d's plus
    ``per_seed`` {seed: d}, ``unpaired`` (seeds present in one map only, or with a missing value), ``p`` (the
    two-sided paired t test of a zero mean) and ``mde`` (the smallest true mean difference that test detects
    with 80% power, from the observed spread; ``mde``)."""
    def ok(v):
        return v is not None and math.isfinite(float(v))

    seeds = [s for s in x if s in y and ok(x[s]) and ok(y[s]) and (not relative or float(y[s]) != 0.0)]
    d = {}
    for s in seeds:
        diff = float(x[s]) - float(y[s])
        d[s] = diff / float(y[s]) if relative else diff
    out = mean_ci(list(d.values()), level)
    out["per_seed"] = d
    out["unpaired"] = sorted({*x, *y} - set(seeds), key=str)
    out["relative"] = relative
    out["p"] = p_value(out)
    out["mde"] = mde(out["std"], out["n"], level=level)
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


def _verdict(ci: dict, fmt, none: str, below: str, above: str, what: str, baseline: str, unit: str) -> str:
    """The shared skeleton of the verdicts: no pair, one pair, a difference below / above zero, or none
    detectable (with the smallest difference the comparison could have detected, and Holm's adjustment when
    it is what hid a raw interval that excludes 0). ``below`` and ``above`` are templates with {m} {lo} {hi}
    (magnitudes, formatted by ``fmt``)."""
    n, m = ci["n"], ci["mean"]
    if n == 0:
        return f"{what}: {none}"
    if n == 1:
        return f"{what}: {fmt(m, True)}{unit} vs {baseline} (n=1, no interval)"
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


def cost_verdict(ci: dict, cost: str, baseline: str, group: str | None = None) -> str:
    """Words for a relative paired difference of a to-target cost (negative = cheaper than the baseline),
    with the censored seeds of ``paired_censored`` said and the direction of the bias they leave."""
    def fmt(v, signed=False):
        return f"{v:+.1%}" if signed else _pct(v)

    words = _verdict(ci, fmt, "no seed pair where both reach the target",
                     f"reaches the target with {{m}} [{{lo}}, {{hi}}] less {cost} than {baseline}",
                     f"needs {{m}} [{{lo}}, {{hi}}] more {cost} than {baseline} to reach the target",
                     cost, baseline, "")
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
    bias = {"x": f"the difference understates {group}'s cost (biased in its favour)",
            "y": f"the difference understates {baseline}'s cost (biased against {group})",
            "both": "censored on both sides: the bias can go either way"}.get(ci.get("bias"))
    return " [" + "; ".join(parts + ([bias] if bias else [])) + "]"


def loss_verdict(ci: dict, what: str, baseline: str) -> str:
    """Words for an absolute paired difference of a loss (negative = lower loss than the baseline)."""
    def fmt(v, signed=False):
        return f"{v:+.4f}" if signed else f"{v:.4f}"

    return _verdict(ci, fmt, "no seed pair to compare",
                    f"{what} lower than {baseline} by {{m}} [{{lo}}, {{hi}}] nats",
                    f"{what} higher than {baseline} by {{m}} [{{lo}}, {{hi}}] nats", what, baseline, " nats")


def fmt_ci(ci: dict, spec: str = ".4f") -> str:
    """'4.348 ± 0.110 (n=5)' / '4.348 (n=1, no interval)' / '—'."""
    if ci["n"] == 0 or ci["mean"] is None:
        return "—"
    if ci["half_width"] is None:
        return f"{format(ci['mean'], spec)} (n=1, no interval)"
    return f"{format(ci['mean'], spec)} ± {format(ci['half_width'], spec)} (n={ci['n']})"


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


def paired_power(effect: float, sd: float, n: int, level: float = LEVEL) -> float:
    """Power of the two-sided paired t test at 1 - ``level`` (5%) with n pairs of standard deviation ``sd``
    against a true mean difference ``effect``."""
    df = n - 1
    crit = t_quantile(0.5 + level / 2.0, df)
    ncp = effect * math.sqrt(n) / sd
    return 1.0 - nct_cdf(crit, df, ncp) + nct_cdf(-crit, df, ncp)


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
    out, censored = {}, []
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
