"""A torchtitan-style loss: ``loss_fn(pred, labels, global_valid_tokens) -> (loss, metrics)``.

This mirrors the contract of torchtitan's loss classes (torchtitan is not a dependency, nor installed by the tests):
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

import torch

from eslm.api import AdaAlpha, kept_tokens, selective_loss

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
