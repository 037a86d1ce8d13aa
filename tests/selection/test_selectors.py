import math

import pytest
import torch

from eslm.data.batch import Batch
from eslm.ops.token_stats import TokenStats
from eslm.selection.ada import AdaController
from eslm.selection.scores import standardize
from eslm.selection.selectors import AllTokens, RandomSelector, VaRSelector
from eslm.selection.stats import selection_stats


def _ts(scores):
    """The scoring pass's statistics with ``scores`` as both the loss and the entropy."""
    flat = scores.reshape(-1)
    return TokenStats(loss=flat, entropy=flat, lse=torch.zeros_like(flat))


def _batch(B=4, T=16, n_domains=2):
    x = torch.randint(0, 50, (B, T))
    return Batch(x, x.roll(-1, 1), torch.arange(B) % n_domains)


def test_var_selector_keeps_top_scores_and_reports_stats():
    b = _batch()
    scores = torch.randn(4, 16)
    sel = VaRSelector("entropy", 0.25, n_domains=2).select(_ts(scores), b)
    assert sel.num_kept == 48 and sel.num_tokens == 64
    kept = scores.reshape(-1)[sel.index]
    dropped_mask = torch.ones(64, dtype=torch.bool)
    dropped_mask[sel.index] = False
    assert kept.min() >= scores.reshape(-1)[dropped_mask].max()
    st = sel.stats
    assert float(st.cvar) == pytest.approx(float(kept.mean()), rel=1e-6)
    assert float(st.threshold) == float(kept.min())
    assert float(st.score_dropped_mean) == pytest.approx(float(scores.reshape(-1)[dropped_mask].mean()), rel=1e-6)
    assert int(st.num_kept) == 48 and int(st.num_tokens) == 64 and float(st.kept_frac) == 0.75
    kept_rows = (~dropped_mask).view(4, 16)  # rows 0, 2 are domain 0; rows 1, 3 domain 1
    assert st.kept_per_domain.tolist() == [float(kept_rows[0::2].sum()), float(kept_rows[1::2].sum())]
    assert st.tokens_per_domain.tolist() == [32.0, 32.0]


def test_batch_standardisation_never_changes_the_mask():
    b = _batch()
    scores = torch.rand(4, 16) * 5 + 3
    a = VaRSelector("loss", 0.3, "none", 2).select(_ts(scores), b).index.sort().values
    z = VaRSelector("loss", 0.3, "batch", 2).select(_ts(scores), b).index.sort().values
    assert torch.equal(a, z)


def test_sequence_and_domain_standardisation():
    scores = torch.cat([torch.rand(2, 8) + 10, torch.rand(2, 8)])  # rows 0,1 uniformly harder
    dom = torch.tensor([0, 0, 1, 1])
    seq = standardize(scores, "sequence", dom, 2)
    assert torch.allclose(seq.mean(1), torch.zeros(4), atol=1e-5)
    d = standardize(scores, "domain", dom, 2)
    assert abs(float(d[:2].mean())) < 1e-5 and abs(float(d[2:].mean())) < 1e-5
    b = Batch(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long), dom)
    raw = VaRSelector("loss", 0.5, "none", 2).select(_ts(scores), b)
    by_dom = VaRSelector("loss", 0.5, "domain", n_domains=2).select(_ts(scores), b)
    assert (raw.index < 16).all()  # raw scores: the hard domain takes the whole budget
    assert (by_dom.index >= 16).any() and (by_dom.index < 16).any()


def test_threshold_mode_keeps_all_at_or_above():
    b = _batch()
    scores = torch.randn(4, 16)
    sel = VaRSelector("loss", 0.1, n_domains=2).select(_ts(scores), b, threshold=torch.tensor(0.0))
    assert sel.num_kept == int((scores >= 0).sum())


def test_random_selector_same_k_and_resumable():
    b = _batch()
    s = RandomSelector(0.5, seed=3, n_domains=2)
    first = s.select(None, b)
    state = s.state_dict()
    nxt = s.select(None, b).index
    s2 = RandomSelector(0.5, seed=99, n_domains=2)
    s2.load_state_dict(state)
    assert first.num_kept == 32
    assert torch.equal(s2.select(None, b).index, nxt)
    # it ranked no scores: no threshold, CVaR or dropped-score mean to report (NaN, not a made-up 0.0)
    st = first.stats
    assert all(math.isnan(float(v)) for v in (st.threshold, st.cvar, st.score_dropped_mean))
    assert float(st.kept_frac) == 0.5 and float(st.kept_per_domain.sum()) == 32


