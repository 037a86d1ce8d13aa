"""The drop-in selective loss against an independent NumPy reference of the VaR rule, and the HF example."""

import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from eslm.api import SelectionStats, selective_loss, shift_for_causal_lm
from eslm.errors import ConfigError

IGNORE = -100


def _inputs(B=3, T=37, V=29, ignore_frac=0.2, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2.0
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[torch.rand(B, T, generator=g) < ignore_frac] = IGNORE
    return logits, targets


def _numpy_reference(logits, targets, score, alpha):
    """The paper's rule in float64 NumPy: keep the top K = N - floor(alpha N) valid scores."""
    z = logits.reshape(-1, logits.shape[-1]).double().numpy()
    t = targets.reshape(-1).numpy()
    valid = np.nonzero(t != IGNORE)[0]
    z = z[valid] - z[valid].max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    ce = -logp[np.arange(len(valid)), t[valid]]
    s = ce if score == "loss" else -(np.exp(logp) * logp).sum(1)
    n = len(valid)
    k = max(1, n - math.floor(alpha * n + 1e-9))
    order = np.argsort(-s, kind="stable")
    kept, dropped = order[:k], order[k:]
    return {"loss": ce[kept].mean(), "n": n, "k": k, "threshold": s[kept].min(), "cvar": s[kept].mean(),
            "dropped_mean": s[dropped].mean() if len(dropped) else 0.0, "kept_rows": set(valid[kept])}


@pytest.mark.parametrize("score", ["entropy", "loss"])
@pytest.mark.parametrize("alpha,shape", [(0.1, (3, 37, 29)), (0.29, (1, 100, 11)), (0.5, (4, 8, 50)),
                                         (0.95, (2, 5, 7)), (0.0, (2, 16, 13))])
def test_matches_numpy_reference(score, alpha, shape):
    logits, targets = _inputs(*shape, seed=int(alpha * 100))
    loss, st = selective_loss(targets, logits=logits, score=score, alpha=alpha, chunk_size=7)
    ref = _numpy_reference(logits, targets, score, alpha)
    assert int(st.num_tokens) == ref["n"] and int(st.num_kept) == ref["k"]
    assert float(st.kept_frac) == pytest.approx(ref["k"] / ref["n"])
    assert float(loss) == pytest.approx(ref["loss"], rel=1e-5)
    assert float(st.threshold) == pytest.approx(ref["threshold"], rel=1e-5, abs=1e-6)
    assert float(st.cvar) == pytest.approx(ref["cvar"], rel=1e-5)
    assert float(st.score_dropped_mean) == pytest.approx(ref["dropped_mean"], rel=1e-5, abs=1e-6)


def test_alpha_zero_is_plain_cross_entropy():
    logits, targets = _inputs()
    loss, st = selective_loss(targets, logits=logits, alpha=0.0)
    plain = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)
    assert float(loss) == pytest.approx(float(plain), rel=1e-6)
    assert int(st.num_kept) == int((targets != IGNORE).sum())


def test_gradient_flows_only_through_kept_tokens():
    logits, targets = _inputs()
    logits.requires_grad_(True)
    loss, _ = selective_loss(targets, logits=logits, score="entropy", alpha=0.5)
    loss.backward()
    ref = _numpy_reference(logits.detach(), targets, "entropy", 0.5)
    row_has_grad = logits.grad.reshape(-1, logits.shape[-1]).abs().sum(1) > 0
    assert set(torch.nonzero(row_has_grad).flatten().tolist()) == ref["kept_rows"]
    # the gradient of a kept row is that of its own CE / K: softmax - onehot, scaled
    i = next(iter(ref["kept_rows"]))
    z = logits.detach().reshape(-1, logits.shape[-1])[i]
    expected = (torch.softmax(z, 0) - F.one_hot(targets.reshape(-1)[i], z.numel())) / ref["k"]
    assert torch.allclose(logits.grad.reshape(-1, logits.shape[-1])[i], expected, atol=1e-6)


