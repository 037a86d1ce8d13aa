"""Row selectors: which sequences of a micro-batch train. Default: all rows.

GREATS (``eslm.baselines.greats``) is the one non-trivial row selector in the paper's comparison.
"""

from __future__ import annotations

from eslm.data.batch import Batch


class AllRows:
    """Keep every row (the default for every token-level method)."""

    def select(self, model, batch: Batch, step: int, lr: float) -> tuple[Batch, dict]:
        return batch, {}

    def num_rows(self, batch_rows: int) -> int:
        """How many of batch_rows rows train (known before the forward, for global normalisation)."""
        return batch_rows

    def extra_flops(self, tokens_seen: int) -> tuple[float, float, int]:
        """(extra paper FLOPs, extra executed FLOPs, extra forward tokens of the trained model) per micro-batch."""
        return 0.0, 0.0, 0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass
