"""Per-token objectives. An objective gives the scoring pass over all N tokens of a micro-batch (``score``) and
the summed loss of the kept tokens with its gradient (``loss_sum``). The step normalises the sum; objectives
never divide by a token count.
"""

from __future__ import annotations

import torch

from eslm.contracts import NO_EXTRA_WORK, ExtraWork
from eslm.data.batch import Batch
from eslm.objectives.cross_entropy import TokenStats, naive_selected_ce, selected_ce, token_stats


class Objective:
    """Base class of the ``eslm.contracts.Objective`` protocol: ``score`` is the plain scoring pass; ``loss_sum``
    sums ``per_token``. Subclasses define ``per_token(hidden, weight, batch, index, stats) -> (K,)`` fp32 with
    gradient (or override ``loss_sum``)."""

    def __init__(self, impl: str = "fused", chunk_size: int = 1024):
        self.impl, self.chunk_size = impl, chunk_size

    def score(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, need_scores: bool,
              need_entropy: bool, keep_fraction: float, for_loss: bool = True) -> TokenStats | None:
        """Detached fp32 per-token statistics of all N tokens (hidden (N, C) detached), or None when the token
        selector needs no scores. ``keep_fraction`` K/N lets an objective choose its cheapest route; with
        ``for_loss`` False only the scores are wanted (no ``loss_sum`` follows on this pass)."""
        if not need_scores:
            return None
        return token_stats(hidden, weight, targets, need_entropy=need_entropy, impl=self.impl,
                           chunk_size=self.chunk_size)

    def loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, batch: Batch, index: torch.Tensor | None,
                 stats: TokenStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the kept tokens' losses, 0-dim with gradient; their per-token losses (K,) detached)."""
        per_token = self.per_token(hidden, weight, batch, index, stats)
        return per_token.sum(), per_token.detach()

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        """Work beyond the trained model per micro-batch: none."""
        return NO_EXTRA_WORK

    def head_work(self, n: int, k: int, *, scored: bool) -> tuple[float, float]:
        """For ``eslm.flops.step_flops``: (rows whose head backward ran, rows whose logits were formed again)
        of a micro-batch of n tokens with k kept. Default: a chunked loss on the kept rows that recomputes
        their logits in its backward."""
        return float(k), float(k)

    def on_step_end(self, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class CrossEntropy(Objective):
    """Next-token cross-entropy on the kept tokens (CLM, ESLM, Rho-1, GREATS).

    With the fused implementation the scoring pass and the loss share the work (``eslm.ops.fused_head``):
    * scores needed and ``cache_probs``: the scoring pass keeps its softmax P, and the kept rows' gradients are
      formed from it with the dropped rows zeroed in the (N, C) factors (3u, no recompute; one (N, V) fp32
      buffer);
    * every token kept (CLM), or most (k >= 0.8): the one pass over the vocabulary also forms the gradients, so
      the head costs what plain training's does (3u, plus 2(1-k)u to take the dropped rows out);
    * otherwise only the kept rows get logits and gradients (1u + 3ku after a scoring pass).
    """

    def __init__(self, impl: str = "fused", chunk_size: int = 1024, cache_probs: bool = True):
        super().__init__(impl, chunk_size)
        self.cache_probs = cache_probs

    def score(self, hidden, weight, targets, *, need_scores, need_entropy, keep_fraction, for_loss=True):
        if self.impl == "naive" or not for_loss:  # scores only: the plain pass, no softmax kept, no gradients
            return super().score(hidden, weight, targets, need_scores=need_scores, need_entropy=need_entropy,
                                 keep_fraction=keep_fraction)
        from eslm.ops.fused_head import head_pass, wants_grads_in_pass

        keep_probs = need_scores and self.cache_probs
        with_grads = not keep_probs and wants_grads_in_pass(keep_fraction)
        if not (need_scores or with_grads):
            return None
        return head_pass(hidden, weight, targets, need_entropy=need_scores and need_entropy, with_grads=with_grads,
                         keep_probs=keep_probs, chunk_size=self.chunk_size)

    def loss_sum(self, hidden, weight, batch, index, stats):
        targets = batch.y.reshape(-1)
        if self.impl == "naive":
            per_token = naive_selected_ce(hidden, weight, targets, index)
            return per_token.sum(), per_token.detach()
        from eslm.ops.fused_head import fused_ce_sum

        return fused_ce_sum(hidden, weight, targets, index, pre=stats, chunk_size=self.chunk_size)

    def head_work(self, n, k, *, scored):
        if self.impl == "naive":
            return float(n), 0.0  # a masked loss: the backward runs over every row
        from eslm.ops.fused_head import head_work

        return head_work(n, k, scored=scored, cached_probs=self.cache_probs)

    def per_token(self, hidden: torch.Tensor, weight: torch.Tensor, batch: Batch, index: torch.Tensor | None,
                  stats: TokenStats | None) -> torch.Tensor:
        """hidden (N, C) with grad, weight (V, C) -> (K,) fp32 CE of the kept tokens (any upstream gradient)."""
        lse = stats.lse if stats is not None else None
        return selected_ce(hidden, weight, batch.y.reshape(-1), index, impl=self.impl,
                           chunk_size=self.chunk_size, lse=lse)
