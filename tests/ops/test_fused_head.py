"""The fused head path against the naive oracle (full logits), in the manner of the kernel libraries."""

import pytest
import torch

from eslm.model.gpt import GPT, preset
from eslm.objectives.cross_entropy import naive_selected_ce, naive_token_stats
from eslm.ops.fused_head import fused_selected_ce, fused_token_stats

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def _inputs(n, c, v, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, c, generator=g).to(dtype)
    w = (torch.randn(v, c, generator=g) * 0.3).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    return h, w, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,c,v,chunk", [(37, 16, 97, 8), (64, 32, 1031, 64), (5, 8, 50, 1024), (1, 4, 7, 3)])
def test_token_stats_match_naive(dtype, n, c, v, chunk):
    h, w, y = _inputs(n, c, v, dtype)
    ref = naive_token_stats(h.float(), w.float(), y)
    got = fused_token_stats(h, w, y, need_entropy=True, chunk_size=chunk)
    for name in ("loss", "entropy", "lse"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), **TOL[dtype], msg=name)
    assert fused_token_stats(h, w, y, need_entropy=False, chunk_size=chunk).entropy is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep", [1.0, 0.9, 0.5, "one", None])
@pytest.mark.parametrize("use_lse", [False, True])
def test_selected_ce_values_and_grads(dtype, keep, use_lse):
    n, c, v, chunk = 45, 24, 131, 16
    h0, w0, y = _inputs(n, c, v, dtype, seed=1)
    if keep is None:
        index = None
    else:
        k = 1 if keep == "one" else int(round(keep * n))
        index = torch.randperm(n, generator=torch.Generator().manual_seed(2))[:k]
    gw = torch.rand(n if index is None else index.numel(), generator=torch.Generator().manual_seed(3))

    def run(fn, **kw):
        h = h0.clone().float().requires_grad_() if fn is naive_selected_ce else h0.clone().requires_grad_()
        w = w0.clone().float().requires_grad_() if fn is naive_selected_ce else w0.clone().requires_grad_()
        out = fn(h, w, y, index, **kw)
        (out * gw).sum().backward()  # random per-token upstream gradients, not only a mean
        return out, h.grad.float(), w.grad.float()

    lse = naive_token_stats(h0.float(), w0.float(), y).lse if use_lse else None
    ref = run(naive_selected_ce)
    got = run(fused_selected_ce, chunk_size=chunk, lse=lse)
    for name, a, b in zip(("loss", "grad_hidden", "grad_weight"), got, ref):
        torch.testing.assert_close(a.float(), b, **TOL[dtype], msg=name)
    if index is not None:
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[index] = False
        assert torch.all(got[1][dropped] == 0)  # exactly zero, not merely small


def test_tied_embedding_grads_through_gpt():
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=97))
    x = torch.randint(0, 97, (3, 20))
    y = x.roll(-1, 1).reshape(-1)
    index = torch.randperm(60)[:41]
    grads = []
    for fn in (naive_selected_ce, fused_selected_ce):
        model.zero_grad()
        h = model(x).flatten(0, 1)
        fn(h, model.head_weight, y, index).mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


# ----------------------------------------------------------------------------- the summed loss used in training

from eslm.ops.fused_head import fused_ce_sum, head_pass  # noqa: E402


