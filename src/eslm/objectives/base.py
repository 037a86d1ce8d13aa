"""Per-token objectives. An objective gives the scoring pass over all N tokens of a micro-batch (``score``) and
the summed loss of the kept tokens with its gradient (``loss_sum``). The step normalises the sum; objectives
never divide by a token count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eslm import contracts
from eslm.contracts import NO_EXTRA_WORK, ExtraWork
from eslm.data.batch import Batch
from eslm.ops.head_backend import HeadBackend, backend
from eslm.ops.token_stats import HeadOptions, HeadState, HeadWork, TokenStats


class BaseObjective(contracts.Objective):
    """The ``eslm.contracts.Objective`` protocol's defaults (its hooks are documented there): ``score`` is the plain
    scoring pass of the head backend (None when no scores are needed); ``loss_sum`` sums ``per_token``, which
    subclasses define as ``per_token(hidden, weight, batch, index, stats) -> (K,)`` fp32 with gradient (or they
    override ``loss_sum``); ``head_work`` books a chunked loss on the kept rows that recomputes their logits in its
    backward; no extra work, no state. ``impl``: the head backend (``eslm.ops.head_backend``, "auto": the
    device's default), built with ``options``."""

    # what a subclass defines (declared for a type checker; a subclass overriding ``loss_sum`` needs none)
    per_token: Callable[[torch.Tensor, torch.Tensor, Batch, torch.Tensor | None, TokenStats | None], torch.Tensor]

    def __init__(self, impl: str = "auto", chunk_size: int = 1024, *, cache_probs: bool = True,
                 route: str = "auto"):
        self.impl, self.chunk_size = impl, chunk_size
        self.head_options = HeadOptions(chunk_size, cache_probs, route)
        backend(impl, None, self.head_options)  # a bad name or option fails here, in one line

    def head(self, hidden: torch.Tensor | None = None) -> HeadBackend:
        """The head backend for tensors on ``hidden``'s device (None: the CPU's, for predictions)."""
        return backend(self.impl, None if hidden is None else hidden.device.type, self.head_options)

    def score(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, need_scores: bool,
              need_entropy: bool, num_kept: int, for_loss: bool = True) -> TokenStats | None:
        if not need_scores:
            return None
        return self.head(hidden).token_stats(hidden, weight, targets, need_entropy=need_entropy)

    def loss_sum(self, hidden: torch.Tensor, weight: torch.Tensor, batch: Batch, index: torch.Tensor | None,
                 stats: TokenStats | None) -> tuple[torch.Tensor, torch.Tensor]:
        per_token = self.per_token(hidden, weight, batch, index, stats)
        return per_token.sum(), per_token.detach()

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        return NO_EXTRA_WORK

    def head_work(self, n: int, k: int, *, scored: bool) -> HeadWork:
        return HeadWork(float(n), float(k), float(k))

    def on_step_end(self, step: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class CrossEntropy(BaseObjective):
    """Next-token cross-entropy on the kept tokens (CLM, ESLM, Rho-1, GREATS), through the head backend's score
    pass and kept-rows loss (``eslm.ops.head_backend``): the scoring pass over all rows leaves the backend's state,
    which the loss of the kept rows consumes. ``head_work`` reports what the backend ran.
    """

    _pending: tuple[TokenStats | None, HeadState] | None = None  # the last pass, until its loss_sum
    last_route: str | None = None  # the backend's route of the last micro-batch (for head_work)
    last_head: HeadBackend | None = None  # the backend that ran it (on CUDA, not the CPU's)

    def score(self, hidden, weight, targets, *, need_scores, need_entropy, num_kept, for_loss=True):
        if not for_loss:  # scores only (the step scope's pre-pass): the plain pass, nothing kept for a loss
            return super().score(hidden, weight, targets, need_scores=need_scores, need_entropy=need_entropy,
                                 num_kept=num_kept)
        head = self.head(hidden)
        stats, state = head.score(hidden, weight, targets, num_kept=num_kept, need_scores=need_scores,
                                  need_entropy=need_entropy)
        self._pending, self.last_route, self.last_head = (stats, state), state.route, head
        return stats

    def loss_sum(self, hidden, weight, batch, index, stats):
        pending, self._pending = self._pending, None
        state = pending[1] if pending is not None and pending[0] is stats else None  # this pass's, or none
        return self.head(hidden).kept_loss(hidden, weight, batch.y.reshape(-1), index, state)

    def head_work(self, n, k, *, scored):
        """What the backend ran for the last micro-batch's route (the CPU backend's prediction for (n, k) before
        any ran): the backend of the device the step ran on, whose routes may not be the CPU backend's."""
        if self.last_route is None or self.last_head is None:
            return self.head().work(n, k, scored=scored, state=None)
        return self.last_head.work(n, k, scored=scored, state=HeadState(self.last_route))
