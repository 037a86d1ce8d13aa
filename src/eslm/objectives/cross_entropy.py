"""Cross-entropy from hidden states: the per-token loss, entropy and log-sum-exp of the LM head, for the
objectives' scoring pass and kept-token loss, GREATS' per-row losses, the frozen models and evaluation.
(The KD loss forms its own logits: ``eslm.objectives.distill``.)

The implementations are the head backends of ``eslm.ops.head_backend`` (``naive``: full logits, the oracle;
``fused``: chunked, never the full fp32 logits; ``triton``: the GPU's), chosen by name through its registry:
``impl`` here is a backend name or "auto" (the device's default).

Shapes: hidden (N, C) (any float dtype), weight (V, C) the LM-head / tied embedding, targets (N,) int64.
All returned per-token quantities are fp32.
"""

from __future__ import annotations

import torch

from eslm.ops.head_backend import backend
from eslm.ops.token_stats import HeadOptions, TokenStats


def token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                need_entropy: bool = True, impl: str = "auto", chunk_size: int = 1024) -> TokenStats:
    """Detached per-token loss / entropy / lse, through the backend ``impl``."""
    return backend(impl, hidden.device.type, HeadOptions(chunk_size)).token_stats(
        hidden, weight, targets, need_entropy=need_entropy)


def selected_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                index: torch.Tensor | None, *, impl: str = "auto", chunk_size: int = 1024,
                lse: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token CE (K,) with gradient for the kept rows ``index`` (None = all rows), through the backend
    ``impl``. ``lse`` (N,), when the scoring pass already computed it, lets a backend skip recomputing it."""
    return backend(impl, hidden.device.type, HeadOptions(chunk_size)).per_token_ce(
        hidden, weight, targets, index, lse=lse)
