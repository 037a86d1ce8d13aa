"""Risk measures on an empirical score distribution: VaR threshold, top-K selection, CVaR.

Notation: N scores s_1..s_N (fp32, one per token in the selection scope), confidence level alpha in [0, 1).

VaR. The paper defines VaR_alpha = inf{t : P(S >= t) <= 1 - alpha} on the empirical distribution and keeps
{s >= VaR}, "the top (1 - alpha) fraction". We keep exactly

    K = N - floor(alpha * N)        (= ceil((1 - alpha) * N); K >= 1 for every alpha < 1)

tokens and report the threshold as the smallest kept score, i.e. the order statistic of rank K from the
top (rank floor(alpha*N) + 1 from the bottom). Without ties, {s >= threshold} is exactly the kept set.

Ties (docs/paper.md's departures): `topk_index` keeps exactly K, ties at the threshold broken by torch.topk's
order; a shared threshold (`at_or_above`) keeps every tie, so possibly more than K.

CVaR_alpha = mean of the scores at or above VaR (the kept tokens' mean, reported by
``eslm.selection.stats.selection_stats`` with the other statistics of a selection). The Rockafellar-Uryasev form
    CVaR_alpha = min_eta  eta + E[max(0, S - eta)] / (1 - alpha)
is minimised at eta = VaR and, on an empirical distribution where (1 - alpha) * N is an integer and there are
no ties at the threshold, equals the tail mean exactly (tests/selection/test_risk.py checks the agreement).

Everything here avoids host synchronisation (except where a docstring says so): K is a Python int computed from
shapes, torch.topk has a static output shape, and nothing calls .item().

The ONE place where scores become kept tokens (docs/architecture.md). alpha is validated once (``check_alpha``)
where a selector or a call is set up, not inside the per-batch functions.
"""

from __future__ import annotations

import math

import torch

from eslm.errors import ConfigError

# alpha * N is computed in floating point; 0.29 * 100 = 28.999999999999996 must count as 29.
FLOOR_EPS = 1e-9


def check_alpha(alpha: float) -> float:
    """alpha as a float, or a one-line ConfigError (the one check of alpha; method.alpha's too)."""
    if not (0.0 <= float(alpha) < 1.0) or math.isnan(alpha):
        raise ConfigError(f"alpha: expected 0 <= alpha < 1 (fraction of tokens dropped), got {alpha}")
    return float(alpha)


def num_kept(n: int, alpha: float) -> int:
    """K = N - floor(alpha * N): how many of N tokens the VaR rule keeps (always >= 1 for N >= 1).
    alpha must already be valid (``check_alpha``)."""
    if n <= 0:
        return 0
    return max(1, n - math.floor(alpha * n + FLOOR_EPS))


def num_kept_tensor(n: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """``num_kept`` of a 0-dim int64 tensor N (computed in float64 on its device, no sync); 0 when N = 0."""
    dropped = torch.floor(n.double() * alpha + FLOOR_EPS).long()
    return torch.clamp(n - dropped, min=1) * (n > 0)


def topk_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Flat indices (k,) of the k largest scores of a flattened score tensor (static shape, no sync)."""
    flat = scores.reshape(-1)
    if k >= flat.numel():
        return torch.arange(flat.numel(), device=flat.device)
    return torch.topk(flat, k, sorted=False).indices


def at_or_above(scores: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    """Boolean mask (same shape as scores): the tokens a shared threshold keeps (score >= threshold, ties kept)."""
    return scores >= threshold


def select(ranked: torch.Tensor, alpha: float, threshold: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The VaR rule on one micro-batch's (standardised) scores: (flat indices (K,) of the kept tokens, K).

    Without ``threshold``: the top K = num_kept(N, alpha) (static K, no sync). With ``threshold`` (selection
    scope "step": the VaR of the whole optimizer step): every token at or above it (variable K; this syncs).
    """
    if threshold is None:
        k = num_kept(ranked.numel(), alpha)
        return topk_index(ranked, k), k
    index = torch.nonzero(at_or_above(ranked.reshape(-1), threshold)).squeeze(1)
    return index, int(index.numel())


def select_valid(scores: torch.Tensor, valid: torch.Tensor, alpha: float | torch.Tensor,
                 bound: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The VaR rule over the valid entries of scores (N,) (ignored tokens are neither kept nor counted), on
    the device with no sync: (index (K_max,), keep (K_max,) bool, K (), N_valid ()).

    K_max = num_kept(rows, bound) >= K for every alpha >= bound: a static K_max with a data-dependent cut-off, so
    ``alpha`` may be a 0-dim tensor (no recompile per value, no sync).
    """
    ranked = scores.masked_fill(~valid, float("-inf"))
    index = torch.topk(ranked, num_kept(ranked.numel(), bound), sorted=True).indices
    n_valid = valid.sum()
    k = num_kept_tensor(n_valid, alpha)
    return index, torch.arange(index.numel(), device=scores.device) < k, k, n_valid


def var_threshold(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """VaR_alpha of the flattened scores: the K-th largest score (0-dim fp32 tensor), K = num_kept(N, alpha).

    An exact order statistic (torch.kthvalue), valid for any dtype and size (unlike torch.quantile, which
    rejects bf16 and inputs above 2^24 elements).
    """
    flat = scores.reshape(-1).float()
    k = num_kept(flat.numel(), alpha)
    # the K-th largest is the (N - K + 1)-th smallest
    return torch.kthvalue(flat, flat.numel() - k + 1).values
