"""Chunked LM-head losses: per-token loss and entropy without full logits; head gradients only for kept rows.

Shapes: hidden (N, C), weight (V, C) (the tied LM head), targets (N,) int64, index (K,) int64 kept rows.
Cost unit below: u = one (N x C) x (C x V) head matmul. The naive path (full logits, log-softmax, masked mean)
costs 3u plus about eight elementwise passes over an (N, V) fp32 tensor, and holds up to three of them.

**One pass** (``head_pass``). Tokens are processed in chunks of ``chunk_size`` rows; for each chunk the
(chunk, V) logits z are formed once, in fp32, and reduced to

    lse_i = log sum_v exp(z_iv),   loss_i = lse_i - z_{i,y_i},   H_i = lse_i - sum_v p_iv z_iv,

with p = softmax(z) (the entropy costs one multiply-add per logit). With ``with_grads`` the same chunk also
forms the cross-entropy gradient of every row, dz_i = p_i - onehot(y_i), and spends the two gradient matmuls

    G_h[i] = dz_i W   (N, C),        G_W = sum_i dz_i^T h_i   (V, C, fp32),

so scores, loss and gradients together cost 3u — what plain training's head costs anyway. At most one
(chunk, V) fp32 block is alive, never the naive path's (N, V) logits, log-probabilities and gradients.

**The selected loss** (``fused_ce_sum``) returns sum_{i in kept} loss_i with its gradient, by one of two routes:

* the pass kept its softmax (``keep_probs``): zero the dropped rows, subtract onehot(y) in place, and run the
  two gradient matmuls over the buffer: 1u + 2u, no (N, V) copy (the default when selection scores are needed;
  one (N, V) fp32 buffer);
* the pass already holds all-row gradients (most tokens kept): the kept rows' gradient is G_h with the dropped
  rows zeroed, and G_W minus the dropped rows' share, recomputed for the N-K dropped rows only: 3u + 2(1-k)u;
* otherwise (few tokens kept, or no pass ran): logits, dz and both gradient matmuls for the K kept rows only,
  after a scoring pass without gradients: 1u + 3ku.

The two cost the same at k = 0.8 (``GRADS_IN_PASS_MIN_KEEP``); ``wants_grads_in_pass`` picks by the keep
fraction. Either way the gradients are formed in the forward (as Liger-Kernel's fused linear cross-entropy
does) and the backward only scales them by the scalar upstream gradient, which is exact because the output is
a scalar sum. Dropped rows get exactly zero gradient at the head.

``fused_selected_ce`` keeps a per-token output (K,) for callers that weight tokens individually (the drop-in
API, GREATS' per-sample losses); its backward recomputes the kept rows' logits (1u + 3ku after a pass).

K is a Python int fixed by the selection; nothing here synchronises with the device.
"""

from __future__ import annotations

import contextlib

import torch

from eslm.objectives.cross_entropy import TokenStats

GRADS_IN_PASS_MIN_KEEP = 0.8  # 3 + 2(1-k) <= 1 + 3k  <=>  k >= 0.8


def wants_grads_in_pass(keep_fraction: float) -> bool:
    """Whether the scoring pass should also form all-row gradients (cheaper when most tokens are kept)."""
    return keep_fraction >= GRADS_IN_PASS_MIN_KEEP


def head_work(n: int, k: int, *, scored: bool, cached_probs: bool = False) -> tuple[float, float]:
    """What ``CrossEntropy`` on this path runs at the head, for the FLOPs accounting, in rows:
    (rows with the two gradient matmuls, rows with an extra logits-sized matmul beyond the one forward).

    grads in the pass: all N rows get gradients; the N-K dropped rows are recomputed and their weight gradient
    formed again to be subtracted (two extra matmuls each). Otherwise the K kept rows get gradients, and their
    logits are formed again after a scoring pass (``scored``), or for the first time if none ran (the dropped
    rows' forward then never happens; counted as run, an overcount of (N-K) head forwards). With the softmax
    cached by the scoring pass, the gradient matmuls run over all N rows (the dropped ones zeroed) and nothing
    is recomputed."""
    if cached_probs and scored:
        return float(n), 0.0
    if wants_grads_in_pass(k / n):
        return float(n), 2.0 * (n - k)
    return float(k), float(k) if scored else 0.0


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's (bf16 on GPU) when it is on, else the input's."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def _no_autocast(t: torch.Tensor):
    """Dtypes are managed explicitly below (fp32 softmax and accumulators, matmuls in the compute dtype)."""
    return torch.autocast(device_type=t.device.type, enabled=False) if torch.is_autocast_enabled(
        t.device.type) else contextlib.nullcontext()


def _logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(c, C) x (V, C) -> (c, V) fp32 logits; the matmul runs in the inputs' (shared) dtype."""
    return (h @ w.t()).float()


