"""Chunked LM-head losses: per-token loss and entropy without full logits; head backward only for kept rows.

Shapes: hidden (N, C), weight (V, C) (the tied LM head), targets (N,) int64, index (K,) int64 kept rows.

Scoring (``fused_token_stats``, no gradient). Tokens are processed in chunks of ``chunk_size`` rows; for each
chunk the (chunk, V) logits z are formed once, in fp32, and reduced to

    lse_i = log sum_v exp(z_iv),   loss_i = lse_i - z_{i,y_i},   H_i = lse_i - sum_v softmax(z_i)_v z_iv,

so at most one (chunk, V) fp32 block is alive instead of the naive path's (N, V) logits, log-softmax and
probabilities.

Training loss (``fused_selected_ce``, autograd). Only the K kept rows enter: their hidden states are gathered
and, when the scoring pass already produced ``lse``, the forward is just loss_i = lse_i - <h_i, W_{y_i}> (no
vocabulary work at all). The backward recomputes the kept rows' logits chunk by chunk and forms

    dL/dz_i = g_i (softmax(z_i) - onehot(y_i)),   dL/dh_i = dL/dz_i W,   dL/dW += dL/dz_i^T h_i,

so the head's backward costs 3 head matmuls over K rows (recompute + two gradient matmuls) instead of 2 over
all N rows plus holding (N, V) gradients; dropped rows receive exactly zero head gradient. The per-token
upstream gradient g is applied row by row, so any reduction (mean, sum, weighted) is correct.

K is a Python int fixed by the selection (no host synchronisation here).
"""

from __future__ import annotations

import torch

from eslm.objectives.cross_entropy import TokenStats


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(c, C) x (V, C) -> (c, V) fp32 logits (the matmul runs in the inputs' dtype, e.g. bf16 on GPU)."""
    w = weight if weight.dtype == h.dtype else weight.to(h.dtype)
    return (h @ w.t()).float()


@torch.no_grad()
def fused_token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                      need_entropy: bool = True, chunk_size: int = 1024) -> TokenStats:
    """Detached fp32 per-token loss, entropy (if asked) and log-sum-exp, chunked over tokens."""
    n = hidden.shape[0]
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(loss)
    ent = torch.empty_like(loss) if need_entropy else None
    for s, e in _chunks(n, chunk_size):
        z = _logits(hidden[s:e], weight)
        l = torch.logsumexp(z, dim=-1)
        lse[s:e] = l
        loss[s:e] = l - z.gather(1, targets[s:e, None]).squeeze(1)
        if need_entropy:
            # H = lse - sum_v p_v z_v: one extra multiply-add per logit, on a chunk-sized buffer
            ent[s:e] = l - (torch.exp(z - l[:, None]) * z).sum(-1)
    return TokenStats(loss=loss, entropy=ent, lse=lse)


class _SelectedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_kept, weight, y_kept, lse_kept, chunk_size):
        if lse_kept is None:
            lse_kept = torch.empty(h_kept.shape[0], dtype=torch.float32, device=h_kept.device)
            for s, e in _chunks(h_kept.shape[0], chunk_size):
                lse_kept[s:e] = torch.logsumexp(_logits(h_kept[s:e], weight), dim=-1)
        w_y = weight[y_kept]
        z_y = (h_kept.float() * w_y.float()).sum(-1)
        ctx.save_for_backward(h_kept, weight, y_kept, lse_kept)
        ctx.chunk_size = chunk_size
        return lse_kept - z_y

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, y, lse = ctx.saved_tensors
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        g = grad_out.float()
        for s, e in _chunks(h.shape[0], ctx.chunk_size):
            dz = _logits(h[s:e], weight).sub_(lse[s:e, None]).exp_()  # softmax of the kept rows
            dz[torch.arange(e - s, device=h.device), y[s:e]] -= 1.0
            dz.mul_(g[s:e, None])
            dz = dz.to(h.dtype)
            if grad_h is not None:
                grad_h[s:e] = dz @ weight.to(h.dtype)
            if grad_w is not None:
                grad_w.addmm_(dz.t().float() if h.dtype != torch.float32 else dz.t(), h[s:e].float())
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None


def fused_selected_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      index: torch.Tensor | None, *, chunk_size: int = 1024,
                      lse: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token CE (K,) fp32 of the kept rows (all rows if index is None), with autograd to hidden and weight.

    The gather ``hidden[index]`` scatters the kept rows' gradients back into an (N, C) zero tensor, so dropped
    rows get exactly zero gradient from the head.
    """
    if index is not None:
        hidden, targets = hidden[index], targets[index]
        lse = lse[index] if lse is not None else None
    return _SelectedCE.apply(hidden, weight, targets, lse.detach() if lse is not None else None, chunk_size)
