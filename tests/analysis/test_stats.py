"""Across-seed statistics (Student-t intervals, paired differences, power, spread, equivalence) against the standard
tables and scipy's own tests of them, and the report's verdict words for them."""

from __future__ import annotations

import math

import pytest

from eslm.analysis import stats as S
from eslm.analysis.report import verdicts as V

# two-sided 95% critical values t_{0.975, df} from the standard tables
T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 9: 2.2622, 29: 2.0452, 120: 1.9799}


@pytest.mark.parametrize("df,t", sorted(T975.items()))
def test_the_interval_uses_the_tables_t_quantile(df, t):
    # df + 1 values of standard deviation 1: the half-width is t_{0.975, df} / sqrt(df + 1)
    values = [0.0] * (df + 1)
    values[0], values[1] = math.sqrt(df / 2.0), -math.sqrt(df / 2.0)
    ci = S.mean_ci(values)
    assert ci["std"] == pytest.approx(1.0)
    assert ci["half_width"] * math.sqrt(df + 1) == pytest.approx(t, abs=1e-4)


def test_the_interval_matches_scipy_everywhere():
    st = pytest.importorskip("scipy.stats")
    for n in (2, 3, 4, 5, 7, 11, 31, 201):
        values = [math.sin(i) for i in range(n)]
        for level in (0.2, 0.8, 0.9, 0.95, 0.99):
            lo, hi = st.t.interval(level, n - 1, loc=st.tmean(values), scale=st.sem(values))
            ci = S.mean_ci(values, level)
            assert (ci["lo"], ci["hi"]) == pytest.approx((lo, hi), abs=1e-12)


def test_mean_ci_worked_example():
    # 1..5: mean 3, s = sqrt(2.5) = 1.5811, half-width = 2.7764 * 1.5811 / sqrt(5) = 1.9632
    ci = S.mean_ci([1, 2, 3, 4, 5])
    assert ci["n"] == 5 and ci["mean"] == 3.0 and ci["std"] == pytest.approx(math.sqrt(2.5))
    assert ci["half_width"] == pytest.approx(1.96324, abs=1e-4)
    assert (ci["lo"], ci["hi"]) == pytest.approx((3 - 1.96324, 3 + 1.96324), abs=1e-4)


def test_mean_ci_one_value_has_no_interval_and_none_is_ignored():
    ci = S.mean_ci([4.2, None, float("nan")])
    assert ci["n"] == 1 and ci["mean"] == 4.2 and ci["lo"] is None and ci["half_width"] is None
    assert V.fmt_ci(ci) == "4.2000 (n=1, no interval)"
    assert S.mean_ci([])["mean"] is None and V.fmt_ci(S.mean_ci([])) == "—"


def test_paired_differences_by_seed():
    # seeds 1..4 in both, seed 5 only in x: differences 0.1, 0.2, 0.0, 0.1 -> mean 0.1, s = 0.08165
    x = {"1": 4.1, "2": 4.4, "3": 4.0, "4": 4.3, "5": 9.0}
    y = {"1": 4.0, "2": 4.2, "3": 4.0, "4": 4.2}
    d = S.paired(x, y)
    assert d["n"] == 4 and d["unpaired"] == ["5"]
    assert d["mean"] == pytest.approx(0.1)
    assert d["half_width"] == pytest.approx(3.1824 * 0.0816497 / 2.0, abs=1e-4)
    rel = S.paired({"1": 90.0, "2": 80.0}, {"1": 100.0, "2": 100.0}, relative=True)
    assert rel["per_seed"] == pytest.approx({"1": -0.1, "2": -0.2})
    # costs: the geometric mean of the ratios, sqrt(0.9 * 0.8) - 1, the arithmetic one beside it
    assert rel["mean"] == pytest.approx(math.sqrt(0.72) - 1) and rel["arithmetic"]["mean"] == pytest.approx(-0.15)


def test_paired_matches_a_one_sample_t_interval_of_the_differences():
    st = pytest.importorskip("scipy.stats")
    import numpy as np

    x = {str(i): v for i, v in enumerate([4.31, 4.52, 4.18, 4.40, 4.29])}
    y = {str(i): v for i, v in enumerate([4.35, 4.50, 4.25, 4.47, 4.30])}
    diffs = np.array([x[k] - y[k] for k in x])
    lo, hi = st.t.interval(0.95, len(diffs) - 1, loc=diffs.mean(), scale=st.sem(diffs))
    d = S.paired(x, y)
    assert (d["lo"], d["hi"]) == pytest.approx((lo, hi), abs=1e-9)


