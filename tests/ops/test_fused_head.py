"""The fused head path against the naive oracle (full logits), in the manner of the kernel libraries."""

import pytest
import torch

from eslm.model.gpt import GPT, preset
from eslm.ops.fused_head import fused_selected_ce, head_pass
from eslm.ops.naive_head import naive_selected_ce, naive_token_stats

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
    got = head_pass(h, w, y, need_entropy=True, chunk_size=chunk).stats()
    for name in ("loss", "entropy", "lse"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), **TOL[dtype], msg=name)
    assert head_pass(h, w, y, need_entropy=False, chunk_size=chunk).entropy is None


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep", [None, 0.5, "one"])
@pytest.mark.parametrize("use_lse", [False, True])
def test_selected_ce_with_a_detached_weight(dtype, keep, use_lse):
    """GREATS' per-sample losses: the head weight is detached. Without scores the chooser forms each row's
    hidden-state gradient in the one forward pass (grads_in_pass) and the backward scales it; with scores the
    kept rows are recomputed. Either way: the oracle's losses and hidden-state gradients for random upstream
    gradients, no weight gradient."""
    n, c, v, chunk = 45, 24, 131, 16
    h0, w0, y = _inputs(n, c, v, dtype, seed=8)
    index = _index(n, keep)
    up = torch.rand(n if index is None else index.numel(), generator=torch.Generator().manual_seed(9))
    h = h0.float().clone().requires_grad_()
    ref = naive_selected_ce(h, w0.float(), y, index)
    (ref * up).sum().backward()
    hf = h0.clone().requires_grad_()
    lse = naive_token_stats(h0.float(), w0.float(), y).lse if use_lse else None
    got = fused_selected_ce(hf, w0, y, index, chunk_size=chunk, lse=lse)
    assert type(got.grad_fn).__name__ == ("_SelectedCEBackward" if use_lse else "_RowGradCEBackward")
    (got * up).sum().backward()
    torch.testing.assert_close(got.detach(), ref.detach(), **TOL[dtype])
    torch.testing.assert_close(hf.grad.float(), h.grad, **TOL[dtype])
    if index is not None:
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[index] = False
        assert torch.all(hf.grad[dropped] == 0)


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

from eslm.ops.fused_head import fused_ce_sum  # noqa: E402