def test_ignored_tokens_are_never_scored_or_kept():
    logits, targets = _inputs(ignore_frac=0.5)
    ignored = targets == IGNORE
    # ignored rows with enormous-entropy (uniform) logits would be kept first if they were scored
    logits[ignored] = 0.0
    _, st = selective_loss(targets, logits=logits, score="entropy", alpha=0.9)
    other = logits.clone()
    other[ignored] = torch.randn_like(other[ignored]) * 50
    loss_a, _ = selective_loss(targets, logits=logits, score="entropy", alpha=0.9)
    loss_b, _ = selective_loss(targets, logits=other, score="entropy", alpha=0.9)
    assert float(loss_a) == float(loss_b)
    assert int(st.num_tokens) == int((~ignored).sum())
    assert float(st.threshold) < math.log(logits.shape[-1]) - 1e-3  # no ignored (uniform) row was kept

    logits.requires_grad_(True)
    loss, _ = selective_loss(targets, logits=logits, alpha=0.0)
    loss.backward()
    assert logits.grad[ignored].abs().max() == 0


def test_all_ignored_gives_zero_loss_and_zero_grad():
    logits, targets = _inputs()
    logits.requires_grad_(True)
    loss, st = selective_loss(torch.full_like(targets, IGNORE), logits=logits, alpha=0.1)
    loss.backward()
    assert float(loss.detach()) == 0.0 and int(st.num_kept) == 0 and int(st.num_tokens) == 0
    assert logits.grad.abs().max() == 0


@pytest.mark.parametrize("score", ["entropy", "loss"])
def test_hidden_weight_path_equals_logits_path(score):
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 19, 16, generator=g, requires_grad=True)
    weight = torch.randn(41, 16, generator=g, requires_grad=True)
    _, targets = _inputs(2, 19, 41, seed=3)
    loss_h, st_h = selective_loss(targets, hidden=hidden, lm_weight=weight, score=score, alpha=0.3, impl="naive")
    loss_h.backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss_l, st_l = selective_loss(targets, logits=hidden @ weight.t(), score=score, alpha=0.3)
    loss_l.backward()
    assert float(loss_h.detach()) == pytest.approx(float(loss_l.detach()), rel=1e-5)
    assert int(st_h.num_kept) == int(st_l.num_kept)
    assert float(st_h.threshold) == pytest.approx(float(st_l.threshold), rel=1e-5)
    assert torch.allclose(gh, hidden.grad, atol=1e-5) and torch.allclose(gw, weight.grad, atol=1e-5)


