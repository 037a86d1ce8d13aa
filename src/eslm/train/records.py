"""The metric records written to ``metrics.jsonl``: one per logged training step, one per evaluation.

A record holds metrics only (names in ``eslm.metrics``); the step's tensors travel beside it in ``Update``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eslm import metrics as M
from eslm.train.step import StepResult


@dataclass
class Update:
    """One optimizer step as the loop sees it."""

    res: StepResult  # what forward_backward returned (this rank)
    loss: float  # the optimised loss (host float: the one sync per step that refuses a non-finite update)
    lr: float
    grad_norm: float  # before clipping
    tokens_seen: int  # all ranks


def train_record(u: Update, step: int, *, tokens_seen_total: int, step_cpu_s: float, step_time_s: float,
                 tokens_per_s: float, elapsed_s: float, cpu_s: float, selection: dict, flops_totals: dict,
                 load_avg_1m: float | None, mfu: float | None) -> dict:
    """The record of a logged training step (the key order is that of the metrics file)."""
    rec = {M.KIND: M.KIND_TRAIN, M.STEP: step, M.TRAIN_LOSS: u.loss, M.LR: u.lr, M.GRAD_NORM: u.grad_norm,
           M.KEPT_FRAC: u.res.tokens_kept / max(u.res.tokens_seen, 1), M.STEP_CPU_S: step_cpu_s,
           M.TOKENS_PER_S: tokens_per_s, M.TRAIN_LOSS_ALL: float(u.res.loss_all), **selection,
           M.TOKENS_SEEN: tokens_seen_total, M.ELAPSED_S: elapsed_s, M.CPU_S: cpu_s, M.STEP_TIME_S: step_time_s}
    if load_avg_1m is not None:
        rec[M.LOAD_AVG_1M] = load_avg_1m
    rec.update(flops_totals)
    if mfu is not None:
        rec[M.MFU] = mfu
    return rec


def selection_metrics(res: StepResult, tokens, domains: list[str]) -> dict:
    """alpha (selective methods), the threshold, CVaR and dropped-score mean averaged over the step's micro-batches,
    and the kept fraction per domain. ``tokens``: the method's token selector."""
    stats = [s.stats for s in res.selections if s.stats is not None]
    out = {}
    if tokens.score is not None:
        out[M.ALPHA] = tokens.alpha
    if not stats:
        return out
    mean = lambda values: float(torch.stack([v.float() for v in values]).mean())  # noqa: E731
    out.update({M.THRESHOLD: mean(s.threshold for s in stats), M.CVAR: mean(s.cvar for s in stats),
                M.SCORE_DROPPED_MEAN: mean(s.score_dropped_mean for s in stats)})
    kept = sum(s.kept_per_domain for s in stats)
    tot = sum(s.tokens_per_domain for s in stats)
    for i, dom in enumerate(domains):
        if float(tot[i]) > 0:
            out[M.kept_frac_key(dom)] = float(kept[i] / tot[i])
    return out


def eval_record(step: int, *, tokens_seen_total: int, elapsed_s: float, cpu_s: float, flops_totals: dict,
                val: dict) -> dict:
    """The record of an evaluation: ``val`` holds val_loss and val_loss/<domain>."""
    return {M.KIND: M.KIND_EVAL, M.STEP: step, M.TOKENS_SEEN: tokens_seen_total, M.ELAPSED_S: elapsed_s,
            M.CPU_S: cpu_s, **flops_totals, **val}