def _index(n, keep, seed=2):
    if keep is None:
        return None
    k = 1 if keep == "one" else int(round(keep * n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]


def _naive_sum(h0, w0, y, index, upstream=0.37):
    h, w = h0.float().clone().requires_grad_(), w0.float().clone().requires_grad_()
    ref = naive_selected_ce(h, w, y, index)
    ref.sum().mul(upstream).backward()  # any scalar upstream gradient
    return ref.detach(), h.grad, w.grad


def _targets(y, kind, v):
    """The targets of a case: as drawn, or a handful of values repeated (scatter/index_add with duplicates)."""
    return y if kind == "random" else y % 3


# every route of the summed loss, with and without scores: (route, scored)
ROUTE_CASES = [("kept_cached", True), ("all_rows", True), ("grads_in_pass", True), ("kept_recompute", True),
               ("grads_in_pass", False), ("kept_recompute", False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep", [None, 1.0, 0.9, 0.85, 0.5, 0.2, "one"])
@pytest.mark.parametrize("route,scored", ROUTE_CASES)
@pytest.mark.parametrize("n,c,v,chunk,targets", [(45, 24, 131, 16, "random"), (7, 8, 1031, 3, "random"),
                                                 (33, 5, 50, 64, "duplicates")])
def test_ce_sum_every_route_matches_naive(dtype, keep, route, scored, n, c, v, chunk, targets):
    """Each route's loss, per-token losses and gradients against the naive oracle (full logits, masked), for
    keep fractions from every row to a single one, awkward shapes (rows not a multiple of the chunk, C smaller
    than the chunk, C = 5 so the scratch blocks hold 5 rows), duplicate targets; dropped rows exactly zero."""
    from eslm.ops.fused_head import route_pass

    h0, w0, y = _inputs(n, c, v, dtype, seed=1)
    y = _targets(y, targets, v)
    index = _index(n, keep)
    ref, ref_h, ref_w = _naive_sum(h0, w0, y, index)
    pre = route_pass(route, h0, w0, y, scored=scored, need_entropy=True, chunk_size=chunk)
    assert (pre is None) == (route == "kept_recompute" and not scored)
    hf, wf = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    total, per_token = fused_ce_sum(hf, wf, y, index, pre=pre, chunk_size=chunk)
    total.mul(0.37).backward()
    assert total.dtype == torch.float32 and total.dim() == 0 and not per_token.requires_grad
    assert pre is None or (pre.probs is None and pre.grad_weight is None and pre.softmax_w is None)  # released
    torch.testing.assert_close(per_token, ref, **TOL[dtype])
    torch.testing.assert_close(total, ref.sum(), **TOL[dtype])
    assert hf.grad.dtype == dtype and wf.grad.dtype == dtype
    torch.testing.assert_close(hf.grad.float(), ref_h, **TOL[dtype], msg="grad_hidden")
    torch.testing.assert_close(wf.grad.float(), ref_w, **TOL[dtype], msg="grad_weight")
    if index is not None:
        dropped = torch.ones(n, dtype=torch.bool)
        dropped[index] = False
        assert torch.all(hf.grad[dropped] == 0)  # exactly zero, not merely small


@pytest.mark.parametrize("route", ["kept_cached", "all_rows", "grads_in_pass", "kept_recompute"])
def test_ce_sum_every_route_under_cpu_bf16_autocast(route):
    """fp32 parameters, bf16 matmuls (autocast), as training on a GPU runs: each route against the naive path
    under the same autocast."""
    from eslm.ops.fused_head import route_pass

    h0, w0, y = _inputs(40, 16, 201, torch.float32, seed=5)
    index = _index(40, 0.5)
    out = []
    for fused in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                pre = route_pass(route, h.detach(), w.detach(), y, scored=True, need_entropy=True, chunk_size=16)
                total, _ = fused_ce_sum(h, w, y, index, pre=pre, chunk_size=16)
            else:
                total = naive_selected_ce(h, w, y, index).sum()
        total.backward()
        out.append((total.detach(), h.grad, w.grad))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-2)
    assert out[1][1].dtype == torch.float32  # gradients come back in the parameters' dtype


@pytest.mark.parametrize("n,k,block", [(10, 3, 1), (10, 7, 2), (64, 32, 5), (9, 1, 4), (9, 8, 3), (5, 5, 2)])
def test_compaction_moves_the_kept_rows_to_the_front(n, k, block):
    """kept_cached's in-place compaction: buf[:K] holds exactly the kept rows (orig tells which), every moved
    row came from behind K into a dropped slot before K, and nothing else before K changed."""
    from eslm.ops.fused_head import _compact_kept_rows

    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        buf0 = torch.randn(n, 6, generator=g)
        index = torch.randperm(n, generator=g)[:k]
        buf = buf0.clone()
        orig = _compact_kept_rows(buf, index, block)
        assert sorted(orig.tolist()) == sorted(index.tolist())
        torch.testing.assert_close(buf[:k], buf0[orig], rtol=0, atol=0)
        front_kept = [i for i in range(k) if i in set(index.tolist())]
        assert all(orig[i].item() == i for i in front_kept)  # kept rows before K stay where they are


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", ["grads_in_pass", "all_rows", "kept_cached", "kept_recompute"])
@pytest.mark.parametrize("n,c,v,chunk", [(45, 24, 131, 16), (7, 8, 1031, 3), (30, 4, 77, 64)])
def test_every_route_gives_the_naive_scores(dtype, route, n, c, v, chunk):
    """The entropy has a different formula per route (a shifted sum with the logits, through a scratch block
    of at most C rows when the softmax is kept, or h . (p W) in fp32 when the pass forms p W anyway): every
    route's pass must give the oracle's loss, entropy and lse."""
    from eslm.ops.fused_head import route_pass

    h0, w0, y = _inputs(n, c, v, dtype, seed=7)
    ref = naive_token_stats(h0.float(), w0.float(), y)
    got = route_pass(route, h0, w0, y, scored=True, need_entropy=True, chunk_size=chunk)
    for name in ("loss", "entropy", "lse"):
        torch.testing.assert_close(getattr(got, name), getattr(ref, name), **TOL[dtype], msg=name)
    assert (got.softmax_w is not None) == (route == "all_rows" and dtype == torch.float32)
    assert (got.probs is not None) == (route in ("all_rows", "kept_cached")) and got.route == route


def test_head_pass_grads_equal_autograd_of_the_summed_loss():
    h0, w0, y = _inputs(33, 12, 77, torch.float32, seed=4)
    got = head_pass(h0, w0, y, need_entropy=False, with_grads=True, chunk_size=10)
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    naive_selected_ce(h, w, y, None).sum().backward()
    torch.testing.assert_close(got.grad_hidden, h.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.grad_weight, w.grad, rtol=1e-5, atol=1e-6)
    assert got.entropy is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_only_entropy_is_exact_at_the_gpt2_vocabulary(dtype):
    """The scores-only route (no gradients, no cached softmax) sums p_v z_v over the whole vocabulary; at
    GPT-2's V=50257 an fp32 batched dot there was off by 1.5e-3. Reference: the same logits, in float64."""

    n, c, v = 6, 64, 50257
    g = torch.Generator().manual_seed(11)
    h = (torch.randn(n, c, generator=g) * 2.0).to(dtype)
    w = torch.randn(v, c, generator=g).to(dtype)
    y = torch.randint(0, v, (n,), generator=g)
    z = (h @ w.t()).float().double()  # the logits the route computes (bf16 matmul, fp32 result), then exact maths
    p = torch.softmax(z, -1)
    ref = -(p * torch.log_softmax(z, -1)).sum(-1)
    got = head_pass(h, w, y, need_entropy=True, chunk_size=4)
    torch.testing.assert_close(got.entropy.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.lse.double(), torch.logsumexp(z, -1), rtol=1e-5, atol=1e-5)
