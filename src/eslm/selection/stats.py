"""What a token selection did: ``SelectionStats``, filled by ``selection_stats`` and nothing else.

Returned by every scoring selector and by ``eslm.api.selective_loss``. All fields are tensors on the scores'
device, computed without a host sync; ``.item()`` them where a number is needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class SelectionStats:
    """One selection's statistics (0-dim unless said otherwise).

    num_tokens:         int64, scored tokens N (in the drop-in API: targets != ignore_index)
    num_kept:           int64, kept tokens K (>= 1 when N >= 1, except a micro-batch that the selection scope
                        "step"'s shared threshold leaves empty)
    kept_frac:          fp32, K / N
    threshold:          fp32, the smallest kept score on the scale the selection ranked by (standardised scores
                        when the selector standardises; the VaR when it does not); 0 when K = 0
    cvar:               fp32, the mean raw score of the kept tokens: CVaR_alpha, the tail at or above the VaR,
                        when the ranking is the raw scores; 0 when K = 0
    score_dropped_mean: fp32, the mean raw score of the scored tokens not kept; 0 when none
                        (threshold, cvar and score_dropped_mean are NaN for a selection that ranked no scores:
                        the random control)
    kept_per_domain:    (D,) fp32, kept tokens per domain id; None when the caller has no domains
    tokens_per_domain:  (D,) fp32, scored tokens per domain id; None when the caller has no domains
    """

    num_tokens: torch.Tensor
    num_kept: torch.Tensor
    kept_frac: torch.Tensor
    threshold: torch.Tensor = field(metadata={"score": True})
    cvar: torch.Tensor = field(metadata={"score": True})
    score_dropped_mean: torch.Tensor = field(metadata={"score": True})
    kept_per_domain: torch.Tensor | None = None
    tokens_per_domain: torch.Tensor | None = None


# the fields that describe the ranked scores (metadata "score"): NaN for a selection that ranked none (the random
# control, eslm.selection.selectors.RandomSelector)
SCORE_FIELDS = tuple(f.name for f in fields(SelectionStats) if f.metadata.get("score"))


def selection_stats(scores: torch.Tensor, kept: torch.Tensor, *, ranked: torch.Tensor | None = None,
                    valid: torch.Tensor | None = None, domain: torch.Tensor | None = None,
                    n_domains: int = 0) -> SelectionStats:
    """The statistics of one selection, with no host sync.

    scores: raw scores (N,) or (B, T) fp32; kept: bool mask of the kept tokens (N,); ranked: the scores the
    selection ranked (for the threshold; default ``scores``); valid: bool mask of the scored tokens (N,)
    (default: all); domain: (B,) domain ids of the rows of a (B, T) ``scores``, with ``n_domains`` > every id,
    for the per-domain counts.
    """
    raw = scores.reshape(-1)
    kept = kept.reshape(-1)
    dropped = ~kept if valid is None else valid.reshape(-1) & ~kept
    k = kept.sum()
    n = torch.full((), raw.numel(), dtype=torch.int64, device=raw.device) if valid is None else valid.sum()
    kf, nf = k.float(), n.float()
    rank = raw if ranked is None else ranked.reshape(-1)
    # masked sums rather than products with a 0/1 mask: a non-finite score outside the set must not leak in;
    # the dropped sum is taken directly (all - kept would cancel catastrophically)
    threshold = rank.masked_fill(~kept, float("inf")).min()
    out = SelectionStats(
        num_tokens=n, num_kept=k, kept_frac=kf / nf.clamp(min=1),
        threshold=torch.where(k > 0, threshold, torch.zeros_like(threshold)),
        cvar=raw.masked_fill(~kept, 0.0).sum() / kf.clamp(min=1),
        score_dropped_mean=raw.masked_fill(~dropped, 0.0).sum() / (nf - kf).clamp(min=1))
    if domain is not None:
        B, T = scores.shape
        dom = domain.long()
        out.kept_per_domain = torch.zeros(n_domains, device=raw.device).index_add_(
            0, dom, kept.view(B, T).sum(1).float())
        out.tokens_per_domain = torch.zeros(n_domains, device=raw.device).index_add_(
            0, dom, torch.full((B,), float(T), device=raw.device))
    return out
