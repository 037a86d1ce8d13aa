"""Property tests of the VaR / CVaR selection rule against an independent NumPy reference."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eslm.errors import ConfigError
from eslm.selection import risk
from eslm.selection.stats import selection_stats


def var_mask(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """The threshold path's view: fp32 mask (scores' shape), 1 where score >= VaR_alpha (ties all kept)."""
    return risk.at_or_above(scores.float(), risk.var_threshold(scores, alpha)).float()


def cvar_rockafellar_uryasev(scores: torch.Tensor, alpha: float, eta=None):
    """The Rockafellar-Uryasev objective eta + mean(max(0, s - eta)) / (1 - alpha), at eta (default: VaR)."""
    flat = scores.reshape(-1).float()
    if eta is None:
        eta = risk.var_threshold(flat, alpha)
    return eta + torch.clamp(flat - eta, min=0).mean() / (1.0 - alpha)


def np_kept(n: int, alpha: float) -> int:
    """ceil((1-alpha)N) tokens kept, at least one (the decimal alpha a user types: rounded to 9 places)."""
    return max(int(math.ceil(round((1 - alpha) * n, 9))), 1)


def np_var(scores: np.ndarray, alpha: float) -> float:
    """The paper's VaR on the empirical distribution, read as the smallest score t with
    #(s >= t)/N <= 1 - alpha ... rounded so that ceil((1-alpha)N) tokens are kept (see risk.py)."""
    s = np.sort(scores.astype(np.float64))[::-1]  # descending
    return float(s[np_kept(len(s), alpha) - 1])


scores_st = st.lists(st.floats(-50, 50, allow_nan=False, width=32), min_size=1, max_size=300)
alpha_st = st.floats(0.0, 0.999)


@settings(max_examples=150, deadline=None)
@given(scores_st, alpha_st)
def test_threshold_matches_numpy_order_statistic(values, alpha):
    x = torch.tensor(values, dtype=torch.float32)
    assert float(risk.var_threshold(x, alpha)) == pytest.approx(np_var(np.array(values, np.float32), alpha))


@settings(max_examples=150, deadline=None)
@given(scores_st, alpha_st)
def test_kept_fraction_is_one_minus_alpha_up_to_rounding_and_ties(values, alpha):
    x = torch.tensor(values, dtype=torch.float32)
    n = x.numel()
    k = risk.num_kept(n, alpha)
    assert k == np_kept(n, alpha)  # the reference's count (in 1..n)
    assert abs(k - (1 - alpha) * n) < 1 + 1e-6
    idx = risk.topk_index(x, k)
    assert idx.numel() == k and len(set(idx.tolist())) == k
    thr = risk.var_threshold(x, alpha)
    assert torch.all(x[idx] >= thr)  # every kept token is at or above the VaR
    mask = var_mask(x, alpha)
    assert mask.sum() >= k  # the threshold path keeps ties too


def test_alpha_edges():
    x = torch.randn(1000)
    assert risk.num_kept(1000, 0.0) == 1000
    assert risk.num_kept(1000, 1e-9) == 1000
    assert risk.num_kept(1000, 0.9999) == 1
    assert risk.num_kept(1, 0.5) == 1
    assert risk.num_kept(100, 0.29) == 71  # 0.29 * 100 = 28.999999999999996 in floating point
    assert risk.topk_index(x, 1000).numel() == 1000
    with pytest.raises(ConfigError):
        risk.check_alpha(1.0)
    with pytest.raises(ConfigError):
        risk.check_alpha(-0.1)


def test_ties_keep_exactly_k_on_fast_path():
    x = torch.tensor([1.0, 2.0, 2.0, 2.0, 3.0])
    k = risk.num_kept(5, 0.5)  # 3
    assert k == 3
    assert risk.topk_index(x, k).numel() == 3
    assert var_mask(x, 0.5).sum() == 4  # 3, 2, 2, 2


def test_bf16_and_large_inputs():
    x = torch.randn(3000).bfloat16()
    thr = risk.var_threshold(x, 0.1)
    assert thr.dtype == torch.float32
    # torch.quantile rejects inputs above 2^24 elements; the order statistic does not
    big = torch.rand(2**24 + 10)
    assert float(risk.var_threshold(big, 0.5)) == pytest.approx(0.5, abs=1e-3)


def _tail_mean(x, alpha):
    """CVaR as the selection reports it: the cvar of the VaR rule's kept tokens."""
    index, _ = risk.select(x, alpha)
    kept = torch.zeros(x.numel(), dtype=torch.bool).index_fill_(0, index, True)
    return selection_stats(x, kept).cvar


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 60), st.integers(1, 20), st.integers(0, 10_000))
def test_cvar_equals_rockafellar_uryasev_when_tail_is_integral(k, m, seed):
    # choose N and alpha so that (1 - alpha) N = k exactly; continuous scores have no ties
    n = k * m
    alpha = 1.0 - k / n
    if alpha >= 1.0:
        return
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()
    tail_mean = float(_tail_mean(x, alpha))
    ru = float(cvar_rockafellar_uryasev(x, alpha))
    assert ru == pytest.approx(tail_mean, rel=1e-5, abs=1e-5)
    # and eta = VaR minimises the RU objective (check a grid around it)
    var = float(risk.var_threshold(x, alpha))
    for eta in np.linspace(var - 1, var + 1, 21):
        assert float(cvar_rockafellar_uryasev(x, alpha, torch.tensor(eta))) >= ru - 1e-4


def test_cvar_is_mean_of_top_k():
    x = torch.arange(10, dtype=torch.float32)
    assert float(_tail_mean(x, 0.7)) == pytest.approx((7 + 8 + 9) / 3)