def test_verdict_words():
    less = {"n": 5, "mean": -0.12, "lo": -0.2, "hi": -0.04, "half_width": 0.08}
    more = {"n": 5, "mean": 0.12, "lo": 0.04, "hi": 0.2, "half_width": 0.08}
    none = {"n": 3, "mean": -0.01, "lo": -0.05, "hi": 0.03, "half_width": 0.04}
    assert V.cost_verdict(less, "paper-FLOPs", "clm") == \
        "reaches the target with 12.0% [4.0%, 20.0%] less paper-FLOPs than clm"
    assert V.cost_verdict(more, "time", "clm").startswith("needs 12.0% [4.0%, 20.0%] more time than clm")
    assert V.cost_verdict(none, "tokens", "clm").startswith("tokens: no difference detectable with 3 seeds")
    assert "(n=1, no interval)" in V.cost_verdict({"n": 1, "mean": 0.1, "lo": None, "hi": None}, "time", "clm")
    assert V.loss_verdict({"n": 5, "mean": -0.02, "lo": -0.03, "hi": -0.01}, "final validation loss", "clm") == \
        "final validation loss lower than clm by 0.0200 [0.0100, 0.0300] nats"
    assert S.significant(none) == 0 and S.significant(less) == -1 and S.significant(more) == 1


# ---------------------------------------------------------------- what a comparison could have seen


@pytest.mark.parametrize("n", [3, 5, 10, 20, 60])
def test_mde_has_80_percent_power_under_scipy(n):
    # at the MDE, scipy's noncentral t gives the two-sided paired t test exactly 80% power
    st = pytest.importorskip("scipy.stats")
    sd = 0.02
    d = S.mde(sd, n)
    df, crit = n - 1, st.t.ppf(0.975, n - 1)
    ncp = d * math.sqrt(n) / sd
    assert st.nct.sf(crit, df, ncp) + st.nct.cdf(-crit, df, ncp) == pytest.approx(0.8, abs=1e-7)


def test_power_matches_the_standard_table():
    # G*Power, t test, matched pairs / one sample, two-tailed alpha 0.05, d = 0.5: n = 34 gives power 0.8077775,
    # the smallest n reaching 0.8 (n = 33: 0.7954); d = 1 needs n = 10 (power 0.8031)
    assert S.paired_power(0.5, 1.0, 34) == pytest.approx(0.8077775, abs=1e-6)
    assert S.paired_power(0.5, 1.0, 33) < 0.8
    assert S.paired_power(1.0, 1.0, 10) == pytest.approx(0.8031, abs=1e-4) and S.paired_power(1.0, 1.0, 9) < 0.8
    # large n: the normal approximation (z_0.975 + z_0.8) s / sqrt(n) = 2.8016 s / sqrt(n)
    assert S.mde(1.0, 2000) * math.sqrt(2000) == pytest.approx(2.8016, abs=2e-3)
    assert S.mde(1.0, 1) is None and S.mde(0.0, 5) is None


def test_paired_gives_p_and_mde():
    st = pytest.importorskip("scipy.stats")
    x = {str(i): v for i, v in enumerate([4.31, 4.52, 4.18, 4.40, 4.29])}
    y = {str(i): v for i, v in enumerate([4.35, 4.50, 4.25, 4.47, 4.30])}
    d = S.paired(x, y)
    ref = st.ttest_1samp([x[k] - y[k] for k in x], 0.0)
    assert d["p"] == pytest.approx(ref.pvalue, abs=1e-9)
    assert d["mde"] == pytest.approx(S.mde(d["std"], 5)) and d["mde"] == pytest.approx(1.682 * d["std"], abs=1e-3 * d["std"])


def test_holm_worked_example():
    # four p-values: sorted 0.005, 0.01, 0.03, 0.04 are multiplied by 4, 3, 2, 1 -> 0.02, 0.03, 0.06, 0.04,
    # then made non-decreasing -> 0.02, 0.03, 0.06, 0.06 (Holm 1979), returned in the input order
    assert S.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert S.holm([0.01, None, 0.02]) == [0.02, None, 0.02]  # None is outside the family (m = 2)
    assert S.holm([0.6, 0.5]) == [1.0, 1.0] and S.holm([]) == []


