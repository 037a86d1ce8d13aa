"""Cross-entropy from hidden states: the per-token loss, entropy and log-sum-exp of the LM head, for the
objectives' scoring pass and kept-token loss, GREATS' per-row losses, the frozen models and the drop-in API.
(The KD loss forms its own logits: ``eslm.objectives.distill``.)

Two implementations behind one interface:

* ``naive``: full (N, V) logits and an fp32 log-softmax. Simple, obviously right, and the test oracle
  for every fast path. It is also what the paper's implementation does.
* ``fused``: ``eslm.ops.fused_head`` — chunked over tokens, never holds the full fp32 logits, and its
  backward touches only the kept rows.

Shapes: hidden (N, C) (any float dtype), weight (V, C) the LM-head / tied embedding, targets (N,) int64.
All returned per-token quantities are fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eslm.ops.token_stats import TokenStats

__all__ = ["TokenStats", "naive_token_stats", "naive_selected_ce", "token_stats", "selected_ce"]


def naive_token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      need_entropy: bool = True) -> TokenStats:
    """Reference: full logits, fp32 log-softmax. No gradient."""
    with torch.no_grad():
        logits = (hidden @ weight.t()).float()
        logp = torch.log_softmax(logits, dim=-1)
        loss = -logp.gather(1, targets[:, None]).squeeze(1)
        lse = torch.logsumexp(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1) if need_entropy else None
    return TokenStats(loss=loss, entropy=entropy, lse=lse)


def naive_selected_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      index: torch.Tensor | None) -> torch.Tensor:
    """Reference per-token CE (with gradient) of the kept rows ``index`` (K,), or of all rows if None.

    Computes the full (N, V) logits and masks afterwards, exactly like a masked loss does: the backward
    still runs over every row (dropped rows receive zero gradient).
    """
    logits = (hidden @ weight.t()).float()
    per_token = F.cross_entropy(logits, targets, reduction="none")
    return per_token if index is None else per_token[index]


def token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                need_entropy: bool = True, impl: str = "fused", chunk_size: int = 1024) -> TokenStats:
    """Detached per-token loss / entropy / lse, through the chosen implementation."""
    if impl == "naive":
        return naive_token_stats(hidden, weight, targets, need_entropy)
    from eslm.ops.fused_head import fused_token_stats

    return fused_token_stats(hidden, weight, targets, need_entropy=need_entropy, chunk_size=chunk_size)


def selected_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                index: torch.Tensor | None, *, impl: str = "fused", chunk_size: int = 1024,
                lse: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token CE (K,) with gradient for the kept rows ``index`` (None = all rows).

    ``lse`` (N,), when the scoring pass already computed it, lets the fused path skip recomputing it.
    """
    if impl == "naive":
        return naive_selected_ce(hidden, weight, targets, index)
    from eslm.ops.fused_head import fused_selected_ce

    return fused_selected_ce(hidden, weight, targets, index, chunk_size=chunk_size, lse=lse)
