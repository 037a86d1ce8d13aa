"""The chunked KD loss against full-logit references (values and gradients), awkward shapes, dtypes, edges."""

import pytest
import torch
import torch.nn.functional as F

from eslm.errors import ConfigError
from eslm.objectives.distill import kd_per_token


def _inputs(K, V, C, Ct, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    sh = (torch.randn(K, C, generator=g) * scale).to(dtype).requires_grad_()
    sw = (torch.randn(V, C, generator=g) * 0.5).to(dtype).requires_grad_()
    th = (torch.randn(K, Ct, generator=g) * scale).to(dtype)
    tw = (torch.randn(V, Ct, generator=g) * 0.5).to(dtype)
    y = torch.randint(0, V, (K,), generator=g)
    return sh, sw, th, tw, y


def naive_kd_per_token(s_hidden, s_weight, t_hidden, t_weight, targets, *, lam=0.5, rho=1.0):
    """Oracle: full (K, V) fp32 logits and autograd. Same contract as ``kd_per_token``."""
    zs = (s_hidden @ s_weight.t()).float()
    with torch.no_grad():
        log_q = torch.log_softmax((t_hidden @ t_weight.t()).float() / rho, dim=-1)
    log_p = torch.log_softmax(zs / rho, dim=-1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    ce = F.cross_entropy(zs, targets, reduction="none")
    return lam * kl + (1.0 - lam) * ce


def _kl_div_reference(sh, sw, th, tw, y, lam, rho):
    """Independent reference: torch's F.kl_div on fp32 log-probabilities + F.cross_entropy, with autograd."""
    zs = (sh @ sw.t()).float()
    zt = (th @ tw.t()).float()
    log_p = F.log_softmax(zs / rho, -1)
    log_q = F.log_softmax(zt / rho, -1)
    kl = F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    return lam * kl + (1 - lam) * F.cross_entropy(zs, y, reduction="none")


def _grads(fn, sh, sw, w):
    sh.grad = sw.grad = None
    (fn() * w).sum().backward()
    return sh.grad.clone(), sw.grad.clone()


@pytest.mark.parametrize("K,V,C,Ct,chunk", [(37, 53, 16, 24, 8), (5, 101, 8, 8, 1024), (64, 17, 12, 4, 64),
                                            (1, 7, 3, 5, 1)])
@pytest.mark.parametrize("lam,rho", [(0.5, 1.0), (0.0, 1.0), (1.0, 1.0), (0.3, 2.5), (0.7, 0.6)])
def test_values_and_grads_match_reference(K, V, C, Ct, chunk, lam, rho):
    sh, sw, th, tw, y = _inputs(K, V, C, Ct, seed=K + V)
    w = torch.rand(K, generator=torch.Generator().manual_seed(1))  # non-uniform upstream gradient
    got = kd_per_token(sh, sw, th, tw, y, lam=lam, rho=rho, chunk_size=chunk)
    ref = _kl_div_reference(sh, sw, th, tw, y, lam, rho)
    assert got.dtype == torch.float32 and got.shape == (K,)
    torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5)
    g_got = _grads(lambda: kd_per_token(sh, sw, th, tw, y, lam=lam, rho=rho, chunk_size=chunk), sh, sw, w)
    g_ref = _grads(lambda: _kl_div_reference(sh, sw, th, tw, y, lam, rho), sh, sw, w)
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_naive_oracle_agrees_with_kl_div():
    sh, sw, th, tw, y = _inputs(9, 31, 6, 6)
    a = naive_kd_per_token(sh, sw, th, tw, y, lam=0.4, rho=1.7)
    b = _kl_div_reference(sh, sw, th, tw, y, 0.4, 1.7)
    torch.testing.assert_close(a, b)


def test_edges_lam0_is_ce_and_self_distillation_kl_is_zero():
    sh, sw, th, tw, y = _inputs(13, 29, 8, 8)
    ce = F.cross_entropy((sh @ sw.t()).float(), y, reduction="none")
    torch.testing.assert_close(kd_per_token(sh, sw, th, tw, y, lam=0.0), ce)
    # Teacher == student: KL = 0 at any temperature, so lam = 1 gives 0 loss and 0 gradient.
    kl = kd_per_token(sh, sw, sh.detach(), sw.detach(), y, lam=1.0, rho=1.9)
    torch.testing.assert_close(kl, torch.zeros_like(kl), atol=1e-5, rtol=0)
    kl.sum().backward()
    assert sh.grad.abs().max() < 1e-5 and sw.grad.abs().max() < 1e-5


def test_kl_is_nonnegative_and_teacher_gets_no_grad():
    sh, sw, th, tw, y = _inputs(20, 40, 8, 8, scale=3.0)
    th.requires_grad_()
    tw.requires_grad_()
    out = kd_per_token(sh, sw, th, tw, y, lam=1.0, rho=0.7, chunk_size=3)
    assert (out > -1e-6).all()
    out.sum().backward()
    assert th.grad is None and tw.grad is None and sh.grad is not None and sw.grad is not None


def test_bf16_inputs_loose_tolerance():
    sh, sw, th, tw, y = _inputs(33, 67, 16, 16, dtype=torch.bfloat16)
    got = kd_per_token(sh, sw, th, tw, y, lam=0.5, rho=1.0, chunk_size=10)
    ref = naive_kd_per_token(sh, sw, th, tw, y, lam=0.5, rho=1.0)
    torch.testing.assert_close(got, ref.detach(), rtol=2e-2, atol=2e-2)
    g_got = _grads(lambda: kd_per_token(sh, sw, th, tw, y, chunk_size=10), sh, sw, 1.0)
    g_ref = _grads(lambda: naive_kd_per_token(sh, sw, th, tw, y), sh, sw, 1.0)
    assert g_got[0].dtype == torch.bfloat16 and g_got[1].dtype == torch.bfloat16
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-2)


