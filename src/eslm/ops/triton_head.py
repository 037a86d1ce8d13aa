"""The GPU head backend: bf16 logits written once by the scoring pass, Triton row kernels, the kept rows' backward.

Pass A (``score``): z = h W^T in the compute dtype is the (N, V) cache; ``_row_stats`` reads each logit once for
the lse, the entropy and the target logit (online max-shifted sums, fp32). Pass B (``kept_loss``): ``_kept_dz``
writes dz = softmax(z) - onehot(y) for the K kept rows from the pass's lse, then the gradients, formed in the
forward and scaled in the backward (``eslm.ops.fused_head.PrecomputedGrad``). Costs and memory: docs/fused_loss.md.

K is a count fixed before the forward (the selector's top-K has a static size), so nothing here waits for the
device and the kernels' shapes do not change as the kept set does. The kernels run on CUDA tensors, or on the
CPU under ``TRITON_INTERPRET=1``, set before triton is first imported (the tests: tiny shapes; no ``tl.dot`` here, whose bf16 result is wrong under
the interpreter, triton#11584: the matmuls are torch's). Needs the ``gpu`` extra (``pip install 'eslm[gpu]'``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton  # noqa: F401  (the gpu extra: a missing one is reported by eslm.ops.head_backend in one line)
import triton.language as tl

from eslm.errors import ConfigError
from eslm.ops.fused_head import PrecomputedGrad, autocast_consistent, compute_dtype, no_autocast
from eslm.ops.token_stats import HeadOptions, HeadState, HeadWork, TokenStats

BLOCK_V = 1024  # logits per program step along the vocabulary (a power of two)


@triton.jit
def _row_stats(z_ptr: tl.tensor, stride: tl.tensor, y_ptr: tl.tensor, lse_ptr: tl.tensor, ent_ptr: tl.tensor,
               zy_ptr: tl.tensor, V: tl.constexpr, BLOCK: tl.constexpr, ENTROPY: tl.constexpr) -> None:
    """One program per row: lse, entropy (ENTROPY) and the target logit of row z[row, :V], reading it once."""
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    m = tl.zeros([], dtype=tl.float32) - 1e30  # finite: (m - m_new) * s stays 0 before the first block
    s = tl.zeros([], dtype=tl.float32)
    a = tl.zeros([], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        z = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)  # 0 where masked
        if ENTROPY:
            d = tl.where(mask, z - m_new, 0.0)
            a = scale * (a + (m - m_new) * s) + tl.sum(e * d, axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    log_s = tl.log(s)
    tl.store(lse_ptr + row, m + log_s)
    if ENTROPY:  # H = lse - sum p z = log s - sum e (z - m) / s: terms of one sign, no cancellation against lse
        tl.store(ent_ptr + row, log_s - a / s)
    y = tl.load(y_ptr + row).to(tl.int64)
    tl.store(zy_ptr + row, tl.load(base + y).to(tl.float32))


@triton.jit
def _kept_dz(z_ptr: tl.tensor, z_stride: tl.tensor, idx_ptr: tl.tensor, y_ptr: tl.tensor, lse_ptr: tl.tensor,
             out_ptr: tl.tensor, out_stride: tl.tensor, V: tl.constexpr, BLOCK: tl.constexpr) -> None:
    """Program (r, b): block b of kept row r: out[r] = exp(z[idx[r]] - lse[idx[r]]) - onehot(y[idx[r]]), in the
    output's dtype (the compute dtype)."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    src = tl.load(idx_ptr + r).to(tl.int64)
    z = tl.load(z_ptr + src * z_stride + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(z - tl.load(lse_ptr + src))
    y = tl.load(y_ptr + src).to(tl.int64)
    dz = tl.where(offs == y, p - 1.0, p)
    tl.store(out_ptr + r * out_stride + offs, dz.to(out_ptr.dtype.element_ty), mask=mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise ConfigError(f"the triton head backend runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1, "
                          f"for tests); found {t.device.type}; fix: train.loss_impl=auto or fused")


@functools.cache
def _mm_out_dtype_ok(device_type: str) -> bool:
    """Whether torch.mm takes out_dtype=float32 for bf16 operands here (CUDA in recent torch: fp32 output of the
    fp32 accumulator, no bf16 rounding of G_W)."""
    try:
        a = torch.zeros(2, 2, dtype=torch.bfloat16, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as fp32 (the accumulator's precision kept where torch can return it)."""
    if a.dtype == torch.float32:
        return a @ b
    if _mm_out_dtype_ok(a.device.type):
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def row_stats(z: torch.Tensor, targets: torch.Tensor, need_entropy: bool) -> TokenStats:
    """Per-row loss, entropy (if asked) and lse of logits z (n, V) (any float dtype), by one read of each logit."""
    n, v = z.shape
    lse = torch.empty(n, dtype=torch.float32, device=z.device)
    zy = torch.empty_like(lse)
    ent = torch.empty_like(lse) if need_entropy else None
    if n:
        _row_stats[(n,)](z, z.stride(0), targets, lse, ent if need_entropy else lse, zy, v,
                         BLOCK=min(BLOCK_V, triton.next_power_of_2(v)), ENTROPY=need_entropy)
    return TokenStats(loss=lse - zy, entropy=ent, lse=lse)


def kept_dz(z: torch.Tensor, index: torch.Tensor | None, targets: torch.Tensor, lse: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """dz (K, V) = softmax - onehot of the rows ``index`` of the logits z (all rows, in place over z, if None)."""
    n, v = z.shape
    if index is None:
        index, out = torch.arange(n, device=z.device), z
    k = index.numel()
    if out is None:
        out = torch.empty(k, v, dtype=z.dtype, device=z.device)
    if k:
        block = min(BLOCK_V, triton.next_power_of_2(v))
        _kept_dz[(k, triton.cdiv(v, block))](z, z.stride(0), index, targets, lse, out, out.stride(0), v, BLOCK=block)
    return out


class _Cache:
    """Pass A's state: the logits (N, V) in the compute dtype and the per-row statistics."""

    def __init__(self, logits: torch.Tensor, stats: TokenStats) -> None:
        self.logits: torch.Tensor | None = logits  # None once read (pass B)
        self.stats = stats


@torch.no_grad()
def _pass_a(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, need_entropy: bool) -> _Cache:
    cdt = compute_dtype(hidden)
    with no_autocast(hidden):
        z = hidden.to(cdt) @ weight.to(cdt).t()  # the matmul's own output is the cache
    return _Cache(z, row_stats(z, targets, need_entropy))


@torch.no_grad()
def _pass_b(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, index: torch.Tensor | None,
            cache: _Cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(G_h (N, C) in hidden's dtype, G_W (V, C) fp32, the kept rows' CE (K,)) from the cached logits."""
    n, c = hidden.shape
    logits = cache.logits
    assert logits is not None, "the cached logits are read once"
    cdt = logits.dtype
    st = cache.stats
    per_token = st.loss if index is None else st.loss[index]
    dz = kept_dz(logits, index, targets, st.lse)
    del logits  # no reference beyond dz's may keep the (N, V) buffer alive
    cache.logits = None  # the cache is read once; in CLM dz is written over it
    with no_autocast(hidden):
        h, w = hidden.to(cdt), weight.to(cdt)
        h_k = h if index is None else h[index]
        gh_k = dz @ w
        gw = _mm_f32(dz.t(), h_k)
    gh = gh_k if index is None else torch.zeros(n, c, dtype=gh_k.dtype, device=gh_k.device).index_copy_(0, index, gh_k)
    return gh.to(hidden.dtype), gw, per_token


@autocast_consistent
class _TokenCE(torch.autograd.Function):
    """Per-token CE of the given rows for any upstream gradient: the forward caches their logits (one matmul),
    the backward forms dz from them, scaled per row, and the two gradient matmuls."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cache = _pass_a(h, weight, y, need_entropy=False)
        ctx.save_for_backward(h, weight, y, cache.logits, cache.stats.lse)
        return cache.stats.loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight, y, z, lse = ctx.saved_tensors
        dz = kept_dz(z, torch.arange(z.shape[0], device=z.device), y, lse)
        dz = (dz.float() * g.float()[:, None]).to(dz.dtype)
        with no_autocast(h):
            w = weight.to(dz.dtype)
            gh = (dz @ w).to(h.dtype) if ctx.needs_input_grad[0] else None
            gw = _mm_f32(dz.t(), h.to(dz.dtype)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None


class TritonHead:
    """The GPU backend (``eslm.ops.head_backend``): pass A caches the logits, pass B runs the kept rows only."""

    name = "triton"

    def __init__(self, options: HeadOptions = HeadOptions()) -> None:
        self.options = options

    def score(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, num_kept: int,
              need_scores: bool, need_entropy: bool) -> tuple[TokenStats | None, HeadState]:
        _check_device(hidden)
        n = hidden.shape[0]
        if not need_scores and num_kept < n:  # the random control: only the kept rows' logits, in kept_loss
            return None, HeadState("kept_only")
        cache = _pass_a(hidden, weight, targets, need_entropy=need_scores and need_entropy)
        return cache.stats, HeadState("cached_logits", cache)

    def kept_loss(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  index: torch.Tensor | None, state: HeadState | None) -> tuple[torch.Tensor, torch.Tensor]:
        _check_device(hidden)
        h_in, w_in = hidden.detach(), weight.detach()
        cache = None if state is None else state.buffers
        if state is not None:
            state.buffers = None  # consumed
        if cache is None:  # no pass over all rows: the kept rows' logits only
            rows = h_in if index is None else h_in[index]
            y = targets if index is None else targets[index]
            gh_k, gw, per_token = _pass_b(rows, w_in, y, None, _pass_a(rows, w_in, y, need_entropy=False))
            gh = gh_k if index is None else torch.zeros_like(h_in).index_copy_(0, index, gh_k)
        else:
            gh, gw, per_token = _pass_b(h_in, w_in, targets, index, cache)
        value = per_token.sum()
        return PrecomputedGrad.apply(hidden, weight, value, gh, gw.to(weight.dtype)), per_token

    def work(self, n: int, k: int, *, scored: bool, state: HeadState | None = None) -> HeadWork:
        route = state.route if state is not None else ("cached_logits" if scored or k == n else "kept_only")
        return HeadWork(float(k if route == "kept_only" else n), float(k), 0.0)

    def token_stats(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    need_entropy: bool) -> TokenStats:
        _check_device(hidden)
        return _pass_a(hidden, weight, targets, need_entropy).stats

    def per_token_ce(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     index: torch.Tensor | None, *, lse: torch.Tensor | None = None) -> torch.Tensor:
        _check_device(hidden)
        if index is not None:
            hidden, targets = hidden[index], targets[index]
        return _TokenCE.apply(hidden, weight, targets)
