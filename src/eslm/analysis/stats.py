"""Across-seed statistics for reports: Student-t intervals, paired differences and plain-words verdicts.

Pure Python (no scipy): the t quantile is found by bisection on the t CDF, which is written with the
regularized incomplete beta function (continued fraction, Numerical Recipes' ``betacf``):

    P(T <= t) = 1 - I_{df / (df + t^2)}(df / 2, 1/2) / 2      for t >= 0.

Interval of a mean over n seeds: mean +- t_{(1+level)/2, n-1} * s / sqrt(n), s the sample standard deviation
(n - 1 in the denominator). With n = 1 there is no interval ("n=1, no interval").

Paired differences: the runs of two groups are matched by seed (same data order and same initial weights for
a seed, see eslm.study), d_i = x_i - y_i (absolute) or (x_i - y_i) / y_i (relative), and the interval is the
t interval of the d_i. Pairing removes the between-seed variance that both runs share, which is most of it.
"""

from __future__ import annotations

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
    ``per_seed`` {seed: d} and ``unpaired`` (seeds present in one map only, or with a missing value)."""
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
    return out


def significant(ci: dict) -> int:
    """-1 if the interval lies below 0, +1 above 0, 0 if it contains 0 or there is none."""
    if ci.get("lo") is None:
        return 0
    if ci["hi"] < 0:
        return -1
    if ci["lo"] > 0:
        return 1
    return 0


def _pct(v: float) -> str:
    return f"{100.0 * v:.1f}%"


def _verdict(ci: dict, fmt, none: str, below: str, above: str, what: str, baseline: str, unit: str) -> str:
    """The shared skeleton of the verdicts: no pair, one pair, an interval below / above / around zero.
    ``below`` and ``above`` are templates with {m} {lo} {hi} (magnitudes, formatted by ``fmt``)."""
    n, m = ci["n"], ci["mean"]
    if n == 0:
        return f"{what}: {none}"
    if n == 1:
        return f"{what}: {fmt(m, True)}{unit} vs {baseline} (n=1, no interval)"
    lo, hi = ci["lo"], ci["hi"]
    sign = significant(ci)
    if sign < 0:
        return below.format(m=fmt(-m), lo=fmt(-hi), hi=fmt(-lo))
    if sign > 0:
        return above.format(m=fmt(m), lo=fmt(lo), hi=fmt(hi))
    return (f"{what}: no difference detectable with {n} seeds ({fmt(m, True)} [{fmt(lo, True)}, "
            f"{fmt(hi, True)}]{unit} vs {baseline})")


def cost_verdict(ci: dict, cost: str, baseline: str) -> str:
    """Words for a relative paired difference of a to-target cost (negative = cheaper than the baseline)."""
    def fmt(v, signed=False):
        return f"{v:+.1%}" if signed else _pct(v)

    return _verdict(ci, fmt, "no seed pair where both reach the target",
                    f"reaches the target with {{m}} [{{lo}}, {{hi}}] less {cost} than {baseline}",
                    f"needs {{m}} [{{lo}}, {{hi}}] more {cost} than {baseline} to reach the target",
                    cost, baseline, "")


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
