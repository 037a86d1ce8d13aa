"""ESLM in torchtitan: ``loss_config`` / ``chunked_loss_config`` / ``metrics_config`` for torchtitan's own trainer
(0.3.0, imported when called), ``SelectiveCrossEntropy`` for a loop of your own; docs/dropin.md ("torchtitan").
torchtitan divides each micro-batch's summed loss by the step's valid tokens N, so a micro-batch with N_i valid and
K_i kept tokens returns its kept CE sum x N_i / K_i / N (exact with packed data)."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from eslm.api import AdaAlpha, kept_tokens, selective_loss
from eslm.errors import ConfigError
from eslm.selection import risk

IGNORE_INDEX = -100


def global_kept_tokens(labels: list[torch.Tensor], *, alpha: float, group=None) -> torch.Tensor:
    """The kept tokens of an optimizer step: the sum over its micro-batches' ``labels`` of K = N -
    floor(alpha N), summed over the ranks of ``group`` (the data-parallel group; None: this process only)."""
    first, *rest = [kept_tokens(t, alpha=alpha, ignore_index=IGNORE_INDEX) for t in labels]
    k = sum(rest, first)
    if group is not None:
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
        inputs: dict[str, Any] = {"logits": pred} if self.lm_head is None else \
            {"hidden": pred, "lm_weight": self.lm_head.weight, "bias": self.lm_head.bias}
        loss, stats = selective_loss(labels, **inputs, score=self.score, alpha=alpha, ignore_index=IGNORE_INDEX,
                                     num_items_in_batch=global_valid_tokens, chunk_size=self.chunk_size)
        if self.ada is not None:
            self.ada.observe(stats)
        return loss, {"eslm/kept_frac": stats.kept_frac, "eslm/var": stats.threshold, "eslm/cvar": stats.cvar}


def loss_config(*, alpha: float = 0.1, score: str = "entropy", chunk_size: int = 1024):
    """ESLM as torchtitan's loss: ``config.loss = loss_config(alpha=0.1)`` on a torchtitan ``Trainer.Config``."""
    return _titan_classes()[0].Config(alpha=alpha, score=score, chunk_size=chunk_size)


def chunked_loss_config(*, alpha: float = 0.1, score: str = "entropy", num_chunks: int = 8):
    """ESLM inside torchtitan's ``ChunkedLossWrapper`` (the LM head applied one sequence chunk at a time), with the
    selection over the whole micro-batch (one more LM-head forward): ``config.loss = chunked_loss_config(...)``."""
    return _titan_classes()[1].Config(num_chunks=num_chunks,
                                      loss_fn=_titan_classes()[0].Config(alpha=alpha, score=score))


def metrics_config(**options):
    """torchtitan's ``MetricsProcessor.Config`` (same options) whose training log adds ESLM's selection metrics
    (eslm/kept_frac, eslm/var, eslm/cvar since the last log, summed over the data-parallel ranks)."""
    return _titan_classes()[2].Config(**options)


_LOSSES: weakref.WeakSet = weakref.WeakSet()  # the ESLM losses built in this process, read by the metrics


def _selection_metrics(group) -> dict[str, float]:
    """kept_frac / var / cvar over the training calls of every ESLM loss of this process since the last read
    (summed over ``group``'s ranks when given), and the calls forgotten; {} when there were none."""
    total = torch.zeros(5, dtype=torch.float64)
    for loss in list(_LOSSES):
        if loss.totals is not None:
            total += loss.totals.cpu()
            loss.totals = None
    if group is not None:
        dist.all_reduce(total, group=group)
    kept, valid, score_sum, threshold_sum, calls = total.tolist()
    if calls == 0 or valid == 0:
        return {}
    return {"eslm/kept_frac": kept / valid, "eslm/var": threshold_sum / calls, "eslm/cvar": score_sum / max(kept, 1)}


def _stats_row(kept, valid, kept_score_sum, threshold) -> torch.Tensor:
    """One training call's row for ``_selection_metrics``: kept, valid, kept score sum, threshold, 1 call."""
    return torch.stack([torch.as_tensor(v).detach().double().reshape(()).to(threshold.device)
                        for v in (kept, valid, kept_score_sum, threshold, 1)])


def _from_a_chunk(pred: torch.Tensor, depth: int = 4) -> bool:
    """True when ``pred`` was computed from a gradient leaf that is not a parameter within ``depth`` autograd
    steps: the sequence chunk ``h.detach().requires_grad_()`` that torchtitan's ChunkedLossWrapper feeds its
    LM head (a model's own logits lead back to parameters and to integer inputs only)."""
    nodes = [pred.grad_fn]
    for _ in range(depth):
        nodes = [n for node in nodes if node is not None for n, _ in node.next_functions]
        for node in nodes:
            leaf = getattr(node, "variable", None)
            if leaf is not None and not isinstance(leaf, torch.nn.Parameter):
                return True
    return False


