"""Across-seed statistics: Student-t quantiles and intervals, paired differences, verdict words."""

from __future__ import annotations

import math

import pytest

from eslm.analysis import stats as S

# two-sided 95% critical values t_{0.975, df} from the standard tables
T975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 9: 2.2622, 29: 2.0452, 120: 1.9799}


@pytest.mark.parametrize("df,t", sorted(T975.items()))
def test_t_quantile_matches_the_tables(df, t):
    assert S.t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)
    assert S.t_quantile(0.025, df) == pytest.approx(-t, abs=1e-4)


def test_t_quantile_matches_scipy_everywhere():
    st = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4, 6, 10, 30, 200):
        for p in (0.6, 0.9, 0.95, 0.975, 0.995):
            assert S.t_quantile(p, df) == pytest.approx(st.t.ppf(p, df), abs=1e-8)


def test_mean_ci_worked_example():
    # 1..5: mean 3, s = sqrt(2.5) = 1.5811, half-width = 2.7764 * 1.5811 / sqrt(5) = 1.9632
    ci = S.mean_ci([1, 2, 3, 4, 5])
    assert ci["n"] == 5 and ci["mean"] == 3.0 and ci["std"] == pytest.approx(math.sqrt(2.5))
    assert ci["half_width"] == pytest.approx(1.96324, abs=1e-4)
    assert (ci["lo"], ci["hi"]) == pytest.approx((3 - 1.96324, 3 + 1.96324), abs=1e-4)


def test_mean_ci_one_value_has_no_interval_and_none_is_ignored():
    ci = S.mean_ci([4.2, None, float("nan")])
    assert ci["n"] == 1 and ci["mean"] == 4.2 and ci["lo"] is None and ci["half_width"] is None
    assert S.fmt_ci(ci) == "4.2000 (n=1, no interval)"
    assert S.mean_ci([])["mean"] is None and S.fmt_ci(S.mean_ci([])) == "—"


def test_paired_differences_by_seed():
    # seeds 1..4 in both, seed 5 only in x: differences 0.1, 0.2, 0.0, 0.1 -> mean 0.1, s = 0.08165
    x = {"1": 4.1, "2": 4.4, "3": 4.0, "4": 4.3, "5": 9.0}
    y = {"1": 4.0, "2": 4.2, "3": 4.0, "4": 4.2}
    d = S.paired(x, y)
    assert d["n"] == 4 and d["unpaired"] == ["5"]
    assert d["mean"] == pytest.approx(0.1)
    assert d["half_width"] == pytest.approx(3.1824 * 0.0816497 / 2.0, abs=1e-4)
    rel = S.paired({"1": 90.0, "2": 80.0}, {"1": 100.0, "2": 100.0}, relative=True)
    assert rel["per_seed"] == pytest.approx({"1": -0.1, "2": -0.2}) and rel["mean"] == pytest.approx(-0.15)


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
    assert S.cost_verdict(less, "paper-FLOPs", "clm") == \
        "reaches the target with 12.0% [4.0%, 20.0%] less paper-FLOPs than clm"
    assert S.cost_verdict(more, "time", "clm").startswith("needs 12.0% [4.0%, 20.0%] more time than clm")
    assert S.cost_verdict(none, "tokens", "clm").startswith("tokens: no difference detectable with 3 seeds")
    assert "(n=1, no interval)" in S.cost_verdict({"n": 1, "mean": 0.1, "lo": None, "hi": None}, "time", "clm")
    assert S.loss_verdict({"n": 5, "mean": -0.02, "lo": -0.03, "hi": -0.01}, "final validation loss", "clm") == \
        "final validation loss lower than clm by 0.0200 [0.0100, 0.0300] nats"
    assert S.significant(none) == 0 and S.significant(less) == -1 and S.significant(more) == 1
