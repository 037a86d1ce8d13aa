"""``TokenStats``: what a scoring pass over the LM head returns, per token (the lowest layer's data type, so that
the kernels in ``eslm.ops`` and the objectives above them share it without importing upward)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenStats:
    """Per-token statistics of the model's predictive distribution, detached, fp32, shape (N,).

    loss    = -log p(target) = lse - z_target
    entropy = -sum_v p_v log p_v = lse - sum_v p_v z_v      (None when not requested)
    lse     = log sum_v exp(z_v)

    The fused pass may also carry the cross-entropy gradients of sum_i loss_i over all N rows, formed while
    the logits were at hand (``eslm.ops.fused_head.head_pass``): grad_hidden (N, C), grad_weight (V, C) fp32,
    or the softmax itself (probs).
    """

    loss: torch.Tensor
    entropy: torch.Tensor | None
    lse: torch.Tensor
    grad_hidden: torch.Tensor | None = None
    grad_weight: torch.Tensor | None = None
    probs: torch.Tensor | None = None  # (N, V) fp32 softmax, when the pass was asked to keep it
    softmax_w: torch.Tensor | None = None  # (N, C) probs @ weight, when the pass formed it (fp32)
    route: str | None = None  # the head route (eslm.ops.head_route) this pass was made for, when one chose it
