"""Token selectors: which tokens of a micro-batch count in the loss.

A selector owns its whole rule: from the scoring pass's statistics (``TokenStats``) it forms its risk scores
(``scores``), the scale it ranks them on (``rank``: the standardised scores), and the kept tokens (``select``);
in the selection scope "step" it also turns the ranked scores of every micro-batch of the optimizer step into
one threshold (``step_threshold``). Everything is computed on detached fp32 scores. In the scope "micro" the
kept count K is a Python int derived from shapes and nothing reads the device. In the scope "step" the
threshold is the VaR of the whole optimizer step on all ranks (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch
import torch.distributed as dist

from eslm import contracts
from eslm.contracts import NO_EXTRA_WORK, ExtraWork, Selection, StepThreshold
from eslm.data.batch import Batch
from eslm.errors import CheckpointError
from eslm.ops.token_stats import TokenStats
from eslm.selection import risk
from eslm.selection.scores import standardize
from eslm.selection.stats import SCORE_FIELDS, SelectionStats, selection_stats

__all__ = ["Selection", "AllTokens", "VaRSelector", "RandomSelector", "SCOPES", "all_gather", "generator_state",
           "load_generator"]

SCOPES = ("micro", "step")  # method.scope, validated with the config (the drop-in loss's: api.loss.LOSS_SCOPES)
STATS = tuple(f.name for f in fields(TokenStats))  # what a selector may need of the scoring pass: loss, entropy, lse


def generator_state(generator: torch.Generator) -> dict:
    """A random control's generator state for its checkpoint, with the device type it draws on."""
    return {"generator": generator.get_state(), "generator_device": generator.device.type}


def load_generator(generator: torch.Generator, sd: dict, what: str) -> None:
    """Continue ``generator_state``'s stream ``sd`` in ``generator``; a stream drawn on another device type cannot
    continue there: one CheckpointError line (``what``: whose generator)."""
    saved, here = sd["generator_device"], generator.device.type
    if saved != here:
        raise CheckpointError(f"expected the {what}'s generator state of a {here} run; found one drawn on {saved}; "
                              f"fix: resume on a {saved} device (its random stream cannot continue on another), "
                              "or start the run afresh")
    generator.set_state(sd["generator"])


