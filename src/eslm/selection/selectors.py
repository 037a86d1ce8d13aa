"""Token selectors: which tokens of a micro-batch count in the loss.

A selector maps the micro-batch's risk scores (B, T) to the flat indices of the kept tokens. Everything is
computed on detached fp32 scores. The kept count K is a Python int derived from shapes (no host sync);
``select`` never calls ``.item()``.

* ``AllTokens``   keep everything (CLM, dense KD). No scores needed, so no scoring pass runs.
* ``VaRSelector`` keep the top K = N - floor(alpha*N) by score (ESLM VaR-entropy / CVaR-loss, Rho-1).
* ``RandomSelector`` keep K uniformly random tokens: the control that tells selection from mere sparsity.

With ``threshold`` given (selection scope "step": the VaR of the whole optimizer step, computed by the
step's scoring pre-pass), a selector keeps every token whose score is >= threshold instead.
"""

from __future__ import annotations

import torch

from eslm.contracts import NO_EXTRA_WORK, ExtraWork, Selection
from eslm.data.batch import Batch
from eslm.selection import risk
from eslm.selection.scores import standardize
from eslm.selection.stats import selection_stats


__all__ = ["Selection", "TokenSelector", "AllTokens", "VaRSelector", "RandomSelector"]


def _stats(raw: torch.Tensor, ranked: torch.Tensor, index: torch.Tensor, batch: Batch, n_domains: int):
    """The selection's statistics on the RAW scores (threshold reported on the ranking scale)."""
    kept = torch.zeros(raw.numel(), dtype=torch.bool, device=raw.device).index_fill_(0, index, True)
    return selection_stats(raw, kept, ranked=ranked, domain=batch.domain, n_domains=n_domains)


class TokenSelector:
    """Base class of the ``eslm.contracts.TokenSelector`` protocol and the do-nothing default: keep all tokens."""

    score: str | None = None  # which score the selector needs: None | "loss" | "entropy" | "excess_loss"
    standardize: str = "none"  # score standardisation before ranking (eslm.selection.scores)

    def __init__(self, alpha: float = 0.0, n_domains: int = 1):
        self.alpha = risk.check_alpha(alpha)
        self.n_domains = n_domains

    def num_kept(self, n_tokens: int) -> int:
        """K for a micro-batch of n_tokens (known before the forward pass, for global normalisation)."""
        return n_tokens

    def scores(self, stats, batch: Batch) -> torch.Tensor | None:
        """Risk scores (B, T) fp32: the scoring pass's statistic named by ``score`` (None when no score)."""
        if self.score is None:
            return None
        return getattr(stats, self.score).view(batch.x.shape)

    def select(self, scores: torch.Tensor | None, batch: Batch, threshold: torch.Tensor | None = None) -> Selection:
        n = batch.num_tokens
        return Selection(index=None, num_kept=n, num_tokens=n)

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        """Work of scoring beyond the objective's scoring pass: none."""
        return NO_EXTRA_WORK

    def state_dict(self) -> dict:
        return {"alpha": self.alpha}

    def load_state_dict(self, sd: dict) -> None:
        self.alpha = float(sd["alpha"])


AllTokens = TokenSelector


class VaRSelector(TokenSelector):
    """Keep the tokens whose (standardised) score is in the top 1-alpha: score >= VaR_alpha."""

    def __init__(self, score: str, alpha: float, standardize: str = "none", n_domains: int = 1):
        super().__init__(alpha, n_domains)
        self.score = score
        self.standardize = standardize

    def num_kept(self, n_tokens: int) -> int:
        return risk.num_kept(n_tokens, self.alpha)

    def select(self, scores, batch, threshold=None) -> Selection:
        ranked = standardize(scores, self.standardize, batch.domain, self.n_domains)
        index, k = risk.select(ranked, self.alpha, threshold)
        return Selection(index, k, ranked.numel(), _stats(scores, ranked, index, batch, self.n_domains))


class RandomSelector(TokenSelector):
    """Keep K uniformly random tokens (same K as VaR at this alpha). Its generator state is checkpointed."""

    def __init__(self, alpha: float, seed: int, n_domains: int = 1):
        super().__init__(alpha, n_domains)
        self.generator = torch.Generator().manual_seed(seed)

    def num_kept(self, n_tokens: int) -> int:
        return risk.num_kept(n_tokens, self.alpha)

    def select(self, scores, batch, threshold=None) -> Selection:
        n = batch.num_tokens
        k = risk.num_kept(n, self.alpha)
        index = torch.randperm(n, generator=self.generator)[:k].to(batch.x.device)
        fake = torch.zeros(batch.x.shape, device=batch.x.device)
        return Selection(index, k, n, _stats(fake, fake, index, batch, self.n_domains))

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, "generator": self.generator.get_state()}

    def load_state_dict(self, sd: dict) -> None:
        self.alpha = float(sd["alpha"])
        self.generator.set_state(sd["generator"])
