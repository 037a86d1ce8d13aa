"""The baselines as plug-ins of the shared step: Rho-1 as a token selector, GREATS as a row selector.

The maths lives beside: ``rho1.py`` (reference model, excess loss) and ``greats.py`` (ghost inner products,
greedy selection, FLOPs). These adapters only connect it to the step's interfaces.
"""

from __future__ import annotations

import torch

from eslm.baselines.greats import greats_extra_flops, greats_pool_size, greats_select, scored_layer_shapes
from eslm.baselines.rho1 import ReferenceModel, excess_loss
from eslm.selection.selectors import VaRSelector


class Rho1Selector(VaRSelector):
    """Rho-1: keep the top 1-alpha tokens by excess loss = current loss - frozen reference loss (signed)."""

    def __init__(self, reference: ReferenceModel, alpha: float, seq_len: int, standardize: str = "none",
                 n_domains: int = 1):
        super().__init__("excess_loss", alpha, standardize, n_domains)
        self.reference, self.seq_len = reference, seq_len

    def scores(self, stats, batch) -> torch.Tensor:
        """(B, T) fp32 excess loss; runs the reference forward (no grad, eval mode, never in DDP)."""
        return excess_loss(stats.loss.view(batch.x.shape), self.reference.token_loss(batch.x, batch.y))

    def extra_flops(self, tokens_seen: int) -> tuple[float, float]:
        f = self.reference.forward_flops_per_token_at(self.seq_len) * tokens_seen
        return f, f


class GreatsRows:
    """GREATS: per micro-batch, score every row by its gradient's alignment with a fresh validation batch
    (ghost inner products) and keep the greedy best floor((1-alpha) B) rows for the update pass."""

    def __init__(self, val_loader, *, alpha: float, exclude_head: bool, fm, model_config, device):
        self.val_loader, self.budget = val_loader, 1.0 - alpha
        self.exclude_head, self.fm, self.device = exclude_head, fm, device
        self.layer_shapes = scored_layer_shapes(model_config, exclude_head)
        self._last_rows = (0, 0)

    def num_rows(self, batch_rows: int) -> int:
        return greats_pool_size(batch_rows, self.budget, "floor")[1]

    def select(self, model, batch, step: int, lr: float):
        val = self.val_loader.next_batch().to(self.device)
        k = self.num_rows(batch.x.shape[0])
        with torch.autocast(device_type=self.device.type, enabled=False):
            index, info = greats_select(model, batch.x, batch.y, val.x, val.y, lr=lr, k=k,
                                        exclude_head=self.exclude_head)
        self._last_rows = (batch.x.shape[0], val.x.shape[0])
        return batch.rows(index.to(batch.x.device)), info

    def extra_flops(self, tokens_seen: int) -> tuple[float, float, int]:
        B, Bv = self._last_rows
        if B == 0:
            return 0.0, 0.0, 0
        T = tokens_seen // max(self.num_rows(B), 1)
        f = greats_extra_flops(self.fm.forward_per_token, self.fm.backward_per_token, self.layer_shapes, B, Bv, T)
        return f, f, 0

    def state_dict(self) -> dict:
        return {"val_loader": self.val_loader.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.val_loader.load_state_dict(sd["val_loader"])