def all_gather(t: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's ``t`` (one shape on every rank), concatenated in rank order along dim 0; ``t`` on one rank."""
    if world_size == 1:
        return t
    out = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def _stats(raw: torch.Tensor, ranked: torch.Tensor, index: torch.Tensor, batch: Batch,
           n_domains: int) -> SelectionStats:
    """The selection's statistics on the RAW scores (threshold reported on the ranking scale)."""
    kept = torch.zeros(raw.numel(), dtype=torch.bool, device=raw.device).index_fill_(0, index, True)
    return selection_stats(raw, kept, ranked=ranked, domain=batch.domain, n_domains=n_domains)


class AllTokens(contracts.TokenSelector):
    """The ``eslm.contracts.TokenSelector`` protocol's default (its hooks are documented there): keep every token
    (CLM, dense KD), rank nothing (so no scoring pass runs), no step threshold, no extra work; its state is alpha."""

    score: str | None = None  # the name of the score it ranks: None (none) | "loss" | "entropy" | "excess_loss" | ...
    needs: tuple[str, ...] = ()  # the scoring pass's statistics it reads (of ``STATS``); empty: no scoring pass
    scope: str = "micro"  # selection scope: "micro" (per micro-batch) | "step" (one threshold per optimizer step)

    def __init__(self, alpha: float = 0.0, n_domains: int = 1) -> None:
        self.alpha = risk.check_alpha(alpha)
        self.n_domains = n_domains

    def num_kept(self, n_tokens: int) -> int:
        return risk.num_kept(n_tokens, self.alpha)  # every token at AllTokens' alpha 0

    def rank(self, stats: TokenStats | None, batch: Batch) -> torch.Tensor | None:
        return None

    def step_threshold(self, ranked: list[torch.Tensor], world_size: int = 1) -> StepThreshold | None:
        return None

    def select(self, stats: TokenStats | None, batch: Batch, threshold: torch.Tensor | None = None) -> Selection:
        n = batch.num_tokens
        return Selection(index=None, num_kept=n, num_tokens=n)

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        return NO_EXTRA_WORK

    def state_dict(self) -> dict:
        return {"alpha": self.alpha}

    def load_state_dict(self, sd: dict) -> None:
        self.alpha = float(sd["alpha"])


class VaRSelector(AllTokens):
    """Keep the tokens whose (standardised) score is in the top 1-alpha: score >= VaR_alpha (ESLM; Rho-1 and the
    domain-matched control subclass it). By default the score is the scoring pass's statistic named ``score``
    (``STATS``), so that is what it needs; a subclass that forms its own score (``scores``) names the statistics
    it reads in ``needs``."""

    def __init__(self, score: str, alpha: float, standardize: str = "none", n_domains: int = 1,
                 scope: str = "micro", needs: tuple[str, ...] | None = None) -> None:
        super().__init__(alpha, n_domains)
        self.needs = (score,) if needs is None else tuple(needs)
        if not self.needs or not set(self.needs) <= set(STATS):
            raise TypeError(f"{type(self).__name__}: needs {self.needs!r}; expected statistics of the scoring pass "
                            f"among {', '.join(STATS)} (a selector that forms its own score {score!r} names them)")
        self.score, self.standardize, self.scope = score, standardize, scope

    def scores(self, stats: TokenStats | None, batch: Batch) -> torch.Tensor:
        """Risk scores (B, T) fp32: the scoring pass's statistic named by ``score`` (``stats``: the pass the step
        runs for a selector that ``needs`` statistics)."""
        return getattr(stats, str(self.score)).view(batch.x.shape)

    def rank(self, stats: TokenStats | None, batch: Batch) -> torch.Tensor:
        return standardize(self.scores(stats, batch), self.standardize, batch.domain, self.n_domains)

    def step_threshold(self, ranked: list[torch.Tensor], world_size: int = 1) -> StepThreshold:
        """The VaR of all the step's ranked scores on all ranks, and how many are at or above it (for global
        normalisation; reading that count is the step scope's host sync)."""
        scores = all_gather(torch.cat([r.reshape(-1) for r in ranked]), world_size)
        threshold = risk.var_threshold(scores, self.alpha)
        return StepThreshold(threshold, int(risk.at_or_above(scores, threshold).sum()))

    def select(self, stats: TokenStats | None, batch: Batch, threshold: torch.Tensor | None = None) -> Selection:
        raw = self.scores(stats, batch)
        ranked = standardize(raw, self.standardize, batch.domain, self.n_domains)
        index, k = risk.select(ranked, self.alpha, threshold)
        return Selection(index, k, ranked.numel(), _stats(raw, ranked, index, batch, self.n_domains))


class RandomSelector(AllTokens):
    """Keep K uniformly random tokens (same K as VaR at this alpha): the control that tells selection from mere
    sparsity. Its generator lives on the model's device; its state is checkpointed with the device type (a CUDA
    stream cannot continue on the CPU)."""

    def __init__(self, alpha: float, seed: int, n_domains: int = 1, device: torch.device | str = "cpu"):
        super().__init__(alpha, n_domains)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def select(self, stats: TokenStats | None, batch: Batch, threshold: torch.Tensor | None = None) -> Selection:
        n = batch.num_tokens
        k = risk.num_kept(n, self.alpha)
        index = torch.randperm(n, generator=self.generator, device=self.generator.device)[:k].to(batch.x.device)
        fake = torch.zeros(batch.x.shape, device=batch.x.device)
        no_score = torch.full((), float("nan"), device=batch.x.device)  # it ranked no scores: none to report
        out = replace(_stats(fake, fake, index, batch, self.n_domains), **{f: no_score for f in SCORE_FIELDS})
        return Selection(index, k, n, out)

    def state_dict(self) -> dict:
        return {"alpha": self.alpha, **generator_state(self.generator)}

    def load_state_dict(self, sd: dict) -> None:
        load_generator(self.generator, sd, "random control")
        self.alpha = float(sd["alpha"])