def test_empty_selection():
    sh, sw, th, tw, y = _inputs(0, 11, 4, 4)
    out = kd_per_token(sh, sw, th, tw, y)
    assert out.shape == (0,)
    out.sum().backward()
    assert sw.grad.abs().sum() == 0


def test_chunking_never_holds_full_logits(monkeypatch):
    """Every logits matmul the function performs has at most chunk_size rows."""
    import eslm.objectives.distill as d

    rows = []
    orig = d._logits
    monkeypatch.setattr(d, "_logits", lambda h, w: rows.append(h.shape[0]) or orig(h, w))
    sh, sw, th, tw, y = _inputs(50, 19, 4, 4)
    kd_per_token(sh, sw, th, tw, y, chunk_size=16).sum().backward()
    assert max(rows) == 16 and len(rows) == 2 * 4 + 2 * 4  # (student + teacher) x 4 chunks, fwd and bwd


def test_a_teacher_of_another_vocabulary_is_one_config_error():
    """lambda and rho are refused by the config (``KDSection``: tests/test_settings.py); the vocabulary here."""
    sh, sw, th, tw, y = _inputs(4, 11, 4, 4)
    with pytest.raises(ConfigError, match="vocabulary"):
        kd_per_token(sh, sw, th, tw[:-1], y)


def test_a_teacher_smaller_than_the_student_trains(tiny_data, frozen_run, tmp_path):
    """The paper's KD regime (a smaller teacher distilled into a larger student; distill-small-teacher-cpu): a
    `tiny` teacher (2 layers, 64 wide) into a `small` student (4 layers, 128 wide) trains through the real
    trainer (dense KD, and SALT, whose KD phase wraps the same objective)."""
    from conftest import read_metrics, tiny_overrides
    from eslm.config import build_config
    from eslm.train.trainer import Trainer

    for name in ("dense-kd", "salt"):
        trainer = Trainer(build_config(overrides=tiny_overrides(tiny_data, tmp_path / name, **{
            "method.name": name, "method.kd.teacher": str(frozen_run), "model.preset": "small",
            "train.max_steps": 2, "eval.interval": 0})))
        objective = trainer.method.objective
        teacher = getattr(objective, "kd", objective).teacher.config
        assert (teacher.n_layer, teacher.n_embd) == (2, 64) and trainer.model_config.n_embd == 128
        trainer.train()
        last = read_metrics(trainer.run_dir, "train")[-1]
        assert torch.isfinite(torch.tensor(last["train_loss"]))