def _index(n, keep, seed=2):
    if keep is None:
        return None
    k = 1 if keep == "one" else int(round(keep * n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep", [None, 1.0, 0.9, 0.85, 0.5, "one"])
@pytest.mark.parametrize("route", ["grads_in_pass", "cached_probs", "scores_only", "no_pass"])
@pytest.mark.parametrize("n,c,v,chunk", [(45, 24, 131, 16), (7, 8, 1031, 3)])
def test_ce_sum_values_and_grads(dtype, keep, route, n, c, v, chunk):
    h0, w0, y = _inputs(n, c, v, dtype, seed=1)
    index = _index(n, keep)

    h, w = h0.float().clone().requires_grad_(), w0.float().clone().requires_grad_()
    ref = naive_selected_ce(h, w, y, index)
    ref.sum().mul(0.37).backward()  # any scalar upstream gradient
    pre = None if route == "no_pass" else head_pass(h0, w0, y, need_entropy=True, chunk_size=chunk,
                                                    with_grads=route == "grads_in_pass",
                                                    keep_probs=route == "cached_probs")
    hf, wf = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    total, per_token = fused_ce_sum(hf, wf, y, index, pre=pre, chunk_size=chunk)
    total.mul(0.37).backward()
    assert total.dtype == torch.float32 and total.dim() == 0 and not per_token.requires_grad
    assert pre is None or (pre.probs is None and pre.grad_weight is None and pre.softmax_w is None)  # released
    torch.testing.assert_close(per_token, ref.detach(), **TOL[dtype])
    torch.testing.assert_close(total, ref.detach().sum(), **TOL[dtype])
    assert hf.grad.dtype == dtype and wf.grad.dtype == dtype
    torch.testing.assert_close(hf.grad.float(), h.grad, **TOL[dtype], msg="grad_hidden")
    torch.testing.assert_close(wf.grad.float(), w.grad, **TOL[dtype], msg="grad_weight")
    if index is not None:
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[index] = False
        assert torch.all(hf.grad[dropped] == 0)  # exactly zero, not merely small


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", ["grads_in_pass", "cached_probs", "scores_only"])
@pytest.mark.parametrize("n,c,v,chunk", [(45, 24, 131, 16), (7, 8, 1031, 3)])
def test_every_route_gives_the_naive_scores(dtype, route, n, c, v, chunk):
    """The entropy has a different formula per route (batched dot with the logits, or h . (p W) in fp32 when
    the pass forms p W anyway): every route must give the oracle's loss, entropy and lse."""
    h0, w0, y = _inputs(n, c, v, dtype, seed=7)
    ref = naive_token_stats(h0.float(), w0.float(), y)
    got = head_pass(h0, w0, y, need_entropy=True, chunk_size=chunk, with_grads=route == "grads_in_pass",
                    keep_probs=route == "cached_probs")
    for name in ("loss", "entropy", "lse"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), **TOL[dtype], msg=name)
    assert (got.softmax_w is not None) == (route == "cached_probs" and dtype == torch.float32)


def test_head_pass_grads_equal_autograd_of_the_summed_loss():
    h0, w0, y = _inputs(33, 12, 77, torch.float32, seed=4)
    got = head_pass(h0, w0, y, need_entropy=False, with_grads=True, chunk_size=10)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    naive_selected_ce(h, w, y, None).sum().backward()
    torch.testing.assert_close(got.grad_hidden, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.grad_weight, w.grad, rtol=1e-5, atol=1e-6)
    assert got.entropy is None


def test_ce_sum_under_cpu_bf16_autocast_matches_naive_under_autocast():
    h0, w0, y = _inputs(40, 16, 201, torch.float32, seed=5)
    index = _index(40, 0.9)
    out = []
    for fused in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                pre = head_pass(h.detach(), w.detach(), y, with_grads=True, chunk_size=16)
                total, _ = fused_ce_sum(h, w, y, index, pre=pre, chunk_size=16)
            else:
                total = naive_selected_ce(h, w, y, index).sum()
        total.backward()
        out.append((total.detach(), h.grad, w.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
    assert out[1][1].dtype == torch.float32  # gradients come back in the parameters' dtype


def test_head_work_per_route():
    """The FLOPs accounting's view of each route: (rows with the two gradient matmuls, rows recomputed)."""
    from eslm.objectives.base import CrossEntropy
    from eslm.ops.fused_head import head_work

    assert head_work(100, 90, scored=True, cached_probs=True) == (100.0, 0.0)  # softmax kept, dropped rows zeroed
    assert head_work(100, 90, scored=True) == (100.0, 20.0)                    # all-row grads, dropped subtracted
    assert head_work(100, 100, scored=False) == (100.0, 0.0)                   # CLM: one pass
    assert head_work(100, 50, scored=True) == (50.0, 50.0)                     # kept rows after a scoring pass
    assert head_work(100, 50, scored=False) == (50.0, 0.0)                     # random control, no scores
    assert CrossEntropy(impl="naive").head_work(100, 50, scored=True) == (100.0, 0.0)  # masked loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_only_entropy_is_exact_at_the_gpt2_vocabulary(dtype):
    """The scores-only route (no gradients, no cached softmax) sums p_v z_v over the whole vocabulary; at
    GPT-2's V=50257 an fp32 batched dot there was off by 1.5e-3. Reference: the same logits, in float64."""
    from eslm.ops.fused_head import _logits

    n, c, v = 6, 64, 50257
    g = torch.Generator().manual_seed(11)
    h = (torch.randn(n, c, generator=g) * 2.0).to(dtype)
    w = torch.randn(v, c, generator=g).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    z = _logits(h, w).double()  # the logits the route computes (bf16 matmul, fp32 result), then exact maths
    p = torch.softmax(z, -1)
    ref = -(p * torch.log_softmax(z, -1)).sum(-1)
    got = head_pass(h, w, y, need_entropy=True, chunk_size=4)
    torch.testing.assert_close(got.entropy.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse.double(), torch.logsumexp(z, -1), rtol=1e-5, atol=1e-5)