class _Grads:
    """fp32/compute-dtype accumulators of the head gradients, filled chunk by chunk."""

    def __init__(self, n: int, weight: torch.Tensor, h_dtype: torch.dtype, hidden: bool = True):
        self.hidden = torch.empty(n, weight.shape[1], dtype=h_dtype, device=weight.device) if hidden else None
        self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)

    def add(self, rows: slice, dz: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> None:
        """dz (c, V) fp32 logit gradients of the rows h (c, C); w the compute-dtype weight."""
        dzc = dz.to(w.dtype)
        if self.hidden is not None:
            self.hidden[rows] = dzc @ w
        if w.dtype == torch.float32:
            self.weight.addmm_(dzc.t(), h)
        else:
            self.weight += (dzc.t() @ h).float()


@torch.no_grad()
def head_pass(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, need_entropy: bool = True,
              with_grads: bool = False, grad_hidden: bool = True, keep_probs: bool = False,
              chunk_size: int = 1024) -> TokenStats:
    """Detached fp32 per-token loss, entropy (if asked) and lse. With ``with_grads`` also the all-row
    cross-entropy gradients of sum_i loss_i: ``grad_hidden`` (N, C) (unless ``grad_hidden`` is False) and
    ``grad_weight`` (V, C) fp32. With ``keep_probs`` also ``probs``, the (N, V) fp32 softmax, so that the kept
    rows' gradients later need no second logits matmul."""
    n = hidden.shape[0]
    cdt = _compute_dtype(hidden)
    loss = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(loss)
    ent = torch.empty_like(loss) if need_entropy else None
    probs = torch.empty(n, weight.shape[0], dtype=torch.float32, device=hidden.device) if keep_probs else None
    with _no_autocast(hidden):
        h_all, w = hidden.to(cdt), weight.to(cdt)
        grads = _Grads(n, weight, hidden.dtype, grad_hidden) if with_grads else None
        for s, e in _chunks(n, chunk_size):
            h = h_all[s:e]
            z = _logits(h, w)
            y = targets[s:e, None]
            z_y = z.gather(1, y).squeeze(1)
            if not (need_entropy or with_grads or keep_probs):
                lse[s:e] = torch.logsumexp(z, dim=-1)
            else:  # one exp pass serves lse, entropy and the softmax
                m = z.amax(dim=-1, keepdim=True)
                # unnormalised softmax, written straight into the kept buffer or into one (chunk, V) temporary
                p = torch.sub(z, m, out=probs[s:e]) if probs is not None else torch.sub(z, m)
                p.exp_()
                total = p.sum(-1)
                lse[s:e] = m.squeeze(1) + total.log()
                if need_entropy:  # sum_v p_v z_v as a batched dot product: no (chunk, V) product is written
                    ent[s:e] = lse[s:e] - torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1) / total
                p.div_(total[:, None])
                if grads is not None:
                    p.scatter_add_(1, y, torch.full_like(y, -1.0, dtype=p.dtype))  # dz = p - onehot(y)
                    grads.add(slice(s, e), p, h, w)
            loss[s:e] = lse[s:e] - z_y
    if grads is None:
        return TokenStats(loss=loss, entropy=ent, lse=lse, probs=probs)
    return TokenStats(loss=loss, entropy=ent, lse=lse, grad_hidden=grads.hidden, grad_weight=grads.weight,
                      probs=probs)


def fused_token_stats(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                      need_entropy: bool = True, chunk_size: int = 1024) -> TokenStats:
    """Detached fp32 per-token loss, entropy (if asked) and log-sum-exp, chunked over tokens."""
    return head_pass(hidden, weight, targets, need_entropy=need_entropy, chunk_size=chunk_size)


# --------------------------------------------------------------------------- the summed loss (training)


