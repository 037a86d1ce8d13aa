"""Row selectors: which sequences of a micro-batch train. Default: all rows.

``AllRows`` is the do-nothing default of the ``eslm.contracts.RowSelector`` protocol (its hooks documented
there); the others are GREATS (``eslm.baselines.greats.GreatsRows``) and ``eslm.selection.instances.InstanceRows``.
"""

from __future__ import annotations

import torch

from eslm import contracts
from eslm.contracts import NO_EXTRA_WORK, ExtraWork
from eslm.data.batch import Batch


class AllRows(contracts.RowSelector):
    """Keep every row (the default for every token-level method); no extra work, no state."""

    syncs_host = False

    def select(self, model: torch.nn.Module, batch: Batch, step: int, lr: float) -> tuple[Batch, dict]:
        return batch, {}

    def candidate_rows(self, batch_rows: int) -> int:
        return batch_rows

    def num_rows(self, batch_rows: int) -> int:
        return batch_rows

    def candidate_batches(self, accum_steps: int) -> int:
        return accum_steps

    def select_step(self, model: torch.nn.Module, batches: list[Batch], world_size: int = 1) -> list[Batch]:
        return batches

    def extra_work(self, tokens_seen: int) -> ExtraWork:
        return NO_EXTRA_WORK

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass
