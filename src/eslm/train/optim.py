"""AdamW as in nanoGPT / the paper, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import inspect
import math

import torch


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    device_type: str) -> torch.optim.AdamW:
    """AdamW with weight decay on tensors with 2+ dimensions only (matmul weights, embeddings); biases and
    LayerNorm weights are not decayed. Tied parameters are counted once (named_parameters dedupes)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **({"fused": True} if fused else {}))


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup over ``warmup_steps``, then cosine
    decay to ``min_lr`` at ``decay_steps``, then ``min_lr``. The paper sets decay_steps (200k / 600k) far past
    where it stops training, so its runs end early on the cosine."""
    if step < warmup_steps:
        return lr * (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_lr
    ratio = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)