def test_holm_adjusted_verdict_says_what_the_adjustment_hid():
    ci = {"n": 5, "mean": -0.02, "lo": -0.035, "hi": -0.005, "std": 0.012, "p": 0.02, "mde": 0.02,
          "p_adjusted": 0.2, "family": 10}
    assert S.significant(ci) == 0
    words = V.loss_verdict(ci, "final validation loss", "clm")
    assert words == ("final validation loss: no difference detectable with 5 seeds (-0.0200 [-0.0350, -0.0050] "
                     "nats vs clm; detectable at 80% power: 0.0200 nats); the unadjusted interval excludes 0 "
                     "(p = 0.02), Holm-adjusted p = 0.2 over 10 comparisons")
    ci["p_adjusted"] = 0.04
    assert S.significant(ci) == -1 and V.loss_verdict(ci, "final validation loss", "clm") == (
        "final validation loss lower than clm by 0.0200 [0.0050, 0.0350] nats (Holm-adjusted p = 0.04 over 10 "
        "comparisons)")


def test_no_difference_states_the_mde():
    ci = S.paired({"1": 4.0, "2": 4.1, "3": 4.3}, {"1": 4.05, "2": 4.05, "3": 4.2})
    assert ci["lo"] < 0 < ci["hi"]
    assert V.loss_verdict(ci, "final validation loss", "random").endswith(
        f"vs random; detectable at 80% power: {ci['mde']:.4f} nats)")


# ---------------------------------------------------------------- censored costs


def test_a_seed_that_never_reaches_the_target_is_censored_at_its_budget():
    # eslm seed 2 never reaches the target: it counts at its budget 150 (not dropped). Differences (x - y) / y:
    # seed 1: 0, seed 2: 150/110 - 1 = 0.3636, seed 3: 90/100 - 1 = -0.1 -> mean 0.0879 (dropping seed 2
    # would report -0.05, in the method's favour)
    eslm = {"1": 100.0, "2": None, "3": 90.0}
    clm = {"1": 100.0, "2": 110.0, "3": 100.0}
    budget = {"1": 150.0, "2": 150.0, "3": 150.0}
    ci = S.paired_censored(eslm, clm, budget, budget)
    assert ci["n"] == 3 and ci["per_seed"] == pytest.approx({"1": 0.0, "2": 150 / 110 - 1, "3": -0.1})
    assert ci["mean"] == pytest.approx((150 / 110 * 0.9) ** (1 / 3) - 1)
    assert ci["arithmetic"]["mean"] == pytest.approx((150 / 110 - 1 - 0.1) / 3)
    assert ci["censored_x"] == ["2"] and ci["censored_y"] == [] and ci["bias"] == "x"
    words = V.cost_verdict(ci, "paper-FLOPs", "clm", "eslm")
    assert words.endswith("[1 of 3 seeds of eslm never reached the target and counts at its budget; the "
                          "difference understates eslm's cost (biased in its favour)]")
    # the baseline censored instead: biased against the method; both censored for a seed: that pair says nothing
    ci = S.paired_censored(clm, eslm, budget, budget)
    assert ci["censored_y"] == ["2"] and ci["bias"] == "y"
    both = S.paired_censored({"1": None, "2": 5.0}, {"1": None, "2": 4.0}, {"1": 9.0, "2": 9.0}, {"1": 8.0, "2": 9.0})
    assert both["n"] == 1 and both["both_censored"] == ["1"] and both["bias"] is None
    assert S.censor({"1": None}, {}) == ({"1": None}, [])


def test_relative_costs_are_geometric_means_of_the_per_seed_ratios():
    # twice and half the cost: no difference on the log scale (the arithmetic mean of the ratios says +25%)
    ci = S.paired({"1": 200.0, "2": 50.0, "3": 100.0}, {"1": 100.0, "2": 100.0, "3": 100.0}, relative=True)
    assert ci["mean"] == pytest.approx(0.0, abs=1e-12) and ci["arithmetic"]["mean"] == pytest.approx(0.5 / 3)
    st = pytest.importorskip("scipy.stats")
    logs = [math.log(2.0), math.log(0.5), 0.0]
    lo, hi = st.t.interval(0.95, 2, loc=0.0, scale=st.sem(logs))
    assert (ci["lo"], ci["hi"]) == pytest.approx((math.expm1(lo), math.expm1(hi)), abs=1e-9)
    assert ci["p"] == pytest.approx(st.ttest_1samp(logs, 0.0).pvalue, abs=1e-9)


