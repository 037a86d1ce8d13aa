"""The batch that every loader yields and every training step consumes."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One micro-batch of training or validation windows.

    x:      (B, T) int64 input token ids
    y:      (B, T) int64 next-token targets (x shifted by one inside the same window)
    domain: (B,)   int64 index into the loader's ``domains`` list: the domain each row was drawn from
    """

    x: torch.Tensor
    y: torch.Tensor
    domain: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        """On the device; to CUDA without waiting for the host copy where the batch is in pinned memory."""
        nb = device != "cpu" and str(device).startswith("cuda")
        return Batch(self.x.to(device, non_blocking=nb), self.y.to(device, non_blocking=nb),
                     self.domain.to(device, non_blocking=nb))

    def pin_memory(self) -> Batch:
        """In page-locked host memory (needs an accelerator): its copy to the GPU can then run asynchronously."""
        return Batch(self.x.pin_memory(), self.y.pin_memory(), self.domain.pin_memory())

    def rows(self, index: torch.Tensor) -> Batch:
        """The sub-batch of the given row indices (used by row selectors such as GREATS)."""
        return Batch(self.x[index], self.y[index], self.domain[index])

    @property
    def num_tokens(self) -> int:
        return self.x.numel()