@functools.cache
def _titan_classes():
    """The torchtitan subclasses behind ``loss_config``, ``chunked_loss_config`` and ``metrics_config`` (defined
    on first use, so that importing eslm never imports torchtitan)."""
    try:
        from torchtitan.components.loss import BaseLoss, ChunkedLossWrapper
        from torchtitan.components.metrics import MetricsProcessor
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
            self.totals: torch.Tensor | None = None  # summed over training calls: kept, valid, kept score sum,
            # threshold, calls (read and reset by metrics_config's processor)
            self.chunk_plan: list | None = None  # set by ESLMChunkedLoss: per chunk, (kept mask, N_i, K_i)
            _LOSSES.add(self)

        def record(self, row: torch.Tensor) -> None:
            """Adds one training call's ``_stats_row`` to the totals the metrics read."""
            self.totals = row if self.totals is None else self.totals + row

        def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            c = self.config
            if global_valid_tokens is None:
                # torchtitan's Validator: no divisor; it sums the returned losses and divides by the valid tokens
                # itself, as for its CrossEntropyLoss (a sum): the plain CE sum, so validation logs the plain CE
                return F.cross_entropy(pred.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                                       reduction="sum"), {}
            if self.chunk_plan is not None:  # one chunk of ESLMChunkedLoss: the micro-batch's selection
                kept, valid, k = self.chunk_plan.pop(0)
                ce = F.cross_entropy(pred.flatten(0, -2).float(), labels.flatten().clamp(min=0), reduction="none")
                return (ce * kept.flatten()).sum() * valid / k.clamp(min=1) / global_valid_tokens, {}
            if _from_a_chunk(pred):
                raise ConfigError("expected loss_config's loss called on a whole micro-batch, found it inside "
                                  "torchtitan's ChunkedLossWrapper (it would select per chunk); fix: "
                                  "config.loss = chunked_loss_config(alpha=..., num_chunks=...)")
            loss, stats = selective_loss(labels, logits=pred, score=c.score, alpha=c.alpha,
                                         ignore_index=IGNORE_INDEX, chunk_size=c.chunk_size)
            valid = (labels != IGNORE_INDEX).sum()  # kept mean x N_i / N: the trainer's valid-token weighting
            self.record(_stats_row(stats.num_kept, valid, stats.cvar * stats.num_kept, stats.threshold))
            loss = loss * valid / global_valid_tokens
            return loss, {"eslm/kept_frac": stats.kept_frac, "eslm/var": stats.threshold, "eslm/cvar": stats.cvar}

    class ESLMChunkedLoss(ChunkedLossWrapper):
        """torchtitan's ChunkedLossWrapper around ESLMLoss: a first pass without gradients scores every chunk, the
        micro-batch's top K scores are kept, then each chunk's kept CE x N_i / K_i / N is summed."""

        @dataclass(kw_only=True, slots=True)
        class Config(ChunkedLossWrapper.Config):
            pass

        def __call__(self, pred: torch.Tensor, labels: torch.Tensor, global_valid_tokens: torch.Tensor | None = None,
                     **loss_inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            inner = self.loss_fn
            if global_valid_tokens is None or not isinstance(inner, ESLMLoss):
                return ChunkedLossWrapper.__call__(self, pred, labels, global_valid_tokens, **loss_inputs)
            assert self.lm_head is not None, "Set lm_head before calling ChunkedLossWrapper"
            if isinstance(pred, DTensor):
                raise ConfigError("expected chunked_loss_config's hidden states as a plain tensor, found a DTensor "
                                  "(tensor / sequence parallel: not supported); fix: config.loss = loss_config(...) "
                                  "without the chunked LM head, or no tensor parallelism")
            c = inner.config
            if isinstance(self.lm_head, FSDPModule):  # one all-gather for both passes: the wrapper resets it
                self.lm_head.set_reshard_after_forward(False)
            with torch.no_grad():  # the first pass: every token's score, chunk by chunk, as torchtitan chunks
                chunks = zip(pred.split(pred.shape[1] // self.num_chunks, dim=1),
                             labels.split(labels.shape[1] // self.num_chunks, dim=1))
                scores = torch.cat([selective_loss(y, logits=self.lm_head(h), score=c.score, alpha=0.0,
                                                   return_tokens=True)[2].score for h, y in chunks], dim=1)
            valid = labels != IGNORE_INDEX
            n, k = valid.sum(), kept_tokens(labels, alpha=c.alpha)
            flat = scores.flatten().masked_fill(~valid.flatten(), float("-inf"))
            kept = torch.zeros_like(flat, dtype=torch.bool)
            kept[risk.topk_index(flat, int(k))] = True  # the VaR rule's one top-k (eslm.selection.risk)
            kept = kept.view_as(labels)
            kept_scores = scores[kept]
            threshold = kept_scores.min() if kept_scores.numel() else scores.new_zeros(())
            inner.record(_stats_row(k, n, kept_scores.sum(), threshold))
            inner.chunk_plan = [(m, n, k) for m in kept.split(labels.shape[1] // self.num_chunks, dim=1)]
            try:
                return ChunkedLossWrapper.__call__(self, pred, labels, global_valid_tokens, **loss_inputs)
            finally:
                inner.chunk_plan = None

    class ESLMMetrics(MetricsProcessor):
        """torchtitan's MetricsProcessor; its training log adds ESLM's selection metrics (``metrics_config``)."""

        @dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            pass

        def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            mesh = self.parallel_dims.get_optional_mesh("loss") if self.parallel_dims.dp_cp_enabled else None
            extra = {**(extra_metrics or {}), **_selection_metrics(None if mesh is None else mesh.get_group())}
            MetricsProcessor.log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)

    for cls in (ESLMLoss, ESLMChunkedLoss, ESLMMetrics):
        cls.__module__ = __name__
    return ESLMLoss, ESLMChunkedLoss, ESLMMetrics
