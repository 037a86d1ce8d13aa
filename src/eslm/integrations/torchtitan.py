"""ESLM in torchtitan: ``loss_config`` for torchtitan's own trainer, and a torchtitan-style loss for loops of your own.

``loss_config(alpha=..., score=...)`` is what torchtitan's ``Trainer.Config.loss`` takes (a ``BaseLoss.Config``;
torchtitan 0.3.0 from PyPI, imported when called): the unmodified trainer then trains with ESLM. Its trainer
divides every micro-batch's summed loss by the step's valid tokens N (counted before the forward passes, over
all micro-batches and data-parallel ranks), which a loss cannot change; so the loss of a micro-batch with N_i
valid and K_i kept tokens is its kept CE sum x N_i / K_i / N: the mean over the step of each micro-batch's kept
mean, weighted by its valid tokens. With packed data (every micro-batch the same number of valid tokens, as
torchtitan's text datasets give) that is exactly the mean CE over the step's kept tokens; with padding, a kept
token's weight differs from 1/K only through the rounding of floor(alpha N_i): by less than about 1/K_i
relative, K_i of the smallest micro-batch. Called without a divisor (torchtitan's ``Validator`` calls its
``loss_fn`` so, then divides the summed losses by the valid tokens, as for its ``CrossEntropyLoss``, a sum), the
loss is the plain cross-entropy SUM over the valid tokens: validation reports the plain CE, not a kept mean.

``SelectiveCrossEntropy`` mirrors the same contract for a training loop you write yourself:
``pred`` are the logits (..., V) of the model (or its final hidden states (..., C) when the loss is built with
``lm_head=``, so no logits are formed), ``labels`` are already aligned with them (the dataloader shifts),
-100 marks ignored positions, and the returned loss is a SUM divided by ``global_valid_tokens``: the trainer
counts that divisor over every micro-batch of the optimizer step and every data-parallel rank, and sums (not
averages) the gradients across ranks (FSDP's gradient divide factor set to 1).

For ESLM the divisor is the step's kept tokens, not its valid tokens: count it with ``global_kept_tokens``
where the trainer counts valid tokens (before the micro-batch loop), and pass it as ``global_valid_tokens``;
the loss is then exactly the mean cross-entropy over the kept tokens of the whole step. Passing the valid count
instead gives that mean times K/N (about 1 - alpha). Without a divisor the loss is the call's kept mean.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eslm.api import AdaAlpha, kept_tokens, selective_loss
from eslm.errors import ConfigError

IGNORE_INDEX = -100


def global_kept_tokens(labels: list[torch.Tensor], *, alpha: float, group=None) -> torch.Tensor:
    """The kept tokens of an optimizer step: the sum over its micro-batches' ``labels`` of K = N -
    floor(alpha N), summed over the ranks of ``group`` (the data-parallel group; None: this process only)."""
    first, *rest = [kept_tokens(t, alpha=alpha, ignore_index=IGNORE_INDEX) for t in labels]
    k = sum(rest, first)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(k, group=group)
    return k


class SelectiveCrossEntropy:
    """ESLM's selective cross-entropy behind torchtitan's loss signature. ``alpha`` is read from ``ada`` when
    one is given (call ``ada.step()`` after each optimizer step); ``lm_head``: the output projection, when the
    model returns hidden states instead of logits."""

    def __init__(self, *, alpha: float = 0.1, score: str = "entropy", ada: AdaAlpha | None = None,
                 lm_head: torch.nn.Linear | None = None, chunk_size: int = 1024):
        self.alpha, self.score, self.ada, self.lm_head, self.chunk_size = alpha, score, ada, lm_head, chunk_size

    def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                 **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        alpha = self.ada.alpha if self.ada is not None else self.alpha
        if self.lm_head is None:
            loss, stats = selective_loss(labels, logits=pred, score=self.score, alpha=alpha,
                                         ignore_index=IGNORE_INDEX, num_items_in_batch=global_valid_tokens,
                                         chunk_size=self.chunk_size)
        else:
            loss, stats = selective_loss(labels, hidden=pred, lm_weight=self.lm_head.weight, bias=self.lm_head.bias,
                                         score=self.score, alpha=alpha, ignore_index=IGNORE_INDEX,
                                         num_items_in_batch=global_valid_tokens, chunk_size=self.chunk_size)
        if self.ada is not None:
            self.ada.observe(stats)
        return loss, {"eslm/kept_frac": stats.kept_frac, "eslm/var": stats.threshold, "eslm/cvar": stats.cvar}


def loss_config(*, alpha: float = 0.1, score: str = "entropy", chunk_size: int = 1024):
    """ESLM as torchtitan's loss: ``config.loss = loss_config(alpha=0.1)`` on a torchtitan ``Trainer.Config``
    (the trainer builds it with ``config.loss.build(compile_config=...)``). Its metrics (the kept fraction, the
    VaR threshold, the CVaR) are returned beside the loss. Needs torchtitan (tested with 0.3.0)."""
    return _titan_loss_class().Config(alpha=alpha, score=score, chunk_size=chunk_size)


@functools.cache
def _titan_loss_class():
    """The ``torchtitan.components.loss.BaseLoss`` subclass behind ``loss_config`` (defined on first use, so that
    importing eslm never imports torchtitan)."""
    try:
        from torchtitan.components.loss import BaseLoss
    except ImportError as e:
        raise ConfigError(f"expected torchtitan to be installed for its loss hook, found it missing ({e}); fix: "
                          "pip install torchtitan==0.3.0 'eslm[gpu]' in an environment of its own: it pins datasets<4.8 "
                          "(docs/dropin.md)") from None

    class ESLMLoss(BaseLoss):
        """ESLM's selective cross-entropy behind torchtitan's ``BaseLoss``: (pred, labels, global_valid_tokens)
        -> (this micro-batch's kept CE sum x N_i / K_i / global_valid_tokens, metrics); see the module."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseLoss.Config):
            alpha: float = 0.1
            """fraction of each micro-batch's valid tokens dropped, in [0, 1)"""
            score: str = "entropy"
            """'entropy' (ESLM VaR-entropy) or 'loss' (ESLM CVaR-loss)"""
            chunk_size: int = 1024
            """rows of logits per chunk of the selective loss"""

        def __init__(self, config, *, compile_config=None):  # compile_config: the trainer passes it; unused
            self.config = config
            kept_tokens(torch.zeros(1, dtype=torch.long), alpha=config.alpha)  # a bad alpha refused at build

        def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            c = self.config
            if global_valid_tokens is None:
                # torchtitan's Validator: no divisor; it sums the returned losses and divides by the valid tokens
                # itself, as for its CrossEntropyLoss (a sum): the plain CE sum, so validation logs the plain CE
                return F.cross_entropy(pred.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                       reduction="sum"), {}
            loss, stats = selective_loss(labels, logits=pred, score=c.score, alpha=c.alpha,
                                         ignore_index=IGNORE_INDEX, chunk_size=c.chunk_size)
            valid = (labels != IGNORE_INDEX).sum()  # kept mean x N_i / N: the trainer's valid-token weighting
            loss = loss * valid / global_valid_tokens
            return loss, {"eslm/kept_frac": stats.kept_frac, "eslm/var": stats.threshold, "eslm/cvar": stats.cvar}

    ESLMLoss.__module__ = __name__
    return ESLMLoss
