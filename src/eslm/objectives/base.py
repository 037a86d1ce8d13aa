"""Per-token objectives. An objective turns (hidden states, head weight, batch, kept indices) into a
per-kept-token loss (K,) fp32 with gradient. The step sums and normalises it; objectives never reduce.
"""

from __future__ import annotations

import torch

from eslm.data.batch import Batch
from eslm.objectives.cross_entropy import TokenStats, selected_ce


class CrossEntropy:
    """Next-token cross-entropy on the kept tokens (CLM, ESLM, Rho-1, GREATS)."""

    def __init__(self, impl: str = "fused", chunk_size: int = 1024):
        self.impl, self.chunk_size = impl, chunk_size

    def per_token(self, hidden: torch.Tensor, weight: torch.Tensor, batch: Batch, index: torch.Tensor | None,
                  stats: TokenStats | None, step: int) -> torch.Tensor:
        """hidden (N, C) with grad, weight (V, C) -> (K,) fp32 CE of the kept tokens."""
        lse = stats.lse if stats is not None else None
        return selected_ce(hidden, weight, batch.y.reshape(-1), index, impl=self.impl,
                           chunk_size=self.chunk_size, lse=lse)

    def extra_flops(self, tokens_seen: int) -> tuple[float, float]:
        """(paper, executed) FLOPs this objective spends beyond the trained model, per micro-batch."""
        return 0.0, 0.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass
