"""The drop-in selective loss against an independent NumPy reference of the VaR rule, and the HF example."""

import importlib.util
import math
import sys
from pathlib import Path

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
    assert float(st.score_kept_mean) == pytest.approx(ref["cvar"], rel=1e-5)
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
    loss_h, st_h = selective_loss(targets, hidden=hidden, weight=weight, score=score, alpha=0.3, impl="naive")
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
        loss, st = selective_loss(targets, hidden=hidden, weight=weight, alpha=0.2, impl=impl, chunk_size=8)
        loss.backward()
        out[impl] = (loss.detach(), st.threshold, hidden.grad.clone(), weight.grad.clone())
    for a, b in zip(out["naive"], out["fused"]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_fused_dispatch_uses_the_documented_signatures(monkeypatch):
    """impl="fused" calls eslm.ops.fused_head with the cross_entropy contract (a stand-in module here)."""
    import types

    from eslm.objectives import cross_entropy as ce

    calls = []
    fake = types.ModuleType("eslm.ops.fused_head")

    def fused_token_stats(hidden, weight, targets, *, need_entropy, chunk_size):
        calls.append(("stats", hidden.shape, need_entropy, chunk_size))
        return ce.naive_token_stats(hidden, weight, targets, need_entropy)

    def fused_selected_ce(hidden, weight, targets, index, *, chunk_size, lse):
        calls.append(("ce", index.shape, chunk_size, lse.shape))
        return ce.naive_selected_ce(hidden, weight, targets, index)

    fake.fused_token_stats, fake.fused_selected_ce = fused_token_stats, fused_selected_ce
    monkeypatch.setitem(sys.modules, "eslm.ops.fused_head", fake)
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(2, 10, 8, generator=g), torch.randn(17, 8, generator=g)
    _, targets = _inputs(2, 10, 17, ignore_frac=0.0, seed=5)
    loss_f, _ = selective_loss(targets, hidden=hidden, weight=weight, score="loss", alpha=0.3, impl="fused",
                               chunk_size=4)
    loss_n, _ = selective_loss(targets, hidden=hidden, weight=weight, score="loss", alpha=0.3, impl="naive")
    assert calls == [("stats", (20, 8), False, 4), ("ce", (14,), 4, (20,))]
    assert float(loss_f) == pytest.approx(float(loss_n), rel=1e-6)


def test_stats_are_tensors_without_host_sync():
    logits, targets = _inputs()
    _, st = selective_loss(targets, logits=logits)
    assert isinstance(st, SelectionStats)
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in vars(st).values())


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


# --- the transformers example -----------------------------------------------------------------------------

def _example():
    path = Path(__file__).resolve().parents[1] / "examples" / "hf_trainer_eslm.py"
    spec = importlib.util.spec_from_file_location("hf_trainer_eslm", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_example_compute_loss_func_trains_gpt2_lm_head_model():
    """The function Trainer would call, in a hand-written loop (runs without accelerate)."""
    pytest.importorskip("transformers")
    ex = _example()
    model, data = ex.build_model(), ex.ToyDataset(n=8)
    log: list = []
    loss_fn = ex.make_compute_loss_func("entropy", 0.2, log)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _params(model)
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "labels")}
    n_items = batch["labels"][:, 1:].ne(IGNORE).sum()  # what Trainer passes as num_items_in_batch
    for _ in range(3):
        loss = loss_fn(model(input_ids=batch["input_ids"]), batch["labels"], num_items_in_batch=n_items)
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    st = log[-1]
    assert int(st.num_tokens) == int(n_items)
    assert int(st.num_kept) == int(n_items) - math.floor(0.2 * int(n_items))


def test_example_runs_inside_hf_trainer(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer's own dependency
    ex = _example()
    model = ex.build_model()
    before = _params(model)
    log: list = []
    trainer = ex.build_trainer(model, ex.ToyDataset(n=16), ex.make_compute_loss_func("loss", 0.1, log),
                               output_dir=str(tmp_path), max_steps=3)
    out = trainer.train()
    assert math.isfinite(out.training_loss) and len(log) >= 3
    assert any(not torch.equal(a, b.detach().cpu()) for a, b in zip(before, model.parameters()))
