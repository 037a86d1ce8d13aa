"""The naive head backend: full (N, V) logits, an fp32 log-softmax, the loss masked afterwards. Simple, obviously
right, the oracle every other backend is tested against, and what the paper's implementation does (registry:
``eslm.ops.head_backend``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eslm.ops.token_stats import HeadOptions, HeadState, HeadWork, TokenStats, loss_entropy


def naive_token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      need_entropy: bool = True) -> TokenStats:
    """Reference: full logits, fp32 log-softmax. No gradient."""
    with torch.no_grad():
        logits = (hidden @ weight.t()).float()
        loss, entropy = loss_entropy(logits, targets, need_entropy)
        lse = torch.logsumexp(logits, dim=-1)
    return TokenStats(loss=loss, entropy=entropy, lse=lse)


def naive_selected_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      index: torch.Tensor | None) -> torch.Tensor:
    """Reference per-token CE (with gradient) of the kept rows ``index`` (K,), or of all rows if None; the
    backward still runs over every row (dropped rows receive zero gradient)."""
    logits = (hidden @ weight.t()).float()
    per_token = F.cross_entropy(logits, targets, reduction="none")
    return per_token if index is None else per_token[index]


class NaiveHead:
    """The oracle as a backend: the scores from the full logits, the loss masked (its backward runs over every
    row, so every row's two gradient matmuls are booked)."""

    name = "naive"

    def __init__(self, options: HeadOptions = HeadOptions()) -> None:
        self.options = options

    def score(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, num_kept: int,
              need_scores: bool, need_entropy: bool) -> tuple[TokenStats | None, HeadState]:
        stats = naive_token_stats(hidden, weight, targets, need_entropy) if need_scores else None
        return stats, HeadState("masked")

    def kept_loss(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  index: torch.Tensor | None, state: HeadState | None) -> tuple[torch.Tensor, torch.Tensor]:
        per_token = naive_selected_ce(hidden, weight, targets, index)
        return per_token.sum(), per_token.detach()

    def work(self, n: int, k: int, *, scored: bool, state: HeadState | None = None) -> HeadWork:
        return HeadWork(float(n), float(n), 0.0)

    def token_stats(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    need_entropy: bool) -> TokenStats:
        return naive_token_stats(hidden, weight, targets, need_entropy)

    def per_token_ce(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     index: torch.Tensor | None, *, lse: torch.Tensor | None = None) -> torch.Tensor:
        return naive_selected_ce(hidden, weight, targets, index)
