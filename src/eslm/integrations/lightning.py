"""ESLM in a PyTorch Lightning ``LightningModule``: ``SelectiveLossMixin`` (usage: docs/dropin.md, "PyTorch
Lightning"). The update is exactly that of the mean CE over the step's kept tokens (every micro-batch, every
rank); with ``accumulate_grad_batches > 1`` the gradients are rescaled once per optimizer step, so
``training_step`` must return ``eslm_loss``'s tensor alone. The selection is per rank (``group=`` is refused)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from eslm.api import AdaAlpha, selective_loss
from eslm.errors import ConfigError

SET_BY_THE_MIXIN = ("group", "reduction", "num_items_in_batch", "return_tokens")


class SelectiveLossMixin:
    """Put it before ``LightningModule`` in the bases and call ``setup_eslm`` in ``__init__``."""

    log_dict: Callable[..., None]  # the LightningModule's (declared for a type checker)
    trainer: Any  # the LightningModule's

    def setup_eslm(self, *, alpha: float = 0.1, score: str = "entropy", ada: AdaAlpha | None = None,
                   **loss_options) -> None:
        taken = [k for k in SET_BY_THE_MIXIN if k in loss_options]
        if taken:
            raise ConfigError(f"setup_eslm: {', '.join(taken)} is set by the mixin (per-rank selection, exact "
                              "normalisation over ranks and accumulation); found it among the options; fix: drop it")
        self.eslm_alpha, self.eslm_score, self.eslm_ada, self.eslm_options = alpha, score, ada, loss_options
        self._eslm_kept: torch.Tensor | None = None
        self._eslm_returned: torch.Tensor | None = None

    def eslm_loss(self, targets: torch.Tensor, **inputs) -> torch.Tensor:
        """The micro-batch's selective loss, normalised as the module docstring says (``inputs``: logits=, or
        hidden= and lm_weight=, as for ``eslm.api.selective_loss``); logs eslm/loss, eslm/kept_frac, eslm/var,
        eslm/cvar."""
        alpha = self.eslm_ada.alpha if self.eslm_ada is not None else self.eslm_alpha
        total, stats = selective_loss(targets, **inputs, score=self.eslm_score, alpha=alpha, reduction="sum",
                                      **self.eslm_options)
        if self.eslm_ada is not None:
            self.eslm_ada.observe(stats)
        mean = total.detach() / stats.num_kept.clamp(min=1)
        self.log_dict({"eslm/loss": mean, "eslm/kept_frac": stats.kept_frac, "eslm/var": stats.threshold,
                       "eslm/cvar": stats.cvar})
        world = self.trainer.world_size
        if self.trainer.accumulate_grad_batches == 1:
            k = stats.num_kept
            if world > 1:
                k = k.clone()
                torch.distributed.all_reduce(k)
            self._eslm_returned = None
            return total * (world / k.clamp(min=1).to(total.dtype))
        self._eslm_kept = stats.num_kept if self._eslm_kept is None else self._eslm_kept + stats.num_kept
        returned = total + (mean - total.detach())  # value: the kept mean; gradient: the kept sum's
        self._eslm_returned = returned
        return returned

    def on_before_backward(self, loss: torch.Tensor) -> None:
        returned, self._eslm_returned = self._eslm_returned, None
        if returned is None:
            return
        # Lightning backpropagates training_step's loss / accumulate_grad_batches: its one input must be ours
        fn = loss.grad_fn
        if fn is None or not any(nf is returned.grad_fn for nf, _ in fn.next_functions):
            raise ConfigError("with accumulate_grad_batches > 1 training_step must return eslm_loss(...) alone; "
                              "found another loss (the step's gradients are scaled by accumulate x world / K_step, "
                              "which would rescale any added term); fix: accumulate_grad_batches=1 (added terms "
                              "then keep their scale), or drop the added term")

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._eslm_kept is not None:
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
