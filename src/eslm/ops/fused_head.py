"""Chunked LM-head losses: per-token loss and entropy without full logits; head gradients only for kept rows.

Shapes: hidden (N, C), weight (V, C) (the tied LM head), targets (N,) int64, index (K,) int64 kept rows.
``head_pass`` forms each chunk's (chunk, V) fp32 logits once. The routes, their costs, the entropy from h . (p W),
and why the gradients are formed in the forward: docs/fused_loss.md. K is a Python int fixed by the selection;
nothing here synchronises with the device.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from eslm.ops import head_route
from eslm.ops.token_stats import HeadOptions, HeadState, HeadWork, TokenStats

_F = TypeVar("_F", bound=type[torch.autograd.Function])


@dataclass
class HeadPass:
    """What one pass of this backend holds: the per-token statistics (``TokenStats``' three, fp32 (N,)) and, when
    asked, the cross-entropy gradients of sum_i loss_i over all N rows formed while the logits were at hand:
    grad_hidden (N, C), grad_weight (V, C) fp32, or the softmax itself (probs, (N, V) fp32) and softmax_w
    (probs @ weight, (N, C) fp32); ``route``: the head route (``eslm.ops.head_route``) it was made for. Private
    to this backend: it travels inside ``HeadState``, never to a selector."""

    loss: torch.Tensor
    entropy: torch.Tensor | None
    lse: torch.Tensor
    grad_hidden: torch.Tensor | None = None
    grad_weight: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    softmax_w: torch.Tensor | None = None
    route: str | None = None

    def stats(self) -> TokenStats:
        return TokenStats(loss=self.loss, entropy=self.entropy, lse=self.lse)


def _given(t: torch.Tensor | None) -> torch.Tensor:
    """``t``, which the flags that made it guarantee (the type checker cannot see them)."""
    assert t is not None
    return t


def _chunks(n: int, size: int) -> Iterator[tuple[int, int]]:
    for start in range(0, n, size):
        yield start, min(start + size, n)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's (bf16 on GPU) when it is on, else the input's."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def no_autocast(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """Dtypes are managed explicitly below (fp32 softmax and accumulators, matmuls in the compute dtype)."""
    return torch.autocast(device_type=t.device.type, enabled=False) if torch.is_autocast_enabled(
        t.device.type) else contextlib.nullcontext()


def autocast_consistent(cls: _F) -> _F:
    """``torch.amp.custom_fwd`` / ``custom_bwd`` on an autograd Function (a class decorator), for the device type
    of its first tensor input (torch's decorators take the device type when the class is written; the head runs on
    any device): the backward runs under the autocast state its forward ran under, also where autograd runs it on
    another thread (CUDA), where it would otherwise see none. The Functions here manage their dtypes explicitly
    (their matmuls run under ``no_autocast``), so their results do not depend on that state either way."""
    fwd, bwd = cls.forward, cls.backward

    @functools.wraps(fwd)
    def forward(ctx: Any, *args: Any) -> Any:
        if torch.compiler.is_compiling():  # dynamo cannot trace a decorator built at run time; the graph's
            return fwd(ctx, *args)  # backward runs where its forward was traced, so it needs none
        ctx.amp_device_type = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        return torch.amp.custom_fwd(fwd, device_type=ctx.amp_device_type)(ctx, *args)

    @functools.wraps(bwd)
    def backward(ctx: Any, *grads: Any) -> Any:
        device_type = getattr(ctx, "amp_device_type", None)
        if device_type is None or torch.compiler.is_compiling():
            return bwd(ctx, *grads)
        return torch.amp.custom_bwd(bwd, device_type=device_type)(ctx, *grads)

    for name, fn in (("forward", forward), ("backward", backward)):  # setattr: mypy forbids assigning a method
        setattr(cls, name, staticmethod(fn))
    return cls


def _logits_into(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The fp32 logits of the rows h written into ``out`` (c, V): no new (c, V) block per chunk (on CPU a fresh
    block of that size is a fresh mmap, whose page faults cost about as much as the softmax itself)."""
    if h.dtype == torch.float32:
        return torch.mm(h, w.t(), out=out)
    return out.copy_(h @ w.t())


def _rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_j a_ij b_ij in fp32, (n, C) x (n, C) -> (n,)."""
    return torch.bmm(a.float().unsqueeze(1), b.float().unsqueeze(2)).view(-1)


class _Grads:
    """fp32/compute-dtype accumulators of the head gradients, filled chunk by chunk (either may be left out)."""

    def __init__(self, n: int, weight: torch.Tensor, h_dtype: torch.dtype, hidden: bool = True,
                 weight_grad: bool = True) -> None:
        self.hidden = torch.empty(n, weight.shape[1], dtype=h_dtype, device=weight.device) if hidden else None
        self.weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight_grad else None

    def add(self, rows: slice, dz: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
        """dz (c, V) fp32 logit gradients of the rows h (c, C); w the compute-dtype weight. Returns the rows'
        hidden-state gradient dz W (None without a hidden accumulator)."""
        dzc = dz.to(w.dtype)
        if self.hidden is not None:
            if self.hidden.dtype == w.dtype:
                torch.mm(dzc, w, out=self.hidden[rows])
            else:
                self.hidden[rows] = dzc @ w
        if self.weight is not None:
            if w.dtype == torch.float32:
                self.weight.addmm_(dzc.t(), h)
            else:
                self.weight += (dzc.t() @ h).float()
        return None if self.hidden is None else self.hidden[rows]


def _scratch_rows(n: int, width: int) -> int:
    """Rows of a (rows, V) fp32 scratch block that is no larger than the (V, C) fp32 weight-gradient buffer,
    which the routes that cache the softmax also hold: at most C rows (and at least one)."""
    return max(1, min(n, width))


def _softmax_rows(z: torch.Tensor, scratch: torch.Tensor, ent: torch.Tensor | None) -> torch.Tensor:
    """The logits z (c, V) fp32 replaced by their softmax, in place, block by block through ``scratch``
    (r, V); returns lse (c,). With ``ent`` (c,), also the entropy H = log(total) - sum_v e_v (z_v - m) / total
    (e = exp(z - m), total = sum_v e_v): shifted by the max, the terms have one sign and do not cancel against
    lse, and torch's sum adds them pairwise (an fp32 batched dot over z at V=50257 was off by up to 1.5e-3)."""
    lse = torch.empty(z.shape[0], dtype=torch.float32, device=z.device)
    for a, b in _chunks(z.shape[0], scratch.shape[0]):
        zb = z[a:b]
        m = zb.amax(dim=-1, keepdim=True)
        t = torch.sub(zb, m, out=scratch[: b - a])
        torch.exp(t, out=zb)
        total = zb.sum(-1)
        lse[a:b] = m.squeeze(1) + total.log()
        if ent is not None:
            ent[a:b] = total.log() - t.mul_(zb).sum(-1) / total
        zb.div_(total[:, None])
    return lse


@torch.no_grad()
def head_pass(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, need_entropy: bool = True,
              with_grads: bool = False, grad_hidden: bool = True, grad_weight: bool = True,
              keep_probs: bool = False, softmax_w: bool = True, chunk_size: int = 1024) -> HeadPass:
    """Detached fp32 per-token loss, entropy (if asked) and lse. With ``with_grads`` also the all-row
    cross-entropy gradients of sum_i loss_i: ``grad_hidden`` (N, C) and ``grad_weight`` (V, C) fp32 (each
    unless switched off). With ``keep_probs`` also ``probs``, the (N, V) fp32 softmax, so that the kept rows'
    gradients later need no second logits matmul; the logits are written straight into it.

    Entropy: h . (p W) where fp32 matmuls form p W anyway (returned as ``softmax_w`` with ``keep_probs``), else a
    max-shifted, pairwise fp32 sum per row (docs/fused_loss.md)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    cdt = compute_dtype(hidden)
    dev = hidden.device
    fp32 = cdt == torch.float32
    ent_from_w = need_entropy and fp32 and ((with_grads and grad_hidden) or (keep_probs and softmax_w))
    keep_z = need_entropy and not ent_from_w  # the logits must survive the exp
    loss = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty_like(loss)
    ent = torch.empty_like(loss) if need_entropy else None
    probs = torch.empty(n, vocab, dtype=torch.float32, device=dev) if keep_probs else None
    rows = min(chunk_size, n)
    z_buf = None if keep_probs else torch.empty(rows, vocab, dtype=torch.float32, device=dev)
    p_buf = torch.empty_like(_given(z_buf)) if (keep_z and not keep_probs) else None
    scratch = (torch.empty(_scratch_rows(rows, weight.shape[1]), vocab, dtype=torch.float32, device=dev)
               if (keep_z and keep_probs) else None)
    with no_autocast(hidden):
        h_all, w = hidden.to(cdt), weight.to(cdt)
        grads = _Grads(n, weight, hidden.dtype, grad_hidden, grad_weight) if with_grads else None
        for s, e in _chunks(n, chunk_size):
            h = h_all[s:e]
            z = _logits_into(h, w, _given(probs)[s:e] if keep_probs else _given(z_buf)[: e - s])
            y = targets[s:e, None]
            z_y = z.gather(1, y).squeeze(1)
            if not (need_entropy or with_grads or keep_probs):
                lse[s:e] = torch.logsumexp(z, dim=-1)
                loss[s:e] = lse[s:e] - z_y
                continue
            if scratch is not None:  # the softmax over the logits in place, the entropy through the scratch
                lse_c = _softmax_rows(z, scratch, _given(ent)[s:e])
                p = z
            else:  # one exp pass serves lse, entropy and the softmax: in place over the logits unless needed
                m = z.amax(dim=-1, keepdim=True)
                p = p_buf[: e - s] if p_buf is not None else z
                torch.sub(z, m, out=p).exp_()
                total = p.sum(-1)
                lse_c = m.squeeze(1) + total.log()
                if keep_z:  # as in _softmax_rows, the product written over the logits (not needed after this)
                    _given(ent)[s:e] = total.log() - z.sub_(m).mul_(p).sum(-1) / total
                p.div_(total[:, None])
            lse[s:e], loss[s:e] = lse_c, lse_c - z_y
            if grads is not None:
                p.scatter_add_(1, y, torch.full_like(y, -1.0, dtype=p.dtype))  # dz = p - onehot(y)
                g_h = grads.add(slice(s, e), p, h, w)
                if ent_from_w:  # h . (p - onehot) W + z_y = sum_v p_v z_v
                    _given(ent)[s:e] = lse_c - (_rowdot(h, _given(g_h)) + z_y)
        pw = None
        if keep_probs and ent_from_w:  # one (N, V) x (V, C) matmul over the whole buffer
            pw = torch.mm(_given(probs), w)
            _given(ent).copy_(lse - _rowdot(h_all, pw))
    if grads is None:
        return HeadPass(loss=loss, entropy=ent, lse=lse, probs=probs, softmax_w=pw)
    return HeadPass(loss=loss, entropy=ent, lse=lse, grad_hidden=grads.hidden, grad_weight=grads.weight,
                    probs=probs)


# --------------------------------------------------------------------------- the summed loss (training)


@autocast_consistent
class PrecomputedGrad(torch.autograd.Function):
    """A scalar whose gradient with respect to (hidden, weight) was formed in the forward."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, value: torch.Tensor,
                grad_hidden: torch.Tensor, grad_weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(grad_hidden, grad_weight)
        return value

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gh, gw = ctx.saved_tensors
        return (gh * g.to(gh.dtype) if ctx.needs_input_grad[0] else None,
                gw * g.to(gw.dtype) if ctx.needs_input_grad[1] else None,
                None, None, None)


def _dropped_rows(n: int, index: torch.Tensor) -> torch.Tensor:
    """The N-K indices not in ``index``, without a host sync (a stable sort puts the dropped rows first)."""
    kept = torch.zeros(n, dtype=torch.int8, device=index.device).index_fill_(0, index, 1)
    return torch.argsort(kept, stable=True)[: n - index.numel()]


@torch.no_grad()
def _kept_grads(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, index: torch.Tensor | None,
                pre: HeadPass, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of sum_{kept} loss from the pass's all-row gradients minus the dropped rows' share."""
    if index is None or index.numel() == hidden.shape[0]:
        return _given(pre.grad_hidden), _given(pre.grad_weight)
    gh = torch.zeros_like(_given(pre.grad_hidden))
    gh[index] = _given(pre.grad_hidden)[index]
    dropped = _dropped_rows(hidden.shape[0], index)
    part = head_pass(hidden[dropped], weight, targets[dropped], need_entropy=False, with_grads=True,
                     grad_hidden=False, chunk_size=chunk_size)
    return gh, _given(pre.grad_weight).sub_(_given(part.grad_weight))  # the pass's buffer is used once: in place


@torch.no_grad()
def _grads_from_probs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, index: torch.Tensor | None,
                      probs: torch.Tensor, chunk_size: int,
                      softmax_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of sum_{kept} loss from the pass's cached softmax P, which is read, never written:

        G_h = (P W - W[y]) with the dropped rows zeroed,      G_W = P^T H_m - scatter_y(H_m),

    where H_m is the hidden states with the dropped rows zeroed (an (N, C) copy, not (N, V)): a dropped row
    contributes exactly zero to both. P W is the pass's ``softmax_w`` when it formed it (fp32), else it is
    formed here. In fp32 each is one matmul over the whole buffer; in lower precision, chunk by chunk."""
    n, cdt = hidden.shape[0], compute_dtype(hidden)
    dropped = _dropped_rows(n, index) if index is not None and index.numel() < n else None
    with no_autocast(hidden):
        h_all, w = hidden.to(cdt), weight.to(cdt)
        h_m = h_all if dropped is None else h_all.clone().index_fill_(0, dropped, 0.0)
        if cdt == torch.float32:
            pw = softmax_w if softmax_w is not None else torch.mm(probs, w)
            gw = torch.mm(probs.t(), h_m)
        else:
            pw = torch.empty(n, w.shape[1], dtype=cdt, device=w.device)
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=w.device)
            for s, e in _chunks(n, chunk_size):
                pc = probs[s:e].to(cdt)
                pw[s:e] = pc @ w
                gw += (pc.t() @ h_m[s:e]).float()
        gh = pw.sub_(w[targets])
        if dropped is not None:
            gh.index_fill_(0, dropped, 0.0)
        gw.index_add_(0, targets, h_m.float(), alpha=-1.0)
    return gh.to(hidden.dtype), gw


def _compact_kept_rows(buf: torch.Tensor, index: torch.Tensor, block: int) -> torch.Tensor:
    """Move the kept rows of ``buf`` (N, V) into its first K rows, in place. Returns ``orig`` (K,): row r of
    ``buf[:K]`` is now the original row ``orig[r]`` (the kept rows, in some order).

    At most min(K, N-K) rows move, ``block`` rows at a time, with no host sync: docs/fused_loss.md, "The
    compaction"."""
    n, k = buf.shape[0], index.numel()
    pairs = min(k, n - k)
    orig = torch.arange(k, device=buf.device)
    if pairs == 0:
        return orig
    kept = torch.zeros(n, dtype=torch.int8, device=buf.device).index_fill_(0, index, 1)
    dst = torch.argsort(kept[:k], stable=True)[:pairs]  # the dropped slots before K first
    src = k + torch.argsort(1 - kept[k:], stable=True)[:pairs]  # the kept rows behind K first
    src = torch.where(kept[dst].bool(), dst, src)
    scratch = torch.empty(min(block, pairs), buf.shape[1], dtype=buf.dtype, device=buf.device)
    for s, e in _chunks(pairs, scratch.shape[0]):
        torch.index_select(buf, 0, src[s:e], out=scratch[: e - s])
        buf.index_copy_(0, dst[s:e], scratch[: e - s])
    return orig.index_copy_(0, dst, src)


@torch.no_grad()
def _grads_kept_rows(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, index: torch.Tensor | None,
                     probs: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of sum_{kept} loss from the pass's cached softmax P over the K kept rows only (``kept_cached``:
    P's kept rows compacted into P[:K], in place: the buffer is consumed). In fp32 each is one matmul; in lower
    precision, chunk by chunk. Beside P, at most one (V, C)-sized fp32 block is alive at a time."""
    n, c = hidden.shape
    cdt = compute_dtype(hidden)
    k = n if index is None else index.numel()
    orig = None if index is None or k == n else _compact_kept_rows(probs, index, _scratch_rows(n, c))
    with no_autocast(hidden):
        h_all, w = hidden.to(cdt), weight.to(cdt)
        h_k = h_all if orig is None else h_all[orig]
        y_k = targets if orig is None else targets[orig]
        dz = probs[:k]
        dz.scatter_add_(1, y_k[:, None], torch.full((k, 1), -1.0, dtype=dz.dtype, device=dz.device))
        if cdt == torch.float32:
            gw = torch.mm(dz.t(), h_k)
            gh_k = torch.mm(dz, w)
        else:
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=w.device)
            gh_k = torch.empty(k, c, dtype=cdt, device=w.device)
            for s, e in _chunks(k, chunk_size):
                pc = dz[s:e].to(cdt)
                torch.mm(pc, w, out=gh_k[s:e])
                gw += (pc.t() @ h_k[s:e]).float()
    gh = gh_k if orig is None else torch.zeros(n, c, dtype=gh_k.dtype, device=gh_k.device).index_copy_(0, orig, gh_k)
    return gh.to(hidden.dtype), gw


def route_pass(route: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, scored: bool,
               need_entropy: bool, chunk_size: int = 1024) -> HeadPass | None:
    """The pass over all N rows that ``route`` (``eslm.ops.head_route``) starts with: the scores (when
    ``scored``) and what the route's gradients need (the softmax, or the all-row gradients); None when the
    route needs no pass (``kept_recompute`` without scores). The result carries the route for ``fused_ce_sum``."""
    entropy = scored and need_entropy
    if route in ("all_rows", "kept_cached"):
        if not scored:
            raise ValueError(f"the {route} route caches the scoring pass's softmax; no scoring pass was asked for")
        st = head_pass(hidden, weight, targets, need_entropy=entropy, keep_probs=True,
                       softmax_w=route == "all_rows", chunk_size=chunk_size)
    elif route == "grads_in_pass":
        st = head_pass(hidden, weight, targets, need_entropy=entropy, with_grads=True, chunk_size=chunk_size)
    elif route == "kept_recompute":
        if not scored:
            return None
        st = head_pass(hidden, weight, targets, need_entropy=entropy, chunk_size=chunk_size)
    else:
        raise ValueError(f"expected a head route; found {route!r}")
    st.route = route
    return st


def fused_ce_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, index: torch.Tensor | None,
                 *, pre: HeadPass | None = None, chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_{i in kept} CE_i as a 0-dim fp32 tensor with autograd to hidden and weight, and the kept rows'
    per-token CE (K,) detached, by the route ``pre`` was made for (``route_pass``; ``kept_recompute`` for a pass
    made by ``head_pass`` directly). ``pre``: the pass's result for all N rows, if one ran (its large buffers are
    consumed and released); ``index`` None keeps every row."""
    h_in, w_in = hidden.detach(), weight.detach()
    if pre is not None and pre.route == "grads_in_pass":
        gh, gw = _kept_grads(h_in, w_in, targets, index, pre, chunk_size)
    elif pre is not None and pre.route == "all_rows":
        gh, gw = _grads_from_probs(h_in, w_in, targets, index, _given(pre.probs), chunk_size, pre.softmax_w)
    elif pre is not None and pre.route == "kept_cached":
        gh, gw = _grads_kept_rows(h_in, w_in, targets, index, _given(pre.probs), chunk_size)
    else:
        rows = h_in if index is None else h_in[index]
        part = head_pass(rows, w_in, targets if index is None else targets[index], need_entropy=False,
                         with_grads=True, chunk_size=chunk_size)
        gw, per_token = _given(part.grad_weight), part.loss
        gh = _given(part.grad_hidden) if index is None else \
            torch.zeros_like(h_in).index_copy_(0, index, _given(part.grad_hidden))
    if pre is not None:
        per_token = pre.loss if index is None else pre.loss[index]
        pre.grad_hidden = pre.grad_weight = pre.probs = pre.softmax_w = None  # large buffers: free them once used
    value = per_token.sum()
    return PrecomputedGrad.apply(hidden, weight, value, gh, gw.to(weight.dtype)), per_token


# --------------------------------------------------------------------------- per-token loss (any upstream grads)


@autocast_consistent
class _SelectedCE(torch.autograd.Function):
    """Per-token CE of the given rows; the backward forms their logits again (``kept_recompute``)."""

    @staticmethod
    def forward(ctx: Any, h_kept: torch.Tensor, weight: torch.Tensor, y_kept: torch.Tensor,
                lse_kept: torch.Tensor | None, chunk_size: int) -> torch.Tensor:
        if lse_kept is None:
            lse_kept = head_pass(h_kept, weight, y_kept, need_entropy=False, chunk_size=chunk_size).lse
        w_y = weight[y_kept]
        z_y = (h_kept.float() * w_y.float()).sum(-1)
        ctx.save_for_backward(h_kept, weight, y_kept, lse_kept)
        ctx.chunk_size = chunk_size
        return lse_kept - z_y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight, y, lse = ctx.saved_tensors
        grads = _Grads(h.shape[0], weight, h.dtype, hidden=ctx.needs_input_grad[0],
                       weight_grad=ctx.needs_input_grad[1])  # GREATS' head weight is detached: no G_W
        w = weight.to(h.dtype)
        g = grad_out.float()
        with no_autocast(h):  # the forward's autocast state is restored here (autocast_consistent)
            for s, e in _chunks(h.shape[0], ctx.chunk_size):
                dz = (h[s:e] @ w.t()).float().sub_(lse[s:e, None]).exp_()  # softmax of the kept rows
                dz.scatter_add_(1, y[s:e, None], torch.full((e - s, 1), -1.0, device=dz.device))
                grads.add(slice(s, e), dz.mul_(g[s:e, None]), h[s:e], w)
        return (grads.hidden, None if grads.weight is None else grads.weight.to(weight.dtype), None, None, None)


@autocast_consistent
class _RowGradCE(torch.autograd.Function):
    """Per-token CE whose rows' hidden-state gradients (p_i - onehot(y_i)) W were formed by the forward's one
    pass (``grads_in_pass`` for a head weight that needs no gradient); the backward scales row i by its
    upstream gradient, which is exact because row i's loss depends on row i's hidden state only."""

    @staticmethod
    def forward(ctx: Any, h_kept: torch.Tensor, weight: torch.Tensor, y_kept: torch.Tensor,
                chunk_size: int) -> torch.Tensor:
        st = head_pass(h_kept, weight, y_kept, need_entropy=False, with_grads=True, grad_weight=False,
                       chunk_size=chunk_size)
        ctx.save_for_backward(st.grad_hidden)
        return st.loss

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (gh,) = ctx.saved_tensors
        return gh * grad_out.to(gh.dtype)[:, None], None, None, None


def fused_selected_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      index: torch.Tensor | None, *, chunk_size: int = 1024,
                      lse: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token CE (K,) fp32 of the kept rows (all rows if index is None), with autograd to hidden and weight,
    for any upstream gradient; dropped rows get exactly zero gradient from the head. ``lse`` (N,): the scoring
    pass's, when one ran. The route is the rule's (``eslm.ops.head_route``, per-token routes)."""
    n = hidden.shape[0]
    k = n if index is None else index.numel()
    grad = torch.is_grad_enabled()
    if k == 0 or not (grad and (hidden.requires_grad or weight.requires_grad)):
        route = "kept_recompute"  # no backward will run: the forward alone (the lse, or one scores pass)
    else:
        route = head_route.choose_route(n, k, scored=lse is not None, per_token=True,
                                        weight_grad=weight.requires_grad)
    if index is not None:
        hidden, targets = hidden[index], targets[index]
        lse = lse[index] if lse is not None else None
    if route == "grads_in_pass":
        return _RowGradCE.apply(hidden, weight, targets, chunk_size)
    return _SelectedCE.apply(hidden, weight, targets, lse.detach() if lse is not None else None, chunk_size)


# --------------------------------------------------------------------------- the backend (eslm.ops.head_backend)


class FusedHead:
    """The chunked head as a backend: per micro-batch the route of ``eslm.ops.head_route``'s rule (forced by
    ``options.route`` where it can run, the cached routes only with ``options.cache_probs``); the state is the
    route's pass (``HeadPass``), consumed by ``kept_loss``."""

    name = "fused"

    def __init__(self, options: HeadOptions = HeadOptions()) -> None:
        self.options = options

    def choose(self, n: int, k: int, *, scored: bool) -> str:
        """The route of n rows with k kept (the one chooser, ``eslm.ops.head_route``)."""
        return head_route.choose_route(n, k, scored=scored, cache=self.options.cache_probs,
                                       forced=self.options.route)

    def score(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, num_kept: int,
              need_scores: bool, need_entropy: bool) -> tuple[TokenStats | None, HeadState]:
        n = hidden.shape[0]
        route = self.choose(n, min(n, max(1, num_kept)), scored=need_scores)
        pre = route_pass(route, hidden, weight, targets, scored=need_scores, need_entropy=need_entropy,
                         chunk_size=self.options.chunk_size)
        return (None if pre is None else pre.stats()), HeadState(route, pre)

    def kept_loss(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  index: torch.Tensor | None, state: HeadState | None) -> tuple[torch.Tensor, torch.Tensor]:
        pre = None if state is None else state.buffers
        if state is not None:
            state.buffers = None  # consumed: its large buffers are released by fused_ce_sum
        return fused_ce_sum(hidden, weight, targets, index, pre=pre, chunk_size=self.options.chunk_size)

    def work(self, n: int, k: int, *, scored: bool, state: HeadState | None = None) -> HeadWork:
        route = state.route if state is not None else self.choose(n, max(k, 1), scored=scored)
        return head_route.route_work(route, n, k, scored=scored)

    def token_stats(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                    need_entropy: bool) -> TokenStats:
        return head_pass(hidden, weight, targets, need_entropy=need_entropy,
                         chunk_size=self.options.chunk_size).stats()

    def per_token_ce(self, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     index: torch.Tensor | None, *, lse: torch.Tensor | None = None) -> torch.Tensor:
        return fused_selected_ce(hidden, weight, targets, index, chunk_size=self.options.chunk_size, lse=lse)
