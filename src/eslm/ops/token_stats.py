"""The lowest layer's data types, shared by the head backends and the layers above them without importing upward;
and ``loss_entropy``, the one computation of a token's loss and entropy from its logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TokenStats:
    """Per-token statistics of the model's predictive distribution, detached, fp32, shape (N,).

    loss    = -log p(target) = lse - z_target
    entropy = -sum_v p_v log p_v = lse - sum_v p_v z_v      (None when not requested)
    lse     = log sum_v exp(z_v)

    Only what a selector or a caller reads: whatever a backend keeps for its loss travels in its own opaque
    state (``eslm.ops.head_backend.HeadState``).
    """

    loss: torch.Tensor
    entropy: torch.Tensor | None
    lse: torch.Tensor


def loss_entropy(z: torch.Tensor, targets: torch.Tensor,
                 need_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token loss -log p(target) and entropy -sum_v p_v log p_v (None unless asked) of fp32 logits z (n, V),
    through one log-softmax; targets (n,) int64. Differentiable: callers that want scores run it under no_grad."""
    logp = torch.log_softmax(z, dim=-1)
    loss = -logp.gather(1, targets[:, None]).squeeze(1)
    return loss, (-(logp.exp() * logp).sum(-1) if need_entropy else None)


@dataclass(frozen=True)
class HeadWork:
    """What a backend ran at the head for one micro-batch, in rows of one (C x V) head matmul (2CV FLOPs), all
    non-negative:

    forward_rows:   rows whose logits the forward formed once (N; K where no scoring pass ran and only the kept
                    rows' logits were formed)
    backward_rows:  rows whose two gradient matmuls ran (G_h and G_W)
    recompute_rows: rows whose logits-sized matmul ran once more (a recompute, a subtracted share)
    """

    forward_rows: float
    backward_rows: float
    recompute_rows: float = 0.0

    def head_tokens(self, n: int) -> tuple[float, float]:
        """(head backward tokens, head forward tokens beyond one per token) of ``eslm.flops.step_flops`` for a
        micro-batch of ``n`` tokens: the second is negative when rows' forward never ran."""
        return self.backward_rows, self.recompute_rows - (n - self.forward_rows)


@dataclass
class HeadState:
    """What ``score`` leaves for ``kept_loss``: opaque to everyone but the backend that made it. ``route``: the
    name of the way it will compute the loss (the fused backend's head routes; one name for the others)."""

    route: str
    buffers: Any = None


@dataclass(frozen=True)
class HeadOptions:
    """The settings a backend is built with (``train.loss_chunk_size``, ``train.loss_cache_probs``,
    ``train.loss_route``); a backend reads those it has a use for."""

    chunk_size: int = 1024
    cache_probs: bool = True  # the fused backend may keep the scoring pass's (N, V) fp32 softmax
    route: str = "auto"  # the fused backend's head route, forced where it can run (eslm.ops.head_route)
