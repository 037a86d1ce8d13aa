"""ESLM in a PyTorch Lightning ``LightningModule``: ``SelectiveLossMixin``.

    class LitLM(SelectiveLossMixin, L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = ...
            self.setup_eslm(alpha=0.1, score="entropy")          # ada=AdaAlpha(...) for Ada-ESLM

        def training_step(self, batch, batch_idx):
            hidden = self.model.hidden_states(batch["input_ids"])             # no logits
            return self.eslm_loss(batch["targets"], hidden=hidden, lm_weight=self.model.lm_head.weight)

Normalisation. Lightning divides the loss of every micro-batch by ``accumulate_grad_batches`` and DDP averages
the gradients over the ranks, which is the exact kept-token mean only when every micro-batch keeps the same
number of tokens. ``eslm_loss`` therefore returns each micro-batch's SUM of kept CE, counts the kept tokens,
and ``on_before_optimizer_step`` (once the step's gradients are accumulated, before clipping) rescales the
gradients by accumulate_grad_batches * world_size / K_step, K_step the kept tokens of the step summed over
micro-batches and ranks: the update is then exactly that of the mean CE over the step's kept tokens, with any
padding. The logged ``eslm/loss`` is each micro-batch's kept mean. A module that overrides
``on_before_optimizer_step`` must call ``super().on_before_optimizer_step(optimizer)``.
"""

from __future__ import annotations

import torch

from eslm.api import AdaAlpha, selective_loss


class SelectiveLossMixin:
    """Put it before ``LightningModule`` in the bases and call ``setup_eslm`` in ``__init__``."""

    def setup_eslm(self, *, alpha: float = 0.1, score: str = "entropy", ada: AdaAlpha | None = None,
                   **loss_options) -> None:
        self.eslm_alpha, self.eslm_score, self.eslm_ada, self.eslm_options = alpha, score, ada, loss_options
        self._eslm_kept = None

    def eslm_loss(self, targets: torch.Tensor, **inputs) -> torch.Tensor:
        """The micro-batch's summed kept CE (``inputs``: logits=, or hidden= and lm_weight=, as for
        ``eslm.api.selective_loss``); logs eslm/loss, eslm/kept_frac, eslm/var, eslm/cvar."""
        alpha = self.eslm_ada.alpha if self.eslm_ada is not None else self.eslm_alpha
        loss, stats = selective_loss(targets, **inputs, score=self.eslm_score, alpha=alpha, reduction="sum",
                                     **self.eslm_options)
        self._eslm_kept = stats.num_kept if self._eslm_kept is None else self._eslm_kept + stats.num_kept
        if self.eslm_ada is not None:
            self.eslm_ada.observe(stats)
        self.log_dict({"eslm/loss": loss.detach() / stats.num_kept.clamp(min=1), "eslm/kept_frac": stats.kept_frac,
                       "eslm/var": stats.threshold, "eslm/cvar": stats.cvar})
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._eslm_kept is None:
            return
        k = self._eslm_kept.clone()
        world = self.trainer.world_size
        if world > 1:
            torch.distributed.all_reduce(k)
        scale = self.trainer.accumulate_grad_batches * world / k.clamp(min=1).float()
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale.to(p.grad.dtype))
        self._eslm_kept = None
        if self.eslm_ada is not None:
            self.eslm_ada.step()
