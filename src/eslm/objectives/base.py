"""Per-token objectives. An objective gives the scoring pass over all N tokens of a micro-batch (``score``) and
the summed loss of the kept tokens with its gradient (``loss_sum``). The step normalises the sum; objectives
never divide by a token count.
"""

from __future__ import annotations

import torch

from eslm import contracts
from eslm.contracts import NO_EXTRA_WORK, ExtraWork
from eslm.errors import ConfigError
from eslm.data.batch import Batch
from eslm.objectives.cross_entropy import TokenStats, naive_selected_ce, selected_ce, token_stats


class Objective(contracts.Objective):
    """The ``eslm.contracts.Objective`` protocol's defaults (its hooks are documented there): ``score`` is the plain
    scoring pass (None when no scores are needed); ``loss_sum`` sums ``per_token``, which subclasses define as
    ``per_token(hidden, weight, batch, index, stats) -> (K,)`` fp32 with gradient (or they override ``loss_sum``);
    ``head_work`` books a chunked loss on the kept rows that recomputes their logits in its backward; no extra
    work, no state."""

    def __init__(self, impl: str = "fused", chunk_size: int = 1024):
        self.impl, self.chunk_size = impl, chunk_size

    def score(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, need_scores: bool,
              need_entropy: bool, keep_fraction: float, for_loss: bool = True) -> TokenStats | None:
        if not need_scores:
            return None
        return token_stats(hidden, weight, targets, need_entropy=need_entropy, impl=self.impl,
                           chunk_size=self.chunk_size)

    def loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, batch: Batch, index: torch.Tensor | None,
                 stats: TokenStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        per_token = self.per_token(hidden, weight, batch, index, stats)
        return per_token.sum(), per_token.detach()

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        return NO_EXTRA_WORK

    def head_work(self, n: int, k: int, *, scored: bool) -> tuple[float, float]:
        return float(k), float(k)

    def on_step_end(self, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class CrossEntropy(Objective):
    """Next-token cross-entropy on the kept tokens (CLM, ESLM, Rho-1, GREATS).

    With the fused implementation the scoring pass and the loss share the work, by the route the cost model of
    ``eslm.ops.head_route`` picks per micro-batch (``route`` forces one where it can run): with selection scores
    and ``cache_probs``, the pass keeps its softmax and the gradient matmuls run over the kept rows only
    (``kept_cached``, 1u + 2ku) or over every row with the dropped ones zeroed (``all_rows``, 3u); without the
    cache, the pass forms every row's gradients and the dropped rows' share is subtracted (``grads_in_pass``,
    3u + 2(1-k)u), or only the kept rows get logits and gradients (``kept_recompute``, 1u + 3ku); CLM's one pass
    is ``grads_in_pass`` with every row kept (3u). ``head_work`` reports what the route ran.
    """

    def __init__(self, impl: str = "fused", chunk_size: int = 1024, cache_probs: bool = True, route: str = "auto"):
        super().__init__(impl, chunk_size)
        from eslm.ops.head_route import CACHED_ROUTES, ROUTE_CHOICES

        if route not in ROUTE_CHOICES:
            raise ConfigError(f"train.loss_route must be one of {' | '.join(ROUTE_CHOICES)}; found {route!r}; "
                              f"fix: train.loss_route=auto")
        if route in CACHED_ROUTES and not cache_probs:
            raise ConfigError(f"train.loss_route={route} keeps the softmax, which train.loss_cache_probs=false "
                              f"forbids; fix: train.loss_cache_probs=true, or train.loss_route=auto")
        self.cache_probs, self.route = cache_probs, route
        self._geometry = None  # the head's shape and device, known from the first micro-batch
        self._last_route = None  # the route the last micro-batch ran, for head_work

    def choose(self, n: int, k: int, *, scored: bool, entropy: bool = False) -> str:
        """The route of a micro-batch of n tokens with k kept (the one chooser, ``eslm.ops.head_route``);
        ``entropy``: the selection scores include the entropy."""
        from eslm.ops.head_route import choose_route

        return choose_route(n, k, self._geometry, scored=scored, cache=self.cache_probs, forced=self.route,
                            entropy=entropy)

    def score(self, hidden, weight, targets, *, need_scores, need_entropy, keep_fraction, for_loss=True):
        if self.impl == "naive" or not for_loss:  # scores only: the plain pass, no softmax kept, no gradients
            return super().score(hidden, weight, targets, need_scores=need_scores, need_entropy=need_entropy,
                                 keep_fraction=keep_fraction)
        from eslm.ops.fused_head import geometry, route_pass

        n = hidden.shape[0]
        k = min(n, max(1, round(keep_fraction * n)))
        self._geometry = geometry(hidden, weight)
        self._last_route = self.choose(n, k, scored=need_scores, entropy=need_scores and need_entropy)
        return route_pass(self._last_route, hidden, weight, targets, scored=need_scores, need_entropy=need_entropy,
                          chunk_size=self.chunk_size)

    def loss_sum(self, hidden, weight, batch, index, stats):
        targets = batch.y.reshape(-1)
        if self.impl == "naive":
            per_token = naive_selected_ce(hidden, weight, targets, index)
            return per_token.sum(), per_token.detach()
        from eslm.ops.fused_head import fused_ce_sum

        return fused_ce_sum(hidden, weight, targets, index, pre=stats, chunk_size=self.chunk_size)

    def head_work(self, n, k, *, scored):
        """The rows of the route the last micro-batch ran (the chooser's pick for (n, k) before any ran)."""
        if self.impl == "naive":
            return float(n), 0.0  # a masked loss: the backward runs over every row
        from eslm.ops.head_route import route_work

        route = self._last_route if self._last_route is not None else self.choose(n, max(k, 1), scored=scored)
        return route_work(route, n, k, scored=scored)

    def per_token(self, hidden: torch.Tensor, weight: torch.Tensor, batch: Batch, index: torch.Tensor | None,
                  stats: TokenStats | None) -> torch.Tensor:
        """hidden (N, C) with grad, weight (V, C) -> (K,) fp32 CE of the kept tokens (any upstream gradient)."""
        lse = stats.lse if stats is not None else None
        return selected_ce(hidden, weight, batch.y.reshape(-1), index, impl=self.impl,
                           chunk_size=self.chunk_size, lse=lse)
