"""The training loader's micro-batches on the device, one optimizer step ahead on CUDA (copied from pinned memory
while the current step's kernels are queued). The saved position is that of the batches handed out."""

from __future__ import annotations

from typing import Any

import torch

from eslm.data.batch import Batch


class StepBatches:
    """``loader``: a ``TrainLoader`` (``next_batch``, ``state_dict``, ``load_state_dict`` with a ``batch_index``);
    ``per_step``: micro-batches per optimizer step. ``ahead`` (draw the next step's batches at ``prefetch``)
    defaults to whether ``device`` is a CUDA device; copies to CUDA go through pinned memory."""

    def __init__(self, loader: Any, device: torch.device, per_step: int, *, ahead: bool | None = None):
        self.loader, self.device, self.per_step = loader, device, per_step
        self.pin = device.type == "cuda"
        self.ahead = self.pin if ahead is None else ahead
        self._next: list[Batch] = []

    def next_step(self) -> list[Batch]:
        """This optimizer step's micro-batches on the device: those drawn ahead, or drawn now."""
        if not self._next:
            self._next = [self._to_device(self.loader.next_batch()) for _ in range(self.per_step)]
        out, self._next = self._next, []
        return out

    def prefetch(self) -> None:
        """Draws the next step's micro-batches and queues their copies (with ``ahead``; otherwise nothing)."""
        if self.ahead and not self._next:
            self._next = [self._to_device(self.loader.next_batch()) for _ in range(self.per_step)]

    def _to_device(self, batch: Batch) -> Batch:
        return (batch.pin_memory() if self.pin else batch).to(self.device)

    def state_dict(self) -> dict:
        """The loader's state at the first batch not yet handed out."""
        state = self.loader.state_dict()
        state["batch_index"] -= len(self._next)
        return state

    def load_state_dict(self, state: dict) -> None:
        self._next = []
        self.loader.load_state_dict(state)