def test_fused_path_matches_naive_when_available():
    pytest.importorskip("eslm.ops.fused_head")
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 21, 16, generator=g, requires_grad=True)
    weight = torch.randn(53, 16, generator=g, requires_grad=True)
    _, targets = _inputs(3, 21, 53, seed=4)
    out = {}
    for impl in ("naive", "fused"):
        hidden.grad = weight.grad = None
        loss, st = selective_loss(targets, hidden=hidden, lm_weight=weight, alpha=0.2, impl=impl, chunk_size=8)
        loss.backward()
        out[impl] = (loss.detach(), st.threshold, hidden.grad.clone(), weight.grad.clone())
    for a, b in zip(out["naive"], out["fused"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_impl_dispatches_through_the_backend_registry(monkeypatch):
    """impl="fused" reaches the class its registry line names, through the HeadBackend protocol (a stand-in
    module here): the scores with the chunk size, then the kept rows' per-token CE with the pass's lse."""
    import types

    from eslm.ops import head_backend as hb
    from eslm.ops import naive_head as ce

    calls = []
    fake = types.ModuleType("eslm.ops.fused_head")

    class FusedHead:
        name = "fused"

        def __init__(self, options):
            self.options = options

        def token_stats(self, hidden, weight, targets, *, need_entropy):
            calls.append(("stats", hidden.shape, need_entropy, self.options.chunk_size))
            return ce.naive_token_stats(hidden, weight, targets, need_entropy)

        def per_token_ce(self, hidden, weight, targets, index, *, lse=None):
            calls.append(("ce", index.shape, self.options.chunk_size, lse.shape))
            return ce.naive_selected_ce(hidden, weight, targets, index)

    fake.FusedHead = FusedHead
    monkeypatch.setitem(sys.modules, "eslm.ops.fused_head", fake)
    hb._build.cache_clear()
    try:
        g = torch.Generator().manual_seed(5)
        hidden, weight = torch.randn(2, 10, 8, generator=g), torch.randn(17, 8, generator=g)
        _, targets = _inputs(2, 10, 17, ignore_frac=0.0, seed=5)
        loss_f, _ = selective_loss(targets, hidden=hidden, lm_weight=weight, score="loss", alpha=0.3,
                                   impl="fused", chunk_size=4)
    finally:
        hb._build.cache_clear()
    loss_n, _ = selective_loss(targets, hidden=hidden, lm_weight=weight, score="loss", alpha=0.3, impl="naive")
    assert calls == [("stats", (20, 8), False, 4), ("ce", (14,), 4, (20,))]
    assert float(loss_f) == pytest.approx(float(loss_n), rel=1e-6)


def test_stats_are_tensors_without_host_sync():
    logits, targets = _inputs()
    _, st = selective_loss(targets, logits=logits)
    assert isinstance(st, SelectionStats)
    per_domain = {"kept_per_domain", "tokens_per_domain"}  # no domains in a plain loop
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for k, v in vars(st).items() if k not in per_domain)
    assert st.kept_per_domain is None and st.tokens_per_domain is None


def test_shift_for_causal_lm_matches_hf_slicing():
    logits, labels = _inputs(2, 9, 5)
    x, targets = shift_for_causal_lm(logits, labels)
    assert x is logits and targets.shape == labels.shape
    assert torch.equal(targets[:, :-1], labels[:, 1:]) and (targets[:, -1] == IGNORE).all()
    loss, _ = selective_loss(targets, logits=x, alpha=0.0)
    hf = F.cross_entropy(logits[:, :-1].reshape(-1, 5), labels[:, 1:].reshape(-1), ignore_index=IGNORE)
    assert float(loss) == pytest.approx(float(hf), rel=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(score="margin"), "score"),
    (dict(alpha=1.0), "alpha"),
    (dict(impl="fused"), "fused"),
    (dict(impl="triton"), "impl"),
    (dict(hidden=torch.zeros(2, 4, 3)), "exactly one"),
])
def test_user_errors_are_config_errors(kwargs, match):
    logits, targets = _inputs(2, 4, 6)
    with pytest.raises(ConfigError, match=match):
        selective_loss(targets, logits=logits, **kwargs)
    with pytest.raises(ConfigError, match="targets"):
        selective_loss(targets[:, :3], logits=logits)


# --- reductions and the exact normalisation of an optimizer step ------------------------------------------

def test_reduction_sum_is_mean_times_k():
    logits, targets = _inputs()
    mean, st = selective_loss(targets, logits=logits, alpha=0.3)
    total, _ = selective_loss(targets, logits=logits, alpha=0.3, reduction="sum")
    assert float(total) == pytest.approx(float(mean) * int(st.num_kept), rel=1e-6)