class _PrecomputedGrad(torch.autograd.Function):
    """A scalar whose gradient with respect to (hidden, weight) was formed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, value, grad_hidden, grad_weight):
        ctx.save_for_backward(grad_hidden, grad_weight)
        return value

    @staticmethod
    def backward(ctx, g):
        gh, gw = ctx.saved_tensors
        return (gh * g.to(gh.dtype) if ctx.needs_input_grad[0] else None,
                gw * g.to(gw.dtype) if ctx.needs_input_grad[1] else None,
                None, None, None)


def _dropped_rows(n: int, index: torch.Tensor) -> torch.Tensor:
    """The N-K indices not in ``index``, without a host sync (a stable sort puts the dropped rows first)."""
    kept = torch.zeros(n, dtype=torch.int8, device=index.device).index_fill_(0, index, 1)
    return torch.argsort(kept, stable=True)[: n - index.numel()]


@torch.no_grad()
def _kept_grads(hidden, weight, targets, index, pre: TokenStats, chunk_size: int):
    """Gradients of sum_{kept} loss from the pass's all-row gradients minus the dropped rows' share."""
    if index is None or index.numel() == hidden.shape[0]:
        return pre.grad_hidden, pre.grad_weight
    gh = torch.zeros_like(pre.grad_hidden)
    gh[index] = pre.grad_hidden[index]
    dropped = _dropped_rows(hidden.shape[0], index)
    part = head_pass(hidden[dropped], weight, targets[dropped], need_entropy=False, with_grads=True,
                     grad_hidden=False, chunk_size=chunk_size)
    return gh, pre.grad_weight.sub_(part.grad_weight)  # the pass's buffer is used once: update in place


@torch.no_grad()
def _grads_from_probs(hidden, weight, targets, index, probs, chunk_size: int):
    """Gradients of sum_{kept} loss from the pass's cached softmax, in place: the dropped rows are zeroed and
    onehot(y) is subtracted from the kept ones (dz, without a copy), then the two gradient matmuls run chunk by
    chunk over the buffer. A zero row contributes exactly zero to both gradients."""
    n, cdt = hidden.shape[0], _compute_dtype(hidden)
    rows = torch.arange(n, device=hidden.device) if index is None else index
    if index is not None and index.numel() < n:
        probs.index_fill_(0, _dropped_rows(n, index), 0.0)
    probs.index_put_((rows, targets[rows]), torch.full((rows.numel(),), -1.0, device=probs.device),
                     accumulate=True)
    with _no_autocast(hidden):
        h_all, w = hidden.to(cdt), weight.to(cdt)
        grads = _Grads(n, weight, hidden.dtype)
        for s, e in _chunks(n, chunk_size):
            grads.add(slice(s, e), probs[s:e], h_all[s:e], w)
    return grads.hidden, grads.weight


def fused_ce_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, index: torch.Tensor | None,
                 *, pre: TokenStats | None = None, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_{i in kept} CE_i as a 0-dim fp32 tensor with autograd to hidden and weight, and the kept rows'
    per-token CE (K,) detached. ``pre``: the scoring pass's result for all N rows, if one ran (with or without
    ``grad_hidden`` / ``grad_weight`` or ``probs``; those buffers are consumed and released from ``pre``);
    ``index`` None keeps every row."""
    h_in, w_in = hidden.detach(), weight.detach()
    if pre is not None and pre.grad_weight is not None:
        gh, gw = _kept_grads(h_in, w_in, targets, index, pre, chunk_size)
    elif pre is not None and pre.probs is not None:
        gh, gw = _grads_from_probs(h_in, w_in, targets, index, pre.probs, chunk_size)
    else:
        rows = h_in if index is None else h_in[index]
        part = head_pass(rows, w_in, targets if index is None else targets[index], need_entropy=False,
                         with_grads=True, chunk_size=chunk_size)
        gw, per_token = part.grad_weight, part.loss
        gh = part.grad_hidden if index is None else torch.zeros_like(h_in).index_copy_(0, index, part.grad_hidden)
    if pre is not None:
        per_token = pre.loss if index is None else pre.loss[index]
        pre.grad_hidden = pre.grad_weight = pre.probs = None  # large buffers: free them as soon as they are used
    value = per_token.sum()
    return _PrecomputedGrad.apply(hidden, weight, value, gh, gw.to(weight.dtype)), per_token


# --------------------------------------------------------------------------- per-token loss (any upstream grads)


class _SelectedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_kept, weight, y_kept, lse_kept, chunk_size):
        if lse_kept is None:
            lse_kept = head_pass(h_kept, weight, y_kept, need_entropy=False, chunk_size=chunk_size).lse
        w_y = weight[y_kept]
        z_y = (h_kept.float() * w_y.float()).sum(-1)
        ctx.save_for_backward(h_kept, weight, y_kept, lse_kept)
        ctx.chunk_size = chunk_size
        return lse_kept - z_y

    @staticmethod
    def backward(ctx, grad_out):
        h, weight, y, lse = ctx.saved_tensors
        grads = _Grads(h.shape[0], weight, h.dtype)
        w = weight.to(h.dtype)
        g = grad_out.float()
        for s, e in _chunks(h.shape[0], ctx.chunk_size):
            dz = _logits(h[s:e], w).sub_(lse[s:e, None]).exp_()  # softmax of the kept rows
            dz.scatter_add_(1, y[s:e, None], torch.full((e - s, 1), -1.0, device=dz.device))
            grads.add(slice(s, e), dz.mul_(g[s:e, None]), h[s:e], w)
        return (grads.hidden if ctx.needs_input_grad[0] else None,
                grads.weight.to(weight.dtype) if ctx.needs_input_grad[1] else None, None, None, None)


def fused_selected_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      index: torch.Tensor | None, *, chunk_size: int = 1024,
                      lse: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token CE (K,) fp32 of the kept rows (all rows if index is None), with autograd to hidden and weight,
    for any upstream gradient. The gather ``hidden[index]`` scatters the kept rows' gradients back into an
    (N, C) zero tensor, so dropped rows get exactly zero gradient from the head."""
    if index is not None:
        hidden, targets = hidden[index], targets[index]
        lse = lse[index] if lse is not None else None
    return _SelectedCE.apply(hidden, weight, targets, lse.detach() if lse is not None else None, chunk_size)
