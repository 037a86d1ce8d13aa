"""Row selectors: which sequences of a micro-batch train. Default: all rows.

``AllRows`` is the base class of the ``eslm.contracts.RowSelector`` protocol (every hook declared there) and
its do-nothing default. GREATS
(``eslm.baselines.greats``, adapter ``eslm.baselines.plugins.GreatsRows``) is the one non-trivial row selector
in the paper's comparison.
"""

from __future__ import annotations

from eslm.contracts import NO_EXTRA_WORK, ExtraWork
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

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        """Work of the last selection beyond the trained model's pass over the kept rows: none."""
        return NO_EXTRA_WORK

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass
