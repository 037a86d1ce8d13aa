"""Row selectors: which sequences of a micro-batch train. Default: all rows.

A row selector (the ``RowSelector`` protocol; ``AllRows`` is its reference implementation) has ``select``,
``candidate_rows``, ``num_rows``, ``extra_flops``, ``state_dict`` and ``load_state_dict``. GREATS
(``eslm.baselines.greats``, adapter ``eslm.baselines.plugins.GreatsRows``) is the one non-trivial row selector
in the paper's comparison.
"""

from __future__ import annotations

from eslm.data.batch import Batch


class AllRows:
    """Keep every row (the default for every token-level method)."""

    def select(self, model, batch: Batch, step: int, lr: float) -> tuple[Batch, dict]:
        return batch, {}

    def candidate_rows(self, batch_rows: int) -> int:
        """How many candidate rows the selector scores for a loader micro-batch of batch_rows rows.

        The trainer's loader always yields batch_rows rows; a selector that wants a larger pool (GREATS'
        ``pool`` mode) draws the extra candidates itself, from a loader it owns and checkpoints in its
        ``state_dict``, so the step and the trainer stay method-agnostic and resume stays exact. The trainer
        uses this only to count the training tokens drawn (``tokens_seen``)."""
        return batch_rows

    def num_rows(self, batch_rows: int) -> int:
        """How many rows train for a loader micro-batch of batch_rows rows (known before the forward, for
        global normalisation); at most ``candidate_rows(batch_rows)``."""
        return batch_rows

    def extra_flops(self, tokens_seen: int) -> tuple[float, float, int]:
        """(extra paper FLOPs, extra executed FLOPs, extra forward tokens of the trained model) per micro-batch."""
        return 0.0, 0.0, 0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass
