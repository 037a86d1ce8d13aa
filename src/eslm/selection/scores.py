"""Token risk scores (no gradient, fp32) and their optional standardisation.

Scores come from ``TokenStats`` (a head backend's scoring pass, ``eslm.ops.head_backend``):

* ``loss``        l_j = -log p(x_j | x_<j)                  (CVaR-loss)
* ``entropy``     H_j = -sum_v p_v log p_v                  (VaR-entropy)
* ``excess_loss`` l_j - l_j^ref, signed, against a frozen reference model (Rho-1)

Standardisation (the paper: "we standardize token scores within each batch"):

* ``none``     raw scores;
* ``batch``    z-score over the whole selection scope. It is a monotone affine map of all scores at once, so
               by itself it can never change which tokens are kept — it only changes the reported threshold;
* ``sequence`` z-score within each row: each sequence contributes its own hardest tokens;
* ``domain``   z-score within the tokens of each domain in the micro-batch: a domain with uniformly high
               entropy (code vs prose) no longer takes the whole budget. This is the reading that matches the
               paper's stated goal ("prevent domain bias in dataset mixtures").
"""

from __future__ import annotations

import torch

from eslm.errors import ConfigError

STANDARDIZE_MODES = ("none", "batch", "sequence", "domain")
_EPS = 1e-6


def _zscore(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x - x.mean()) / (x.std(unbiased=False) + _EPS)
    return (x - x.mean(dim, keepdim=True)) / (x.std(dim, unbiased=False, keepdim=True) + _EPS)


def _zscore_by_group(x: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Z-score each element against the mean/std of its group. x (B,T), group (B,) int64."""
    B, T = x.shape
    g = group.long()
    count = torch.zeros(num_groups, device=x.device).index_add_(0, g, torch.full((B,), float(T), device=x.device))
    s1 = torch.zeros(num_groups, device=x.device).index_add_(0, g, x.sum(1))
    s2 = torch.zeros(num_groups, device=x.device).index_add_(0, g, (x * x).sum(1))
    mean = s1 / count.clamp(min=1)
    var = (s2 / count.clamp(min=1) - mean * mean).clamp(min=0)
    return (x - mean[g, None]) / (var[g, None].sqrt() + _EPS)


def standardize(scores: torch.Tensor, mode: str, domain: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Standardised copy of scores (B, T) fp32 by ``mode``; ``domain`` (B,) the rows' domain ids, each below
    ``num_groups`` (a selector's n_domains: no host read)."""
    if mode == "none":
        return scores
    if mode == "batch":
        return _zscore(scores)
    if mode == "sequence":
        return _zscore(scores, dim=1)
    if mode == "domain":
        return _zscore_by_group(scores, domain, num_groups)
    raise ConfigError(f"method.standardize: expected one of {', '.join(STANDARDIZE_MODES)}, got {mode!r}")
