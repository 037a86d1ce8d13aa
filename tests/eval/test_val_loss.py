"""``eslm.eval.val_loss.evaluate``: per-domain mean CE over every validation token, the mixed loss weighted
by the training mixture (weight-0 domains reported, not mixed), the model's mode restored."""

import math

import pytest
import torch
import torch.nn.functional as F

from eslm import metrics as M
from eslm.data.batch import Batch
from eslm.eval.val_loss import evaluate
from eslm.model.gpt import GPT, preset

V = 64


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = GPT(preset("tiny", vocab_size=V))
    g = torch.Generator().manual_seed(3)

    def batches(n, rows, T):
        out = []
        for _ in range(n):
            x = torch.randint(0, V, (rows, T), generator=g)
            out.append(Batch(x=x, y=torch.randint(0, V, (rows, T), generator=g), domain=torch.zeros(rows).long()))
        return out

    # unequal token counts per batch and per domain: the mean must be over tokens, not over batches
    return model, {"code": batches(2, 3, 8) + batches(1, 1, 8), "prose": batches(1, 2, 16)}


def _oracle(model, batches):
    with torch.no_grad():
        losses = [F.cross_entropy(model.logits(model(b.x)).flatten(0, 1).double(), b.y.reshape(-1),
                                  reduction="none") for b in batches]
    return float(torch.cat(losses).mean())


def test_domain_means_over_tokens_and_the_mixture(setup):
    model, val = setup
    out = evaluate(model, val, {"code": 0.25, "prose": 0.75}, impl="naive")
    code, prose = _oracle(model, val["code"]), _oracle(model, val["prose"])
    assert out[M.val_loss_key("code")] == pytest.approx(code, rel=1e-5)
    assert out[M.val_loss_key("prose")] == pytest.approx(prose, rel=1e-5)
    assert out[M.VAL_LOSS] == pytest.approx(0.25 * code + 0.75 * prose, rel=1e-5)


def test_weight_zero_domain_is_reported_not_mixed(setup):
    """A weight-0 domain is reported but adds nothing; a weighted domain without validation data is left out
    of the mixture (and of its normalisation) instead of failing."""
    model, val = setup
    out = evaluate(model, val, {"code": 0.0, "prose": 2.0, "web": 5.0}, impl="naive")
    assert M.val_loss_key("code") in out and M.val_loss_key("web") not in out
    assert out[M.VAL_LOSS] == out[M.val_loss_key("prose")]


def test_fused_matches_naive_and_mode_is_restored(setup):
    model, val = setup
    model.train()
    naive = evaluate(model, val, {"code": 1.0, "prose": 1.0}, impl="naive")
    assert model.training
    model.eval()
    fused = evaluate(model, val, {"code": 1.0, "prose": 1.0}, impl="fused", chunk_size=5)
    assert not model.training
    for k in naive:
        assert math.isclose(fused[k], naive[k], rel_tol=1e-5), k
