"""Knowledge distillation per token: lambda * KL(teacher_rho || student_rho) + (1 - lambda) * CE_student.

Notation, per token (one row of the flattened batch):

    z_s = W_s h_s  (V,)     student logits; h_s (C,) student hidden, W_s (V, C) student head
    z_t = W_t h_t  (V,)     teacher logits; h_t (C',) teacher hidden, W_t (V, C') teacher head
    p   = softmax(z_s / rho),  q = softmax(z_t / rho)          rho: temperature (paper: 1.0)
    KL  = sum_v q_v (log q_v - log p_v)
        = sum_v q_v log q_v  -  sum_v q_v z_s,v / rho  +  lse(z_s / rho)        (because sum_v q_v = 1)
    CE  = lse(z_s) - z_s,y                                        at temperature 1, y the target token
    loss = lam * KL + (1 - lam) * CE        (the paper's Algorithm ESLM-KD: no rho^2 factor on the KL term)

Gradient with respect to the student logits (the only place the student enters):

    d loss / d z_s = lam / rho * (p - q)  +  (1 - lam) * (softmax(z_s) - onehot(y))

and then d h_s = dz W_s, d W_s = dz^T h_s. The teacher gets no gradient (its inputs are treated as
constants even if they require grad).

Memory: the forward and the backward walk over the tokens in chunks of ``chunk_size`` rows; per chunk they
hold a few (chunk, V) fp32 tensors, never two full (K, V) ones. The backward recomputes the chunk's logits
(the forward saves only the inputs and three (K,) log-sum-exps) and accumulates d W_s in an fp32 (V, C)
buffer. Logits are formed by a matmul in the inputs' dtype and then upcast to fp32, exactly like the naive
cross-entropy oracle in ``eslm.ops.naive_head``. Nothing here reduces.
"""

from __future__ import annotations

import torch

from eslm.errors import ConfigError


def _logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(c, C) @ (V, C)^T in the inputs' dtype, upcast to fp32 -> (c, V)."""
    return (hidden @ weight.t()).float()


def _teacher_logprobs(zt: torch.Tensor, rho: float, lse_t: torch.Tensor | None = None):
    """log q = z_t/rho - lse(z_t/rho) (c, V) fp32, and the (c,) lse."""
    zt_r = zt / rho
    if lse_t is None:
        lse_t = torch.logsumexp(zt_r, dim=-1)
    return zt_r - lse_t[:, None], lse_t


def _chunk_forward(hs, ws, ht, wt, y, lam, rho):
    """Loss (c,) and the three (c,) log-sum-exps the backward reuses: lse(z_s), lse(z_s/rho), lse(z_t/rho)."""
    zs = _logits(hs, ws)
    lse1 = torch.logsumexp(zs, dim=-1)
    ce = lse1 - zs.gather(1, y[:, None]).squeeze(1)
    zs_r = zs if rho == 1.0 else zs / rho
    lse_r = lse1 if rho == 1.0 else torch.logsumexp(zs_r, dim=-1)
    log_q, lse_t = _teacher_logprobs(_logits(ht, wt), rho)
    q = log_q.exp()
    # sum_v q log q, with 0 log 0 = 0 (a teacher logit of -inf gives q = 0 and log q = -inf).
    neg_ent_q = torch.where(q > 0, q * log_q, torch.zeros_like(q)).sum(-1)
    kl = neg_ent_q - (q * zs_r).sum(-1) + lse_r
    return lam * kl + (1.0 - lam) * ce, lse1, lse_r, lse_t


def _chunk_dlogits(hs, ws, ht, wt, y, g, lse1, lse_r, lse_t, lam, rho):
    """d loss / d z_s (c, V) fp32 for one chunk, already scaled by the upstream gradient g (c,)."""
    zs = _logits(hs, ws)
    p1 = (zs - lse1[:, None]).exp()  # softmax(z_s), for the CE term
    p_r = p1 if rho == 1.0 else (zs / rho - lse_r[:, None]).exp()  # softmax(z_s / rho), for the KL term
    q = _teacher_logprobs(_logits(ht, wt), rho, lse_t)[0].exp()
    dz = (lam / rho) * (p_r - q) + (1.0 - lam) * p1
    dz[torch.arange(dz.shape[0], device=dz.device), y] -= 1.0 - lam  # - (1 - lam) * onehot(y)
    return dz * g[:, None]


class _ChunkedKD(torch.autograd.Function):
    """Chunked KD loss with recomputation in backward; gradient to (s_hidden, s_weight) only."""

    @staticmethod
    def forward(ctx, s_hidden, s_weight, t_hidden, t_weight, targets, lam, rho, chunk_size):
        K = s_hidden.shape[0]
        out = torch.empty(K, dtype=torch.float32, device=s_hidden.device)
        lses = torch.empty(3, K, dtype=torch.float32, device=s_hidden.device)
        for lo in range(0, K, chunk_size):
            sl = slice(lo, lo + chunk_size)
            res = _chunk_forward(s_hidden[sl], s_weight, t_hidden[sl], t_weight, targets[sl], lam, rho)
            out[sl] = res[0]
            for i in range(3):
                lses[i, sl] = res[i + 1]
        ctx.save_for_backward(s_hidden, s_weight, t_hidden, t_weight, targets, lses)
        ctx.args = (lam, rho, chunk_size)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        s_hidden, s_weight, t_hidden, t_weight, targets, lses = ctx.saved_tensors
        lam, rho, chunk_size = ctx.args
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = torch.empty_like(s_hidden) if need_h else None
        d_weight = torch.zeros(s_weight.shape, dtype=torch.float32, device=s_weight.device) if need_w else None
        grad_out = grad_out.float()
        for lo in range(0, s_hidden.shape[0], chunk_size):
            sl = slice(lo, lo + chunk_size)
            hs = s_hidden[sl]
            dz = _chunk_dlogits(hs, s_weight, t_hidden[sl], t_weight, targets[sl], grad_out[sl],
                                lses[0, sl], lses[1, sl], lses[2, sl], lam, rho)
            if need_h:
                d_hidden[sl] = dz.to(s_weight.dtype) @ s_weight  # (c, V) @ (V, C)
            if need_w:
                d_weight += (dz.to(hs.dtype).t() @ hs).float()  # (V, c) @ (c, C)
        if need_w:
            d_weight = d_weight.to(s_weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None, None


def kd_per_token(s_hidden: torch.Tensor, s_weight: torch.Tensor, t_hidden: torch.Tensor, t_weight: torch.Tensor,
                 targets: torch.Tensor, *, lam: float = 0.5, rho: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Per-token KD loss (K,) fp32: lam * KL(q_rho || p_rho) + (1 - lam) * CE(student, target), not reduced.

    s_hidden (K, C), s_weight (V, C): student hidden states of the kept tokens and its head (both may require
    grad; any float dtype). t_hidden (K, C'), t_weight (V, C'): the teacher's (no gradient flows to them).
    targets (K,) int64 in [0, V). lam and rho are validated with the config (``KDSection``).
    """
    if s_weight.shape[0] != t_weight.shape[0]:
        raise ConfigError(
            f"KD teacher vocabulary must equal the student's: expected {s_weight.shape[0]} rows in the teacher "
            f"head, found {t_weight.shape[0]}; use a teacher trained with the same tokenizer and vocab padding "
            "(an imported OpenAI GPT-2 has 50257, ours 50304)")
    return _ChunkedKD.apply(s_hidden, s_weight, t_hidden.detach(), t_weight.detach(), targets,
                            float(lam), float(rho), int(chunk_size))