def test_num_items_in_batch_gives_the_exact_kept_mean_of_an_accumulated_step():
    """Three micro-batches with very different padding: summing the losses normalised by the step's kept count
    (counted before the forward by kept_tokens) gives the gradient of the mean CE over the step's kept tokens,
    computed by hand; dividing each micro-batch mean by G does not."""
    from eslm.api import kept_tokens

    alpha, V = 0.25, 13
    micro = [_inputs(2, 20, V, ignore_frac=f, seed=s) for s, f in ((1, 0.0), (2, 0.6), (3, 0.9))]
    leaves = [lg.clone().requires_grad_(True) for lg, _ in micro]
    k_step = sum(kept_tokens(t, alpha=alpha) for _, t in micro)
    for z, (_, t) in zip(leaves, micro):
        loss, _ = selective_loss(t, logits=z, alpha=alpha, num_items_in_batch=k_step)
        loss.backward()
    # by hand: each micro-batch keeps its own top K by entropy; the step's loss is the mean CE of all kept tokens
    ref_leaves = [lg.clone().requires_grad_(True) for lg, _ in micro]
    kept_ce = []
    for z, (_, t) in zip(ref_leaves, micro):
        ref = _numpy_reference(z.detach(), t, "entropy", alpha)
        rows = torch.tensor(sorted(ref["kept_rows"]))
        kept_ce.append(F.cross_entropy(z.reshape(-1, V)[rows], t.reshape(-1)[rows], reduction="none"))
    all_kept = torch.cat(kept_ce)
    assert int(k_step) == all_kept.numel()
    all_kept.mean().backward()
    for a, b in zip(leaves, ref_leaves):
        assert torch.allclose(a.grad, b.grad, atol=1e-7)
    naive = [lg.clone().requires_grad_(True) for lg, _ in micro]
    for z, (_, t) in zip(naive, micro):
        (selective_loss(t, logits=z, alpha=alpha)[0] / len(micro)).backward()
    assert not torch.allclose(naive[2].grad, ref_leaves[2].grad, rtol=0.1)  # "divide by G" is not the kept mean


# --- your own scores, per-sequence scope, per-token outputs -----------------------------------------------

def test_own_scores_tensor_and_rho1_excess_loss_callable():
    from eslm.api import token_losses

    logits, targets = _inputs(2, 30, 17, seed=8)
    ref_logits = logits + torch.randn(logits.shape, generator=torch.Generator().manual_seed(9))
    reference = token_losses(targets, logits=ref_logits)
    own = token_losses(targets, logits=logits)
    excess = own - reference
    a, st_a, tok_a = selective_loss(targets, logits=logits, scores=excess, alpha=0.4, return_tokens=True)
    b, st_b, tok_b = selective_loss(targets, logits=logits, scores=lambda s: s.loss - reference, alpha=0.4,
                                    return_tokens=True)
    assert float(a) == pytest.approx(float(b), rel=1e-6) and torch.equal(tok_a.kept, tok_b.kept)
    valid = targets != IGNORE
    # by hand: the top K excess-loss tokens, K = N - floor(0.4 N)
    n = int(valid.sum())
    k = n - math.floor(0.4 * n)
    top = torch.topk(excess[valid], k).values
    assert float(st_a.threshold) == pytest.approx(float(top.min()), rel=1e-6)
    assert float(a) == pytest.approx(float(own[tok_a.kept].mean()), rel=1e-5)
    assert set(excess[tok_a.kept].tolist()) == set(top.tolist())
    with pytest.raises(ConfigError, match="scores"):
        selective_loss(targets, logits=logits, scores=excess[:, :3])


def test_per_sequence_scope_keeps_the_top_of_every_row():
    logits, targets = _inputs(3, 25, 11, ignore_frac=0.3, seed=10)
    loss, st, tok = selective_loss(targets, logits=logits, score="loss", alpha=0.5, scope="sequence",
                                   return_tokens=True)
    kept_ce = []
    for b in range(3):
        ref = _numpy_reference(logits[b:b + 1], targets[b:b + 1], "loss", 0.5)
        assert set(torch.nonzero(tok.kept[b]).flatten().tolist()) == ref["kept_rows"]
        kept_ce.append(ref["loss"] * ref["k"])
    assert int(st.num_kept) == int(tok.kept.sum())
    assert float(loss) == pytest.approx(sum(kept_ce) / int(st.num_kept), rel=1e-5)


def test_per_sequence_scope_on_a_packed_row_uses_position_ids():
    """Padding-free packing: sequences of 5, 9 and 6 tokens in one row; each keeps its own top K_s."""
    logits, targets = _inputs(1, 20, 11, ignore_frac=0.0, seed=11)
    position_ids = torch.cat([torch.arange(5), torch.arange(9), torch.arange(6)])[None]
    _, st, tok = selective_loss(targets, logits=logits, score="entropy", alpha=0.5, scope="sequence",
                                position_ids=position_ids, return_tokens=True)
    start = 0
    for size in (5, 9, 6):
        ref = _numpy_reference(logits[:, start:start + size], targets[:, start:start + size], "entropy", 0.5)
        assert set(torch.nonzero(tok.kept[0, start:start + size]).flatten().tolist()) == ref["kept_rows"]
        start += size
    assert int(st.num_kept) == 3 + 5 + 3
    from eslm.api import kept_tokens
    assert int(kept_tokens(targets, alpha=0.5, scope="sequence", position_ids=position_ids)) == 11


