"""random-kd, the control of ESLM-KD: KD on a uniformly random subset of the tokens, of the size ESLM-KD keeps at
the same alpha, with the same KD loss (lambda*KL(teacher||student) + (1-lambda)*CE on the kept tokens)."""

import math

import pytest
import torch
import torch.nn.functional as F

from eslm.config import build_config, method_context
from eslm.data.batch import Batch
from eslm.methods import METHODS, build_method
from eslm.model.gpt import GPT, preset

V, B, T = 97, 3, 16


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """An eslm checkpoint of a tiny random model (the frozen teacher) and the model itself."""
    torch.manual_seed(5)
    model = GPT(preset("tiny", vocab_size=V))
    path = tmp_path_factory.mktemp("teacher") / "step_0000001.pt"
    torch.save({"format": "eslm-checkpoint-v1", "model": model.state_dict(), "model_config": model.config.to_dict(),
                "tokenizer": "byte", "step": 1}, path)
    return path, model.eval()


def _method(name, teacher_path, alpha, seed=1, extra=()):
    cfg = build_config(overrides=[f"method.name={name}", f"method.alpha={alpha}", f"method.kd.teacher={teacher_path}",
                                  "method.kd.lambda=0.4", "method.kd.temperature=1.5", "train.loss_impl=naive",
                                  f"run.seed={seed}", *extra])
    return build_method(method_context(cfg, device=torch.device("cpu"), n_domains=1))


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch(x=torch.randint(0, V, (B, T), generator=g), y=torch.randint(0, V, (B, T), generator=g),
                 domain=torch.zeros(B, dtype=torch.long))


def test_registered_as_the_control_of_eslm_kd():
    spec = METHODS["random-kd"]
    assert spec.role == "control"
    assert METHODS["eslm-kd-entropy"].control == "random-kd" and METHODS["eslm-kd-loss"].control == "random-kd"
    assert [n.key for n in spec.frozen_models] == ["method.kd.teacher"]


@pytest.mark.parametrize("alpha", [0.1, 0.3, 0.5])
def test_keeps_as_many_tokens_as_eslm_kd_uniformly_at_random(teacher, alpha):
    method = _method("random-kd", teacher[0], alpha)
    eslm_kd = _method("eslm-kd-entropy", teacher[0], alpha)
    n = B * T
    assert method.tokens.score is None  # no scoring: the kept set cannot depend on the tokens
    counts = torch.zeros(n)
    draws = 2000
    for i in range(draws):
        sel = method.tokens.select(None, _batch(i % 7))
        idx = sel.index
        assert sel.num_kept == eslm_kd.tokens.num_kept(n) == n - math.floor(alpha * n)
        assert idx.numel() == sel.num_kept and idx.unique().numel() == idx.numel()  # a subset, no repeats
        counts[idx] += 1
    # each position is kept with probability K/n: a binomial count, here within 5 standard deviations
    p = (n - math.floor(alpha * n)) / n
    sd = math.sqrt(draws * p * (1 - p))
    assert (counts - draws * p).abs().max() < 5 * sd
    # and the selection does not follow the position: the first and second half are kept equally often
    assert abs(counts[: n // 2].sum() - counts[n // 2:].sum()) < 5 * sd * math.sqrt(n)


def test_the_step_minimises_the_kd_loss_on_the_kept_subset(teacher):
    """One training step of random-kd: its loss is the mean over the kept tokens of lambda*KL + (1-lambda)*CE,
    computed here from full logits, and its gradients are that loss's."""
    from eslm.train.step import StepOptions, forward_backward

    torch.manual_seed(0)
    student = GPT(preset("tiny", vocab_size=V))
    batch = _batch(3)
    method = _method("random-kd", teacher[0], 0.5)
    res = forward_backward(student, student, method, [batch], StepOptions(accum_steps=1), step=1, lr=1e-3)
    got = {n: p.grad.clone() for n, p in student.named_parameters()}
    idx = res.selections[0].index
    assert res.tokens_kept == idx.numel() == B * T // 2

    student.zero_grad()
    zs = student.logits(student(batch.x)).flatten(0, 1)[idx].float()
    with torch.no_grad():
        zt = teacher[1].logits(teacher[1](batch.x)).flatten(0, 1)[idx].float()
    rho, lam = 1.5, 0.4
    log_p, log_q = F.log_softmax(zs / rho, -1), F.log_softmax(zt / rho, -1)
    kl = (log_q.exp() * (log_q - log_p)).sum(-1)
    expected = (lam * kl + (1 - lam) * F.cross_entropy(zs, batch.y.reshape(-1)[idx], reduction="none")).mean()
    expected.backward()
    torch.testing.assert_close(res.loss, expected.detach(), rtol=1e-5, atol=1e-6)
    for n, p in student.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_same_kept_sets_as_the_random_control_at_one_seed(teacher):
    """random-kd draws its subset from the random control's stream: at one seed both keep the same tokens, so
    random-kd vs random isolates the teacher and random-kd vs eslm-kd the selection."""
    kd, ce = _method("random-kd", teacher[0], 0.3, seed=4), _method("random", teacher[0], 0.3, seed=4)
    for i in range(5):
        assert torch.equal(kd.tokens.select(None, _batch(i)).index, ce.tokens.select(None, _batch(i)).index)
