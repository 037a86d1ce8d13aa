"""SelectiveLossMixin in a Lightning Trainer: with gradient accumulation over micro-batches of different
padding, the gradient the optimizer steps with equals that of the exact mean CE over the step's kept tokens."""

import math

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("pytorch_lightning")

from eslm.api import AdaAlpha  # noqa: E402
from eslm.integrations.lightning import SelectiveLossMixin  # noqa: E402

V, C = 23, 8


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix = torch.nn.Embedding(V, C), torch.nn.Linear(C, C)
        self.lm_head = torch.nn.Linear(C, V, bias=False)

    def hidden_states(self, x):
        return torch.tanh(self.mix(self.emb(x)))


class LitLM(SelectiveLossMixin, L.LightningModule):
    def __init__(self, ada=None):
        super().__init__()
        self.model = TinyLM()
        self.setup_eslm(alpha=0.3, score="entropy", ada=ada)

    def training_step(self, batch, batch_idx):
        return self.eslm_loss(batch["targets"], hidden=self.model.hidden_states(batch["x"]),
                              lm_weight=self.model.lm_head.weight)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def micro_batches():
    out = []
    for seed, pad in ((1, 0), (2, 9), (3, 4), (4, 11)):
        g = torch.Generator().manual_seed(seed)
        x, t = torch.randint(0, V, (2, 12), generator=g), torch.randint(0, V, (2, 12), generator=g)
        t[1, 12 - pad:] = -100
        out.append({"x": x, "targets": t})
    return out


def hand_grads(model, micro, alpha):
    kept_ce = []
    for b in micro:
        logits = (model.hidden_states(b["x"]) @ model.lm_head.weight.t()).reshape(-1, V)
        t = b["targets"].reshape(-1)
        valid = t != -100
        with torch.no_grad():
            logp = torch.log_softmax(logits, -1)
            s = (-(logp.exp() * logp).sum(-1)).masked_fill(~valid, float("-inf"))
        n = int(valid.sum())
        idx = torch.topk(s, n - math.floor(alpha * n)).indices
        kept_ce.append(F.cross_entropy(logits[idx], t[idx], reduction="none"))
    model.zero_grad()
    torch.cat(kept_ce).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def fit(module, steps, accumulate):
    trainer = L.Trainer(max_steps=steps, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(micro_batches(), batch_size=None))


def test_accumulated_gradient_is_the_exact_kept_mean():
    lit = LitLM()
    fit(lit, steps=1, accumulate=2)
    got = [p.grad.clone() for p in lit.model.parameters()]
    want = hand_grads(TinyLM(), micro_batches()[:2], 0.3)
    for a, w in zip(got, want):
        assert torch.allclose(a, w, atol=1e-6)


def test_ada_steps_once_per_optimizer_step():
    ada = AdaAlpha(alpha=0.3, interval=1, gamma=3.0)
    lit = LitLM(ada=ada)
    fit(lit, steps=2, accumulate=2)
    assert ada.steps == 2 and ada.alpha != 0.3