def test_all_tokens_default():
    sel = AllTokens().select(None, _batch())
    assert sel.index is None and sel.num_kept == 64


class _Sel:
    alpha = 0.1


class _Obs:
    def __init__(self, c):
        self.stats = selection_stats(torch.tensor([c]), torch.tensor([True]))


def test_ada_first_measurement_initialises_then_multiplicative_rule():
    sel = _Sel()
    ada = AdaController(sel, gamma=0.5, interval=2, eps=1e-8, alpha_min=0.01, alpha_max=0.5)
    for c in (4.0, 6.0):
        ada.observe(_Obs(c))
    ada.on_step_end(1)
    assert sel.alpha == 0.1  # not an interval boundary
    ada.on_step_end(2)
    assert sel.alpha == 0.1 and ada.prev_cvar == pytest.approx(5.0)  # first measurement: no update
    ada.observe(_Obs(4.0))
    ada.on_step_end(4)
    d = (4.0 - 5.0) / 5.0
    assert sel.alpha == pytest.approx(0.1 * math.exp(-0.5 * d))  # CVaR fell -> alpha rises
    # clamping and state round trip
    ada.observe(_Obs(1000.0))
    ada.on_step_end(6)
    assert sel.alpha == 0.01
    sd = ada.state_dict()
    sel2 = _Sel()
    ada2 = AdaController(sel2, gamma=0.5, interval=2, eps=1e-8, alpha_min=0.01, alpha_max=0.5)
    ada2.load_state_dict(sd)
    assert sel2.alpha == 0.01 and ada2.prev_cvar == ada.prev_cvar


@pytest.mark.parametrize("name,alpha", [("clm", 0.0), ("eslm-entropy", 0.1), ("eslm-entropy", 0.5),
                                        ("eslm-loss", 0.15), ("eslm-loss", 0.6)])
@pytest.mark.parametrize("cache", ["true", "false"])
def test_fused_step_gives_the_naive_steps_gradients(name, alpha, cache):
    """The whole training step, fused vs naive loss path: same loss, same kept tokens, same parameter grads
    (every route of the fused loss: cached softmax; grads formed in the scoring pass at k >= 0.8; kept rows
    only below)."""
    from eslm.config import build_config, method_context
    from eslm.data.batch import Batch
    from eslm.methods import build_method
    from eslm.model.gpt import GPT, preset
    from eslm.train.step import StepOptions, forward_backward

    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=131))
    g = torch.Generator().manual_seed(1)
    batches = [Batch(x=torch.randint(0, 131, (3, 24), generator=g), y=torch.randint(0, 131, (3, 24), generator=g),
                     domain=torch.zeros(3, dtype=torch.long)) for _ in range(2)]
    out = {}
    for impl in ("naive", "fused"):
        cfg = build_config(overrides=[f"method.name={name}", f"method.alpha={alpha}", f"train.loss_impl={impl}",
                                      "train.loss_chunk_size=17", f"train.loss_cache_probs={cache}"])
        method = build_method(method_context(cfg, device=torch.device("cpu"), n_domains=1))
        model.zero_grad(set_to_none=True)
        res = forward_backward(model, model, method, batches, StepOptions(accum_steps=2), step=1, lr=1e-3)
        out[impl] = (res, {n: p.grad.clone() for n, p in model.named_parameters()})
    (rn, gn), (rf, gf) = out["naive"], out["fused"]
    torch.testing.assert_close(rf.loss, rn.loss, rtol=1e-5, atol=1e-6)
    assert rf.tokens_kept == rn.tokens_kept
    for a, b in zip(rf.selections, rn.selections):
        assert (a.index is None and b.index is None) or torch.equal(a.index.sort().values, b.index.sort().values)
    for n in gn:
        torch.testing.assert_close(gf[n], gn[n], rtol=1e-4, atol=1e-6, msg=n)
