"""Rho-1's reference model: frozen, no gradient, correct per-token losses, excess-loss sign, FLOPs."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from eslm.baselines.rho1 import ReferenceModel, excess_loss
from eslm.model.gpt import GPT, preset

V, T = 50, 8


def _gpt(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(preset("tiny", vocab_size=kw.pop("vocab_size", V), block_size=16, **kw))


def _batch(n=3, seed=1, vocab=V):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, T), generator=g), torch.randint(0, vocab, (n, T), generator=g)


def _ce(model, x, y):
    return F.cross_entropy(model.logits(model(x)).transpose(1, 2), y, reduction="none")


def test_frozen_eval_not_a_module_and_no_grad():
    model = _gpt().train()
    ref = ReferenceModel(model, impl="naive")
    assert not isinstance(ref, nn.Module)  # so it can never be registered under (or DDP-wrapped with) the student
    assert not ref.model.training and all(not p.requires_grad for p in ref.model.parameters())
    x, y = _batch()
    with torch.enable_grad():
        loss = ref.token_loss(x, y)
    assert loss.shape == (3, T) and loss.dtype == torch.float32 and not loss.requires_grad
    assert all(p.grad is None for p in ref.model.parameters())
    torch.testing.assert_close(loss, _ce(model, x, y).detach())


def test_tiny_reference_vs_itself_gives_zero_excess():
    student = _gpt(seed=3)
    ref = ReferenceModel(copy.deepcopy(student), impl="naive")
    x, y = _batch(4, seed=5)
    current = _ce(student, x, y)  # the student's loss, with gradient
    ex = excess_loss(current.detach(), ref.token_loss(x, y))
    torch.testing.assert_close(ex, torch.zeros_like(ex), atol=1e-6, rtol=0)
    current.mean().backward()  # the student trains; the reference is untouched
    assert all(p.grad is None for p in ref.model.parameters())


def test_excess_loss_sign_against_a_better_reference():
    """A reference fitted to the batch has lower loss, so the untrained student's excess loss is positive."""
    x, y = _batch(2, seed=7)
    fitted = _gpt(seed=11)
    opt = torch.optim.Adam(fitted.parameters(), lr=5e-2)
    for _ in range(8):
        opt.zero_grad()
        _ce(fitted, x, y).mean().backward()
        opt.step()
    ref = ReferenceModel(fitted, impl="naive")
    student = _gpt(seed=12)
    ex = excess_loss(_ce(student, x, y).detach(), ref.token_loss(x, y))
    assert (ex > 0).float().mean() >= 0.85 and ex.mean() > 1.0
    torch.testing.assert_close(excess_loss(ref.token_loss(x, y), _ce(student, x, y).detach()), -ex)
    assert excess_loss(torch.tensor([2.0, 1.0]), torch.tensor([1.5, 1.5])).tolist() == [0.5, -0.5]
    with pytest.raises(ValueError):
        excess_loss(torch.zeros(2, 3), torch.zeros(3, 2))


def test_smaller_reference_vocabulary_scores_real_token_ids():
    """An OpenAI-style reference (V 50257) scores our targets (< 50257): here V 43 against a student of 50."""
    ref = ReferenceModel(_gpt(vocab_size=43), impl="naive")
    x, y = _batch(2, seed=3, vocab=43)
    loss = ref.token_loss(x, y)
    assert loss.shape == (2, T) and torch.isfinite(loss).all()
    student_loss = _ce(_gpt(seed=4), x, y).detach()
    assert excess_loss(student_loss, loss).shape == (2, T)


def test_from_path_uses_loading_module(monkeypatch):
    model = _gpt()
    from eslm.model import loading

    calls = []
    monkeypatch.setattr(loading, "load_model",
                        lambda path, device: calls.append((path, device)) or (model, {"kind": "fake", "step": 7}))
    ref = ReferenceModel.from_path("runs/clm/checkpoints/step_0040000.pt", "cpu", impl="naive")
    assert calls == [("runs/clm/checkpoints/step_0040000.pt", "cpu")]
    assert ref.model is model
    assert all(not p.requires_grad for p in ref.model.parameters()) and not ref.model.training


def test_reference_forward_is_declared_and_priced_as_a_third_of_palm():
    from eslm.baselines.rho1 import Rho1Selector
    from eslm.flops import FlopsModel, extra_flops

    for name, kw in [("tiny", {}), ("small", {"bias": True})]:
        model = GPT(preset(name, vocab_size=V, **kw))
        cfg = model.config
        L, C, Vs = cfg.n_layer, cfg.n_embd, cfg.vocab_size
        # independent count: per block 12 C^2 weights + 2 LayerNorms; ln_f; the tied wte/head once
        per_block = 12 * C * C + 2 * C + ((3 * C + C + 4 * C + C) + 2 * C if cfg.bias else 0)
        N = Vs * C + L * per_block + C + (C if cfg.bias else 0)
        H, Q = cfg.n_head, C // cfg.n_head
        ref = ReferenceModel(model, impl="naive")
        assert model.num_params() == N
        for Tm in (cfg.block_size, 32):
            want = (6 * N + 12 * L * H * Q * Tm) / 3
            # Rho-1 declares the reference's forward over the micro-batch's tokens; eslm.flops prices it
            work = Rho1Selector(ref, 0.1, Tm).extra_work(tokens_seen=10)
            assert [(p.tokens, p.model) for p in work.passes] == [(10, cfg)]
            fm = FlopsModel.from_config(cfg, Tm)  # the trained model's (here the reference's own)
            assert extra_flops([work], fm) == pytest.approx((10 * want, 10 * want, 0), rel=1e-12)
