"""The domain-matched random control (``random-domain``): it separates domain reweighting from token selection.

At each micro-batch, ESLM-entropy's own rule (``VaRSelector`` on the entropy, at the run's alpha,
standardisation and scope) decides how many tokens of each domain are kept; then that many tokens of each domain
are drawn uniformly at random within that domain. So the kept count per domain, and with it the domain mixture
the loss sees, is ESLM's, while which tokens of a domain are kept does not depend on their scores. ESLM-entropy
minus this control is token selection alone; this control minus ``random`` is ESLM's domain reweighting alone.

The draw stays on the device with no host sync. Domains are per row (``Batch.domain``).
"""

from __future__ import annotations

import torch

from eslm.contracts import Selection
from eslm.data.batch import Batch
from eslm.ops.token_stats import TokenStats
from eslm.selection import risk
from eslm.selection.scores import standardize
from eslm.selection.selectors import VaRSelector, generator_state, load_generator
from eslm.selection.stats import selection_stats

__all__ = ["DomainRandomSelector", "domain_counts", "domain_matched_draw"]


def domain_counts(ids: torch.Tensor, n: int) -> torch.Tensor:
    """How many of ``ids`` (int64, each in [0, n)) equal each of 0..n-1: a (n,) int64 count with a static shape
    (``torch.bincount`` sizes its output by the largest id: a host read)."""
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def domain_matched_draw(token_domain: torch.Tensor, kept_per_domain: torch.Tensor, k: int,
                        generator: torch.Generator) -> torch.Tensor:
    """Flat indices (k,) of a uniformly random subset of the tokens that holds ``kept_per_domain[d]`` tokens of
    each domain d (the counts must sum to k). token_domain: (N,) int64 domain id of each token."""
    n = token_domain.numel()
    key = torch.rand(n, generator=generator, device=generator.device).to(token_domain.device)
    # domain + key in [0, 1): ascending order groups the domains, each in random order (float64: exact for ids)
    order = torch.argsort(token_domain.double() + key.double())
    dom_sorted = token_domain[order]
    n_domains = kept_per_domain.numel()
    per_domain = domain_counts(token_domain, n_domains)
    start = torch.cumsum(per_domain, 0) - per_domain  # first sorted position of each domain
    place = torch.arange(n, device=token_domain.device) - start[dom_sorted]
    keep_sorted = place < kept_per_domain.to(place.dtype)[dom_sorted]
    # exactly k entries are kept: the k largest of the 0/1 mask, by risk's one top-k (static shape, no sync)
    return order[risk.topk_index(keep_sorted.float(), k)]


class DomainRandomSelector(VaRSelector):
    """ESLM-entropy's kept count per domain, drawn uniformly at random within each domain. It scores like
    ``VaRSelector`` (so the step runs the same scoring pass as ESLM-entropy and books the same work) and reports
    the raw scores of the tokens it actually kept; its threshold field is ESLM's (the count rule), not a
    property of the random set."""

    def __init__(self, score: str, alpha: float, seed: int, standardize: str = "none", n_domains: int = 1,
                 scope: str = "micro", device: torch.device | str = "cpu") -> None:
        super().__init__(score, alpha, standardize, n_domains, scope)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def select(self, stats: TokenStats | None, batch: Batch, threshold: torch.Tensor | None = None) -> Selection:
        raw = self.scores(stats, batch)
        ranked = standardize(raw, self.standardize, batch.domain, self.n_domains)
        eslm_index, k = risk.select(ranked, self.alpha, threshold)
        B, T = batch.x.shape
        token_domain = batch.domain.long().repeat_interleave(T)
        n_dom = max(self.n_domains, 1)
        eslm_per_domain = domain_counts(token_domain[eslm_index], n_dom)
        index = domain_matched_draw(token_domain, eslm_per_domain, k, self.generator)
        kept = torch.zeros(raw.numel(), dtype=torch.bool, device=raw.device).index_fill_(0, index, True)
        out = selection_stats(raw, kept, ranked=ranked, domain=batch.domain, n_domains=self.n_domains)
        if k > 0:
            out.threshold = ranked.reshape(-1)[eslm_index].min()
        return Selection(index, k, ranked.numel(), out)

    def state_dict(self) -> dict:
        return {**super().state_dict(), **generator_state(self.generator)}

    def load_state_dict(self, sd: dict) -> None:
        load_generator(self.generator, sd, "domain-matched control")
        super().load_state_dict(sd)
