"""The metric records written to ``metrics.jsonl``: one per logged training step, one per evaluation; and the
progress line printed from a step's record (``progress_line``).

A record holds metrics only (names in ``eslm.metrics``); the step's tensors travel beside it in ``Update``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from eslm import metrics as M
from eslm.train.step import StepResult


@dataclass
class Update:
    """One optimizer step as the loop sees it (its numbers read to the host in the step's one read, ``readout``)."""

    res: StepResult  # what forward_backward returned (this rank)
    loss: float  # the optimised loss
    lr: float
    grad_norm: float  # before clipping
    tokens_seen: int  # all ranks
    loss_all: float = float("nan")  # the mean CE over all tokens seen
    selection: list[float] = field(default_factory=list)  # readout's selection part (steps that are logged)


def readout(res: StepResult, grad_norm: torch.Tensor, with_selection: bool) -> torch.Tensor:
    """What a step reads to the host, as one fp32 vector on the device (one read, however many numbers): the
    loss, the gradient norm (the non-finite check reads these two), the all-token CE, then, ``with_selection``
    (a step that is logged) and when the selector produced statistics, the means over micro-batches of the
    threshold, CVaR and dropped-score mean, the kept fraction per domain and the tokens per domain (decoded by
    ``selection_metrics``). Each number is the fp32 value the record used to read from its own tensor."""
    head = [res.loss.float(), grad_norm.float().to(res.loss.device), res.loss_all.float().to(res.loss.device)]
    stats = [s.stats for s in res.selections if s.stats is not None] if with_selection else []
    if not stats:
        return torch.stack(head)
    mean = lambda values: torch.stack([v.float() for v in values]).mean()  # noqa: E731
    kept = sum(s.kept_per_domain for s in stats)
    tot = sum(s.tokens_per_domain for s in stats)
    parts = [torch.stack(head + [mean(s.threshold for s in stats), mean(s.cvar for s in stats),
                                 mean(s.score_dropped_mean for s in stats)]).to(res.loss.device),
             (kept / tot).float().to(res.loss.device), tot.float().to(res.loss.device)]
    return torch.cat(parts)


def train_record(u: Update, step: int, *, tokens_seen_total: int, step_cpu_s: float, step_time_s: float,
                 tokens_per_s: float, elapsed_s: float, cpu_s: float, selection: dict, flops_totals: dict,
                 load_avg_1m: float | None, mfu: float | None) -> dict:
    """The record of a logged training step (the key order is that of the metrics file)."""
    rec = {M.KIND: M.KIND_TRAIN, M.STEP: step, M.TRAIN_LOSS: u.loss, M.LR: u.lr, M.GRAD_NORM: u.grad_norm,
           M.KEPT_FRAC: u.res.tokens_kept / max(u.res.tokens_seen, 1), M.STEP_CPU_S: step_cpu_s,
           M.TOKENS_PER_S: tokens_per_s, M.TRAIN_LOSS_ALL: u.loss_all, **selection,
           M.TOKENS_SEEN: tokens_seen_total, M.ELAPSED_S: elapsed_s, M.CPU_S: cpu_s, M.STEP_TIME_S: step_time_s}
    if load_avg_1m is not None:
        rec[M.LOAD_AVG_1M] = load_avg_1m
    rec.update(flops_totals)
    if mfu is not None:
        rec[M.MFU] = mfu
    return rec


def selection_metrics(values: list[float], tokens, domains: list[str]) -> dict:
    """alpha, the threshold, CVaR and dropped-score mean averaged over the step's micro-batches (selectors that rank
    a score; none of them for the random control, which has no scores),
    and the kept fraction per domain, from ``values``: the selection part of the step's ``readout`` read to the host
    (empty when the selector has no statistics). ``tokens``: the method's token selector."""
    out = {}
    if tokens.score is not None:
        out[M.ALPHA] = tokens.alpha
    if not values:
        return out
    n = len(domains)
    threshold, cvar, dropped, frac, tot = values[0], values[1], values[2], values[3:3 + n], values[3 + n:3 + 2 * n]
    if tokens.score is not None:  # a selector that ranks no scores (the random control) has none to report
        out.update({M.THRESHOLD: threshold, M.CVAR: cvar, M.SCORE_DROPPED_MEAN: dropped})
    for i, dom in enumerate(domains):
        if tot[i] > 0:
            out[M.kept_frac_key(dom)] = frac[i]
    return out


def eval_record(step: int, *, tokens_seen_total: int, elapsed_s: float, cpu_s: float, flops_totals: dict,
                val: dict) -> dict:
    """The record of an evaluation: ``val`` holds val_loss and val_loss/<domain>."""
    return {M.KIND: M.KIND_EVAL, M.STEP: step, M.TOKENS_SEEN: tokens_seen_total, M.ELAPSED_S: elapsed_s,
            M.CPU_S: cpu_s, **flops_totals, **val}


def progress_line(rec: dict, step: int, total: str, done: float, elapsed_s: float) -> str:
    """``rec``: the step's metric record; ``total``: the step total to show; ``done``: the fraction of the run
    done (the ETA extrapolates elapsed_s linearly)."""
    remaining = elapsed_s * (1.0 - done) / max(done, 1e-12)
    parts = [f"step {step}/{total}", f"loss {rec[M.TRAIN_LOSS]:.4f}", f"lr {rec[M.LR]:.2e}"]
    if M.ALPHA in rec:
        parts.append(f"kept {rec[M.KEPT_FRAC]:.3f} (alpha {rec[M.ALPHA]:.3f})")
    parts.append(f"{rec[M.TOKENS_PER_S] / 1e3:.1f}k tok/s")
    if M.MFU in rec:
        parts.append(f"MFU {100 * rec[M.MFU]:.1f}%")
    parts.append(f"ETA {fmt_time(remaining)}")
    return " | ".join(parts)


def fmt_time(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
