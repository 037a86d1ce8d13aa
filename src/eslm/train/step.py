"""The one training step shared by every method (forward + selection + loss + backward of one optimizer step).

Reads top to bottom: the row selector picks the micro-batches that train from the step's (``select_step``: all
of them, or instance-level selection's re-packed kept rows); for each micro-batch, the row selector picks rows,
the model gives hidden states, the objective's scoring pass gives detached fp32 per-token statistics (the risk
scores, when the token selector needs them; the fused cross-entropy may form its gradients in the same pass), the
token selector keeps K tokens, the objective gives the sum of their losses, and the normalised sum is
backpropagated. The optimizer update itself is the trainer's. Nothing here knows a method's name, and nothing reads a component's settings: the
step calls the hooks of ``eslm.contracts``. In the selection scope "step" (the token selector's ``scope``) one
extra scoring forward of every micro-batch comes first; the selector ranks it (``rank``) and turns the ranks of
the whole step into one threshold (``step_threshold``), which its ``select`` then applies to each micro-batch.

Normalisation (``train.normalize``):
* ``paper``  each micro-batch contributes mean(kept losses) / accum_steps (what nanoGPT-style code does);
* ``global`` sum(kept losses) / (kept tokens of the whole step over all micro-batches and ranks).
With a fixed K per micro-batch the two coincide; they differ when K varies (selection scope "step").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from eslm.contracts import EXECUTED, NO_EXTRA_WORK, ExtraWork, Pass


@dataclass
class StepResult:
    loss: torch.Tensor  # the optimised loss of the step (sum of the normalised micro-batch losses), detached
    loss_all: torch.Tensor  # mean CE over all tokens seen (comparable across methods), detached
    tokens_seen: int  # this rank
    tokens_kept: int  # this rank
    selections: list = field(default_factory=list)
    work: ExtraWork = NO_EXTRA_WORK  # the step's own passes per micro-batch (``step_work``), for the FLOPs ledger


@dataclass
class StepOptions:
    accum_steps: int
    normalize: str = "paper"
    world_size: int = 1
    autocast: contextlib.AbstractContextManager | None = None


def forward_backward(model, raw_model, method, batches, opts: StepOptions, step: int, lr: float) -> StepResult:
    with opts.autocast or contextlib.nullcontext():  # the micro-batches that train (default: every one given)
        batches = method.rows.select_step(raw_model, batches, opts.world_size)
    step_threshold = _step_threshold(raw_model, method, batches, opts) if method.tokens.scope == "step" else None
    threshold = step_threshold.value if step_threshold is not None else None
    denom = _global_denominator(method, batches, opts, step_threshold)
    dev = batches[0].x.device  # accumulators on the batches' device: a CPU zero moved to CUDA is a host sync
    loss_sum, ce_sum, seen, kept, sels = torch.zeros((), device=dev), torch.zeros((), device=dev), 0, 0, []
    for i, batch in enumerate(batches):
        with _no_sync(model, i < len(batches) - 1), (opts.autocast or contextlib.nullcontext()):
            batch, _ = method.rows.select(raw_model, batch, step, lr)
            hidden = model(batch.x).flatten(0, 1)
            weight, targets, n = raw_model.head_weight, batch.y.reshape(-1), batch.x.numel()
            stats = method.objective.score(hidden.detach(), weight.detach(), targets,
                                           need_scores=bool(method.tokens.needs),
                                           need_entropy=method.needs_entropy,
                                           num_kept=method.tokens.num_kept(n))
            sel = method.tokens.select(stats, batch, threshold)
            kept_sum, kept_loss = method.objective.loss_sum(hidden, weight, batch, sel.index, stats)
            loss = kept_sum / (sel.num_kept * opts.accum_steps if denom is None else denom)
        loss.backward()
        method.observe(sel)
        all_ce = stats.loss if stats is not None else kept_loss
        loss_sum = loss_sum.to(loss.device) + loss.detach().float()
        ce_sum = ce_sum.to(loss.device) + all_ce.float().mean() / len(batches)
        seen, kept = seen + sel.num_tokens, kept + sel.num_kept
        sels.append(sel)
    return StepResult(loss_sum, ce_sum, seen, kept, sels, step_work(method, seen // len(batches)))


def step_work(method, tokens_seen: int) -> ExtraWork:
    """What the step itself runs per micro-batch of ``tokens_seen`` tokens beyond the trained model's forward and
    backward of them (which ``eslm.flops`` prices from the token counts): in the selection scope "step" the scoring
    forward of every token (``_step_threshold``), which only the executed count includes."""
    if method.tokens.scope != "step":
        return NO_EXTRA_WORK
    return ExtraWork(passes=(Pass(tokens_seen, counted_by=(EXECUTED,)),))


def _no_sync(model, skip_sync: bool):
    """DDP: no gradient all-reduce on non-final micro-steps."""
    if skip_sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def _global_denominator(method, batches, opts: StepOptions, step_threshold) -> float | None:
    """Kept tokens of the whole step on all ranks (divided by world size, since DDP averages gradients)."""
    if opts.normalize != "global":
        return None
    if step_threshold is not None:
        return max(1, step_threshold.kept) / opts.world_size
    per_rank = sum(method.tokens.num_kept(method.rows.num_rows(b.x.shape[0]) * b.x.shape[1]) for b in batches)
    return float(per_rank)  # every rank has the same shapes, hence the same count: (W * n) / W


@torch.no_grad()
def _step_threshold(raw_model, method, batches, opts: StepOptions):
    """Selection scope "step": one extra forward of every micro-batch with the objective's scoring pass (scores
    only); the token selector ranks each and returns its threshold over the whole step on all ranks (a
    ``StepThreshold``, or None). The step declares the forward (``step_work``)."""
    ranked = []
    for batch in batches:
        with opts.autocast or contextlib.nullcontext():
            hidden = raw_model(batch.x).flatten(0, 1)
            n = hidden.shape[0]
            stats = method.objective.score(hidden, raw_model.head_weight, batch.y.reshape(-1), need_scores=True,
                                           need_entropy=method.needs_entropy,
                                           num_kept=method.tokens.num_kept(n), for_loss=False)
        ranked.append(method.tokens.rank(stats, batch))
    return method.tokens.step_threshold(ranked, opts.world_size)