def test_token_outputs_match_the_selection():
    logits, targets = _inputs(2, 19, 9, seed=12)
    loss, st, tok = selective_loss(targets, logits=logits, score="loss", alpha=0.3, return_tokens=True)
    valid = targets != IGNORE
    assert tok.kept.shape == tok.score.shape == tok.loss.shape == targets.shape
    assert int(tok.kept.sum()) == int(st.num_kept) and not bool((tok.kept & ~valid).any())
    ce = F.cross_entropy(logits.reshape(-1, 9), targets.reshape(-1), ignore_index=IGNORE, reduction="none")
    assert torch.allclose(tok.loss.reshape(-1), ce, atol=1e-5)
    assert torch.equal(tok.score, tok.loss)  # score="loss" ranks the loss itself
    assert float(tok.score[tok.kept].min()) == pytest.approx(float(st.threshold))
    assert float(loss) == pytest.approx(float(tok.loss[tok.kept].mean()), rel=1e-6)
    _, _, tok_h = selective_loss(targets, logits=logits, score="entropy", alpha=0.3, return_tokens=True)
    assert torch.allclose(tok_h.loss.reshape(-1), ce, atol=1e-5) and not torch.allclose(tok_h.score, tok_h.loss)


# --- heads with a bias, a logit scale, a softcap ----------------------------------------------------------

@pytest.mark.parametrize("bias,scale,cap", [(True, None, None), (False, 0.125, None), (False, None, 3.0),
                                            (True, 2.0, 5.0)])
def test_transformed_head_matches_full_logits(bias, scale, cap):
    g = torch.Generator().manual_seed(13)
    hidden = torch.randn(2, 15, 8, generator=g, requires_grad=True)
    w = torch.randn(23, 8, generator=g, requires_grad=True)
    b = torch.randn(23, generator=g, requires_grad=True) if bias else None
    _, targets = _inputs(2, 15, 23, seed=13)
    loss, st = selective_loss(targets, hidden=hidden, lm_weight=w, bias=b, logit_scale=scale, softcap=cap,
                              alpha=0.3, chunk_size=4)
    loss.backward()
    got = [hidden.grad.clone(), w.grad.clone()] + ([b.grad.clone()] if bias else [])
    hidden.grad = w.grad = None
    if bias:
        b.grad = None
    z = hidden @ w.t() + (b if bias else 0)
    z = z * (scale or 1.0)
    z = torch.tanh(z / cap) * cap if cap else z
    ref, st_ref = selective_loss(targets, logits=z, alpha=0.3)
    ref.backward()
    want = [hidden.grad, w.grad] + ([b.grad] if bias else [])
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    assert int(st.num_kept) == int(st_ref.num_kept)
    for a, c in zip(got, want):
        assert torch.allclose(a, c, atol=1e-5)


def test_transform_arguments_are_checked():
    logits, targets = _inputs(2, 4, 6)
    with pytest.raises(ConfigError, match="hidden="):
        selective_loss(targets, logits=logits, softcap=30.0)
    hidden, w = torch.zeros(2, 4, 3), torch.zeros(6, 3)
    with pytest.raises(ConfigError, match="softcap"):
        selective_loss(targets, hidden=hidden, lm_weight=w, softcap=-1.0)
    with pytest.raises(ConfigError, match="bias"):
        selective_loss(targets, hidden=hidden, lm_weight=w, bias=torch.zeros(5))


# --- torch.compile and autocast ---------------------------------------------------------------------------

@pytest.mark.parametrize("route", ["logits", "fused", "naive", "sequence", "softcap", "z_loss"])
def test_one_graph_without_host_sync(route):
    """fullgraph=True fails on any graph break; with capture_scalar_outputs off (the default), a host read of a
    tensor (.item(), bool(), data-dependent shapes) is a graph break, so this is also the no-sync check."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(14)
    hidden = torch.randn(2, 12, 8, generator=g, requires_grad=True)
    w = torch.randn(17, 8, generator=g, requires_grad=True)
    _, targets = _inputs(2, 12, 17, seed=14)

    def step(hidden, w, targets):
        kw = dict(hidden=hidden, lm_weight=w, impl="naive" if route == "naive" else "auto")
        if route == "logits":
            kw = dict(logits=hidden @ w.t())
        if route == "sequence":
            kw["scope"] = "sequence"
        if route == "softcap":
            kw["softcap"] = 4.0
        if route == "z_loss":
            kw.update(label_smoothing=0.1, z_loss=1e-3)
        loss, st = selective_loss(targets, alpha=0.3, chunk_size=8, **kw)
        return loss, st.threshold

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss, thr = compiled(hidden, w, targets)
    loss.backward()
    got = hidden.grad.clone()
    hidden.grad = None
    ref, ref_thr = step(hidden, w, targets)
    ref.backward()
    assert float(loss) == pytest.approx(float(ref), rel=1e-5) and float(thr) == pytest.approx(float(ref_thr))
    assert torch.allclose(got, hidden.grad, atol=1e-6)


@pytest.mark.parametrize("route", ["logits", "hidden"])
def test_bf16_autocast(route):
    """Under CPU bf16 autocast the loss and the kept set follow the fp32 computation on the same bf16 values."""
    g = torch.Generator().manual_seed(15)
    hidden = torch.randn(2, 24, 16, generator=g).bfloat16().float().requires_grad_(True)
    w = torch.randn(37, 16, generator=g).bfloat16().float().requires_grad_(True)
    _, targets = _inputs(2, 24, 37, seed=15)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kw = {"logits": hidden @ w.t()} if route == "logits" else {"hidden": hidden, "lm_weight": w}
        loss, st, tok = selective_loss(targets, alpha=0.25, return_tokens=True, **kw)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0
    z = (hidden.detach() @ w.detach().t()).bfloat16().float()
    ref, ref_st, ref_tok = selective_loss(targets, logits=z, alpha=0.25, return_tokens=True)
    assert int(st.num_kept) == int(ref_st.num_kept)
    assert (tok.kept == ref_tok.kept).float().mean() > 0.95  # bf16 matmul rounding may swap near-ties
    assert float(loss) == pytest.approx(float(ref), rel=2e-2)


# --- the loss features people pass: label smoothing, z-loss, ignore_index, logit chunks, refusals ---------

def _hand_terms(z, t, rows, eps, zl):
    """float64 by hand on the kept rows: (1 - eps) CE + eps mean_v(-log p_v) + zl logsumexp^2, their mean."""
    z = z.reshape(-1, z.shape[-1]).double()[rows]
    lse = torch.logsumexp(z, -1)
    logp = z - lse[:, None]
    ce = -logp.gather(1, t.reshape(-1)[rows][:, None]).squeeze(1)
    return ((1 - eps) * ce + eps * (-logp).mean(-1) + zl * lse ** 2).mean()


@pytest.mark.parametrize("route", ["logits", "hidden"])
@pytest.mark.parametrize("eps,zl", [(0.1, 0.0), (0.0, 1e-2), (0.2, 1e-3)])
def test_label_smoothing_and_z_loss_match_a_hand_computation(route, eps, zl):
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(2, 13, 8, generator=g, requires_grad=True)
    w = torch.randn(19, 8, generator=g, requires_grad=True)
    _, targets = _inputs(2, 13, 19, seed=21)
    kw = {"logits": hidden @ w.t()} if route == "logits" else {"hidden": hidden, "lm_weight": w, "chunk_size": 5}
    loss, st = selective_loss(targets, alpha=0.3, label_smoothing=eps, z_loss=zl, **kw)
    loss.backward()
    got = hidden.grad.clone()
    hidden.grad = None
    z = hidden @ w.t()
    # the selection is unchanged by the loss terms: the kept rows are those of the plain entropy score
    rows = sorted(_numpy_reference(z.detach(), targets, "entropy", 0.3)["kept_rows"])
    assert int(st.num_kept) == len(rows)
    want = _hand_terms(z, targets, torch.tensor(rows), eps, zl)
    want.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert torch.allclose(got, hidden.grad.float(), atol=1e-6)
    if route == "hidden":
        with pytest.raises(ConfigError, match="label smoothing"):
            selective_loss(targets, hidden=hidden, lm_weight=w, label_smoothing=eps or 0.1, impl="fused")


def test_nanogpt_ignore_index_minus_one():
    """nanoGPT marks ignored targets -1: passing ignore_index=-1 gives F.cross_entropy's loss at alpha 0;
    forgetting it is one line naming the fix (it was a raw 'index -1 is out of bounds')."""
    logits, targets = _inputs(2, 11, 9, seed=22)
    targets[targets == IGNORE] = -1
    loss, _ = selective_loss(targets, logits=logits, alpha=0.0, ignore_index=-1)
    want = F.cross_entropy(logits.reshape(-1, 9), targets.reshape(-1), ignore_index=-1)
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    with pytest.raises(ConfigError, match="ignore_index=-1") as e:
        selective_loss(targets, logits=logits)
    assert "\n" not in str(e.value)
    targets[0, 0] = 9
    with pytest.raises(ConfigError, match=r"found 9 .*vocabulary has 9"):
        selective_loss(targets, logits=logits, ignore_index=-1)


@pytest.mark.parametrize("scope", ["batch", "sequence"])
@pytest.mark.parametrize("score", ["entropy", "loss"])
def test_a_list_of_logit_chunks_is_the_concatenated_logits(scope, score):
    """litgpt's chunked logits ((B, t_i, V) pieces along the sequence) give the loss, statistics, per-token
    outputs and gradients of the whole (B, T, V) tensor."""
    logits, targets = _inputs(3, 17, 11, seed=23)
    whole = logits.clone().requires_grad_(True)
    chunks = [c.clone().requires_grad_(True) for c in logits.split([8, 8, 1], dim=1)]
    ref, ref_st, ref_tok = selective_loss(targets, logits=whole, score=score, scope=scope, alpha=0.3,
                                          label_smoothing=0.1, return_tokens=True)
    got, st, tok = selective_loss(targets, logits=chunks, score=score, scope=scope, alpha=0.3,
                                  label_smoothing=0.1, return_tokens=True)
    assert float(got) == pytest.approx(float(ref), rel=1e-6)
    assert int(st.num_kept) == int(ref_st.num_kept) and torch.equal(tok.kept, ref_tok.kept)
    (ref + got).backward()
    assert torch.allclose(torch.cat([c.grad for c in chunks], 1), whole.grad, atol=1e-7)
    with pytest.raises(ConfigError, match="chunks"):
        selective_loss(targets, logits=list(logits.split([8, 8, 1], dim=1))[:2])


def test_weight_with_logits_and_unknown_keywords_are_refused_in_one_line():
    """lm_weight= is the LM-head weight of the hidden path: with logits= it was silently ignored; weight= (the
    removed old name, which reads like F.cross_entropy's class weights) is an unknown keyword that points to
    lm_weight=. An unknown keyword was a TypeError naming only itself."""
    logits, targets = _inputs(2, 5, 7)
    with pytest.raises(ConfigError, match="lm_weight= is the LM-head weight"):
        selective_loss(targets, logits=logits, lm_weight=torch.rand(7))
    with pytest.raises(ConfigError, match="unsupported keyword.*weight.*lm_weight="):
        selective_loss(targets, logits=logits, weight=torch.rand(7))
    with pytest.raises(ConfigError, match="unsupported keyword.*lse_square_scale.*z_loss") as e:
        selective_loss(targets, logits=logits, lse_square_scale=1e-4)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="label_smoothing"):
        selective_loss(targets, logits=logits, label_smoothing=1.5)