def test_sd_interval_and_upper_limit_match_scipy():
    st = pytest.importorskip("scipy.stats")
    values = [4.31, 4.52, 4.18, 4.40, 4.29]
    ci = S.sd_ci(values)
    s = st.tstd(values)
    assert ci["sd"] == pytest.approx(s) and ci["n"] == 5
    assert ci["lo"] == pytest.approx(s * math.sqrt(4 / st.chi2.ppf(0.975, 4)), rel=1e-9)
    assert ci["hi"] == pytest.approx(s * math.sqrt(4 / st.chi2.ppf(0.025, 4)), rel=1e-9)
    # the upper 80% confidence limit a study is planned from: 1.557 s with 5 values
    assert S.sd_upper(s, 5) == pytest.approx(s * math.sqrt(4 / st.chi2.ppf(0.2, 4)), rel=1e-9)
    assert S.sd_upper(1.0, 5) == pytest.approx(1.557, abs=1e-3)
    assert S.sd_ci([1.0])["lo"] is None


def test_spread_comparison_matches_scipy():
    st = pytest.importorskip("scipy.stats")
    x = {"1": 4.31, "2": 4.52, "3": 4.18, "4": 4.40, "5": 4.29, "6": 4.61}
    y = {"1": 4.35, "2": 4.37, "3": 4.33, "4": 4.41, "5": 4.36}
    c = S.spread_comparison(x, y)
    vx, vy = st.tvar(list(x.values())), st.tvar(list(y.values()))
    f = vx / vy
    assert c["ratio"] == pytest.approx(math.sqrt(f))
    assert c["p_f"] == pytest.approx(2 * min(st.f.cdf(f, 5, 4), st.f.sf(f, 5, 4)), abs=1e-10)
    assert c["lo"] == pytest.approx(math.sqrt(f / st.f.ppf(0.975, 5, 4)), rel=1e-8)
    assert c["hi"] == pytest.approx(math.sqrt(f / st.f.ppf(0.025, 5, 4)), rel=1e-8)
    seeds = ["1", "2", "3", "4", "5"]  # Pitman-Morgan: the correlation of sums and differences over shared seeds
    r = st.pearsonr([x[k] + y[k] for k in seeds], [x[k] - y[k] for k in seeds])
    assert c["n_pairs"] == 5 and c["p_paired"] == pytest.approx(r.pvalue, abs=1e-9)
    assert S.spread_comparison({"1": 1.0}, y)["ratio"] is None


def test_tost_worked_example():
    # paired differences d (nats), margin 0.015: mean 0.00275, s = 0.0067559, se = s / sqrt(8) = 0.0023886;
    # t_lower = (0.00275 + 0.015) / se = 7.431, t_upper = (0.00275 - 0.015) / se = -5.129, 7 df:
    # p_lower = P(T > 7.431) = 7.28e-5, p_upper = P(T < -5.129) = 6.78e-4 -> TOST p = 6.78e-4: equivalent;
    # the 90% interval 0.00275 +- 1.8946 se = [-0.00178, +0.00728] lies inside (-0.015, 0.015)
    d = [0.010, -0.004, 0.006, 0.002, -0.008, 0.012, 0.000, 0.004]
    ci = S.paired({str(i): v for i, v in enumerate(d)}, {str(i): 0.0 for i in range(8)})
    t = S.tost(ci, 0.015)
    assert t["p_lower"] == pytest.approx(7.276e-5, rel=1e-3) and t["p_upper"] == pytest.approx(6.779e-4, rel=1e-3)
    assert t["p"] == t["p_upper"] and t["equivalent"]
    assert (t["lo90"], t["hi90"]) == pytest.approx((0.00275 - 1.89458 * 0.00238859, 0.00275 + 1.89458 * 0.00238859),
                                                   abs=1e-7)
    assert V.tost_verdict(t).startswith("equivalent within +-0.015 nats (TOST p = 0.00068; 90% interval")
    # three times the spread: the 90% interval reaches past +0.015, equivalence is not shown (p_upper = 0.175)
    wide = [0.010, -0.024, 0.036, 0.002, -0.028, 0.032, 0.000, 0.024]
    t = S.tost(S.paired({str(i): v for i, v in enumerate(wide)}, {str(i): 0.0 for i in range(8)}), 0.015)
    assert not t["equivalent"] and t["p"] == pytest.approx(0.17464, abs=1e-4)
    assert "not shown" in V.tost_verdict(t) and S.tost(S.paired({"1": 1.0}, {"1": 0.0}), 0.015) is None


def test_the_pairs_needed_for_a_target_mde():
    n = S.pairs_for_mde(0.05, 0.025)
    assert S.mde(0.05, n) <= 0.025 < S.mde(0.05, n - 1)
