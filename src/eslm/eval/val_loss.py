"""Validation loss on the fixed per-domain validation budget."""

from __future__ import annotations

import contextlib

import torch

from eslm import metrics as M
from eslm.ops.head_backend import backend
from eslm.ops.token_stats import HeadOptions


@torch.no_grad()
def evaluate(model, val: dict, weights: dict, *, impl: str, chunk_size: int = 1024,
             autocast=None) -> dict:
    """Mean CE per domain over its fixed validation windows, and the mixed loss (domains weighted by the
    training mixture; a domain with weight 0 is reported but not mixed in).

    val: {domain: [Batch, ...]} on the model's device. Returns {"val_loss": x, "val_loss/<domain>": y, ...}.
    """
    was_training = model.training
    model.eval()
    out = {}
    for domain, batches in val.items():
        total, count = torch.zeros((), dtype=torch.float64), 0
        for b in batches:
            with autocast or contextlib.nullcontext():
                hidden = model(b.x).flatten(0, 1)
                stats = backend(impl, hidden.device.type, HeadOptions(chunk_size)).token_stats(
                    hidden, model.head_weight, b.y.reshape(-1), need_entropy=False)
            total += stats.loss.double().sum().cpu()
            count += stats.loss.numel()
        out[M.val_loss_key(domain)] = float(total / max(count, 1))
    mixed_w = {d: w for d, w in weights.items() if w > 0 and M.val_loss_key(d) in out}
    norm = sum(mixed_w.values()) or 1.0
    out[M.VAL_LOSS] = sum(w * out[M.val_loss_key(d)] for d, w in mixed_w.items()) / norm
    model.train(was_training)
    return out
